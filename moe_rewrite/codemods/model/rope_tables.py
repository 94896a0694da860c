"""Keep the RoPE modules' table rebuilds out of torch.compile's graphs (always)::

    # Before
    class DeepseekV3RotaryEmbedding(nn.Module):
        def forward(self, x, seq_len=None):
            if self.max_seq_len_cached is None or seq_len > self.max_seq_len_cached:
                self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)
            ...
    # After (the class untouched; at the end of the file)
    _moe_rewrite_rope_tables_eager(
        DeepseekV3RotaryEmbedding,
    )  # moe-rewrite: their forward rebuilds the tables on first use: kept out of torch.compile's graphs

Every published DeepSeek file forgets the tables' length at construction, so the first forward rebuilds them on the
activations' device. A compiled decoder layer that traced the rebuild would trace another graph on the next call, and
under non-reentrant checkpointing its recomputation would save other tensors than its forward did (CheckpointError,
runtime/model/rope_tables.py). The classes are those whose own `forward` calls `self._set_cos_sin_cache(...)`; their
subclasses inherit it. The line only changes what torch.compile traces, never the numbers, so it needs no proof.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import Context, Field, find, is_marked

CALL = "_moe_rewrite_rope_tables_eager"
LINE = CALL + "({classes})  # moe-rewrite: their forward rebuilds the tables on first use: kept out of torch.compile\n"
OUR_LINE = m.SimpleStatementLine(body=[m.Expr(m.Call(func=m.Name(CALL)))])
REBUILD = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_set_cos_sin_cache")))
FORWARD = m.FunctionDef(name=m.Name("forward"))
READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ()


def _rebuilding_classes(module: cst.Module) -> list[str]:
    names = []
    for cls in module.body:
        if not isinstance(cls, cst.ClassDef):
            continue
        forwards = [s for s in cls.body.body if m.matches(s, FORWARD)]
        if any(find(fn, REBUILD, cst.Call) for fn in forwards):
            names.append(cls.name.value)
    return names


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with the line (re)made at its end where a class's forward rebuilds RoPE tables."""
    module = module.with_changes(body=[s for s in module.body if not (m.matches(s, OUR_LINE) and is_marked(s))])
    classes = _rebuilding_classes(module)
    if not classes:
        return module
    text = LINE.format(classes="".join(f"\n    {name}," for name in classes) + "\n")
    line = cst.parse_statement(text.replace("\n", module.default_newline), config=module.config_for_parsing)
    context.sections.add("rope_tables")
    return module.with_changes(body=[*module.body, line.with_changes(leading_lines=[cst.EmptyLine(indent=False)] * 2)])
