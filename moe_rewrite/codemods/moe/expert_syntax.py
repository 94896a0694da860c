"""Syntax helpers of the expert-MLP proof (expert_mlp_proof.py): a node as Python's ast, a method's statements and
parameters, the names a function assigns."""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m


def _ast(node: cst.CSTNode) -> ast.AST:
    """An expression as Python's AST (equal up to formatting, comments and redundant parentheses)."""
    return ast.parse(cst.Module(body=[]).code_for_node(node).strip(), mode="eval").body


def _statements(fn: cst.FunctionDef, where: str) -> list[cst.BaseSmallStatement | cst.BaseCompoundStatement]:
    """The function's statements, a docstring left out, each small statement on its own."""
    if not isinstance(fn.body, cst.IndentedBlock):
        return list(fn.body.body)
    found: list[cst.BaseSmallStatement | cst.BaseCompoundStatement] = []
    for i, stmt in enumerate(fn.body.body):
        if isinstance(stmt, cst.SimpleStatementLine):
            small = list(stmt.body)
            if i == 0 and m.matches(small[0], m.Expr(m.SimpleString() | m.ConcatenatedString())):
                small = small[1:]
            found += small
        else:
            found.append(stmt)
    return found


def _params(fn: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in fn.params.params]


def _assigned(fn: cst.FunctionDef) -> set[str]:
    targets = [cst.ensure_type(t, cst.AssignTarget).target for t in m.findall(fn, m.AssignTarget())]
    targets += [t.target for t in m.findall(fn, m.AugAssign() | m.AnnAssign() | m.NamedExpr())]  # type: ignore[attr-defined]
    return {t.value for t in targets if isinstance(t, cst.Name)}
