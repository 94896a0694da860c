"""Let the router run in training mode: drop `assert not self.training` from the gate's forward (V3 form).

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

from moe_rewrite.errors import RewriteError

DESCRIPTION = "Removes the router's `assert not self.training`."

ASSERT_NOT_TRAINING = m.SimpleStatementLine(
    body=[
        m.Assert(
            test=m.UnaryOperation(
                operator=m.Not(), expression=m.Attribute(value=m.Name("self"), attr=m.Name("training"))
            )
        )
    ]
)


class _DropTrainingAsserts(cst.CSTTransformer):
    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> cst.IndentedBlock:
        body: list[cst.BaseStatement] = []
        carried: list[cst.EmptyLine] = []
        for stmt in updated_node.body:
            if m.matches(stmt, ASSERT_NOT_TRAINING):
                carried += stmt.leading_lines  # keep comments written above the assert
                continue
            if carried:
                stmt = stmt.with_changes(leading_lines=[*carried, *stmt.leading_lines])
                carried = []
            body.append(stmt)
        if not body:
            body = [cst.SimpleStatementLine(body=[cst.Pass()], leading_lines=carried)]
        return updated_node.with_changes(body=body)


def transform(module: cst.Module, gate_class: str | None) -> cst.Module:
    if gate_class is None:
        raise RewriteError("the MoE class's __init__ does not assign `self.gate = <GateClass>(...)`")
    gates = [s for s in module.body if m.matches(s, m.ClassDef(name=m.Name(gate_class)))]
    if len(gates) != 1:
        raise RewriteError(f"gate class {gate_class} is not defined once at module level")
    gate = cst.ensure_type(gates[0], cst.ClassDef)
    forwards = [s for s in gate.body.body if m.matches(s, m.FunctionDef(name=m.Name("forward")))]
    if len(forwards) != 1:
        raise RewriteError(f"{gate_class} has no forward()")
    forward = forwards[0]
    return cst.ensure_type(module.deep_replace(forward, forward.visit(_DropTrainingAsserts())), cst.Module)
