"""Give the MoE class a grouped-GEMM training path: `moe_train`, its helper block, and a training branch calling it.

V3 form (the training output is never defined)::

    # Before
    if not self.training:
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
    # After
    if not self.training:
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
    else:
        y = self.moe_train(hidden_states, topk_idx, topk_weight).type(hidden_states.dtype).view(*orig_shape)

V2 form (a Python loop over the experts)::

    # Before
    if self.training:
        hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
        y = torch.empty_like(hidden_states)
        for i, expert in enumerate(self.experts):
            y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        y = y.to(hidden_states.dtype).view(*orig_shape)     # kept: this revision's dtype behaviour
        y = AddAuxiliaryLoss.apply(y, aux_loss)             # kept: the aux-loss semantics
    # After
    if self.training:
        y = self.moe_train(hidden_states, topk_idx, topk_weight)
        y = y.to(hidden_states.dtype).view(*orig_shape)
        y = AddAuxiliaryLoss.apply(y, aux_loss)

Both forms get the `moe_train` method and the module-level block (regenerated on every run, so a run with other
options rewrites them and a run with the same options changes nothing). Eval mode and `moe_infer` are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from moe_rewrite.errors import NotMoeFileError, RewriteError
from moe_rewrite.options import RewriteOptions
from moe_rewrite.templates import render_block, render_moe_methods

DESCRIPTION = "Gives the DeepSeek MoE class a grouped-GEMM training path (moe_train)."

SELF_TRAINING = m.Attribute(value=m.Name("self"), attr=m.Name("training"))
NOT_SELF_TRAINING = m.UnaryOperation(operator=m.Not(), expression=SELF_TRAINING)
MOE_INFER_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("moe_infer")))
MOE_TRAIN_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("moe_train")))
SELF_EXPERTS = m.Attribute(value=m.Name("self"), attr=m.Name("experts"))
SELF_GATE_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("gate")))
GENERATED_PREFIXES = ("MOE_REWRITE_", "_moe_rewrite_", "_MoeRewrite")
GENERATED_METHODS = ("moe_train",)  # and every method named moe_rewrite_*


@dataclass
class MoeClassInfo:
    name: str
    gate_class: str | None
    form: str  # "v3" or "v2"


def _methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    return {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}


def find_moe_class(module: cst.Module) -> cst.ClassDef:
    """The one top-level class defining both forward() and moe_infer()."""
    found = [
        s
        for s in module.body
        if isinstance(s, cst.ClassDef) and {"forward", "moe_infer"} <= _methods(s).keys()
    ]
    if not found:
        raise NotMoeFileError("not a DeepSeek-family MoE file: no class defines both forward() and moe_infer()")
    if len(found) > 1:
        names = ", ".join(c.name.value for c in found)
        raise RewriteError(f"more than one MoE class (forward() and moe_infer()): {names}")
    return found[0]


def gate_class_name(moe: cst.ClassDef) -> str | None:
    """X in `self.gate = X(...)` inside the MoE's __init__."""
    init = _methods(moe).get("__init__")
    if init is None:
        return None
    pattern = m.Assign(
        targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("gate")))],
        value=m.Call(func=m.Name()),
    )
    for node in m.findall(init, pattern):
        return cst.ensure_type(cst.ensure_type(node, cst.Assign).value, cst.Call).func.value  # type: ignore[union-attr]
    return None


def _gate_arity(forward: cst.FunctionDef, where: str) -> int:
    assigns = m.findall(forward, m.Assign(targets=[m.AssignTarget(target=m.Tuple())], value=SELF_GATE_CALL))
    if len(assigns) != 1:
        raise RewriteError(f"{where}: expected one `... = self.gate(...)` unpacking its results, found {len(assigns)}")
    target = cst.ensure_type(cst.ensure_type(assigns[0], cst.Assign).targets[0].target, cst.Tuple)
    return len(target.elements)


def _training_if(forward: cst.FunctionDef, where: str) -> cst.If:
    ifs = [s for s in forward.body.body if m.matches(s, m.If(test=SELF_TRAINING | NOT_SELF_TRAINING))]
    if len(ifs) != 1:
        raise RewriteError(f"{where}: expected one `if self.training:` or `if not self.training:` branch, found {len(ifs)}")
    return ifs[0]


def _single_moe_infer_assign(block: cst.BaseSuite, where: str) -> cst.SimpleStatementLine:
    body = block.body if isinstance(block, cst.IndentedBlock) else [block]
    stmts = [s for s in body if m.findall(s, MOE_INFER_CALL)]
    if len(stmts) != 1 or not m.matches(stmts[0], m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])):
        raise RewriteError(f"{where}: the eval branch does not assign the result of self.moe_infer(...)")
    return cst.ensure_type(stmts[0], cst.SimpleStatementLine)


def _moe_infer_args(stmt: cst.CSTNode) -> list[cst.Arg]:
    call = cst.ensure_type(m.findall(stmt, MOE_INFER_CALL)[0], cst.Call)
    if len(call.args) != 3:
        raise RewriteError("self.moe_infer(...) should take three arguments (tokens, topk ids, topk weights)")
    return list(call.args)


class _ReplaceMoeInfer(cst.CSTTransformer):
    """self.moe_infer(a, b, c) -> self.moe_train(a, b, c).type(a.dtype), inside one statement."""

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not m.matches(original_node, MOE_INFER_CALL):
            return updated_node
        func = cst.ensure_type(updated_node.func, cst.Attribute)
        train = updated_node.with_changes(func=func.with_changes(attr=cst.Name("moe_train")))
        dtype = cst.Attribute(value=updated_node.args[0].value, attr=cst.Name("dtype"))
        return cst.Call(func=cst.Attribute(value=train, attr=cst.Name("type")), args=[cst.Arg(dtype)])


def _v3_training_else(infer_stmt: cst.SimpleStatementLine, options: RewriteOptions) -> cst.Else:
    """The training branch: moe_train where eval calls moe_infer, then the opt-in router-training statements."""
    train_stmt = cst.ensure_type(infer_stmt.visit(_ReplaceMoeInfer()), cst.SimpleStatementLine)
    body: list[cst.BaseStatement] = [train_stmt.with_changes(leading_lines=[])]
    tokens, topk_ids = (a.value for a in _moe_infer_args(infer_stmt)[:2])
    if options.bias_update is not None:
        count = cst.Call(
            func=cst.Attribute(value=cst.Name("self"), attr=cst.Name("moe_rewrite_count_load")), args=[cst.Arg(topk_ids)]
        )
        body.append(cst.SimpleStatementLine(body=[cst.Expr(count)]))
    if options.aux_loss:
        target = cst.ensure_type(infer_stmt.body[0], cst.Assign).targets[0]
        attach = cst.Call(
            func=cst.Name("_moe_rewrite_with_balance_loss"),
            args=[cst.Arg(cst.Name("self")), cst.Arg(target.target), cst.Arg(tokens), cst.Arg(topk_ids)],
        )
        body.append(cst.SimpleStatementLine(body=[cst.Assign(targets=[target], value=attach)]))
    return cst.Else(body=cst.IndentedBlock(body=body))


def _rewrite_v2_training_body(body: cst.IndentedBlock, infer_args: list[cst.Arg], where: str) -> cst.IndentedBlock:
    stmts = list(body.body)
    if any(m.findall(s, MOE_TRAIN_CALL) for s in stmts):
        return body  # already rewritten
    loops = [i for i, s in enumerate(stmts) if m.matches(s, m.For(iter=m.Call(args=[m.Arg(SELF_EXPERTS)]) | SELF_EXPERTS))]
    if len(loops) != 1:
        raise RewriteError(f"{where}: the training branch has no `for ... in enumerate(self.experts)` loop")
    loop = loops[0]
    weight_name = infer_args[2].value
    weighted = next(
        (
            i
            for i in range(loop + 1, len(stmts))
            if m.matches(stmts[i], m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])]))
            and m.findall(stmts[i], m.Name(_name_of(weight_name)))
        ),
        None,
    )
    if weighted is None:
        raise RewriteError(f"{where}: no weighted sum over the top-k outputs after the experts loop")
    for i in range(loop):
        if not m.matches(stmts[i], m.SimpleStatementLine(body=[m.Assign()])):
            raise RewriteError(f"{where}: unexpected statement before the experts loop in the training branch")
    target = cst.ensure_type(cst.ensure_type(stmts[weighted], cst.SimpleStatementLine).body[0], cst.Assign).targets[0]
    call = cst.Call(
        func=cst.Attribute(value=cst.Name("self"), attr=cst.Name("moe_train")),
        args=[a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in infer_args],
    )
    # The comments above the replaced statements described the loop; say what replaced it instead.
    note = cst.EmptyLine(comment=cst.Comment("# moe-rewrite: the experts as grouped GEMMs instead of a loop over experts"))
    new = cst.SimpleStatementLine(body=[cst.Assign(targets=[target], value=call)], leading_lines=[note])
    return body.with_changes(body=[new, *stmts[weighted + 1 :]])


def _name_of(expr: cst.BaseExpression) -> str:
    if not isinstance(expr, cst.Name):
        raise RewriteError("self.moe_infer(...)'s third argument should be the topk weights' name")
    return expr.value


def rewrite_forward(moe: cst.ClassDef, options: RewriteOptions) -> tuple[cst.FunctionDef, str]:
    """The MoE forward with its training branch calling moe_train, and the form ("v3" or "v2")."""
    name = moe.name.value
    forward = _methods(moe)["forward"]
    where = f"{name}.forward"
    arity = _gate_arity(forward, where)
    branch = _training_if(forward, where)
    if arity == 2 and m.matches(branch.test, NOT_SELF_TRAINING):
        infer_stmt = _single_moe_infer_assign(branch.body, where)
        if branch.orelse is not None and not m.findall(branch.orelse, MOE_TRAIN_CALL):
            raise RewriteError(f"{where}: `if not self.training:` already has an else branch that moe-rewrite did not write")
        new_branch = branch.with_changes(orelse=_v3_training_else(infer_stmt, options))
        form = "v3"
    elif arity == 3 and m.matches(branch.test, SELF_TRAINING):
        if options.aux_loss or options.bias_update is not None:
            raise RewriteError(
                f"{where}: --aux-loss and --bias-update apply to the V3 form; this V2-form file trains its own aux loss"
            )
        if branch.orelse is None:
            raise RewriteError(f"{where}: `if self.training:` has no else branch calling self.moe_infer(...)")
        infer_args = _moe_infer_args(_single_moe_infer_assign(branch.orelse.body, where))
        new_branch = branch.with_changes(
            body=_rewrite_v2_training_body(cst.ensure_type(branch.body, cst.IndentedBlock), infer_args, where)
        )
        form = "v2"
    else:
        raise RewriteError(
            f"{where}: unrecognised structure (self.gate returns {arity} values; "
            "expected 2 with `if not self.training:` (V3 form) or 3 with `if self.training:` (V2 form))"
        )
    return cst.ensure_type(forward.deep_replace(branch, new_branch), cst.FunctionDef), form


def is_generated_method(name: str) -> bool:
    return name in GENERATED_METHODS or name.startswith("moe_rewrite_")


def with_methods(moe: cst.ClassDef, forward: cst.FunctionDef, methods: list[cst.FunctionDef]) -> cst.ClassDef:
    """The class with `forward` replaced and the generated methods right after it (replacing earlier ones)."""
    body: list[cst.BaseStatement] = []
    for stmt in moe.body.body:
        if isinstance(stmt, cst.FunctionDef) and is_generated_method(stmt.name.value):
            continue
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
            body += [forward, *methods]
        else:
            body.append(stmt)
    return moe.with_changes(body=moe.body.with_changes(body=body))


def _is_generated(stmt: cst.BaseStatement) -> bool:
    names: list[str] = []
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        names.append(stmt.name.value)
    elif isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                names += [t.target.value for t in small.targets if isinstance(t.target, cst.Name)]
    return bool(names) and all(n.startswith(GENERATED_PREFIXES) for n in names)


def transform(
    module: cst.Module, options: RewriteOptions, extra_sections: tuple[str, ...] = ()
) -> tuple[cst.Module, MoeClassInfo]:
    moe = find_moe_class(module)
    forward, form = rewrite_forward(moe, options)
    new_moe = with_methods(moe, forward, render_moe_methods(module, options))
    block = render_block(module, moe.name.value, options, extra_sections)
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        if _is_generated(stmt):
            continue
        if stmt is moe:
            body += [*block, new_moe]
        else:
            body.append(stmt)
    info = MoeClassInfo(name=moe.name.value, gate_class=gate_class_name(moe), form=form)
    return module.with_changes(body=body), info
