"""Goldens that show what the codemod changes: a rewritten file's diff against its source with the generated code
replaced by placeholders (one line naming the block's sections, its options line, one line per generated method), and
a hash of each section's code, so that a change to a runtime section shows as one changed line in review."""

from __future__ import annotations

import difflib
import hashlib
from functools import lru_cache

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.block import _generated_block
from moe_rewrite.codemods.kit import is_generated_method
from moe_rewrite.options import RewriteOptions
from moe_rewrite.render import OPTIONS_NAME, SECTIONS, render_section

_EMPTY = cst.parse_module("")
_OPTIONS_LINE = m.SimpleStatementLine(body=[m.Assign([m.AssignTarget(m.Name(OPTIONS_NAME))])])


def _names(stmts: list[cst.BaseStatement]) -> list[str]:
    names = []
    for stmt in stmts:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            names.append(stmt.name.value)
        elif isinstance(stmt, cst.SimpleStatementLine):
            names += [
                t.target.value
                for s in stmt.body
                if isinstance(s, cst.Assign)
                for t in s.targets
                if isinstance(t.target, cst.Name)
            ]
    return names


@lru_cache(maxsize=None)
def _first_names() -> dict[str, str]:
    """Each section's first module-level name (a section without module-level code has none)."""
    found = {}
    for section in SECTIONS:
        names = _names(render_section(section, _EMPTY).statements)
        if names:
            found[section] = names[0]
    return found


def _sections_of(block: list[cst.BaseStatement]) -> list[str]:
    """The runtime sections a generated block is made of, in order (each recognised by its first name)."""
    names = set(_names(block))
    return [section for section, first in _first_names().items() if first in names]


class _Placeholders(cst.CSTTransformer):
    """Generated methods -> `def name(...): ...  # generated`; the block -> one comment naming its sections."""

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if not is_generated_method(original):
            return updated
        return updated.with_changes(
            body=cst.SimpleStatementSuite(
                body=[cst.Expr(cst.Ellipsis())],
                trailing_whitespace=cst.TrailingWhitespace(
                    whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment("# <generated>")
                ),
            ),
            decorators=updated.decorators,
        )

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        ids = _generated_block(original)
        block = [s for s in original.body if id(s) in ids]
        if not block:
            return updated
        # The block's banner, a line naming its sections and the block's options line, above the statement after the
        # block (the MoE class).
        comment = f"# <moe-rewrite block: {', '.join(_sections_of(block))}>"
        lines = [*block[0].leading_lines, cst.EmptyLine(comment=cst.Comment(comment))]
        options = [s.with_changes(leading_lines=lines) for s in block if m.matches(s, _OPTIONS_LINE)]
        body, pending = [], None
        for old, new in zip(original.body, updated.body):
            if id(old) in ids:
                pending = lines
            elif pending is not None:
                if options:
                    body += [options[0], new]
                else:
                    body.append(new.with_changes(leading_lines=[*pending, *new.leading_lines]))
                pending = None
            else:
                body.append(new)
        return updated.with_changes(body=body)


def diff_text(old: str, new: str, old_name: str, new_name: str) -> str:
    diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{old_name}", f"b/{new_name}", n=2)
    return "".join(diff)


def what_changed(source: str, rewritten: str, name: str) -> str:
    """The unified diff from `source` to `rewritten`, the generated code as placeholders."""
    return diff_text(source, cst.parse_module(rewritten).visit(_Placeholders()).code, name, name)


def _code(module: cst.Module, stmt: cst.BaseStatement) -> str:
    return module.code_for_node(stmt.with_changes(leading_lines=[]))


def _section_code(name: str) -> str:
    section = render_section(name, _EMPTY)
    return "".join(_code(_EMPTY, s) for s in [*section.statements, *section.moe_methods, *section.model_methods])


def section_hashes() -> str:
    """One line per runtime section (render.SECTIONS order): the sha256 of its code as a file holds it, its name."""
    return "".join(f"{hashlib.sha256(_section_code(name).encode()).hexdigest()}  {name}\n" for name in SECTIONS)


@lru_cache(maxsize=None)
def _sections_code(newline: str, indent: str, options: RewriteOptions) -> frozenset[str]:
    """Every statement and method of every section, rendered for files with this newline and indentation (once: the
    tests rewrite several files with the same options)."""
    module = cst.parse_module("", config=cst.PartialParserConfig(default_newline=newline, default_indent=indent))
    codes = set()
    for name in SECTIONS:
        section = render_section(name, module, options)
        codes |= {_code(module, s) for s in [*section.statements, *section.moe_methods, *section.model_methods]}
    return frozenset(codes)


def not_from_sections(rewritten: str, options: RewriteOptions) -> list[str]:
    """The generated statements and methods of a rewritten file that are not, byte for byte, those of a section
    rendered for it: none, when the placeholders and the section hashes show all of the generated code."""
    module = cst.parse_module(rewritten)
    known = _sections_code(module.default_newline, module.default_indent, options)
    ids = _generated_block(module)
    generated = [s for s in module.body if id(s) in ids]
    classes = [c for c in module.body if isinstance(c, cst.ClassDef) and id(c) not in ids]  # the file's own
    generated += [s for c in classes for s in c.body.body if is_generated_method(s)]
    return [_code(module, s)[:80] for s in generated if _code(module, s) not in known]
