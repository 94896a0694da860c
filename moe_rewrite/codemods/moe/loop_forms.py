"""The loop forms (V2, V1, ESFT): the training branch's per-expert loop (the tokens' repeat_interleave, the output
buffer, the loop, the weighted sum) replaced by one moe_train call, everything else kept in order or refused by name;
the eval call's arguments checked against what training computes with."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import one_line, reads
from moe_rewrite.codemods.kit.prove import same
from moe_rewrite.codemods.moe.moe_class import MOE_TRAIN_CALL, SELF_EXPERTS, SELF_GATE_CALL, as_block, esft_branch
from moe_rewrite.errors import RewriteError
from moe_rewrite.options import RewriteOptions


def _names_in(node: cst.CSTNode) -> set[str]:
    return {cst.ensure_type(n, cst.Name).value for n in m.findall(node, m.Name())}


def _bound(target: cst.BaseExpression) -> set[str]:
    """Names an assignment target binds (`a`, `a, (b, *c)`); `a[i] = ...` and `a.b = ...` bind none."""
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(_bound(e.value) for e in target.elements))
    if isinstance(target, cst.StarredElement):
        return _bound(target.value)
    return set()


def _assigned_in(node: cst.CSTNode) -> set[str]:
    targets = [cst.ensure_type(t, cst.AssignTarget).target for t in m.findall(node, m.AssignTarget())]
    targets += [t.target for t in m.findall(node, m.AugAssign() | m.AnnAssign() | m.For() | m.NamedExpr())]  # type: ignore[attr-defined]
    targets += [a.name for a in m.findall(node, m.AsName())]  # type: ignore[attr-defined]
    return set().union(*(_bound(t) for t in targets)) if targets else set()


def _uses_beyond_dtype(node: cst.CSTNode, name: str) -> bool:
    """Whether `node` reads `name` other than as `name.dtype` / `name.device` (the same for the tokens before and
    after repeat_interleave)."""
    total = len(m.findall(node, m.Name(name)))
    meta = len(m.findall(node, m.Attribute(value=m.Name(name), attr=m.Name("dtype") | m.Name("device"))))
    return total > meta


def _experts_loop_names(loop: cst.For) -> tuple[str, str, str] | None:
    """(y, idx, x) of `for i, expert in enumerate(self.experts): y[idx == i] = expert(x[idx == i])`, else None."""
    try:
        i, expert = (cst.ensure_type(e.value, cst.Name).value for e in cst.ensure_type(loop.target, cst.Tuple).elements)
        assign = cst.ensure_type(cst.ensure_type(loop.body.body[0], cst.SimpleStatementLine).body[0], cst.Assign)
        store = cst.ensure_type(assign.targets[0].target, cst.Subscript)
        y = cst.ensure_type(store.value, cst.Name).value
        mask = cst.ensure_type(cst.ensure_type(store.slice[0].slice, cst.Index).value, cst.Comparison)
        idx = cst.ensure_type(mask.left, cst.Name).value
        x = cst.ensure_type(
            cst.ensure_type(cst.ensure_type(assign.value, cst.Call).args[0].value, cst.Subscript).value, cst.Name
        ).value
    except (TypeError, ValueError, IndexError, AttributeError):
        return None
    expected = f"for {i}, {expert} in enumerate(self.experts):\n    {y}[{idx} == {i}] = {expert}({x}[{idx} == {i}])"
    return (y, idx, x) if same(loop, expected) else None


def loop_training_body(
    body: cst.IndentedBlock, forward: cst.FunctionDef, branch: cst.If, where: str, skip_after: int = 0
) -> tuple[cst.IndentedBlock, tuple[str, str, str]]:
    """Replace exactly the per-expert computation: the tokens' repeat_interleave, the output buffer, the loop and the
    weighted sum, as published. Every other statement stays, in order, before the moe_train call (if it cannot see
    what the replaced ones computed) or after it; anything that could tell the difference is refused by name.
    Returns the new body and the names moe_train gets (tokens, topk ids, topk weights), read off the loop itself: the
    tokens it indexes, the ids its flat ids are a view of, the weights of the weighted sum."""
    stmts = list(body.body)
    for call in (c for s in stmts for c in m.findall(s, MOE_TRAIN_CALL)):  # already rewritten
        args = cst.ensure_type(call, cst.Call).args
        if len(args) == 3 and all(isinstance(a.value, cst.Name) for a in args):
            return body, tuple(cst.ensure_type(a.value, cst.Name).value for a in args)  # type: ignore[return-value]
        raise RewriteError(f"{where}: `{one_line(call)}` is not the moe_train call moe-rewrite writes")
    loops = [
        i for i, s in enumerate(stmts) if m.matches(s, m.For(iter=m.Call(args=[m.Arg(SELF_EXPERTS)]) | SELF_EXPERTS))
    ]
    if len(loops) != 1:
        raise RewriteError(f"{where}: the training branch has no `for ... in enumerate(self.experts)` loop")
    loop = loops[0]
    found = _experts_loop_names(cst.ensure_type(stmts[loop], cst.For))
    if found is None:
        raise RewriteError(
            f"{where}: the experts loop `{one_line(stmts[loop])}` is not `for i, expert in enumerate(self.experts): "
            "y[idx == i] = expert(x[idx == i])`"
        )
    y, flat, tokens = found
    ids = _flat_source(forward, branch, flat)
    if ids is None:
        raise RewriteError(
            f"{where}: the experts loop's ids `{flat}` should be assigned once, as `{flat} = topk_idx.view(-1)`"
        )
    weights = _sum_weights(stmts[loop + 1 :], y) or "topk_weight"
    repeat = f"{tokens} = {tokens}.repeat_interleave(self.num_experts_per_tok, dim=0)"
    known = {
        "repeat": [i for i in range(loop) if same(stmts[i], repeat)],
        "buffer": [
            i
            for i in range(loop)
            if same(stmts[i], f"{y} = torch.empty_like({tokens})", f"{y} = torch.zeros_like({tokens})")
        ],
        "sum": [
            i
            for i in range(loop + 1, len(stmts))
            if m.matches(stmts[i], m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])]))
            and same(
                stmts[i],
                f"{_assign_target(stmts[i])} = ({y}.view(*{weights}.shape, -1) * {weights}.unsqueeze(-1)).sum(dim=1)",
            )
        ],
    }
    for what, expected in (
        ("repeat", repeat),
        ("buffer", f"{y} = torch.empty_like({tokens})"),
        ("sum", f"y = ({y}.view(*{weights}.shape, -1) * {weights}.unsqueeze(-1)).sum(dim=1)"),
    ):
        if len(known[what]) != 1:
            where_ = "before" if what != "sum" else "after"
            raise RewriteError(
                f"{where}: expected one `{expected}` {where_} the experts loop, found {len(known[what])}"
            )
    r, b, total = known["repeat"][0], known["buffer"][0], known["sum"][0]
    if not r < b:
        raise RewriteError(f"{where}: `{repeat}` should come before `{one_line(stmts[b])}`")
    _check_ids_from_gate(forward, ids, where)
    out = _assign_target(stmts[total])
    kept_before, kept_after = [], []
    buffer_live = out != y  # after the sum, `y` still names the loop's buffer until something assigns it
    for i, stmt in enumerate(stmts):
        if i in (r, b, loop, total):
            continue
        if i < total:
            seen = _names_in(stmt)
            if seen & {y, flat} or (i > r and tokens in seen) or ids in _assigned_in(stmt):
                raise RewriteError(
                    f"{where}: `{one_line(stmt)}` sits between the replaced per-expert statements and uses what they "
                    "compute; moe-rewrite cannot keep it exactly"
                )
            kept_before.append(stmt)
        else:
            if _uses_beyond_dtype(stmt, tokens) or (buffer_live and reads(stmt, y)):
                raise RewriteError(
                    f"{where}: `{one_line(stmt)}` reads the per-expert copies of the tokens; "
                    "moe-rewrite cannot keep it exactly"
                )
            buffer_live = buffer_live and y not in _assigned_in(stmt)
            kept_after.append(stmt)
    for stmt in statements_after(forward, branch)[skip_after:]:
        if _uses_beyond_dtype(stmt, tokens):
            raise RewriteError(
                f"{where}: `{one_line(stmt)}` reads `{tokens}`, which training repeats per expert; "
                "moe-rewrite cannot keep it exactly"
            )
    target = cst.ensure_type(cst.ensure_type(stmts[total], cst.SimpleStatementLine).body[0], cst.Assign).targets[0]
    call = cst.Call(
        func=cst.Attribute(value=cst.Name("self"), attr=cst.Name("moe_train")),
        args=[cst.Arg(cst.Name(n)) for n in (tokens, ids, weights)],
    )
    # The comments above the replaced statements described the loop; say what replaced it instead.
    note = cst.EmptyLine(
        comment=cst.Comment("# moe-rewrite: the experts as grouped GEMMs instead of a loop over experts")
    )
    new = cst.SimpleStatementLine(body=[cst.Assign(targets=[target], value=call)], leading_lines=[note])
    return body.with_changes(body=[*kept_before, new, *kept_after]), (tokens, ids, weights)


def _sum_weights(stmts: Sequence[cst.BaseStatement], y: str) -> str | None:
    """W of the first `out = (y.view(*W.shape, -1) * W.unsqueeze(-1)).sum(dim=1)` among `stmts`, else None."""
    unsqueezed = m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("unsqueeze")))
    for stmt in stmts:
        if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])):
            continue
        for call in m.findall(stmt, unsqueezed):
            w = cst.ensure_type(cst.ensure_type(cst.ensure_type(call, cst.Call).func, cst.Attribute).value, cst.Name)
            expected = f"{_assign_target(stmt)} = ({y}.view(*{w.value}.shape, -1) * {w.value}.unsqueeze(-1)).sum(dim=1)"
            if same(stmt, expected):
                return w.value
    return None


FLAT_VIEW = m.Call(
    func=m.Attribute(value=m.Name(), attr=m.Name("view") | m.Name("reshape")),
    args=[m.Arg(m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1")), keyword=None)],
)


def _flat_source(forward: cst.FunctionDef, branch: cst.If, flat: str) -> str | None:
    """ids of the one `flat = ids.view(-1)` (or `.reshape(-1)`) before the branch, else None."""
    body = list(forward.body.body)
    defs = [s for s in body if flat in _assigned_in(s)]
    pattern = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(flat))], value=FLAT_VIEW)])
    if len(defs) != 1 or defs[0] not in body[: body.index(branch)] or not m.matches(defs[0], pattern):
        return None
    view = cst.ensure_type(cst.ensure_type(defs[0], cst.SimpleStatementLine).body[0], cst.Assign).value
    return cst.ensure_type(cst.ensure_type(cst.ensure_type(view, cst.Call).func, cst.Attribute).value, cst.Name).value


def check_eval_args(
    args: list[cst.Arg], kind: str, names: tuple[str, str, str], forward: cst.FunctionDef, branch: cst.If, where: str
) -> None:
    """The eval branch must give moe_infer what training computes with, in the shapes its body takes: (tokens,
    topk ids, topk weights), or for a V1-form body (kind "flat") the flat ids (`topk_idx.view(-1)` or a name assigned
    once as that before the branch) and `topk_weight.view(-1, 1)`."""
    tokens, ids, weights = names
    first, second, third = (a.value for a in args)
    if kind == "topk":
        expected = f"{tokens}, {ids}, {weights}"
        ok = all(isinstance(v, cst.Name) and v.value == n for v, n in zip((first, second, third), names))
    else:
        expected = f"{tokens}, {ids}.view(-1), {weights}.view(-1, 1)"
        flat_ids = same(second, f"{ids}.view(-1)", f"{ids}.reshape(-1)")
        if isinstance(second, cst.Name) and second.value != ids:
            flat_ids = _flat_source(forward, branch, second.value) == ids
        ok = (
            isinstance(first, cst.Name)
            and first.value == tokens
            and flat_ids
            and same(third, f"{weights}.view(-1, 1)", f"{weights}.reshape(-1, 1)")
        )
    if not ok:
        got = ", ".join(cst.Module(body=[]).code_for_node(v) for v in (first, second, third))
        raise RewriteError(
            f"{where}: the eval branch calls self.moe_infer({got}); training computes with `{tokens}`, `{ids}` and "
            f"`{weights}`, so moe_infer should get ({expected})"
        )


def _assign_target(stmt: cst.BaseStatement) -> str:
    line = cst.ensure_type(stmt, cst.SimpleStatementLine)
    return cst.ensure_type(cst.ensure_type(line.body[0], cst.Assign).targets[0].target, cst.Name).value


def statements_after(forward: cst.FunctionDef, branch: cst.If) -> list[cst.BaseStatement]:
    body = list(forward.body.body)
    return body[body.index(branch) + 1 :]


def _check_ids_from_gate(forward: cst.FunctionDef, ids: str, where: str) -> None:
    """The ids the loop's flat ids view (_flat_source) are assigned only by the gate: moe_train gets topk_idx."""
    body = list(forward.body.body)
    if [s for s in body if ids in _assigned_in(s) and not m.findall(s, SELF_GATE_CALL)]:
        raise RewriteError(f"{where}: `{ids}` is assigned again after the gate; moe-rewrite cannot keep it exactly")


def rewrite_esft(forward: cst.FunctionDef, options: RewriteOptions, where: str) -> cst.FunctionDef:
    """ESFT form (DeepSeek's expert-specialised fine-tuning fork of V2): one per-expert loop for training and eval,
    then the weighted sum shared with the expert-parallel path::

        # Before                                         # After
        if self.ep_size == 1:                            if self.ep_size == 1:
            hidden_states = hidden_states.repeat_...(...)    y = self.moe_train(hidden_states, topk_idx, topk_weight)
            y = torch.empty_like(hidden_states)          else:
            for i, expert in enumerate(self.experts):        y = self.moe_ep(hidden_states, topk_idx)
                y[flat_topk_idx == i] = expert(...)          y = (y.view(...) * topk_weight.unsqueeze(-1)).sum(dim=1)
        else:
            y = self.moe_ep(hidden_states, topk_idx)
        y = (y.view(...) * topk_weight.unsqueeze(-1)).sum(dim=1)

    The expert-parallel path is left as it is; the same exact-or-refused rules as the V2 form apply."""
    if options.aux_loss or options.bias_update is not None:
        raise RewriteError(
            f"{where}: --aux-loss and --bias-update apply to the V3 form; this ESFT-form file trains its own aux loss"
        )
    branch = cst.ensure_type(esft_branch(forward), cst.If)
    if m.findall(branch.body, MOE_TRAIN_CALL):
        return forward  # already rewritten
    if branch.orelse is None or not isinstance(branch.orelse, cst.Else):
        raise RewriteError(f"{where}: `if self.ep_size == 1:` has no else branch for expert parallelism")
    after = statements_after(forward, branch)
    star = m.Arg(star="*", value=m.Attribute(value=m.Name(), attr=m.Name("shape")))
    weights = next(iter(m.findall(after[0], star)), None) if after else None
    loop = next(iter(m.findall(branch.body, m.For(iter=m.Call(args=[m.Arg(SELF_EXPERTS)])))))
    if weights is None or _experts_loop_names(cst.ensure_type(loop, cst.For)) is None:
        raise RewriteError(
            f"{where}: no weighted sum right after `if self.ep_size == 1:`, "
            "or its experts loop is not the published one"
        )
    merged = cst.IndentedBlock(body=[*as_block(branch.body).body, after[0]])
    body, _ = loop_training_body(merged, forward, branch, where, skip_after=1)
    orelse = as_block(branch.orelse.body)
    new_branch = branch.with_changes(
        body=body, orelse=branch.orelse.with_changes(body=orelse.with_changes(body=[*orelse.body, after[0]]))
    )
    statements = [new_branch if s is branch else s for s in forward.body.body if s is not after[0]]
    return forward.with_changes(body=forward.body.with_changes(body=statements))
