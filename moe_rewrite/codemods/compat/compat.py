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

The cache helpers are in runtime/compat_cache.py, the rope_scaling reader in runtime/compat_rope_scaling.py,
the import fallbacks in the other runtime/compat_*.py. A name that is gone, used by the file and has no fallback here
is refused. Every run first undoes these edits, so a run with --no-compat gives the file's coupling back as published
and a second run changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import (
    MARK,
    CompatChanges,
    Context,
    Field,
    body_lines,
    class_methods,
    in_file_lineage,
    replace,
    top_classes,
)
from moe_rewrite.codemods.kit.index import Index
from moe_rewrite.errors import RewriteError
from moe_rewrite.render import render_statements

# (module, name) -> the runtime section defining the name where the import fails.
FALLBACKS = {
    ("transformers.utils.import_utils", "is_torch_fx_available"): "compat_fx_available",
    ("transformers.modeling_attn_mask_utils", "_prepare_4d_causal_attention_mask"): "compat_causal_mask",
    # the 4.3x-era imports of DeepSeekMoE 16B (V1) and of training forks of the V2/V3 files
    ("transformers.modeling_attn_mask_utils", "AttentionMaskConverter"): "compat_attn_mask_converter",
    ("transformers.modeling_attn_mask_utils", "_prepare_4d_attention_mask"): "compat_attention_mask",
    ("transformers.modeling_attn_mask_utils", "_prepare_4d_causal_attention_mask_for_sdpa"): "compat_sdpa_causal_mask",
}
GONE_MODULES = {"transformers.modeling_attn_mask_utils": "5.x"}  # the whole module
GONE_NAMES = {("transformers.utils.import_utils", "is_torch_fx_available"): "5.0"}

# Llama's attention classes as 4.46/4.47 had them (DeepSeek-VL2 and DeepSeek-OCR's language models, `use_mla: false`).
# 4.48 removed LlamaFlashAttention2 and LlamaSdpaAttention, so their import fails there; the LlamaAttention imported
# beside them is then 4.48's, which takes RoPE from the caller and returns two values: the stand-in replaces it too.
LLAMA = "transformers.models.llama.modeling_llama"
FALLBACKS |= {(LLAMA, name): "compat_llama_attention" for name in ("LlamaAttention", "LlamaFlashAttention2")}
GONE_NAMES |= {(LLAMA, "LlamaFlashAttention2"): "4.48", (LLAMA, "LlamaSdpaAttention"): "4.48"}

# method name -> the generated helper that answers it; the receiver becomes the helper's first argument.
CACHE_METHODS = {
    "get_usable_length": "_moe_rewrite_cache_usable_length",
    "get_max_length": "_moe_rewrite_cache_max_length",
    "from_legacy_cache": "_moe_rewrite_cache_from_legacy",
    "to_legacy_cache": "_moe_rewrite_cache_to_legacy",
}
SEEN_TOKENS_HELPER = "_moe_rewrite_cache_seen_tokens"
ROPE_SCALING_HELPER = "_moe_rewrite_rope_scaling"  # `config.rope_scaling` -> `_moe_rewrite_rope_scaling(config)`
POSITION_IDS_HELPER = "_moe_rewrite_generation_position_ids"
POSITION_IDS_GET = m.Call(
    func=m.Attribute(value=m.Name("kwargs"), attr=m.Name("get")),
    args=[
        m.Arg(m.SimpleString('"position_ids"') | m.SimpleString("'position_ids'")),
        m.ZeroOrOne(m.Arg(m.Name("None"))),
    ],
)
HELPERS = {helper: method for method, helper in CACHE_METHODS.items()}
# The names a statement must hold for _Undo or _CacheCalls to change it.
UNDONE = {POSITION_IDS_HELPER, SEEN_TOKENS_HELPER, ROPE_SCALING_HELPER, *HELPERS, "_tied_weights_keys"}
CACHE_NAMES = {*CACHE_METHODS, "seen_tokens", "rope_scaling"}
READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ("compat",)

MIXIN_IMPORT = (
    "from transformers.generation import GenerationMixin  # moe-rewrite: generate() needs it since transformers 4.50\n"
)
SELF_OR_SUPER = m.Name("self") | m.Call(func=m.Name("super"))


TIED_NOTE = "# moe-rewrite: {tied: source} for transformers 5.x"
TIED_LIST = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("_tied_weights_keys"))],
            value=m.List(elements=[m.Element(m.SimpleString())]),
        )
    ]
)
TIED_OURS = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name("_tied_weights_keys"))], value=m.Dict())],
    trailing_whitespace=m.TrailingWhitespace(comment=m.Comment(TIED_NOTE)),
)


def _module_name(node: cst.ImportFrom) -> str:
    return "." * len(node.relative) + (cst.Module(body=[]).code_for_node(node.module) if node.module else "")


def _is_our_guard(stmt: cst.CSTNode) -> bool:
    if not (isinstance(stmt, cst.Try) and len(stmt.handlers) == 1):
        return False
    handler = stmt.handlers[0].body
    if not isinstance(handler, cst.IndentedBlock):  # `except ImportError: x = None`, the file's own
        return False
    return handler.header.comment is not None and handler.header.comment.value.startswith(MARK)


def _is_our_mixin_import(stmt: cst.CSTNode) -> bool:
    return (
        m.matches(
            stmt, m.SimpleStatementLine(body=[m.ImportFrom(names=[m.ImportAlias(name=m.Name("GenerationMixin"))])])
        )
        and stmt.trailing_whitespace.comment is not None  # type: ignore[attr-defined]
        and stmt.trailing_whitespace.comment.value.startswith(MARK)  # type: ignore[attr-defined]
    )


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
    mixin_added = any(_is_our_mixin_import(s) for s in module.body)
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        if _is_our_guard(stmt):
            body += [s.with_changes(leading_lines=[*stmt.leading_lines, *s.leading_lines]) for s in stmt.body.body]
        elif _is_our_mixin_import(stmt):
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
    class, over the methods that do, unless its header does."""
    new: list[cst.BaseStatement] = []
    for stmt in body:
        if not index.mentions(stmt, *names):
            new.append(stmt)
        elif (
            isinstance(stmt, cst.ClassDef)
            and isinstance(stmt.body, cst.IndentedBlock)
            and index.only_in_body(stmt, names)
        ):
            members = _visit_mentioning(stmt.body.body, names, transformer, index)
            new.append(stmt.with_changes(body=stmt.body.with_changes(body=members)))
        else:
            new.append(cst.ensure_type(stmt.visit(transformer), cst.BaseStatement))
    return new


def _bound_names(node: cst.ImportFrom) -> list[tuple[str, str]]:
    """(imported name, name it is bound to) for each alias of a `from M import ...`."""
    if isinstance(node.names, cst.ImportStar):
        return []
    return [
        (cst.ensure_type(a.name, cst.Name).value, a.evaluated_alias or cst.ensure_type(a.name, cst.Name).value)
        for a in node.names
    ]


def _gone_since(source: str, imported: str) -> str | None:
    """The transformers release that removed `from source import imported`, or None if it is still there."""
    return GONE_MODULES.get(source) or GONE_NAMES.get((source, imported))


def _guard(
    stmt: cst.SimpleStatementLine, node: cst.ImportFrom, module: cst.Module, changes: CompatChanges, index: Index
) -> cst.Try:
    source = _module_name(node)
    fallback: list[cst.BaseStatement] = []
    rendered: set[str] = set()
    for imported, bound in _bound_names(node):
        section = FALLBACKS.get((source, imported))
        since = _gone_since(source, imported)
        if section is not None:
            changes.imports.append(bound)
            if section in rendered:  # a section that stands in for several names (Llama's attention classes)
                continue
            rendered.add(section)
            defs = render_statements(section, module)
            classes = [d for d in defs if isinstance(d, cst.ClassDef)]
            if not classes:  # the function under the file's name for it; its helpers keep theirs
                fallback += [d.with_changes(name=cst.Name(bound)) if is_named(d, imported) else d for d in defs]
                continue
            # Classes keep their names (one is the other's base): the file must bind them by those names only.
            for cls in classes:
                name = cls.name.value
                aliases = [b for i, b in _bound_names(node) if i == name]
                if aliases not in ([], [name]) or (not aliases and index.count(module, name)):
                    raise RewriteError(
                        f"compat: the stand-in for `{imported}` from {source} defines {name}, which the file binds "
                        "otherwise; rerun with --no-compat to keep the import as it is"
                    )
            fallback += defs
        elif since is None:  # still there: imported on its own, beside the stand-ins
            alias = f" as {bound}" if bound != imported else ""
            fallback.append(
                cst.parse_statement(f"from {source} import {imported}{alias}\n", config=module.config_for_parsing)
            )
        elif index.count(module, bound) > 1:  # more than the import itself
            raise RewriteError(
                f"compat: `{imported}` from {source} is gone in transformers {since} and the file uses it; "
                "moe-rewrite has no stand-in for it (rerun with --no-compat to keep the import as it is)"
            )
    if not fallback:  # nothing the file uses: keep the import importable by binding nothing else
        fallback = [cst.SimpleStatementLine(body=[cst.Pass()])]
    since = next(filter(None, (_gone_since(source, imported) for imported, _ in _bound_names(node))))
    comment = f"{MARK}: gone in transformers {since}; defined here as 4.x had it"
    handler = cst.ExceptHandler(
        type=cst.Name("ImportError"),
        body=cst.IndentedBlock(
            body=fallback,
            header=cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(comment)),
        ),
    )
    return cst.Try(
        body=cst.IndentedBlock(body=[stmt.with_changes(leading_lines=[])]),
        handlers=[handler],
        leading_lines=stmt.leading_lines,
    )


def is_named(stmt: cst.BaseStatement, name: str) -> bool:
    """The stand-in's own definition (its helpers keep their names)."""
    return isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.name.value == name


def _removed(node: cst.ImportFrom) -> bool:
    source = _module_name(node)
    return any(_gone_since(source, imported) for imported, _ in _bound_names(node))


IMPORT_FROM_LINE = m.SimpleStatementLine(body=[m.ImportFrom()])


class _CacheCalls(cst.CSTTransformer):
    """Cache method calls (and `.seen_tokens`) -> the generated helpers, on any receiver but self / super(); every
    read of `X.rope_scaling` but `self.rope_scaling` -> the rope_scaling reader."""

    def __init__(self) -> None:
        self.count = 0
        self.rope_reads = 0
        self._targets: set[int] = set()

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._targets.add(id(node.target))

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = updated_node.func
        if (
            not isinstance(func, cst.Attribute)
            or func.attr.value not in CACHE_METHODS
            or m.matches(func.value, SELF_OR_SUPER)
        ):
            return updated_node
        self.count += 1
        args = [cst.Arg(func.value), *updated_node.args]
        args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in args]
        return cst.Call(func=cst.Name(CACHE_METHODS[func.attr.value]), args=args)

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        attr = updated_node.attr.value
        if attr not in ("seen_tokens", "rope_scaling") or id(original_node) in self._targets:
            return updated_node
        if m.matches(updated_node.value, SELF_OR_SUPER):
            return updated_node
        if attr == "rope_scaling":
            self.rope_reads += 1
            return cst.Call(func=cst.Name(ROPE_SCALING_HELPER), args=[cst.Arg(updated_node.value)])
        self.count += 1
        return cst.Call(func=cst.Name(SEEN_TOKENS_HELPER), args=[cst.Arg(updated_node.value)])


def _defines_cache_methods(module: cst.Module, index: Index) -> list[str]:
    names = set(CACHE_METHODS) | {"seen_tokens"}
    return sorted({name for facts in index.module_facts(module) for name in facts.functions if name in names})


def _add_generation_mixin(module: cst.Module, changes: CompatChanges, index: Index) -> cst.Module:
    generating = {
        id(s)
        for s in module.body
        if isinstance(s, cst.ClassDef)
        and s.bases
        and any(m.matches(f, m.FunctionDef(name=m.Name("prepare_inputs_for_generation"))) for f in s.body.body)
        and not any(
            m.matches(b.value, m.Name("GenerationMixin") | m.Attribute(attr=m.Name("GenerationMixin"))) for b in s.bases
        )
    }
    if not generating:
        return module
    if index.count(module, "GenerationMixin"):
        raise RewriteError(
            "compat: the file names GenerationMixin already, but not as a base of its generating classes"
        )
    body: list[cst.BaseStatement] = []
    last_import = max(i for i, s in enumerate(module.body) if _imports_transformers(s, index))
    for i, stmt in enumerate(module.body):
        if id(stmt) in generating:
            assert isinstance(stmt, cst.ClassDef)
            bases = [*stmt.bases]
            bases[-1] = bases[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            stmt = stmt.with_changes(bases=[*bases, cst.Arg(cst.Name("GenerationMixin"))])
            changes.generation_mixin.append(stmt.name.value)
        body.append(stmt)
        if i == last_import:
            body.append(
                cst.parse_statement(
                    MIXIN_IMPORT.replace("\n", module.default_newline), config=module.config_for_parsing
                )
            )
    return module.with_changes(body=body)


def _imports_transformers(stmt: cst.CSTNode, index: Index) -> bool:
    """A top-level `from transformers... import` line, or one of our guarded ones."""
    return isinstance(stmt, (cst.SimpleStatementLine, cst.Try)) and any(
        _module_name(n).split(".")[0] == "transformers" for n in index.facts(stmt).imports
    )


def _embedding_path(cls: cst.ClassDef, module: cst.Module) -> str | None:
    """'model.embed_tokens' from `def get_input_embeddings(self): return self.model.embed_tokens`; without that
    method (files written for transformers >= 4.5x, Kimi's), what transformers' own default returns: the base model
    `self.<base_model_prefix>`'s `embed_tokens`, where this class and that model's class are in the file and say so."""
    for fn in cls.body.body:
        if m.matches(fn, m.FunctionDef(name=m.Name("get_input_embeddings"))):
            returns = m.findall(fn, m.Return(value=m.Attribute()))
            if len(returns) == 1:
                parts = cst.Module(body=[]).code_for_node(cst.ensure_type(returns[0], cst.Return).value).split(".")  # type: ignore[arg-type]
                if parts[0] == "self" and len(parts) > 1 and all(p.isidentifier() for p in parts):
                    return ".".join(parts[1:])
            return None
    classes = top_classes(module)
    prefix = _class_constant(in_file_lineage(cls, module), "base_model_prefix")
    model = _init_assignment(cls, prefix) if prefix else None
    if not m.matches(model, m.Call(func=m.Name())):
        return None
    base = classes.get(cst.ensure_type(cst.ensure_type(model, cst.Call).func, cst.Name).value)
    if base is None:
        return None
    if any(
        "get_input_embeddings" in class_methods(c)
        for c in [*in_file_lineage(cls, module), *in_file_lineage(base, module)]
    ):
        return None  # an in-file base answers otherwise: not transformers' default
    embedding = m.Call(func=m.Attribute(value=m.Name("nn"), attr=m.Name("Embedding")) | m.Name("Embedding"))
    return f"{prefix}.embed_tokens" if m.matches(_init_assignment(base, "embed_tokens"), embedding) else None


def _class_constant(lineage: list[cst.ClassDef], name: str) -> str | None:
    """A string class attribute, `name = "..."`, of the first class in `lineage` that sets it."""
    assign = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(name))])])
    for stmt in (s for cls in lineage for s in cls.body.body if m.matches(s, assign)):
        value = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign).value
        return value.evaluated_value if isinstance(value, cst.SimpleString) else None  # type: ignore[return-value]
    return None


def _init_assignment(cls: cst.ClassDef, attribute: str) -> cst.BaseExpression | None:
    """The value of the one `self.<attribute> = ...` in `cls.__init__`, else None."""
    init = class_methods(cls).get("__init__")
    target = m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name(attribute)))
    found = m.findall(init, m.Assign(targets=[target])) if init is not None else []
    return cst.ensure_type(found[0], cst.Assign).value if len(found) == 1 else None


def _tied_keys_as_dict(module: cst.Module, changes: CompatChanges) -> cst.Module:
    """`_tied_weights_keys = ["lm_head.weight"]` -> a {tied: source} dict, which 4.x iterates as the same keys."""
    for cls in [s for s in module.body if isinstance(s, cst.ClassDef)]:
        for stmt in cls.body.body:
            if not m.matches(stmt, TIED_LIST):
                continue
            source = _embedding_path(cls, module)
            if source is None:
                raise RewriteError(
                    f"compat: {cls.name.value}._tied_weights_keys is a list, which transformers 5.x cannot read, "
                    "and neither its get_input_embeddings() nor its base model's "
                    "`self.embed_tokens = nn.Embedding(...)` says which weight it is tied to; rerun with --no-compat"
                )
            assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
            elements = cst.ensure_type(assign.value, cst.List).elements
            entries = ", ".join(f'{cst.Module(body=[]).code_for_node(e.value)}: "{source}.weight"' for e in elements)
            new = cst.parse_statement(
                f"_tied_weights_keys = {{{entries}}}  {TIED_NOTE}\n", config=module.config_for_parsing
            )
            module = replace(module, stmt, new.with_changes(leading_lines=stmt.leading_lines))
            changes.tied_keys.append(cls.name.value)
    return module


def _slice_generation_position_ids(module: cst.Module, changes: CompatChanges) -> cst.Module:
    """In prepare_inputs_for_generation, `kwargs.get("position_ids", None)` -> the helper that cuts generate()'s
    position ids to the uncached tokens; only where the get comes after every statement that assigns input_ids (the
    file's own slicing), so the helper sees the tokens the model is given."""
    for cls in [s for s in module.body if isinstance(s, cst.ClassDef)]:
        for fn in cls.body.body:
            if not m.matches(fn, m.FunctionDef(name=m.Name("prepare_inputs_for_generation"))):
                continue
            fn = cst.ensure_type(fn, cst.FunctionDef)
            if not m.findall(fn, POSITION_IDS_GET):
                continue
            body = body_lines(fn, f"compat: {cls.name.value}.prepare_inputs_for_generation")
            gets = [i for i, s in enumerate(body) if m.findall(s, POSITION_IDS_GET)]
            slicing = [i for i, s in enumerate(body) if m.findall(s, m.AssignTarget(target=m.Name("input_ids")))]
            if len(gets) != 1 or (slicing and max(slicing) > gets[0]):
                continue
            stmt = body[gets[0]]
            new = cst.ensure_type(
                m.replace(
                    stmt,
                    POSITION_IDS_GET,
                    lambda node, _: cst.Call(
                        func=cst.Name(POSITION_IDS_HELPER),
                        args=[
                            cst.Arg(node, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                            cst.Arg(cst.Name("input_ids")),
                        ],  # type: ignore[arg-type]
                    ),
                ),
                cst.BaseStatement,
            )
            module = replace(module, stmt, new)
            changes.position_ids.append(cls.name.value)
    return module


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
                if _removed(node):
                    raise RewriteError(
                        f"compat: `from {_module_name(node)} import ...` inside a block; rerun with --no-compat"
                    )
    body = []
    for stmt in module.body:
        if m.matches(stmt, IMPORT_FROM_LINE) and _removed(stmt.body[0]):  # type: ignore[union-attr]
            stmt = _guard(stmt, stmt.body[0], module, changes, index)  # type: ignore[arg-type]
        body.append(stmt)
    module = module.with_changes(body=body)
    own = _defines_cache_methods(module, index)
    calls = _CacheCalls()
    rewritten = module.with_changes(body=_visit_mentioning(module.body, CACHE_NAMES, calls, index))
    if calls.count and own:
        raise RewriteError(f"compat: the file defines its own {', '.join(own)}; rerun with --no-compat")
    changes.cache_calls = calls.count
    changes.rope_scaling_reads = calls.rope_reads
    rewritten = _slice_generation_position_ids(rewritten, changes)
    for section, called in [
        ("compat_cache", changes.cache_calls),
        ("compat_rope_scaling", changes.rope_scaling_reads),
        ("compat_generation", changes.position_ids),
    ]:
        if called:
            context.sections.add(section)
    return _tied_keys_as_dict(_add_generation_mixin(rewritten, changes, index), changes)
