"""Give the MoE class a grouped-GEMM training path: `moe_train`, its helper block, and a training branch calling it.

V3 form (the training output is never defined)::

    # Before
    if not self.training:
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
    # After
    if not self.training:
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
    else:
        y = self.moe_train(hidden_states, topk_idx, topk_weight, out_dtype=hidden_states.dtype).view(*orig_shape)

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

V1 form (DeepSeekMoE 16B): the V2 form's training loop (without the dtype cast), rewritten the same way; its eval
call passes flat ids and `topk_weight.view(-1, 1)` to a moe_infer that takes them so. moe_train's arguments are read
off the training loop (the tokens it indexes, the ids its flat ids view, the weights of its weighted sum), and the
eval call's are checked against them in the shapes its moe_infer's body takes (moe_infer_body.FLAT_ARGUMENTS).

All forms get the `moe_train` method and its module-level helpers (render.CORE_SECTIONS, put in by the block
codemod). `moe_infer` is untouched; eval mode calls it through `moe_rewrite_infer` (runtime/parameter_lora.py),
which runs the grouped GEMMs instead only where moe_infer cannot index the experts (PEFT wrapped their parameters)::

    y = self.moe_rewrite_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)  # moe-rewrite: ...
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import (
    Context,
    Field,
    MoeClassInfo,
    class_methods,
    in_file_lineage,
    one_line,
    reads,
    top_classes,
)
from moe_rewrite.codemods.moe.gate import SELF_TRAINING, drop_training_guards
from moe_rewrite.codemods.moe.moe_infer_body import check_moe_infer
from moe_rewrite.errors import NotMoeFileError, RewriteError
from moe_rewrite.options import RewriteOptions
from moe_rewrite.render import CORE_SECTIONS

READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ("moe",)
NOT_SELF_TRAINING = m.UnaryOperation(operator=m.Not(), expression=SELF_TRAINING)
# the eval branch's call, as published or as moe-rewrite left it (moe_rewrite_infer calls moe_infer)
MOE_INFER_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("moe_infer") | m.Name("moe_rewrite_infer")))
EVAL_NOTE = "# moe-rewrite: moe_infer, unless PEFT wrapped the experts"
MOE_TRAIN_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("moe_train")))
SELF_EXPERTS = m.Attribute(value=m.Name("self"), attr=m.Name("experts"))
SELF_GATE_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("gate")))
EP_SIZE_IS_1 = m.Comparison(
    left=m.Attribute(value=m.Name("self"), attr=m.Name("ep_size")),
    comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Integer("1"))],
)


def _is_training_refusal(orelse: cst.If | cst.Else | None) -> bool:
    """Kimi form: `if not self.training: ... else: raise NotImplementedError(...)`, an else whose only statement
    raises (any exception, any message) refuses training, as `assert not self.training` does in the V3 gate; the
    training path replaces it."""
    if not isinstance(orelse, cst.Else):
        return False
    stmts = _block(orelse.body).body
    return len(stmts) == 1 and m.matches(stmts[0], m.SimpleStatementLine(body=[m.Raise()]))


def _esft_branch(forward: cst.FunctionDef) -> cst.If | None:
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
        found = [c for c in classes if "forward" in class_methods(c) and _esft_branch(class_methods(c)["forward"])]
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


def _gate_arity(forward: cst.FunctionDef, where: str) -> int:
    assigns = m.findall(forward, m.Assign(targets=[m.AssignTarget(target=m.Tuple())], value=SELF_GATE_CALL))
    if len(assigns) != 1:
        raise RewriteError(f"{where}: expected one `... = self.gate(...)` unpacking its results, found {len(assigns)}")
    target = cst.ensure_type(cst.ensure_type(assigns[0], cst.Assign).targets[0].target, cst.Tuple)
    return len(target.elements)


def _training_if(forward: cst.FunctionDef, where: str) -> cst.If:
    ifs = [s for s in forward.body.body if m.matches(s, m.If(test=SELF_TRAINING | NOT_SELF_TRAINING))]
    if len(ifs) != 1:
        raise RewriteError(
            f"{where}: expected one `if self.training:` or `if not self.training:` branch, found {len(ifs)}"
        )
    return ifs[0]


def _block(suite: cst.BaseSuite) -> cst.IndentedBlock:
    """A branch's body as an indented block (`if c: a; b` means the same as the block `a`, `b`)."""
    if isinstance(suite, cst.IndentedBlock):
        return suite
    small = cst.ensure_type(suite, cst.SimpleStatementSuite).body
    return cst.IndentedBlock(
        body=[cst.SimpleStatementLine(body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]) for s in small]
    )


def _single_moe_infer_assign(block: cst.BaseSuite, where: str) -> cst.SimpleStatementLine:
    stmts = [s for s in _block(block).body if m.findall(s, MOE_INFER_CALL)]
    if len(stmts) != 1 or not m.matches(stmts[0], m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])):
        raise RewriteError(f"{where}: the eval branch does not assign the result of self.moe_infer(...)")
    return cst.ensure_type(stmts[0], cst.SimpleStatementLine)


def _moe_infer_args(stmt: cst.CSTNode, params: list[str], where: str) -> list[cst.Arg]:
    return _bind(cst.ensure_type(m.findall(stmt, MOE_INFER_CALL)[0], cst.Call), params, where)


def _bind(call: cst.Call, params: list[str], where: str) -> list[cst.Arg]:
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


def _eval_through_moe_rewrite(suite: cst.BaseSuite, bind: Callable[[cst.Call], list[cst.Arg]]) -> cst.BaseSuite:
    return cst.ensure_type(suite.visit(_EvalThroughMoeRewrite(bind)), cst.BaseSuite)


NO_GRAD = m.Attribute(attr=m.Name("no_grad") | m.Name("inference_mode")) | m.Name("no_grad") | m.Name("inference_mode")


def _v3_training_else(
    eval_body: cst.BaseSuite, options: RewriteOptions, bind: Callable[[cst.Call], list[cst.Arg]], where: str
) -> cst.Else:
    """The training branch: the eval branch's statements, in order, with moe_train where eval calls moe_infer (so any
    post-processing of its result is the same in training), then the opt-in router-training statements."""
    infer_stmt = _single_moe_infer_assign(eval_body, where)
    eval_stmts = _block(eval_body).body
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


def _refuse_helpers_reading_training(
    stmts: Sequence[cst.BaseStatement], moe: cst.ClassDef, module: cst.Module, where: str
) -> None:
    """The eval branch runs in training too, so what it calls must not depend on training mode: a method of the MoE
    class (or of its in-file bases), the forward of a submodule whose class is in the file (`self.norm = Norm(...)`),
    or a function of the file, called there, or what those call in turn, must not read `.training` (the branch itself
    is checked in _v3_training_else). Submodules of classes from elsewhere (torch's) are not looked into."""
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
            for node in m.findall(init, assign) if init is not None else []:
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
                if m.findall(target, m.Attribute(attr=m.Name("training"))):
                    calls = " -> ".join(f"{c}()" for c in (*chain, name))
                    raise RewriteError(
                        f"{where}: `{one_line(stmt)}` in the eval branch calls {calls}, which reads `.training`; "
                        "moe-rewrite cannot mirror it in training"
                    )
                todo.append((target, target_owner, (*chain, name)))


def _refuse_overriding_subclasses(module: cst.Module, moe: cst.ClassDef) -> None:
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


def _same_code(node: cst.CSTNode, expected: str) -> bool:
    """Whether a statement is `expected` up to formatting, comments and redundant parentheses (Python AST equality)."""
    try:
        return ast.dump(ast.parse(cst.Module(body=[node]).code)) == ast.dump(ast.parse(expected))  # type: ignore[list-item]
    except SyntaxError:
        return False


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
    return (y, idx, x) if _same_code(loop, expected) else None


def _rewrite_v2_training_body(
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
        "repeat": [i for i in range(loop) if _same_code(stmts[i], repeat)],
        "buffer": [
            i
            for i in range(loop)
            if _same_code(stmts[i], f"{y} = torch.empty_like({tokens})")
            or _same_code(stmts[i], f"{y} = torch.zeros_like({tokens})")
        ],
        "sum": [
            i
            for i in range(loop + 1, len(stmts))
            if m.matches(stmts[i], m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])]))
            and _same_code(
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
    for stmt in _statements_after(forward, branch)[skip_after:]:
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
            if _same_code(stmt, expected):
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


def _same_expression(expr: cst.BaseExpression, *expected: str) -> bool:
    code = cst.Module(body=[]).code_for_node(expr)
    return ast.dump(ast.parse(code, mode="eval")) in {ast.dump(ast.parse(e, mode="eval")) for e in expected}


def _check_eval_args(
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
        flat_ids = _same_expression(second, f"{ids}.view(-1)", f"{ids}.reshape(-1)")
        if isinstance(second, cst.Name) and second.value != ids:
            flat_ids = _flat_source(forward, branch, second.value) == ids
        ok = (
            isinstance(first, cst.Name)
            and first.value == tokens
            and flat_ids
            and _same_expression(third, f"{weights}.view(-1, 1)", f"{weights}.reshape(-1, 1)")
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


def _statements_after(forward: cst.FunctionDef, branch: cst.If) -> list[cst.BaseStatement]:
    body = list(forward.body.body)
    return body[body.index(branch) + 1 :]


def _check_ids_from_gate(forward: cst.FunctionDef, ids: str, where: str) -> None:
    """The ids the loop's flat ids view (_flat_source) are assigned only by the gate: moe_train gets topk_idx."""
    body = list(forward.body.body)
    if [s for s in body if ids in _assigned_in(s) and not m.findall(s, SELF_GATE_CALL)]:
        raise RewriteError(f"{where}: `{ids}` is assigned again after the gate; moe-rewrite cannot keep it exactly")


def rewrite_forward(
    moe: cst.ClassDef, options: RewriteOptions, module: cst.Module | None = None
) -> tuple[cst.FunctionDef, str]:
    """The MoE forward with its training branch calling moe_train, and the form ("v3" or "v2"). `module`, the file,
    is where the eval branch's helpers are looked up."""
    name = moe.name.value
    where = f"{name}.forward"
    forward = drop_training_guards(class_methods(moe)["forward"], where)
    if "moe_infer" not in class_methods(moe):
        return _rewrite_esft(forward, options, where), "esft"
    moe_infer = class_methods(moe)["moe_infer"]
    params = [p.name.value for p in moe_infer.params.params][1:]  # proved below: (self, tokens, ids, weights)

    def bind(call: cst.Call) -> list[cst.Arg]:
        return _bind(call, params, where)

    arity = _gate_arity(forward, where)
    published = branch = _training_if(forward, where)
    if arity == 2 and m.matches(branch.test, NOT_SELF_TRAINING):
        if _is_training_refusal(branch.orelse):
            branch = branch.with_changes(orelse=None)  # Kimi form: the training path goes where it refused
        if branch.orelse is not None and not m.findall(branch.orelse, MOE_TRAIN_CALL):
            raise RewriteError(
                f"{where}: `if not self.training:` already has an else branch that moe-rewrite did not write"
            )
        if module is not None:
            _refuse_helpers_reading_training(_block(branch.body).body, moe, module, where)
        new_branch = branch.with_changes(
            body=_eval_through_moe_rewrite(branch.body, bind),
            orelse=_v3_training_else(branch.body, options, bind, where),
        )
        form = "v3"
    elif arity == 3 and m.matches(branch.test, SELF_TRAINING):
        if options.aux_loss or options.bias_update is not None:
            raise RewriteError(
                f"{where}: --aux-loss and --bias-update apply to the V3 form; this V2-form file trains its own aux loss"
            )
        if branch.orelse is None:
            raise RewriteError(f"{where}: `if self.training:` has no else branch calling self.moe_infer(...)")
        infer_args = _moe_infer_args(_single_moe_infer_assign(branch.orelse.body, where), params, where)
        training_body, names = _rewrite_v2_training_body(_block(branch.body), forward, branch, where)
        new_branch = branch.with_changes(
            body=training_body,
            orelse=branch.orelse.with_changes(body=_eval_through_moe_rewrite(branch.orelse.body, bind)),
        )
        form = "v2"
    else:
        raise RewriteError(
            f"{where}: unrecognised structure (self.gate returns {arity} values; "
            "expected 2 with `if not self.training:` (V3 form) or 3 with `if self.training:` (V2 form))"
        )
    # last, so that a file of another structure is told what in its forward is not recognised
    kind = check_moe_infer(cst.Module(body=[moe_infer]).code, f"{name}.moe_infer")
    if form == "v2":
        _check_eval_args(infer_args, kind, names, forward, branch, where)
    elif kind != "topk":
        raise RewriteError(
            f"{name}.moe_infer takes flat ids and weights (the V1 form's), but {where} has the V3 form's structure, "
            "which trains through moe_infer's arguments"
        )
    return cst.ensure_type(forward.deep_replace(published, new_branch), cst.FunctionDef), form


def _rewrite_esft(forward: cst.FunctionDef, options: RewriteOptions, where: str) -> cst.FunctionDef:
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
    branch = cst.ensure_type(_esft_branch(forward), cst.If)
    if m.findall(branch.body, MOE_TRAIN_CALL):
        return forward  # already rewritten
    if branch.orelse is None or not isinstance(branch.orelse, cst.Else):
        raise RewriteError(f"{where}: `if self.ep_size == 1:` has no else branch for expert parallelism")
    after = _statements_after(forward, branch)
    star = m.Arg(star="*", value=m.Attribute(value=m.Name(), attr=m.Name("shape")))
    weights = next(iter(m.findall(after[0], star)), None) if after else None
    loop = next(iter(m.findall(branch.body, m.For(iter=m.Call(args=[m.Arg(SELF_EXPERTS)])))))
    if weights is None or _experts_loop_names(cst.ensure_type(loop, cst.For)) is None:
        raise RewriteError(
            f"{where}: no weighted sum right after `if self.ep_size == 1:`, "
            "or its experts loop is not the published one"
        )
    merged = cst.IndentedBlock(body=[*_block(branch.body).body, after[0]])
    body, _ = _rewrite_v2_training_body(merged, forward, branch, where, skip_after=1)
    orelse = _block(branch.orelse.body)
    new_branch = branch.with_changes(
        body=body, orelse=branch.orelse.with_changes(body=orelse.with_changes(body=[*orelse.body, after[0]]))
    )
    statements = [new_branch if s is branch else s for s in forward.body.body if s is not after[0]]
    return forward.with_changes(body=forward.body.with_changes(body=statements))


def transform(module: cst.Module, context: Context) -> cst.Module:
    moe = find_moe_class(module)
    _refuse_overriding_subclasses(module, moe)
    if "moe_infer" not in class_methods(moe):  # the ESFT form (rewrite_forward)
        context.need_per_expert_layers(
            f"{moe.name.value}.forward: ESFT form: it trains selected experts (requires_grad per expert), which "
            "fused experts cannot express"
        )
    forward, form = rewrite_forward(moe, context.options, module)
    old_forward = class_methods(moe)["forward"]
    new_moe = moe.with_changes(
        body=moe.body.with_changes(body=[forward if s is old_forward else s for s in moe.body.body])
    )
    context.moe = MoeClassInfo(name=moe.name.value, gate_class=gate_class_name(moe), form=form)
    context.sections |= CORE_SECTIONS
    if context.options.aux_loss:
        context.sections.add("aux_loss")
    if context.options.bias_update is not None:
        context.sections.add("bias_update")
    return module.with_changes(body=[new_moe if s is moe else s for s in module.body])
