"""The whole-model rewrites' branch: an `if` an earlier run put in front of published statements (under a marker
comment, calling generated code), the published statements kept in its `else` (or below it, for a first-statement
branch). `unbranched` takes such branches back before a run proves the published statements again."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m


def is_marked_branch(stmt: cst.CSTNode, note: str, call: str) -> bool:
    """Whether `stmt` is a branch an earlier run put in: an `if` under the `note` comment whose body calls `call`."""
    return (
        isinstance(stmt, cst.If)
        and any(line.comment is not None and line.comment.value == note for line in stmt.leading_lines)
        and bool(m.findall(stmt.body, m.Call(func=m.Name(call))))
    )


def unbranched(function: cst.FunctionDef, note: str, call: str) -> cst.FunctionDef:
    """`function` with each marked branch taken back: a first-statement branch (no else) removed, an if/else branch
    replaced by the published statements kept in its else (their first one gets the branch's other comments back)."""
    if not isinstance(function.body, cst.IndentedBlock):
        return function
    statements = function.body.body
    if not any(is_marked_branch(s, note, call) for s in statements):
        return function
    body: list[cst.BaseStatement] = []
    for stmt in statements:
        if not is_marked_branch(stmt, note, call):
            body.append(stmt)
            continue
        branch = cst.ensure_type(stmt, cst.If)
        if not isinstance(branch.orelse, cst.Else):
            continue
        published = list(cst.ensure_type(branch.orelse.body, cst.IndentedBlock).body)
        lines = [line for line in branch.leading_lines if not (line.comment and line.comment.value == note)]
        body += [published[0].with_changes(leading_lines=lines), *published[1:]]
    return function.with_changes(body=function.body.with_changes(body=body))


def parsed_branch(text: str, module: cst.Module) -> cst.If:
    """The `if` statement `text` (lines ending in "\n"), parsed in the file's newline, indentation and encoding."""
    return cst.ensure_type(
        cst.parse_statement(text.replace("\n", module.default_newline), config=module.config_for_parsing), cst.If
    )


def around(statements: list[cst.BaseStatement], text: str, note: str, module: cst.Module) -> cst.If:
    """The branch `text` (an `if ...: ... else: pass`) under the `note` comment, with the published `statements` in
    its else; the first statement's comments go above the branch, so that `unbranched` gives them back."""
    branch = parsed_branch(text, module)
    first = statements[0]
    orelse = cst.ensure_type(branch.orelse, cst.Else)
    return branch.with_changes(
        leading_lines=[*first.leading_lines, cst.EmptyLine(comment=cst.Comment(note))],
        orelse=orelse.with_changes(
            body=orelse.body.with_changes(body=[first.with_changes(leading_lines=[]), *statements[1:]])
        ),
    )


def first_branch(function: cst.FunctionDef, text: str, note: str, module: cst.Module, at: int) -> cst.FunctionDef:
    """`function` with the branch `text` (an `if` without else) under the `note` comment as its statement `at` (after
    a docstring); the published statements stay below it, their comments with them."""
    body = list(cst.ensure_type(function.body, cst.IndentedBlock).body)
    body.insert(at, parsed_branch(text, module).with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(note))]))
    return function.with_changes(body=function.body.with_changes(body=body))
