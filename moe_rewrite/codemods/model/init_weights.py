"""Make the PreTrainedModel subclass's `_init_weights` deterministic, and safe on transformers 5.x::

    # Before
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
        ...
    # After
    def _init_weights(self, module):
        _moe_rewrite_restore_buffers(module)  # moe-rewrite: transformers 5 leaves non-persistent buffers unset
        if _moe_rewrite_loaded(module):  # moe-rewrite: keep what the checkpoint loaded (transformers 5.0 re-inits it)
            return
        std = self.config.initializer_range
        ...
        if getattr(module, "e_score_correction_bias", None) is not None:  # moe-rewrite: torch.empty; start at 0
            module.e_score_correction_bias.data.zero_()
    ...
    _moe_rewrite_records_init(
        DeepseekV3RotaryEmbedding,
        DeepseekV3YarnRotaryEmbedding,
    )  # moe-rewrite: they rebuild their non-persistent buffers in _init_weights

The guard (with compat): transformers 5.0 calls _init_weights on every module after loading, and `.data.normal_()`
writes through its guards, so every loaded nn.Linear would be re-drawn; 5.x marks loaded parameters
`_is_hf_initialized`, and a module whose own parameters all carry it is left alone, as later 5.x releases do
themselves. The buffers (with compat): 5.x also fills every non-persistent buffer (the RoPE tables) with
uninitialised memory after loading (huggingface/transformers#48892), so the classes that register one remember their
constructor arguments (the line at the end of the file) and _init_weights recomputes the buffers from a fresh copy.
The bias (always, V3 form): MoEGate creates `e_score_correction_bias` with torch.empty and nothing
initialises it, so models built with from_config route on whatever memory held; checkpoints still overwrite it.
Every added line carries the marker comment, so a later run replaces them.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import Context, Field, body_lines, find, is_generated_method, is_marked, replace
from moe_rewrite.codemods.kit.index import Index

GUARD = (
    "if _moe_rewrite_loaded(module):  # moe-rewrite: keep what the checkpoint loaded (transformers 5.0 re-inits it)\n"
    "    return\n"
)
BIAS = (
    'if getattr(module, "e_score_correction_bias", None) is not None:  # moe-rewrite: torch.empty; start at 0\n'
    "    module.e_score_correction_bias.data.zero_()\n"
)
RESTORE = "_moe_rewrite_restore_buffers(module)  # moe-rewrite: transformers 5 leaves non-persistent buffers unset\n"
RECORDS = (
    "_moe_rewrite_records_init({classes})  # moe-rewrite: they rebuild their non-persistent buffers in _init_weights\n"
)
RECORDS_LINE = m.SimpleStatementLine(body=[m.Expr(m.Call(func=m.Name("_moe_rewrite_records_init")))])
NON_PERSISTENT = m.Call(
    func=m.Attribute(attr=m.Name("register_buffer")),
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("persistent"), value=m.Name("False")), m.ZeroOrMore()],
)
PRETRAINED_BASE = m.Name("PreTrainedModel") | m.Attribute(attr=m.Name("PreTrainedModel"))
READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ()
INIT_WEIGHTS = m.FunctionDef(
    name=m.Name("_init_weights"), params=m.Parameters(params=[m.Param(), m.Param(name=m.Name("module"))])
)


def _buffer_classes(module: cst.Module, index: Index) -> list[str]:
    """Top-level classes that register a non-persistent buffer (outside moe-rewrite's own methods, whose buffers are
    made on first use), and the file's subclasses of them."""
    classes = [s for s in module.body if isinstance(s, cst.ClassDef)]

    def registers(cls: cst.ClassDef) -> bool:
        own = [s for s in cls.body.body if not is_generated_method(s, index)]
        return any("register_buffer" in index.facts(s).attributes and find(s, NON_PERSISTENT, cst.Call) for s in own)

    found = [c.name.value for c in classes if registers(c)]
    for cls in classes:  # in file order, so a subclass follows its base
        bases = {b.value.value for b in cls.bases if isinstance(b.value, cst.Name)}
        if cls.name.value not in found and bases & set(found):
            found.append(cls.name.value)
    return found


def _statement(text: str, module: cst.Module) -> cst.BaseStatement:
    return cst.parse_statement(text.replace("\n", module.default_newline), config=module.config_for_parsing)


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with the edits above (re)made (the bias line where the file has a correction bias); the guard and
    the buffers with compat only."""
    guard = context.options.compat
    index = context.index
    correction_bias = any("e_score_correction_bias" in facts.attributes for facts in index.module_facts(module))
    module = module.with_changes(body=[s for s in module.body if not (m.matches(s, RECORDS_LINE) and is_marked(s))])
    buffered = _buffer_classes(module, index)
    used = False
    for cls in module.body:
        if not (isinstance(cls, cst.ClassDef) and any(m.matches(b.value, PRETRAINED_BASE) for b in cls.bases)):
            continue
        for fn in cls.body.body:
            if not m.matches(fn, INIT_WEIGHTS):
                continue
            fn = cst.ensure_type(fn, cst.FunctionDef)
            body = [s for s in body_lines(fn, f"{cls.name.value}._init_weights") if not is_marked(s)]
            if guard:
                docstring = m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())]))
                added = [_statement(RESTORE, module)] if buffered else []
                body[1 if docstring else 0 : 1 if docstring else 0] = [*added, _statement(GUARD, module)]
            if correction_bias:
                body.append(_statement(BIAS, module))
            used = used or guard
            new_fn = fn.with_changes(body=fn.body.with_changes(body=body))
            module = replace(module, fn, new_fn)
    if used and buffered:  # at the end, where every class it names is defined
        records = _statement(RECORDS.format(classes="".join(f"\n    {name}," for name in buffered) + "\n"), module)
        module = module.with_changes(
            body=[*module.body, records.with_changes(leading_lines=[cst.EmptyLine(indent=False)] * 2)]
        )
    if used:
        context.sections.add("init_guards")
    return module
