"""Where aux_loss_alpha = 0, let the V2-form MoE forward train without the aux loss (it weighs nothing).

The published gate returns no aux loss (None) in training when aux_loss_alpha is 0, which users set for fine-tuning,
and the MoE forward's `AddAuxiliaryLoss.apply(y, aux_loss)` then fails on None (its forward starts with
`assert loss.numel() == 1`). The call goes through runtime/router/no_aux_loss.py instead::

    # Before
    y = AddAuxiliaryLoss.apply(y, aux_loss)
    # After
    # moe-rewrite: with aux_loss_alpha = 0, no aux loss (it weighs nothing; a warning says so once)
    y = _moe_rewrite_add_aux_loss(AddAuxiliaryLoss, y, aux_loss, self.config)

which makes the published call whenever the gate returns a loss; for None with aux_loss_alpha = 0 it returns y,
training without the aux loss (the published loop's numbers with the loss skipped), and warns once per process; for
None with another alpha it raises an error naming config.aux_loss_alpha (config.moe_rewrite_train_without_aux_loss
= True, the opt-in earlier releases asked for, still returns y, silently). Only a call into a class of the file whose
forward starts with that assert (so that the published code fails on None) in a MoE class that keeps its config as
`self.config` is changed; others stay as they are.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import MARK, Context, Field, class_methods, code, replace, top_classes

READS: tuple[Field, ...] = ("moe",)
PROVIDES: tuple[Field, ...] = ()
OUR_CALL = "_moe_rewrite_add_aux_loss"
NOTE = f"{MARK}: with aux_loss_alpha = 0, no aux loss (it weighs nothing; a warning says so once)"
NOTE_PREFIX = f"{MARK}: with aux_loss_alpha = 0, "  # this note's, and earlier releases' (replaced by NOTE)
APPLY = m.Call(
    func=m.Attribute(value=m.Name(), attr=m.Name("apply")),
    args=[m.Arg(keyword=None, star=""), m.Arg(keyword=None, star="")],
)  # X.apply(y, aux_loss)
SELF_CONFIG = m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name("config")))])


def _fails_on_none(cls: cst.ClassDef) -> bool:
    """The class's forward(ctx, x, loss) starts (after a docstring) with `assert loss.numel() == 1`."""
    forward = class_methods(cls).get("forward")
    if forward is None or len(forward.params.params) != 3 or not isinstance(forward.body, cst.IndentedBlock):
        return False
    body = list(forward.body.body)
    if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])):
        body = body[1:]
    loss = forward.params.params[2].name.value
    return bool(body) and code(body[0]).strip() == f"assert {loss}.numel() == 1"


class _Calls(cst.CSTTransformer):
    """`X.apply(y, aux_loss)` for the classes X named -> our call, the note above its statement."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.found = 0

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if m.matches(updated_node, m.Call(func=m.Name(OUR_CALL))):
            self.found += 1
            return updated_node
        if not m.matches(updated_node, APPLY) or updated_node.func.value.value not in self.names:  # type: ignore
            return updated_node
        self.found += 1
        cls, y, loss = (code(node) for node in (updated_node.func.value, *(a.value for a in updated_node.args)))  # type: ignore
        return cst.parse_expression(f"{OUR_CALL}({cls}, {y}, {loss}, self.config)")

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        if not m.findall(updated_node, m.Call(func=m.Name(OUR_CALL))):
            return updated_node
        comments = [line.comment.value for line in updated_node.leading_lines if line.comment is not None]
        ours = [comment for comment in comments if comment.startswith(NOTE_PREFIX)]
        if ours == [NOTE]:
            return updated_node
        lines = [line for line in updated_node.leading_lines if not (line.comment and line.comment.value in ours)]
        return updated_node.with_changes(leading_lines=[*lines, cst.EmptyLine(comment=cst.Comment(NOTE))])


def transform(module: cst.Module, context: Context) -> cst.Module:
    classes = top_classes(module)
    moe = classes.get(context.moe_class().name)
    names = {name for name, cls in classes.items() if _fails_on_none(cls)}
    forward = class_methods(moe).get("forward") if moe is not None else None
    init = class_methods(moe).get("__init__") if moe is not None else None
    if forward is None or init is None or not m.findall(init, SELF_CONFIG):
        return module
    calls = _Calls(names)
    new_forward = cst.ensure_type(forward.visit(calls), cst.FunctionDef)
    if calls.found:
        context.sections.add("no_aux_loss")
    return replace(module, forward, new_forward)
