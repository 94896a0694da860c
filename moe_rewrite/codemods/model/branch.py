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
