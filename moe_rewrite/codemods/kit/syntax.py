"""Syntax helpers the codemods share: a node's text, a class's methods, the file's classes, and `replace`, a cheaper
`deep_replace`."""

from __future__ import annotations

from typing import TypeVar

import libcst as cst
import libcst.matchers as m

from moe_rewrite.errors import RewriteError


def code(node: cst.CSTNode) -> str:
    """A node's source text (a statement's with its leading comment lines)."""
    return cst.Module(body=[]).code_for_node(node)


def first_line(node: cst.CSTNode) -> str:
    """A statement's first line of code (its comments skipped), ` ...` after it where more follow."""
    lines = [line.strip() for line in code(node).splitlines() if line.strip() and not line.strip().startswith("#")]
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""


def single_method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    """The class's method `name` where it defines exactly one (none, or a second definition: None)."""
    found = [s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name]
    return found[0] if len(found) == 1 else None


def reads(node: cst.CSTNode, name: str) -> bool:
    """Whether `node` reads `name` (any use but as the plain target of an assignment)."""
    stores = m.findall(node, m.AssignTarget(target=m.Name(name)))
    return len(m.findall(node, m.Name(name))) > len(stores)


def one_line(node: cst.CSTNode) -> str:
    """A statement or expression on one line (its first line, then ` ...`), for an error message."""
    text = cst.Module(body=[]).code_for_node(node).strip()
    return " ".join(text.split("\n")[0].split()) + (" ..." if "\n" in text else "")


def top_classes(module: cst.Module) -> dict[str, cst.ClassDef]:
    """The file's top-level classes by name."""
    return {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}


def in_file_lineage(cls: cst.ClassDef, module: cst.Module) -> list[cst.ClassDef]:
    """The class and its bases defined in the file, nearest first."""
    classes = top_classes(module)
    lineage, todo = [], [cls]
    while todo:
        current = todo.pop(0)
        if current in lineage:
            continue
        lineage.append(current)
        todo += [
            classes[b.value.value] for b in current.bases if isinstance(b.value, cst.Name) and b.value.value in classes
        ]
    return lineage


def class_methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    """A class's own methods by name (not its bases')."""
    return {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}


def body_lines(fn: cst.FunctionDef, where: str) -> list[cst.BaseStatement]:
    """The statements of a function a codemod edits; one written on its `def` line (`def f(self): return x`) is
    refused by name, as the edits go on lines of their own."""
    if not isinstance(fn.body, cst.IndentedBlock):
        raise RewriteError(f"{where}: its body is on the `def` line; put it on lines of its own to rewrite the file")
    return list(fn.body.body)


Block = TypeVar("Block", cst.Module, cst.IndentedBlock)


def replace(module: cst.Module, old: cst.CSTNode, new: cst.CSTNode) -> cst.Module:
    """module.deep_replace(old, new) for a statement at the top level, in a top-level class or in one of its methods,
    looking only at those statements (deep_replace rebuilds every node of the file: most of a rewrite's time)."""

    def swapped(block: Block) -> Block:
        return block.with_changes(body=[new if s is old else s for s in block.body])

    for stmt in module.body:
        if stmt is old:
            return swapped(module)
        if not isinstance(stmt, cst.ClassDef) or not isinstance(stmt.body, cst.IndentedBlock):
            continue
        for member in stmt.body.body:
            if member is old:
                return replace(module, stmt, stmt.with_changes(body=swapped(stmt.body)))
            if isinstance(member, cst.FunctionDef) and isinstance(member.body, cst.IndentedBlock):
                if any(s is old for s in member.body.body):
                    return replace(module, member, member.with_changes(body=swapped(member.body)))
    return cst.ensure_type(module.deep_replace(old, new), cst.Module)
