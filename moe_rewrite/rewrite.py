"""The library entry point: `rewrite_source(text, options) -> RewriteResult`. Syntax-tree transforms only; the code
being rewritten is never imported or executed."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import libcst as cst

from moe_rewrite.codemods import checkpointing, compat, fused_experts, gate, init_weights, moe_forward
from moe_rewrite.errors import RewriteError
from moe_rewrite.options import BACKENDS, STACKINGS, RewriteOptions
from moe_rewrite.templates import (
    CHECKPOINTING_TEMPLATE,
    COMPAT_CACHE_TEMPLATE,
    COMPAT_GENERATION_TEMPLATE,
    COMPAT_ROPE_TEMPLATE,
)

__all__ = ["BACKENDS", "STACKINGS", "RewriteOptions", "RewriteResult", "rewrite_source"]

DEEP_RECURSION = 20_000  # Python-to-Python calls take no C stack from 3.11 on, so this is safe there


@dataclass(frozen=True)
class RewriteResult:
    text: str
    changed: bool
    form: str  # "v3" or "v2"
    moe_class: str
    gate_class: str
    compat: str = ""  # what the compat codemod changed, for the summary ("compat: 2 imports guarded, ...")


def rewrite_source(text: str, options: RewriteOptions = RewriteOptions()) -> RewriteResult:
    """Rewrite one modeling file's text. Raises RewriteError (a one-line message) when it cannot. Byte for byte
    outside the edits: a UTF-8 byte-order mark and the file's last line break stay as they were."""
    bom = "\ufeff" if text.startswith("\ufeff") else ""
    body = text[len(bom) :]
    _check_syntax(body)
    limit = sys.getrecursionlimit()
    if sys.version_info >= (3, 11):  # libcst walks a long `a + b + ...` chain one frame per term
        sys.setrecursionlimit(max(limit, DEEP_RECURSION))
    try:
        new_body, compat_changes, info = _rewrite(body, options)
    except RecursionError:
        raise RewriteError("an expression is nested too deeply for moe-rewrite's parser") from None
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, StopIteration) as e:
        # a structure no matcher expected: still one line and exit 2, never a traceback
        raise RewriteError(f"moe-rewrite cannot handle this file's structure ({type(e).__name__}: {e}); please report it") from None
    finally:
        sys.setrecursionlimit(limit)
    ending = body[len(body.rstrip("\r\n")) :]  # libcst turns a final lone CR into LF
    new_text = bom + new_body.rstrip("\r\n") + ending
    return RewriteResult(
        text=new_text,
        changed=new_text != text,
        form=info.form,
        moe_class=info.name,
        gate_class=info.gate_class or "",
        compat=compat_changes.describe(),
    )


def _check_syntax(text: str) -> None:
    """Python's own parser first (it only parses; nothing in the file runs): it reports as an error what would crash
    libcst's native parser (2000 nested parentheses)."""
    import ast
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(text)
    except SyntaxError as e:
        raise RewriteError(f"syntax error at line {e.lineno}, column {e.offset}: {e.msg}") from None
    except (RecursionError, MemoryError, ValueError) as e:
        raise RewriteError(f"cannot parse the file ({type(e).__name__})") from None


def _rewrite(text: str, options: RewriteOptions) -> tuple[str, compat.CompatChanges, moe_forward.MoeClassInfo]:
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as e:
        raise RewriteError(f"syntax error at line {e.raw_line}, column {e.raw_column}") from None
    module, compat_changes = compat.transform(module, options.compat)
    module, checkpointed = checkpointing.transform(module, options.gradient_checkpointing)
    module, guarded = init_weights.transform(module, guard=options.compat)
    # The block's sections that these edits call.
    sections = tuple(
        name
        for name, called in [
            (COMPAT_CACHE_TEMPLATE, compat_changes.cache_calls),
            (COMPAT_ROPE_TEMPLATE, compat_changes.rope_scaling_reads),
            (COMPAT_GENERATION_TEMPLATE, compat_changes.position_ids),
            (CHECKPOINTING_TEMPLATE, checkpointed),
            (init_weights.TEMPLATE, guarded),
        ]
        if called
    )
    module, info = moe_forward.transform(module, options, sections)
    if info.form == "v3":
        module = gate.transform(module, info.gate_class)
    module = fused_experts.transform(module, options)
    return module.code, compat_changes, info
