"""The attention core proved the published one, statement by statement through the kit's prover (kit/prove.py), up
to names, formatting and comments (attention.py's docstring shows it): `find_core` gives where it is in the forward
and what its placeholders are bound to, or why it is not the published core. What is the attention's own stays here:
the optional shape checks and assert, the mask add holding the mask's shape check, the scale and dropout rate SDPA
can take, where the core starts and what surrounds it."""

from __future__ import annotations

import ast

import libcst as cst

from moe_rewrite.codemods.kit import code, first_line
from moe_rewrite.codemods.kit.prove import Proof, Statement, Template, prove

# The published core, one statement each, in capitals the names it binds: S the scores, Q K V, M the mask, O the
# output; SCALE and P any expression (checked below). Softmax and dropout in nn.functional's two spellings. `self`
# is a placeholder bound to `self` (the forward's own parameter, which the dropout reads); `torch` and `nn` are the
# globals, bound nowhere in the forward.
TENSORS = {"S", "Q", "K", "V", "M", "O"}
PLACEHOLDERS = {*TENSORS, "self"}
WILDCARDS = {"SCALE", "P"}
FUNCTIONAL = ("nn.functional", "torch.nn.functional")
SCORE = ["S = torch.matmul(Q, K.transpose(2, 3)) * SCALE"]
SCORE_ALONE = ["S = torch.matmul(Q, K.transpose(2, 3))"]
SCALED = ["S = S * SCALE"]
ASSERT_MASK = ["assert M is not None"]
MASK_ADD = ["if M is not None:\n    S = S + M"]
SOFTMAX = [f"S = {f}.softmax(S, dim=-1, dtype=torch.float32).to(Q.dtype)" for f in FUNCTIONAL]
DROPOUT = [f"S = {f}.dropout(S, p=P, training=self.training)" for f in FUNCTIONAL]
VALUE = ["O = torch.matmul(S, V)"]

TEMPLATES = {
    name: [Template(t, placeholders=PLACEHOLDERS, wildcards=WILDCARDS) for t in texts]
    for name, texts in {
        "score": SCORE,
        "score_alone": SCORE_ALONE,
        "scaled": SCALED,
        "assert": ASSERT_MASK,
        "mask": MASK_ADD,
        "softmax": SOFTMAX,
        "dropout": DROPOUT,
        "value": VALUE,
    }.items()
}


class _Step:
    """The core proven so far: the proof carried from statement to statement (kit.prove's `bound=`), in the forward
    whose locals must not shadow the globals the core reads."""

    def __init__(self, forward: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.proof = Proof({"self": "self"})
        self.forward = forward

    def matches(self, name: str, statement: Statement) -> bool:
        """Whether `statement` is one of the templates `name` (the proof extended where it is)."""
        return self.why_not(name, statement) is None

    def why_not(self, name: str, statement: Statement) -> str | None:
        """None where `statement` is one of the templates `name` (the proof extended); else "" where its first
        statement is not one, or the rule of the kit's that refuses it where only that does (a line holding two
        statements, a global the core reads bound in the forward): its reason."""
        first = _trees(statement)[0] if isinstance(statement, cst.CSTNode) else statement
        why = ""
        for template in TEMPLATES[name]:
            proof = prove(template, [statement], bound=self.proof, within=self.forward)
            if isinstance(proof, Proof):
                self.proof = proof
                return None
            if not why and proof.why and isinstance(prove(template, [first], bound=self.proof), Proof):
                why = proof.why  # its first statement is the template's: only the kit's rule refuses it
        return why

    @property
    def bound(self) -> dict[str, object]:
        """The placeholders' names and the wildcards' expressions, as Core holds them."""
        return {**{k: v for k, v in self.proof.names.items() if k in TENSORS}, **self.proof.expressions}


def _trees(statement: cst.CSTNode) -> list[ast.stmt]:
    """The statements of one line (`a = 1; b = 2`: two)."""
    return ast.parse(code(statement)).body


def _forward_tree(forward: cst.FunctionDef) -> ast.FunctionDef | ast.AsyncFunctionDef:
    tree = ast.parse(code(forward.with_changes(leading_lines=[], decorators=[])).strip()).body[0]
    assert isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef))
    return tree


def _because(why: str | None) -> str:
    """The kit's rule that refused a statement, where only that did, for the end of a line."""
    return f" ({why})" if why else ""


def _is_check(node: ast.stmt, name: object) -> bool:
    """`if <name>.size() != ...: raise ...`: a shape check, which only raises."""
    if not (isinstance(node, ast.If) and not node.orelse and len(node.body) == 1):
        return False
    test = node.test
    return (
        isinstance(node.body[0], ast.Raise)
        and isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.NotEq)
        and isinstance(test.left, ast.Call)
        and not test.left.args
        and not test.left.keywords
        and isinstance(test.left.func, ast.Attribute)
        and test.left.func.attr == "size"
        and isinstance(test.left.func.value, ast.Name)
        and test.left.func.value.id == name
    )


def _names(node: ast.AST, stored: bool = False) -> set[str]:
    """The names `node` reads (stored=False) or binds or deletes (stored=True)."""
    kinds = (ast.Store, ast.Del) if stored else (ast.Load,)
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, kinds)}


SCALAR_NODES = (ast.Name, ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load)


def _scalar(node: ast.AST, bound: dict[str, object]) -> bool:
    """A scale made of names, attributes, numbers and arithmetic (math.sqrt(...) too), reading none of the core's
    tensors: SDPA takes it as `scale=`."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            if not (
                isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id == "math"
            ):
                return False
        elif not isinstance(n, SCALAR_NODES):
            return False
    return not _names(node) & {v for k, v in bound.items() if k in TENSORS}


class Core:
    """The core found in a forward: statements [start, end) of its body, and what they bind."""

    def __init__(self, start: int, end: int, bound: dict[str, object]) -> None:
        self.start, self.end, self.bound = start, end, bound


def find_core(forward: cst.FunctionDef) -> Core | str:
    """The forward's published core, or why there is none (one line)."""
    body = list(forward.body.body) if isinstance(forward.body, cst.IndentedBlock) else []
    lines = [_trees(stmt) for stmt in body]
    trees = [line[0] for line in lines]
    matmul = [i for i, t in enumerate(trees) if _has_score_matmul(t)]
    if not matmul:
        return "no statement computes the scores as `torch.matmul(Q, K.transpose(2, 3))` at the top of its forward"
    i = matmul[0]
    core = _Step(_forward_tree(forward))
    why = core.why_not("score", body[i])
    if why is not None and (alone := core.why_not("score_alone", body[i])) is not None:
        reason = f"the scores `{ast.unparse(trees[i])}` are not `torch.matmul(Q, K.transpose(2, 3))` times a scale"
        return reason + _because(why or alone)
    start, i = i, i + 1
    if "SCALE" not in core.proof.expressions:
        why = core.why_not("scaled", body[i]) if i < len(body) else ""
        if why is not None:
            return f"the scores `{first_line(body[start])}` are not scaled by the next statement" + _because(why)
        i += 1
    bound = core.bound
    if not _scalar(bound["SCALE"], bound):  # type: ignore[arg-type]
        return f"the scale `{ast.unparse(bound['SCALE'])}` is not a number SDPA can take"  # type: ignore[arg-type]

    def step(name: str, what: str) -> str | None:
        nonlocal i
        why = core.why_not(name, body[i]) if i < len(body) else ""
        if why is None:
            i += 1
            return None
        found = f"`{first_line(body[i])}`" if i < len(body) else "the end of forward"
        return f"{found} where the published core has {what}" + _because(why)

    def optional_check(name: str) -> None:
        nonlocal i
        if i < len(trees) and _is_check(trees[i], core.proof.names.get(name)):
            i += 1

    optional_check("S")
    if i < len(body) and core.matches("assert", body[i]):
        i += 1
    mask_added = False
    mask_add = trees[i] if i < len(trees) else None
    if isinstance(mask_add, ast.If) and mask_add.body and len(mask_add.body) == 2:  # the mask's own shape check
        check = mask_add.body[0]
        if core.matches("mask", ast.If(test=mask_add.test, body=mask_add.body[1:], orelse=mask_add.orelse)):
            if not _is_check(check, core.proof.names["M"]):
                return f"the mask add holds `{ast.unparse(check).splitlines()[0]}`, not a shape check"
            i += 1
            mask_added = True
    for name, what in [
        ("mask", "the mask add `S = S + M` under `if M is not None:`"),
        ("softmax", "the fp32 softmax `.to(Q.dtype)`"),
        ("dropout", "the dropout with `training=self.training`"),
        ("value", "the value matmul `torch.matmul(S, V)`"),
    ]:
        if name == "mask" and mask_added:
            continue
        reason = step(name, what)
        if reason:
            return reason
    optional_check("O")
    bound = core.bound
    if _names(bound["P"]) & {v for k, v in bound.items() if k in TENSORS}:  # type: ignore[arg-type]
        return f"the dropout rate `{ast.unparse(bound['P'])}` reads the core's tensors"  # type: ignore[arg-type]
    return _check_surroundings(forward, lines, start, i, bound)


def _has_score_matmul(tree: ast.stmt) -> bool:
    """An assignment whose value calls torch.matmul(_, _.transpose(...)): where a core starts."""
    if not isinstance(tree, ast.Assign):
        return False
    for n in ast.walk(tree.value):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "matmul"
            and len(n.args) == 2
        ):
            second = n.args[1]
            if isinstance(second, ast.Call) and isinstance(second.func, ast.Attribute):
                if second.func.attr == "transpose":
                    return True
    return False


def _check_surroundings(
    forward: cst.FunctionDef, lines: list[list[ast.stmt]], start: int, end: int, bound: dict
) -> Core | str:
    """The mask is the forward's parameter, not rebound before the core; output_attentions is a parameter; the scores
    are read after the core only by `return` (the branch sets them to None). `lines`: each line's statements, every
    one of a line holding several."""
    params = {p.name.value for p in [*forward.params.params, *forward.params.kwonly_params]}
    mask, scores = bound["M"], bound["S"]
    if mask not in params:
        return f"the mask `{mask}` is not a parameter of forward"
    if "output_attentions" not in params:
        return "forward has no `output_attentions` parameter"
    if any(mask in _names(t, stored=True) for line in lines[:start] for t in line):
        return f"`{mask}` is reassigned before the core"
    for t in (t for line in lines[end:] for t in line):
        if isinstance(t, ast.Return):
            continue
        if scores in _names(t):
            return f"`{scores}` is read after the core: `{ast.unparse(t).splitlines()[0]}`"
    return Core(start, end, bound)
