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
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods import Context, Field, replace
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
    for node in m.findall(fn, m.Assert() | m.If()):
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
        if moe.form != "v3":
            return module
        raise RewriteError("the MoE class's __init__ does not assign `self.gate = <GateClass>(...)`")
    gates = [s for s in module.body if m.matches(s, m.ClassDef(name=m.Name(gate_class)))]
    if len(gates) != 1:
        if moe.form != "v3":  # as before V2 gates were looked into: a gate the file does not define is not ours
            return module
        raise RewriteError(f"gate class {gate_class} is not defined once at module level")
    gate = cst.ensure_type(gates[0], cst.ClassDef)
    forwards = [s for s in gate.body.body if m.matches(s, m.FunctionDef(name=m.Name("forward")))]
    if len(forwards) != 1 and moe.form == "v3":
        raise RewriteError(f"{gate_class} has no forward()")
    # Every method: a guard in a helper the forward calls stops training as surely as one in the forward.
    for method in [s for s in gate.body.body if isinstance(s, cst.FunctionDef)]:
        module = replace(module, method, drop_training_guards(method, f"{gate_class}.{method.name.value}"))
    return module
