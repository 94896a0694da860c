"""The library entry point: `rewrite_source(text, options) -> RewriteResult`. Syntax-tree transforms only; the code
being rewritten is never imported or executed."""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import sys
import tokenize
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest

import libcst as cst

from moe_rewrite.codemods import block
from moe_rewrite.codemods.compat import compat
from moe_rewrite.codemods.kit import MARK, Codemod, Context, Field, Form, Note
from moe_rewrite.codemods.model import (
    attention,
    attention_mask,
    gradient_checkpointing,
    init_weights,
    lm_loss,
    packing,
    rmsnorm,
    rope,
    rope_tables,
)
from moe_rewrite.codemods.moe import expert_layout, expert_mlp, expert_parallel, gate, moe_forward, no_aux_loss
from moe_rewrite.errors import InternalError, NotMoeFileError, Refusals, RewriteError
from moe_rewrite.options import BACKENDS, STACKINGS, RewriteOptions

__all__ = ["BACKENDS", "STACKINGS", "RewriteOptions", "RewriteResult", "rewrite_source"]

# The rewrites, in order: each is `transform(module, context) -> module` (see moe_rewrite/codemods/kit/context.py).
# moe_forward finds the MoE class the later ones read (expert_mlp proves its experts' class); block, last, puts in
# the code of every section asked for.
CODEMODS: list[Codemod] = [
    compat,
    attention,
    attention_mask,
    lm_loss,
    packing,
    rmsnorm,
    rope,
    gradient_checkpointing,
    init_weights,
    rope_tables,
    moe_forward,
    expert_mlp,
    gate,
    no_aux_loss,
    expert_parallel,
    expert_layout,
    block,
]
# The codemods that decide whether the MoE layer can be rewritten: their reasons for refusing a file come first, as
# the others' (compat, attention, ...) only matter once the MoE layer can be rewritten.
MOE_FORM: tuple[Codemod, ...] = (moe_forward, expert_mlp, gate, expert_layout, block)
RESULT_READS: tuple[Field, ...] = ("moe", "compat", "notes")  # what rewrite_source reads from the context after them
DEEP_RECURSION = 20_000  # Python-to-Python calls take no C stack from 3.11 on, so this is safe there


def check_order(codemods: list[Codemod], reads_after: tuple[Field, ...]) -> None:
    """Each codemod reads only what an earlier one provides, and the caller what they all provided."""
    provided: set[str] = set()
    for codemod in codemods:
        missing = set(codemod.READS) - provided
        if missing:
            name = getattr(codemod, "__name__", repr(codemod))
            raise InternalError(f"{name} reads {', '.join(sorted(missing))}, which no codemod before it provides")
        provided |= set(codemod.PROVIDES)
    if missing := set(reads_after) - provided:
        raise InternalError(f"the result reads {', '.join(sorted(missing))}, which no codemod provides")


check_order(CODEMODS, RESULT_READS)


@dataclass(frozen=True)
class RewriteResult:
    text: str  # the input itself when it is up to date (see rewrite_source)
    changed: bool  # text != the input
    form: str  # "v3", "v2" or "esft" (codemods.kit.Form)
    moe_class: str
    gate_class: str
    options: RewriteOptions  # the options the file was rewritten with: the caller's, with what its form chose
    chosen: tuple[str, ...] = ()  # the options chosen for the file (an explicit option it needs), a line each
    compat: str = ""  # what the compat codemod changed, for the summary ("compat: 2 imports guarded, ...")
    sections: tuple[str, ...] = ()  # the generated code's sections (render.SECTIONS names)
    # what the whole-model codemods did, or left as published and why, a note each (str(note): its summary line)
    notes: tuple[Note, ...] = ()

    def _lines(self, *concerns: str) -> tuple[str, ...]:
        return tuple(str(note) for note in self.notes if note.concern in concerns)

    @property
    def attention(self) -> tuple[str, ...]:
        """The attention and attention mask codemods' lines (the notes' text)."""
        return self._lines("attention", "attention mask")

    @property
    def loss(self) -> tuple[str, ...]:
        """The lm_loss codemod's lines."""
        return self._lines("loss")

    @property
    def norm(self) -> tuple[str, ...]:
        """The rmsnorm codemod's lines."""
        return self._lines("norm")

    @property
    def rope(self) -> tuple[str, ...]:
        """The rope codemod's lines."""
        return self._lines("rope")


def rewrite_source(text: str, options: RewriteOptions | None = None, config: dict | None = None) -> RewriteResult:
    """Rewrite one modeling file's text; `config`, the checkpoint's config.json where there is one, decides the
    options left to the checkpoint (fp8_choice). Raises RewriteError (a one-line message) when it cannot:
    NotMoeFileError alone for a file that is not a DeepSeek-family MoE file, else Refusals with every codemod's
    reason, the MoE form's first; InternalError when moe-rewrite itself fails (a bug, whatever the file). Byte for
    byte outside the edits: a UTF-8 byte-order mark and the file's last line break stay as they were.

    A file that holds this rewrite already, reformatted since (black, `ruff format`), is up to date: `changed` is
    False and `text` is the input, so that --check, --in-place and the pre-commit hooks agree with a formatter
    (`up_to_date`)."""
    options = options or RewriteOptions()
    bom = "\ufeff" if text.startswith("\ufeff") else ""
    body = text[len(bom) :]
    _check_syntax(body)
    limit = sys.getrecursionlimit()
    if sys.version_info >= (3, 11):  # libcst walks a long `a + b + ...` chain one frame per term
        sys.setrecursionlimit(max(limit, DEEP_RECURSION))
    options, compute_line = fp8_compute_choice(options, body)
    options, fp8_line = fp8_choice(options, config, body)
    options, ep_line = expert_parallel_choice(options, body)
    try:
        lines = [line for line in (fp8_line, compute_line, ep_line) if line]
        new_body, context = _rewrite(body, options, lines)
        if new_body != body and up_to_date(body, new_body):
            new_body = body
    except RecursionError:
        raise RewriteError("an expression is nested too deeply for moe-rewrite's parser") from None
    except (RewriteError, InternalError):
        raise
    except Exception as e:
        # a codemod failed on its own assumptions: a file it should have refused by name, or a bug; either way ours
        raise InternalError(f"{type(e).__name__}: {e}") from e
    finally:
        sys.setrecursionlimit(limit)
    ending = body[len(body.rstrip("\r\n")) :]  # libcst turns a final lone CR into LF
    new_text = bom + new_body.rstrip("\r\n") + ending
    moe = context.moe_class()
    return RewriteResult(
        text=new_text,
        changed=new_text != text,
        form=Form(moe.form).value,
        moe_class=moe.name,
        gate_class=moe.gate_class or "",
        options=context.options,
        chosen=tuple(context.chosen),
        compat=context.compat_changes().describe(),
        sections=tuple(sorted(context.sections)),
        notes=tuple(context.notes),
    )


def up_to_date(text: str, rewritten: str) -> bool:
    """Whether `text` differs from its rewrite `rewritten` in formatting only: the same syntax tree, docstrings compared
    as black compares them (a formatter re-indents them), and the same moe-rewrite markers in the same order (the
    banner names the version and options; a later run finds the generated code by them). The markers are compared
    as they are read, so that a file without any (the first run on it) is not tokenized at all, and its rewrite only
    up to its first marker."""
    theirs = _markers(text) if MARK in text or block.BANNER in text else iter(())
    same = all(a == b for a, b in zip_longest(theirs, _markers(rewritten)))  # a missing one is None
    return same and _code(text) == _code(rewritten)


def _code(text: str) -> str:
    """The syntax tree, each docstring with its lines stripped (black's own equivalence check does the same)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escapes, as in _check_syntax
        tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            doc = first.value if isinstance(first, ast.Expr) else None
            if isinstance(doc, ast.Constant) and isinstance(doc.value, str):
                doc.value = "\n".join(line.strip() for line in doc.value.splitlines()).strip()
    return ast.dump(tree)


def _markers(text: str) -> Iterator[str]:
    """The file's moe-rewrite comments, in order, as the tokenizer reaches them."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    comments = (token.string.strip() for token in tokens if token.type == tokenize.COMMENT)
    return (comment for comment in comments if comment.startswith((MARK, block.BANNER)))


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


def fp8_choice(options: RewriteOptions, config: dict | None, text: str) -> tuple[RewriteOptions, str | None]:
    """The options with fp8_experts decided, and the summary line saying why where the file's checkpoint chose them:
    the caller's choice stands; else FP8 experts where config.json's quantization_config asks for FP8 (DeepSeek-V3,
    R1 and Kimi-K2 as shipped), else where an earlier rewrite's banner records them (a vendored file rewritten again
    without its config), else where --fp8-compute asks for them, else none."""
    if options.fp8_experts is not None:
        return options, None
    settings = (config or {}).get("quantization_config")
    if isinstance(settings, dict) and settings.get("quant_method") == "fp8":
        line = "FP8 experts: generated, as config.json's quantization_config asks (quant_method fp8)"
        return dataclasses.replace(options, fp8_experts=True), line
    if re.search(rf"^{re.escape(block.BANNER)} .*\bfp8-experts\b", text, re.M):
        line = "FP8 experts: kept, as the earlier rewrite's banner records them (--no-fp8-experts drops them)"
        return dataclasses.replace(options, fp8_experts=True), line
    if options.fp8_compute:
        return dataclasses.replace(options, fp8_experts=True), "FP8 experts: generated, as --fp8-compute asks"
    return dataclasses.replace(options, fp8_experts=False), None


def fp8_compute_choice(options: RewriteOptions, text: str) -> tuple[RewriteOptions, str | None]:
    """The options with fp8_compute decided, and the summary line saying why where the file chose it: the caller's
    choice stands; else FP8 compute where an earlier rewrite's banner records it and FP8 experts are not refused (a
    second run keeps it), else bf16 compute."""
    line = "FP8 compute: kept, as the earlier rewrite's banner records it (--no-fp8-compute drops it)"
    return _kept_from_banner(options, "fp8_compute", text, options.fp8_experts is not False, line)


def expert_parallel_choice(options: RewriteOptions, text: str) -> tuple[RewriteOptions, str | None]:
    """The options with expert_parallel decided, and the summary line saying why where the file chose it: the caller's
    choice stands; else expert parallelism where an earlier rewrite's banner records it (a second run keeps it), else
    none."""
    line = "expert parallelism: kept, as the earlier rewrite's banner records it (--no-expert-parallel drops it)"
    return _kept_from_banner(options, "expert_parallel", text, options.fuse_experts is not False, line)


def _kept_from_banner(
    options: RewriteOptions, field: str, text: str, possible: bool, line: str
) -> tuple[RewriteOptions, str | None]:
    """`field` (an opt-in whose name, dashed, RewriteOptions.describe writes into the banner) decided: the caller's
    value stands; else on, with `line`, where an earlier rewrite's banner names it and it is `possible`; else off."""
    if getattr(options, field) is not None:
        return options, None
    feature = field.replace("_", "-")
    if possible and re.search(rf"^{re.escape(block.BANNER)} .*\b{feature}\b", text, re.M):
        return dataclasses.replace(options, **{field: True}), line
    return dataclasses.replace(options, **{field: False}), None


def _rewrite(text: str, options: RewriteOptions, chosen: list[str]) -> tuple[str, Context]:
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as e:
        raise RewriteError(f"syntax error at line {e.raw_line}, column {e.raw_column}") from None
    context = Context(options, chosen=chosen)
    module = block.strip(module)
    refused: list[tuple[Codemod, str]] = []
    missing: set[str] = set()  # what the refused codemods, and those they left without input, did not provide
    for codemod in CODEMODS:
        if missing & set(codemod.READS):
            missing |= set(codemod.PROVIDES)
            continue  # its input is missing: the refusal that left it out is the reason
        sections = set(context.sections)
        try:
            module = codemod.transform(module, context)
        except NotMoeFileError:
            raise  # not a DeepSeek-family file at all: nothing else to say about it
        except RewriteError as e:
            # say every reason in one run: go on with the module as it was before this codemod
            refused.append((codemod, str(e)))
            missing |= set(codemod.PROVIDES)
            context.sections = sections
    if refused:
        moe_first = sorted(refused, key=lambda item: item[0] not in MOE_FORM)  # stable: CODEMODS order within each
        raise Refusals([reason for _, reason in moe_first])
    shared = {id(stmt) for section in context.rendered.values() for stmt in section.statements}
    return _module_code(module, shared), context


# the code of statements that rewrites share (rendered sections: Context.section), by (id, newline, indent); the
# statement is kept so that its id stays its own
_STATEMENT_CODE: dict[tuple[int, str, str], tuple[cst.CSTNode, str]] = {}


def _module_code(module: cst.Module, shared: set[int]) -> str:
    """`module.code`, with the code of the `shared` top-level statements generated once per process: the generated
    block is most of a rewritten file, and generating its code a fifth of a rewrite. libcst generates a module as its
    header, each statement, its footer (a top-level statement's code does not depend on what comes before it), then
    drops the last line break where the file had none: that case, and a file without shared statements, is left to
    libcst."""
    if not shared or not module.has_trailing_newline:
        return module.code
    parts = [module.code_for_node(line) for line in module.header]
    for stmt in module.body:
        if id(stmt) not in shared:
            parts.append(module.code_for_node(stmt))
            continue
        key = (id(stmt), module.default_newline, module.default_indent)
        known = _STATEMENT_CODE.get(key)
        if known is None or known[0] is not stmt:
            if len(_STATEMENT_CODE) > 20_000:  # sections rendered for many layouts and options: start again
                _STATEMENT_CODE.clear()
            known = _STATEMENT_CODE[key] = (stmt, module.code_for_node(stmt))
        parts.append(known[1])
    parts += [module.code_for_node(line) for line in module.footer]
    return "".join(parts)
