"""The library entry point: `rewrite_source(text, options) -> RewriteResult`. Syntax-tree transforms only; the code
being rewritten is never imported or executed."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from moe_rewrite.codemods import gate, moe_forward
from moe_rewrite.errors import RewriteError

BACKENDS = ("auto", "torch", "grouped_gemm", "loop")
STACKINGS = ("stack", "sequential")


@dataclass(frozen=True)
class RewriteOptions:
    backend: str = "auto"
    stacking: str = "stack"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise RewriteError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}")
        if self.stacking not in STACKINGS:
            raise RewriteError(f"unknown stacking {self.stacking!r}; choose from {', '.join(STACKINGS)}")


@dataclass(frozen=True)
class RewriteResult:
    text: str
    changed: bool
    form: str  # "v3" or "v2"
    moe_class: str
    gate_class: str


def rewrite_source(text: str, options: RewriteOptions = RewriteOptions()) -> RewriteResult:
    """Rewrite one modeling file's text. Raises RewriteError (a one-line message) when it cannot."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as e:
        raise RewriteError(f"syntax error at line {e.raw_line}, column {e.raw_column}") from None
    module, info = moe_forward.transform(module, options.backend, options.stacking)
    if info.form == "v3":
        module = gate.transform(module, info.gate_class)
    new_text = module.code
    return RewriteResult(
        text=new_text,
        changed=new_text != text,
        form=info.form,
        moe_class=info.name,
        gate_class=info.gate_class or "",
    )
