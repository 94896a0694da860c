"""Keep the file running on every transformers release from 4.46 to the newest 5.x (on by default; --no-compat).

The published files were written against transformers 4.36-4.45. Later releases removed what they call; each edit
below keeps the old behaviour where the old API still exists and answers with the new API where it does not::

    # Before
    from transformers.utils.import_utils import is_torch_fx_available
    ...
    kv_seq_len += past_key_value.get_usable_length(kv_seq_len, self.layer_idx)
    past_key_values = DynamicCache.from_legacy_cache(past_key_values)
    scaling_type = self.config.rope_scaling["type"]
    position_ids = kwargs.get("position_ids", None)
    class DeepseekV3ForCausalLM(DeepseekV3PreTrainedModel):
        _tied_weights_keys = ["lm_head.weight"]
    # After
    try:
        from transformers.utils.import_utils import is_torch_fx_available
    except ImportError:  # moe-rewrite: gone in transformers 5.x; defined here as 4.x had it
        def is_torch_fx_available():
            ...
    from transformers.generation import GenerationMixin  # moe-rewrite: generate() needs it since transformers 4.50
    ...
    kv_seq_len += _moe_rewrite_cache_usable_length(past_key_value, kv_seq_len, self.layer_idx)
    past_key_values = _moe_rewrite_cache_from_legacy(DynamicCache, past_key_values)
    scaling_type = _moe_rewrite_rope_scaling(self.config)["type"]
    position_ids = _moe_rewrite_generation_position_ids(kwargs.get("position_ids", None), input_ids)
    class DeepseekV3ForCausalLM(DeepseekV3PreTrainedModel, GenerationMixin):
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # moe-rewrite: {tied: source} for 5.x

The cache helpers are in runtime/compat/compat_cache.py, the rope_scaling reader in
runtime/compat/compat_rope_scaling.py, the import fallbacks in the other runtime/compat/compat_*.py. A name that is
gone, used by the file and has no fallback here is refused. Every run first undoes these edits, so a run with
--no-compat gives the file's coupling back as published and a second run changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.compat.cache import (
    CACHE_NAMES,
    HELPERS,
    ROPE_SCALING_HELPER,
    SEEN_TOKENS_HELPER,
    CacheCalls,
    defines_cache_methods,
)
from moe_rewrite.codemods.compat.generation import (
    POSITION_IDS_HELPER,
    add_generation_mixin,
    is_our_mixin_import,
    slice_generation_position_ids,
)
from moe_rewrite.codemods.compat.imports import IMPORT_FROM_LINE, guard, is_our_guard, module_name, removed
from moe_rewrite.codemods.compat.tied_keys import TIED_OURS, tied_keys_as_dict
from moe_rewrite.codemods.kit import CompatChanges, Context, Field, Index
from moe_rewrite.errors import RewriteError

# The names a statement must hold for _Undo or CacheCalls to change it.
UNDONE = {POSITION_IDS_HELPER, SEEN_TOKENS_HELPER, ROPE_SCALING_HELPER, *HELPERS, "_tied_weights_keys"}
READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ("compat",)


class _Undo(cst.CSTTransformer):
    """Helper calls back to the Cache methods they stand for; our tied-keys dicts back to lists."""

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if not m.matches(updated_node, TIED_OURS):
            return updated_node
        assign = cst.ensure_type(updated_node.body[0], cst.Assign)
        keys = [
            cst.Element(e.key)
            for e in cst.ensure_type(assign.value, cst.Dict).elements
            if isinstance(e, cst.DictElement)
        ]
        return updated_node.with_changes(
            body=[assign.with_changes(value=cst.List(elements=keys))],
            trailing_whitespace=cst.TrailingWhitespace(),
        )

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        name = updated_node.func.value if isinstance(updated_node.func, cst.Name) else None
        if name == POSITION_IDS_HELPER:
            return updated_node.args[0].value
        if name in (SEEN_TOKENS_HELPER, ROPE_SCALING_HELPER):
            attr = "seen_tokens" if name == SEEN_TOKENS_HELPER else "rope_scaling"
            return cst.Attribute(value=updated_node.args[0].value, attr=cst.Name(attr))
        if name in HELPERS:
            receiver, *args = updated_node.args
            if args:
                args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return cst.Call(func=cst.Attribute(value=receiver.value, attr=cst.Name(HELPERS[name])), args=args)
        return updated_node


def undo(module: cst.Module, index: Index) -> cst.Module:
    """The module with every compat edit taken back (a module without any is returned unchanged)."""
    mixin_added = any(is_our_mixin_import(s) for s in module.body)
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        if is_our_guard(stmt):
            body += [s.with_changes(leading_lines=[*stmt.leading_lines, *s.leading_lines]) for s in stmt.body.body]
        elif is_our_mixin_import(stmt):
            continue
        elif mixin_added and isinstance(stmt, cst.ClassDef):
            bases = [b for b in stmt.bases if not m.matches(b.value, m.Name("GenerationMixin"))]
            if len(bases) != len(stmt.bases):
                bases[-1] = bases[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                stmt = stmt.with_changes(bases=bases)
            body.append(stmt)
        else:
            body.append(stmt)
    return module.with_changes(body=_visit_mentioning(body, UNDONE, _Undo(), index))


def _visit_mentioning(
    body: Sequence[cst.BaseStatement], names: set[str], transformer: cst.CSTTransformer, index: Index
) -> list[cst.BaseStatement]:
    """`body` with `transformer` run over the statements that mention one of `names` (it changes no other); in a
    class or function, over the statements of its body that do, unless its header does (a transformer that rebuilds
    a method for one line is most of a rewrite's time, and gives the index new nodes to walk)."""
    new: list[cst.BaseStatement] = []
    for stmt in body:
        if not index.mentions(stmt, *names):
            new.append(stmt)
        elif (
            isinstance(stmt, (cst.ClassDef, cst.FunctionDef))
            and isinstance(stmt.body, cst.IndentedBlock)
            and index.only_in_body(stmt, names)
        ):
            members = _visit_mentioning(stmt.body.body, names, transformer, index)
            new.append(stmt.with_changes(body=stmt.body.with_changes(body=members)))
        else:
            new.append(cst.ensure_type(stmt.visit(transformer), cst.BaseStatement))
    return new


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with its compat edits (re)made, or taken back without --compat; what they were goes in context."""
    index = context.index
    module = undo(module, index)
    changes = context.compat = CompatChanges()
    if not context.options.compat:
        return module
    for stmt in module.body:  # a removed import anywhere but at the top level cannot be guarded here
        if not m.matches(stmt, IMPORT_FROM_LINE):
            for node in index.facts(stmt).imports:
                if removed(node):
                    raise RewriteError(
                        f"compat: `from {module_name(node)} import ...` inside a block; rerun with --no-compat"
                    )
    body = []
    for stmt in module.body:
        if m.matches(stmt, IMPORT_FROM_LINE) and removed(stmt.body[0]):  # type: ignore[union-attr]
            stmt = guard(stmt, stmt.body[0], module, changes, index)  # type: ignore[arg-type]
        body.append(stmt)
    module = module.with_changes(body=body)
    own = defines_cache_methods(module, index)
    calls = CacheCalls()
    rewritten = module.with_changes(body=_visit_mentioning(module.body, CACHE_NAMES, calls, index))
    if calls.count and own:
        raise RewriteError(f"compat: the file defines its own {', '.join(own)}; rerun with --no-compat")
    changes.cache_calls = calls.count
    changes.rope_scaling_reads = calls.rope_reads
    rewritten = slice_generation_position_ids(rewritten, changes)
    for section, called in [
        ("compat_cache", changes.cache_calls),
        ("compat_rope_scaling", changes.rope_scaling_reads),
        ("compat_generation", changes.position_ids),
    ]:
        if called:
            context.sections.add(section)
    return tied_keys_as_dict(add_generation_mixin(rewritten, changes, index), changes)
