"""Let the router run in training mode: drop `assert not self.training` from the gate's forward.

V3 form, and V2-form gates that carry V3's `noaux_tc` branch (DeepSeek-VL2's and DeepSeek-OCR's language models:
with `topk_method: noaux_tc` the published file fails its first training step).

Also its other spellings (`assert self.training is False`, `== False`, `if self.training: raise ...`), here and in the
MoE forward; an assert or raise on `self.training` in another form is refused, so no rewritten file fails its first
training step.

    # Before
    if self.topk_method == "noaux_tc":
        assert not self.training
        scores_for_choice = scores.view(bsz * seq_len, -1) + self.e_score_correction_bias.unsqueeze(0)
    # After
    if self.topk_method == "noaux_tc":
        scores_for_choice = scores.view(bsz * seq_len, -1) + self.e_score_correction_bias.unsqueeze(0)

Selection is then the same in training as in eval: the bias is added for choosing experts, the weights are gathered
from the unbiased scores, and the bias gets no gradient (top-k indices are not differentiable).

Kimi's gate (`KimiMoEGate`, Kimi-Linear) adds the bias in place, to a view of the scores, so the published weights
(gathered from `scores` afterwards) include the bias, and autograd, which keeps the sigmoid's output for its backward,
would fail at the first backward. The add is made out of place with the same values, `scores` rebound to the sum::

    # Before
    scores_for_choice = scores.view(bsz * seq_len, -1)
    scores_for_choice += self.e_score_correction_bias.unsqueeze(0)
    # After
    scores_for_choice = scores.view(bsz * seq_len, -1)
    scores_for_choice = (scores_for_choice + self.e_score_correction_bias.unsqueeze(0)).to(scores_for_choice.dtype)
    scores = scores_for_choice.view(scores.shape)  # moe-rewrite: ...

Training then computes exactly the eval path with gradients, the bias's included (it is in the weights). Any other
augmented assignment in the gate's forward is refused by name.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import Context, Field, Form, find, reads, replace
from moe_rewrite.errors import RewriteError

READS: tuple[Field, ...] = ("moe",)
PROVIDES: tuple[Field, ...] = ()
SELF_TRAINING = m.Attribute(value=m.Name("self"), attr=m.Name("training"))
FALSE = m.Name("False")
TRUE = m.Name("True")
# `assert not self.training`, `assert self.training is False`, `assert self.training == False` (any message), and
# `if self.training: raise ...` (also `is True` / `== True`), with nothing else in the branch.
TRAINING_GUARD = m.SimpleStatementLine(
    body=[
        m.Assert(
            test=m.UnaryOperation(operator=m.Not(), expression=SELF_TRAINING)
            | m.Comparison(
                left=SELF_TRAINING, comparisons=[m.ComparisonTarget(operator=m.Is() | m.Equal(), comparator=FALSE)]
            )
        )
    ]
) | m.If(
    test=SELF_TRAINING
    | m.Comparison(left=SELF_TRAINING, comparisons=[m.ComparisonTarget(operator=m.Is() | m.Equal(), comparator=TRUE)]),
    body=m.IndentedBlock(body=[m.SimpleStatementLine(body=[m.Raise()])]) | m.SimpleStatementSuite(body=[m.Raise()]),
    orelse=None,
)


class _DropTrainingGuards(cst.CSTTransformer):
    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body: list[cst.BaseStatement] = []
        carried: list[cst.EmptyLine] = []
        for stmt in updated_node.body:
            if m.matches(stmt, TRAINING_GUARD):
                carried += stmt.leading_lines  # keep comments written above the guard
                continue
            if carried:
                stmt = stmt.with_changes(leading_lines=[*carried, *stmt.leading_lines])
                carried = []
            body.append(stmt)
        if not body:
            body = [cst.SimpleStatementLine(body=[cst.Pass()], leading_lines=carried)]
        return updated_node.with_changes(body=body)


def drop_training_guards(fn: cst.FunctionDef, where: str) -> cst.FunctionDef:
    """`fn` without its training guards (TRAINING_GUARD); refuses a guard-like statement it does not recognise: an
    assert on self.training, or a raise under a test of it."""
    fn = cst.ensure_type(fn.visit(_DropTrainingGuards()), cst.FunctionDef)
    for node in find(fn, m.Assert() | m.If(), cst.Assert, cst.If):
        test = cst.ensure_type(node, (cst.Assert, cst.If)).test  # type: ignore[arg-type]
        raises = isinstance(node, cst.Assert) or any(
            m.matches(s, m.SimpleStatementLine(body=[m.Raise()])) for s in _top(node)
        )
        if raises and m.findall(test, SELF_TRAINING):
            code = cst.Module(body=[]).code_for_node(test)
            raise RewriteError(
                f"{where}: cannot tell whether the check on `{code}` lets training run; moe-rewrite removes "
                "`assert not self.training` and `if self.training: raise ...`"
            )
    return fn


def _top(node: cst.CSTNode) -> list[cst.CSTNode]:
    body = getattr(node, "body", None)
    if isinstance(body, cst.IndentedBlock):
        return list(body.body)
    if isinstance(body, cst.SimpleStatementSuite):
        return [cst.SimpleStatementLine(body=list(body.body))]
    return []


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The router's training guards dropped: V3 form, and a V2-form gate with any (the `noaux_tc` branch of VL2 and
    OCR); a V2-form gate without one trains as published and is left as it is."""
    moe = context.moe_class()
    gate_class = moe.gate_class
    if gate_class is None:
        if moe.form != Form.V3:
            return module
        raise RewriteError("the MoE class's __init__ does not assign `self.gate = <GateClass>(...)`")
    gates = [s for s in module.body if m.matches(s, m.ClassDef(name=m.Name(gate_class)))]
    if len(gates) != 1:
        if moe.form != Form.V3:  # as before V2 gates were looked into: a gate the file does not define is not ours
            return module
        raise RewriteError(f"gate class {gate_class} is not defined once at module level")
    gate = cst.ensure_type(gates[0], cst.ClassDef)
    forwards = [s for s in gate.body.body if m.matches(s, m.FunctionDef(name=m.Name("forward")))]
    if len(forwards) != 1 and moe.form == Form.V3:
        raise RewriteError(f"{gate_class} has no forward()")
    # Every method: a guard in a helper the forward calls stops training as surely as one in the forward.
    for method in [s for s in gate.body.body if isinstance(s, cst.FunctionDef)]:
        where = f"{gate_class}.{method.name.value}"
        fixed = drop_training_guards(method, where)
        if method.name.value == "forward" and moe.form == Form.V3:  # a V2 gate trains as published, in place or not
            fixed = out_of_place_view_adds(fixed, where)
        module = replace(module, method, fixed)
    return module


INPLACE_NOTE = "# moe-rewrite: the add out of place (autograd), as it left them"


def out_of_place_view_adds(fn: cst.FunctionDef, where: str) -> cst.FunctionDef:
    """`v = b.view(...)` right before `v += e` (Kimi's gate): the add out of place, `b` rebound to the sum as the
    in-place add left it. `b` must not be read before the view (no other alias of it could see the add). Any other
    augmented assignment is refused by name."""
    if not isinstance(fn.body, cst.IndentedBlock):
        return fn
    stmts = list(fn.body.body)
    body: list[cst.BaseStatement] = []
    for i, stmt in enumerate(stmts):
        if not m.findall(stmt, m.AugAssign()):
            body.append(stmt)
            continue
        view = _view_base(stmts[i - 1], stmt) if i else None
        if view is None or any(reads(s, view[1]) for s in stmts[: i - 1]):
            code = cst.Module(body=[]).code_for_node(cst.ensure_type(m.findall(stmt, m.AugAssign())[0], cst.AugAssign))
            raise RewriteError(
                f"{where}: `{code.strip()}` changes a tensor in place, which autograd may refuse in training; "
                "moe-rewrite rewrites only `v += e` right after `v = scores.view(...)` (Kimi's gate)"
            )
        name, base = view
        aug = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.AugAssign)
        total = cst.ensure_type(cst.parse_expression(f"({name} + _).to({name}.dtype)"), cst.Call)
        plus = cst.ensure_type(cst.ensure_type(total.func, cst.Attribute).value, cst.BinaryOperation)
        total = total.with_changes(
            func=cst.ensure_type(total.func, cst.Attribute).with_changes(value=plus.with_changes(right=aug.value))
        )
        body.append(
            stmt.with_changes(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(name))], value=total)])  # type: ignore[attr-defined]
        )
        rebind = cst.parse_statement(f"{base} = {name}.view({base}.shape)  {INPLACE_NOTE}")
        body.append(rebind)
    return fn.with_changes(body=fn.body.with_changes(body=body))


def _view_base(previous: cst.BaseStatement, stmt: cst.BaseStatement) -> tuple[str, str] | None:
    """(v, b) for `v = b.view(...)` followed by `v += e` (one statement each), else None."""
    view = m.SimpleStatementLine(
        body=[
            m.Assign(
                targets=[m.AssignTarget(m.Name())],
                value=m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("view"))),
            )
        ]
    )
    if not m.matches(previous, view) or not m.matches(
        stmt, m.SimpleStatementLine(body=[m.AugAssign(target=m.Name(), operator=m.AddAssign())])
    ):
        return None
    assign = cst.ensure_type(cst.ensure_type(previous, cst.SimpleStatementLine).body[0], cst.Assign)
    name = cst.ensure_type(assign.targets[0].target, cst.Name).value
    base = cst.ensure_type(cst.ensure_type(cst.ensure_type(assign.value, cst.Call).func, cst.Attribute).value, cst.Name)
    aug = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.AugAssign)
    if cst.ensure_type(aug.target, cst.Name).value != name or base.value == name or reads(aug.value, name):
        return None
    return name, base.value
