"""Goldens that show what the codemod changes: a rewritten file's diff against its source with the generated code
replaced by placeholders (one line per block section, one per generated method), and the generated code on its own."""

from __future__ import annotations

import difflib
from functools import lru_cache

import libcst as cst

from moe_rewrite.codemods import is_generated_method
from moe_rewrite.codemods.block import _generated_block
from moe_rewrite.render import SECTIONS, render_section

_EMPTY = cst.parse_module("")


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
        # The block's banner and a line naming its sections, above the statement after the block (the MoE class).
        comment = f"# <moe-rewrite block: {', '.join(_sections_of(block))}>"
        lines = [*block[0].leading_lines, cst.EmptyLine(comment=cst.Comment(comment))]
        body, pending = [], None
        for old, new in zip(original.body, updated.body):
            if id(old) in ids:
                pending = lines
            elif pending is not None:
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


def generated_code(rewritten: str) -> str:
    """The generated block, then each generated method under the name of its class, as the file has them."""
    module = cst.parse_module(rewritten)
    ids = _generated_block(module)
    parts = [module.code_for_node(s) for s in module.body if id(s) in ids]
    for cls in module.body:
        if isinstance(cls, cst.ClassDef):
            for method in cls.body.body:
                if is_generated_method(method):
                    parts.append(f"\n# ---- in class {cls.name.value}:\n" + module.code_for_node(method))
    return "".join(parts)
