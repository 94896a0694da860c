"""The expert class proved the published expert MLP (expert_mlp.py's docstring shows it): its chain of in-file bases
down to nn.Module, its members, `__init__` (three bias-free nn.Linear projections of matching sizes, `act_fn =
ACT2FN[config.hidden_act]`, plain attributes) and `forward` (`down(act_fn(gate(x)) * up(x))`, temporaries inlined);
the projections' names are read from the forward's use. DeepSeek's ESFT fork casts x to one projection's weight dtype
first and the result back to x's dtype (`dtype = x.dtype`, `x = x.to(self.gate_proj.weight.dtype)`, ...,
`return down_proj.to(dtype)`, its trainable fp32 experts beside frozen bf16 ones): that forward is the MLP between
the two casts (dtype_cast), which the generated code runs as grouped GEMMs only where every expert's weights have x's
dtype (the casts then do nothing), else through the experts' own forward."""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import class_methods, one_line
from moe_rewrite.codemods.moe.expert_syntax import _assigned, _ast, _params, _statements
from moe_rewrite.errors import RewriteError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
NN = m.Name("nn") | m.Attribute(value=m.Name("torch"), attr=m.Name("nn"))
NN_MODULE = m.Attribute(value=NN, attr=m.Name("Module")) | m.Name("Module")
NN_LINEAR = m.Attribute(value=NN, attr=m.Name("Linear")) | m.Name("Linear")
SUPER_INIT = m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__")), args=[]) | m.Call(
    func=m.Attribute(value=NN_MODULE, attr=m.Name("__init__")), args=[m.Arg(m.Name("self"))]
)
PRETRAINING_TP_BRANCH = m.If(
    test=m.Comparison(
        left=m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name("config")), attr=m.Name("pretraining_tp")),
        comparisons=[m.ComparisonTarget(operator=m.GreaterThan(), comparator=m.Integer("1"))],
    ),
    orelse=m.Else(),
)
EXPECTED_FORWARD = "self.{down}(self.act_fn(self.{gate}({x})) * self.{up}({x}))"


def _chain(name: str, classes: dict[str, cst.ClassDef], where: str) -> list[cst.ClassDef]:
    """The class and its in-file bases, nearest first, one base each, ending in nn.Module; else refused."""
    chain = [classes[name]]
    while True:
        cls = chain[-1]
        bases = [b.value for b in cls.bases]
        if len(bases) != 1 or cls.keywords:
            raise RewriteError(f"{where}: {cls.name.value} should have one base class (nn.Module or an in-file class)")
        if m.matches(bases[0], NN_MODULE):
            return chain
        base = bases[0].value if isinstance(bases[0], cst.Name) else None
        if base not in classes or classes[base] in chain:
            raise RewriteError(
                f"{where}: {cls.name.value}'s base `{one_line(bases[0])}` is not nn.Module or a class of this file"
            )
        chain.append(classes[base])


def _resolve(chain: list[cst.ClassDef], method: str) -> tuple[str, cst.FunctionDef] | None:
    for cls in chain:
        found = class_methods(cls).get(method)
        if found is not None:
            return cls.name.value, found
    return None


def _check_class_bodies(chain: list[cst.ClassDef]) -> None:
    """Each class of the chain holds only a docstring, __init__ and forward: any other member (a method the experts'
    callers might run, a class attribute) is something the grouped GEMMs do not reproduce."""
    for cls in chain:
        for i, stmt in enumerate(cls.body.body):
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value in ("__init__", "forward"):
                if stmt.decorators:
                    raise RewriteError(f"{cls.name.value}.{stmt.name.value}: decorated; moe-rewrite cannot prove it")
                continue
            docstring = m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])
            if i == 0 and m.matches(stmt, docstring) or m.matches(stmt, m.SimpleStatementLine(body=[m.Pass()])):
                continue
            raise RewriteError(
                f"{cls.name.value}: `{one_line(stmt)}` in the expert class; moe-rewrite's grouped experts compute "
                "only the published expert MLP (__init__ and forward)"
            )


def _check_init(owner: str, init: cst.FunctionDef, projections: tuple[str, str, str] = PROJECTIONS) -> None:
    where = f"{owner}.__init__"
    params = _params(init)
    if len(params) < 2 or params[0] != "self" or isinstance(init.params.star_arg, cst.Param) or init.params.star_kwarg:
        raise RewriteError(f"{where}: expected `def __init__(self, config, ...)` with no *args or **kwargs")
    config = params[1]
    known = set(params)  # names a plain attribute may be computed from
    found: dict[str, cst.Call | cst.BaseExpression] = {}
    for stmt in _statements(init, where):
        if isinstance(stmt, cst.Expr) and m.matches(stmt.value, SUPER_INIT):
            continue
        target = (
            stmt.targets[0].target if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 else None
        )  # one target: `a = b = ...` is refused below
        if isinstance(target, cst.Name) and target.value not in (config, "self"):
            _check_plain(stmt, known, where)
            known.add(target.value)
            continue
        if m.matches(target, m.Attribute(value=m.Name("self"), attr=m.Name())):
            attr = cst.ensure_type(target, cst.Attribute).attr.value
            if attr in found:
                raise RewriteError(f"{where}: `{one_line(stmt)}` assigns self.{attr} a second time")
            value = cst.ensure_type(stmt, cst.Assign).value
            if attr in (*projections, "act_fn"):
                found[attr] = value
            else:
                _check_plain(stmt, known, where)
            continue
        raise RewriteError(
            f"{where}: `{one_line(stmt)}` is not in the published expert MLP; moe-rewrite's grouped experts read only "
            "the three bias-free projections and act_fn"
        )
    missing = [name for name in (*projections, "act_fn") if name not in found]
    if missing:
        raise RewriteError(f"{where}: no `self.{missing[0]} = ...`; the expert MLP needs gate, up and down projections")
    shapes = {}
    for name in projections:
        call = found[name]
        bias = [a for a in getattr(call, "args", ()) if a.keyword is not None]
        positional = [a for a in getattr(call, "args", ()) if a.keyword is None]
        if (
            not m.matches(call, m.Call(func=NN_LINEAR))
            or len(positional) != 2
            or any(a.star for a in positional)
            or len(bias) != 1
            or not m.matches(bias[0], m.Arg(keyword=m.Name("bias"), value=m.Name("False")))
        ):
            raise RewriteError(
                f"{where}: `self.{name} = {one_line(call)}` is not `nn.Linear(in, out, bias=False)`; moe-rewrite's "
                "grouped experts have no bias"
            )
        shapes[name] = tuple(ast.dump(_ast(a.value)) for a in positional)
    gate, up, down = (shapes[name] for name in projections)
    if up != gate or down != gate[::-1]:
        raise RewriteError(
            f"{where}: the projections' sizes differ from the expert MLP's: {projections[0]} and {projections[1]} "
            f"should both be nn.Linear(hidden, intermediate, ...) and {projections[2]} nn.Linear(intermediate, "
            "hidden, ...)"
        )
    act = found["act_fn"]
    expected = m.Subscript(
        value=m.Name("ACT2FN"),
        slice=[m.SubscriptElement(m.Index(m.Attribute(value=m.Name(config), attr=m.Name("hidden_act"))))],
    )
    if not m.matches(act, expected) or config in _assigned(init):
        raise RewriteError(
            f"{where}: `self.act_fn = {one_line(act)}` is not `ACT2FN[{config}.hidden_act]` with {config} the "
            "parameter as passed"
        )


def _check_plain(stmt: cst.BaseSmallStatement, known: set[str], where: str) -> None:
    """A plain attribute or local: computed without calls from the parameters, self and earlier locals (a call, or a
    name from elsewhere, could make a submodule, parameter or buffer the grouped GEMMs would skip)."""
    value = cst.ensure_type(stmt, cst.Assign).value
    names = {cst.ensure_type(n, cst.Name).value for n in m.findall(value, m.Name())}
    attrs = {cst.ensure_type(a, cst.Attribute).attr.value for a in m.findall(value, m.Attribute())}
    free = names - attrs - known - {"None", "True", "False"}
    if m.findall(value, m.Call() | m.Lambda()) or free:
        raise RewriteError(
            f"{where}: `{one_line(stmt)}` may add a submodule, parameter or buffer that moe-rewrite's grouped experts "
            "would not compute"
        )


def _check_forward(owner: str, forward: cst.FunctionDef, projections: tuple[str, str, str] = PROJECTIONS) -> None:
    where = f"{owner}.forward"
    params = _params(forward)
    if (
        len(params) != 2
        or params[0] != "self"
        or forward.params.params[1].default is not None
        or isinstance(forward.params.star_arg, cst.Param)
        or forward.params.star_kwarg
        or forward.params.kwonly_params
        or forward.params.posonly_params
    ):
        raise RewriteError(f"{where}: expected `def forward(self, x)`, one input and nothing else")
    x = params[1]
    gate, up, down = projections
    expected = {
        ast.dump(ast.parse(EXPECTED_FORWARD.format(x=x, gate=gate, up=up, down=down), mode="eval").body),
        ast.dump(ast.parse(f"self.{down}(self.{up}({x}) * self.act_fn(self.{gate}({x})))", mode="eval").body),
    }
    result, stmt = _returned(forward, x)
    if result is not None and ast.dump(result) in expected:
        return
    shown = one_line(stmt) if stmt is not None else "(empty)"
    raise RewriteError(
        f"{where}: `{shown}` differs from the expert MLP moe-rewrite's grouped experts compute, "
        f"`return {EXPECTED_FORWARD.format(x=x, gate=gate, up=up, down=down)}`"
    )


def dtype_cast(forward: cst.FunctionDef) -> tuple[cst.FunctionDef, str] | None:
    """ESFT's expert forward, `D = x.dtype`, `x = x.to(self.P.weight.dtype)`, the MLP, `return R.to(D)`: (the forward
    with the casts taken out, `return R`, and P), or None where the forward is not of that shape. D is read nowhere
    else."""
    params = _params(forward)
    if len(params) != 2:
        return None
    x = params[1]
    stmts = _statements(forward, "")
    if len(stmts) < 3:
        return None
    first, second, last = stmts[0], stmts[1], stmts[-1]
    if not (
        isinstance(first, cst.Assign)
        and len(first.targets) == 1
        and isinstance(first.targets[0].target, cst.Name)
        and m.matches(first.value, m.Attribute(value=m.Name(x), attr=m.Name("dtype")))
    ):
        return None
    dtype = first.targets[0].target.value
    if dtype in (x, "self"):
        return None
    cast = m.Call(
        func=m.Attribute(value=m.Name(x), attr=m.Name("to")),
        args=[
            m.Arg(
                keyword=None,
                star="",
                value=m.Attribute(
                    value=m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name()), attr=m.Name("weight")),
                    attr=m.Name("dtype"),
                ),
            )
        ],
    )
    if not (
        isinstance(second, cst.Assign)
        and len(second.targets) == 1
        and m.matches(second.targets[0].target, m.Name(x))
        and m.matches(second.value, cast)
    ):
        return None
    back = m.Call(func=m.Attribute(attr=m.Name("to")), args=[m.Arg(keyword=None, star="", value=m.Name(dtype))])
    if not (isinstance(last, cst.Return) and last.value is not None and m.matches(last.value, back)):
        return None
    middle = stmts[2:-1]
    result = cst.ensure_type(cst.ensure_type(last.value, cst.Call).func, cst.Attribute).value
    kept = [*middle, cst.Return(value=result)]
    if any(m.findall(stmt, m.Name(dtype)) for stmt in kept):
        return None  # D read again: not only the cast back
    projection = cst.ensure_type(
        cst.ensure_type(cst.ensure_type(second.value, cst.Call).args[0].value, cst.Attribute).value, cst.Attribute
    )
    owner = cst.ensure_type(projection.value, cst.Attribute).attr.value
    body = cst.IndentedBlock(
        body=[s if isinstance(s, cst.BaseCompoundStatement) else cst.SimpleStatementLine(body=[s]) for s in kept]
    )
    return forward.with_changes(body=body), owner


def _returned(forward: cst.FunctionDef, x: str) -> tuple[ast.AST | None, cst.CSTNode | None]:
    """The forward's result as one expression of `x` (each temporary inlined where it is read, once; a name may be
    assigned again once its value was read: `h = f(x)`, `h = g(h)`), or None and the first statement that is not
    that."""
    temporaries: dict[str, ast.AST] = {}
    stmts = _statements(forward, "")
    if stmts and m.matches(stmts[0], PRETRAINING_TP_BRANCH):
        # DeepSeekMoE 16B (V1): `if self.config.pretraining_tp > 1:` slices the projections (the same sums in
        # another order), else the published MLP. The else branch is what is proved; the generated code refuses
        # pretraining_tp > 1 at run time (moe_train and the fused experts raise NotImplementedError).
        orelse = cst.ensure_type(cst.ensure_type(stmts[0], cst.If).orelse, cst.Else)
        stmts = _statements(cst.FunctionDef(name=forward.name, params=forward.params, body=orelse.body), "") + stmts[1:]
    for i, stmt in enumerate(stmts):
        last = i == len(stmts) - 1
        if last and isinstance(stmt, cst.Return) and stmt.value is not None:
            result = _Inline(temporaries).visit(_ast(stmt.value))
            return (None, stmt) if any(temporaries.values()) else (result, stmt)
        if (
            not last
            and isinstance(stmt, cst.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0].target, cst.Name)
            and stmt.targets[0].target.value not in (x, "self")
        ):
            name = stmt.targets[0].target.value
            value = _Inline(temporaries).visit(_ast(stmt.value))
            if temporaries.get(name) is not None:  # assigned again before its value was read
                return None, stmt
            temporaries[name] = value
            continue
        return None, stmt
    return None, stmts[-1] if stmts else None


def projections_by_use(forward: cst.FunctionDef) -> tuple[str, str, str] | None:
    """The (gate, up, down) projections' attribute names as the expert's forward uses them,
    `self.D(self.act_fn(self.G(x)) * self.U(x))` (the product either way round): `w2(act(w1(x)) * w3(x))` reads w1
    as the gate, w3 as up and w2 as down, whatever their names. None when the forward is not of that shape."""
    params = _params(forward)
    if len(params) != 2:
        return None
    x = params[1]
    result, _ = _returned(forward, x)

    def projection(node: ast.AST) -> str | None:  # `self.P(x)` -> P
        if (
            isinstance(node, ast.Call)
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            return node.func.attr
        return None

    if projection(result) is None or not isinstance(result.args[0], ast.BinOp):  # type: ignore[union-attr]
        return None
    product = result.args[0]  # type: ignore[union-attr]
    for activated, other in ((product.left, product.right), (product.right, product.left)):
        if projection(activated) == "act_fn":
            found = (projection(activated.args[0]), projection(other), projection(result))  # type: ignore[attr-defined]
            if all(found) and len(set(found)) == 3 and "act_fn" not in found:
                return found  # type: ignore[return-value]
    return None


class _Inline(ast.NodeTransformer):
    """Each temporary replaced by its value, once: a temporary read twice, or never, is left over (refused)."""

    def __init__(self, temporaries: dict[str, ast.AST]) -> None:
        self.temporaries = temporaries

    def visit_Name(self, node: ast.Name) -> ast.AST:
        value = self.temporaries.get(node.id)
        if value is None:
            return node
        self.temporaries[node.id] = None  # type: ignore[assignment]
        return value


def check_expert_class(name: str, classes: dict[str, cst.ClassDef]) -> tuple[str, str, str]:
    """Refuses (RewriteError naming the class, method and statement) an expert class that is not the published MLP."""
    chain = _chain(name, classes, name)
    _check_class_bodies(chain)
    return _check_methods(name, chain)


def _check_methods(name: str, chain: list[cst.ClassDef]) -> tuple[str, str, str]:
    """The expert class's (gate, up, down) projection names, read from its forward (projections_by_use; the published
    names when the forward is not of the MLP's shape, which _check_forward then refuses)."""
    found = {method: _resolve(chain, method) for method in ("__init__", "forward")}
    for method, resolved in found.items():
        if resolved is None:
            raise RewriteError(f"{name}: no {method} in the expert class or its in-file bases")
    owner, forward = found["forward"]  # type: ignore[misc]
    cast = dtype_cast(forward)
    if cast is not None:  # ESFT: the MLP between a cast to one projection's weight dtype and the cast back
        forward = cast[0]
    projections = projections_by_use(forward)
    if projections is None:
        init = found["__init__"][1]  # type: ignore[index]
        if not all(m.findall(init, m.Attribute(value=m.Name("self"), attr=m.Name(name))) for name in PROJECTIONS):
            _check_forward(owner, forward)  # other names: the forward is what differs
        projections = PROJECTIONS
    _check_init(*found["__init__"], projections)  # type: ignore[misc]
    _check_forward(owner, forward, projections)
    if cast is not None and cast[1] not in projections:
        raise RewriteError(
            f"{owner}.forward: casts x to self.{cast[1]}.weight.dtype, which is not one of its projections "
            f"({', '.join(projections)}); moe-rewrite cannot tell when that cast does nothing"
        )
    return projections


def expert_casts(name: str, classes: dict[str, cst.ClassDef]) -> str | None:
    """ "Class.forward" where the (proved) expert class's forward casts x to its weights' dtype and back (ESFT), else
    None."""
    resolved = _resolve(_chain(name, classes, name), "forward")
    if resolved is None or dtype_cast(resolved[1]) is None:
        return None
    return f"{resolved[0]}.forward"
