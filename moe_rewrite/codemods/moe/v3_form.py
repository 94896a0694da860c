"""The V3 form: `if not self.training:` calling moe_infer gets an else, the same statements with moe_train where eval
calls moe_infer (and the opt-in router-training statements); what the eval branch calls must not read `.training`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import class_methods, find, in_file_lineage, one_line, top_classes
from moe_rewrite.codemods.moe.eval_call import EVAL_NOTE, single_moe_infer_assign
from moe_rewrite.codemods.moe.gate import SELF_TRAINING
from moe_rewrite.codemods.moe.moe_class import MOE_INFER_CALL, as_block
from moe_rewrite.errors import RewriteError
from moe_rewrite.options import RewriteOptions


class _ReplaceMoeInfer(cst.CSTTransformer):
    """self.moe_infer(a, b, c) -> self.moe_train(a, b, c, out_dtype=a.dtype), inside one statement (without the eval
    branch's note): moe_infer returns a's dtype, so training does too. Arguments by keyword are bound to moe_infer's
    parameters (`bind`) and passed by position."""

    def __init__(self, bind: Callable[[cst.Call], list[cst.Arg]]) -> None:
        super().__init__()
        self.bind = bind

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not m.matches(original_node, MOE_INFER_CALL):
            return updated_node
        func = cst.ensure_type(updated_node.func, cst.Attribute)
        *first, before_last, last = self.bind(updated_node)
        # out_dtype goes last in the call's own layout: the last argument takes the separator the others have, and
        # a trailing comma (with what follows it: a comment, the line break before the parenthesis) moves after it.
        out_dtype = cst.Arg(
            cst.Attribute(value=first[0].value, attr=cst.Name("dtype")),
            keyword=cst.Name("out_dtype"),
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
            ),
            comma=last.comma,
        )
        args = [*first, before_last, last.with_changes(comma=before_last.comma), out_dtype]
        return updated_node.with_changes(func=func.with_changes(attr=cst.Name("moe_train")), args=args)

    def leave_TrailingWhitespace(
        self, original_node: cst.TrailingWhitespace, updated_node: cst.TrailingWhitespace
    ) -> cst.TrailingWhitespace:
        if updated_node.comment is not None and updated_node.comment.value == EVAL_NOTE:
            return cst.TrailingWhitespace()
        return updated_node


NO_GRAD = m.Attribute(attr=m.Name("no_grad") | m.Name("inference_mode")) | m.Name("no_grad") | m.Name("inference_mode")


def v3_training_else(
    eval_body: cst.BaseSuite, options: RewriteOptions, bind: Callable[[cst.Call], list[cst.Arg]], where: str
) -> cst.Else:
    """The training branch: the eval branch's statements, in order, with moe_train where eval calls moe_infer (so any
    post-processing of its result is the same in training), then the opt-in router-training statements."""
    infer_stmt = single_moe_infer_assign(eval_body, where)
    eval_stmts = as_block(eval_body).body
    for stmt in eval_stmts:
        if m.findall(stmt, SELF_TRAINING) or m.findall(stmt, NO_GRAD):
            raise RewriteError(
                f"{where}: `{one_line(stmt)}` in the eval branch depends on training mode or gradients; moe-rewrite "
                "cannot mirror it in training"
            )
    extra: list[cst.BaseStatement] = []
    call = cst.ensure_type(m.findall(infer_stmt, MOE_INFER_CALL)[0], cst.Call)
    tokens, topk_ids = (a.value for a in bind(call)[:2])
    if options.bias_update is not None:
        count = cst.Call(
            func=cst.Attribute(value=cst.Name("self"), attr=cst.Name("moe_rewrite_count_load")),
            args=[cst.Arg(topk_ids)],
        )
        extra.append(cst.SimpleStatementLine(body=[cst.Expr(count)]))
    if options.aux_loss:
        target = cst.ensure_type(infer_stmt.body[0], cst.Assign).targets[0]
        attach = cst.Call(
            func=cst.Name("_moe_rewrite_with_balance_loss"),
            args=[cst.Arg(cst.Name("self")), cst.Arg(target.target), cst.Arg(tokens), cst.Arg(topk_ids)],
        )
        extra.append(cst.SimpleStatementLine(body=[cst.Assign(targets=[target], value=attach)]))
    body: list[cst.BaseStatement] = []
    for stmt in _without_declarations(eval_stmts):
        if m.matches(stmt, m.SimpleStatementLine()) and m.findall(stmt, MOE_INFER_CALL):
            body += [
                cst.ensure_type(stmt.visit(_ReplaceMoeInfer(bind)), cst.SimpleStatementLine).with_changes(
                    leading_lines=[]
                ),
                *extra,
            ]
        else:
            body.append(stmt.with_changes(leading_lines=[]))
    return cst.Else(body=cst.IndentedBlock(body=body))


class _DropDeclarations(cst.CSTTransformer):
    """Removes `global` / `nonlocal` from the function's own scope (not from functions or classes defined in it)."""

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        kept = [s for s in updated_node.body if not isinstance(s, (cst.Global, cst.Nonlocal))]
        if not kept:
            return cst.RemoveFromParent()
        return updated_node.with_changes(body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) for s in kept])

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        return (
            updated_node
            if updated_node.body
            else updated_node.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])
        )


def _without_declarations(stmts: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """The eval branch's statements for the training copy, without its `global` / `nonlocal` declarations: one applies
    to the whole function, the copy included, and declaring a name again after the eval branch used it does not
    compile."""
    wrapped = cst.Module(body=list(stmts)).visit(_DropDeclarations())
    return list(wrapped.body)


def refuse_helpers_reading_training(
    stmts: Sequence[cst.BaseStatement], moe: cst.ClassDef, module: cst.Module, where: str
) -> None:
    """The eval branch runs in training too, so what it calls must not depend on training mode: a method of the MoE
    class (or of its in-file bases), the forward of a submodule whose class is in the file (`self.norm = Norm(...)`),
    or a function of the file, called there, or what those call in turn, must not read `.training` (the branch itself
    is checked in v3_training_else). Submodules of classes from elsewhere (torch's) are not looked into."""
    functions = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
    classes = top_classes(module)

    def resolve(func: cst.BaseExpression, owner: cst.ClassDef | None) -> tuple[cst.FunctionDef, cst.ClassDef | None]:
        if isinstance(func, cst.Name):
            return functions.get(func.value), None  # type: ignore[return-value]
        name = cst.ensure_type(func, cst.Attribute).attr.value
        if owner is None:
            return None, None  # type: ignore[return-value]
        methods: dict[str, cst.FunctionDef] = {}
        for cls in reversed(in_file_lineage(owner, module)):  # a class's own methods win over its bases'
            methods |= class_methods(cls)
        if name in methods:
            return methods[name], owner
        for init in (class_methods(c).get("__init__") for c in in_file_lineage(owner, module)):
            assign = m.Assign(
                targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name(name)))],
                value=m.Call(func=m.Name()),
            )
            for node in find(init, assign, cst.Assign) if init is not None else []:
                sub = classes.get(cst.ensure_type(cst.ensure_type(node, cst.Assign).value, cst.Call).func.value)  # type: ignore[attr-defined]
                if sub is not None:
                    return resolve(cst.Attribute(value=cst.Name("self"), attr=cst.Name("forward")), sub)[0], sub
        return None, None  # type: ignore[return-value]

    for stmt in stmts:
        seen: set[int] = set()
        todo: list[tuple[cst.CSTNode, cst.ClassDef | None, tuple[str, ...]]] = [(stmt, moe, ())]
        while todo:
            node, owner, chain = todo.pop()
            for call in m.findall(node, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name()) | m.Name())):
                func = cst.ensure_type(call, cst.Call).func
                target, target_owner = resolve(func, owner)
                if target is None or id(target) in seen:
                    continue
                seen.add(id(target))
                name = func.attr.value if isinstance(func, cst.Attribute) else cst.ensure_type(func, cst.Name).value  # type: ignore[attr-defined]
                if find(target, m.Attribute(attr=m.Name("training")), cst.Attribute):
                    calls = " -> ".join(f"{c}()" for c in (*chain, name))
                    raise RewriteError(
                        f"{where}: `{one_line(stmt)}` in the eval branch calls {calls}, which reads `.training`; "
                        "moe-rewrite cannot mirror it in training"
                    )
                todo.append((target, target_owner, (*chain, name)))
