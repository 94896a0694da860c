"""The eval branch's call: `self.moe_infer(...)` bound to moe_infer's parameters, and made
`self.moe_rewrite_infer(...)` (marked), which runs the grouped GEMMs where PEFT wrapped the experts' parameters."""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.moe.moe_class import MOE_INFER_CALL, as_block
from moe_rewrite.errors import RewriteError

EVAL_NOTE = "# moe-rewrite: moe_infer, unless PEFT wrapped the experts"


def single_moe_infer_assign(block: cst.BaseSuite, where: str) -> cst.SimpleStatementLine:
    stmts = [s for s in as_block(block).body if m.findall(s, MOE_INFER_CALL)]
    if len(stmts) != 1 or not m.matches(stmts[0], m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])):
        raise RewriteError(f"{where}: the eval branch does not assign the result of self.moe_infer(...)")
    return cst.ensure_type(stmts[0], cst.SimpleStatementLine)


def moe_infer_args(stmt: cst.CSTNode, params: list[str], where: str) -> list[cst.Arg]:
    return bind_moe_infer_args(cst.ensure_type(m.findall(stmt, MOE_INFER_CALL)[0], cst.Call), params, where)


def bind_moe_infer_args(call: cst.Call, params: list[str], where: str) -> list[cst.Arg]:
    """The call's (tokens, topk ids, topk weights), bound to moe_infer's own parameters as Python binds them:
    positional first, then keywords by name in any order. Returned positional, in moe_infer's order, each position
    keeping the call's own layout there (separator, comments)."""
    shape = "self.moe_infer(...) should take three arguments (tokens, topk ids, topk weights)"
    if len(params) != 3 or any(a.star for a in call.args):
        raise RewriteError(f"{where}: {shape}, by position or by moe_infer's parameter names")
    bound: dict[str, cst.Arg] = {}  # in the call's order
    for i, arg in enumerate(call.args):
        if arg.keyword is not None:
            name = arg.keyword.value
        else:  # positional arguments come first (Python's own rule)
            name = params[i] if i < len(params) else ""
        if name not in params or name in bound:
            raise RewriteError(f"{where}: {shape}; moe_infer's parameters are {', '.join(params)}")
        bound[name] = arg
    if len(bound) != 3:
        raise RewriteError(f"{where}: {shape}; moe_infer's parameters are {', '.join(params)}")
    if list(bound) != params and not all(isinstance(a.value, cst.Name) for a in call.args):
        # putting them in order changes when each is evaluated; for plain names that cannot matter
        raise RewriteError(f"{where}: {shape}; pass them in moe_infer's order, or as plain names")
    return [
        arg.with_changes(value=bound[p].value, keyword=None, equal=cst.MaybeSentinel.DEFAULT)
        for p, arg in zip(params, call.args)
    ]


class _EvalThroughMoeRewrite(cst.CSTTransformer):
    """self.moe_infer(...) -> self.moe_rewrite_infer(...), marked, in the eval branch's statement; arguments by
    keyword passed by position (moe_rewrite_infer's parameters need not have moe_infer's names)."""

    def __init__(self, bind: Callable[[cst.Call], list[cst.Arg]]) -> None:
        super().__init__()
        self.bind = bind

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not m.matches(original_node, MOE_INFER_CALL):
            return updated_node
        func = cst.ensure_type(updated_node.func, cst.Attribute)
        args = self.bind(updated_node)
        return updated_node.with_changes(func=func.with_changes(attr=cst.Name("moe_rewrite_infer")), args=args)

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if not m.findall(original_node, MOE_INFER_CALL) or updated_node.trailing_whitespace.comment is not None:
            return updated_node
        whitespace = updated_node.trailing_whitespace.with_changes(
            whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(EVAL_NOTE)
        )
        return updated_node.with_changes(trailing_whitespace=whitespace)


def eval_through_moe_rewrite(suite: cst.BaseSuite, bind: Callable[[cst.Call], list[cst.Arg]]) -> cst.BaseSuite:
    return cst.ensure_type(suite.visit(_EvalThroughMoeRewrite(bind)), cst.BaseSuite)
