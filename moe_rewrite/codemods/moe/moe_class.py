"""Finding the file's MoE class and its form: the class defining forward() and moe_infer() (or, ESFT form, a forward
looping over the experts under `if self.ep_size == 1:`), its router class, and the branch of its forward that the form
rewrites."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import class_methods, in_file_lineage
from moe_rewrite.codemods.moe.gate import SELF_TRAINING
from moe_rewrite.errors import NotMoeFileError, RewriteError

NOT_SELF_TRAINING = m.UnaryOperation(operator=m.Not(), expression=SELF_TRAINING)
# the eval branch's call, as published or as moe-rewrite left it (moe_rewrite_infer calls moe_infer)
MOE_INFER_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("moe_infer") | m.Name("moe_rewrite_infer")))
MOE_TRAIN_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("moe_train")))
SELF_EXPERTS = m.Attribute(value=m.Name("self"), attr=m.Name("experts"))
SELF_GATE_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("gate")))
EP_SIZE_IS_1 = m.Comparison(
    left=m.Attribute(value=m.Name("self"), attr=m.Name("ep_size")),
    comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Integer("1"))],
)


def is_training_refusal(orelse: cst.If | cst.Else | None) -> bool:
    """Kimi form: `if not self.training: ... else: raise NotImplementedError(...)`, an else whose only statement
    raises (any exception, any message) refuses training, as `assert not self.training` does in the V3 gate; the
    training path replaces it."""
    if not isinstance(orelse, cst.Else):
        return False
    stmts = as_block(orelse.body).body
    return len(stmts) == 1 and m.matches(stmts[0], m.SimpleStatementLine(body=[m.Raise()]))


def esft_branch(forward: cst.FunctionDef) -> cst.If | None:
    """ESFT form: the forward's `if self.ep_size == 1:` branch holding the loop over the experts (or moe_train)."""
    for stmt in forward.body.body:
        if m.matches(stmt, m.If(test=EP_SIZE_IS_1)) and m.findall(
            stmt.body,
            m.For(iter=m.Call(args=[m.Arg(SELF_EXPERTS)])) | MOE_TRAIN_CALL,  # type: ignore[attr-defined]
        ):
            return cst.ensure_type(stmt, cst.If)
    return None


def find_moe_class(module: cst.Module) -> cst.ClassDef:
    """The one top-level class defining both forward() and moe_infer() (or, ESFT form, a forward whose
    `if self.ep_size == 1:` branch loops over the experts)."""
    classes = [s for s in module.body if isinstance(s, cst.ClassDef)]  # all of them: a name defined twice is refused
    found = [c for c in classes if {"forward", "moe_infer"} <= class_methods(c).keys()]
    if not found:
        found = [c for c in classes if "forward" in class_methods(c) and esft_branch(class_methods(c)["forward"])]
    if not found:
        raise NotMoeFileError("not a DeepSeek-family MoE file: no class defines both forward() and moe_infer()")
    if len(found) > 1:
        names = ", ".join(c.name.value for c in found)
        raise RewriteError(f"more than one MoE class (forward() and moe_infer()): {names}")
    return found[0]


def gate_class_name(moe: cst.ClassDef) -> str | None:
    """X in `self.gate = X(...)` inside the MoE's __init__."""
    init = class_methods(moe).get("__init__")
    if init is None:
        return None
    pattern = m.Assign(
        targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("gate")))],
        value=m.Call(func=m.Name()),
    )
    for node in m.findall(init, pattern):
        return cst.ensure_type(cst.ensure_type(node, cst.Assign).value, cst.Call).func.value  # type: ignore[union-attr]
    return None


def refuse_overriding_subclasses(module: cst.Module, moe: cst.ClassDef) -> None:
    """A class of the file deriving from the MoE class (directly or through other classes of the file) that overrides
    forward or moe_infer would run its own code where moe-rewrite proved the MoE class's: refused by name."""
    for cls in module.body:
        if not isinstance(cls, cst.ClassDef) or cls is moe or moe not in in_file_lineage(cls, module):
            continue
        overrides = sorted({"forward", "moe_infer", "moe_train", "moe_rewrite_infer"} & class_methods(cls).keys())
        if overrides:
            raise RewriteError(
                f"{cls.name.value} derives from {moe.name.value} and overrides {', '.join(overrides)}; moe-rewrite "
                f"rewrites {moe.name.value}'s own and cannot prove the override: make it use {moe.name.value}'s"
            )


def gate_arity(forward: cst.FunctionDef, where: str) -> int:
    assigns = m.findall(forward, m.Assign(targets=[m.AssignTarget(target=m.Tuple())], value=SELF_GATE_CALL))
    if len(assigns) != 1:
        raise RewriteError(f"{where}: expected one `... = self.gate(...)` unpacking its results, found {len(assigns)}")
    target = cst.ensure_type(cst.ensure_type(assigns[0], cst.Assign).targets[0].target, cst.Tuple)
    return len(target.elements)


def training_if(forward: cst.FunctionDef, where: str) -> cst.If:
    ifs = [s for s in forward.body.body if m.matches(s, m.If(test=SELF_TRAINING | NOT_SELF_TRAINING))]
    if len(ifs) != 1:
        raise RewriteError(
            f"{where}: expected one `if self.training:` or `if not self.training:` branch, found {len(ifs)}"
        )
    return ifs[0]


def as_block(suite: cst.BaseSuite) -> cst.IndentedBlock:
    """A branch's body as an indented block (`if c: a; b` means the same as the block `a`, `b`)."""
    if isinstance(suite, cst.IndentedBlock):
        return suite
    small = cst.ensure_type(suite, cst.SimpleStatementSuite).body
    return cst.IndentedBlock(
        body=[cst.SimpleStatementLine(body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]) for s in small]
    )
