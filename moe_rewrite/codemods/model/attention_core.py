"""The attention core proved the published one, statement by statement on Python's syntax tree, up to names,
formatting and comments (attention.py's docstring shows it): `find_core` gives where it is in the forward and what
its placeholders are bound to, or why it is not the published core."""

from __future__ import annotations

import ast

import libcst as cst

from moe_rewrite.codemods.kit import code, first_line

# The published core, one statement each, in capitals the names it binds: S the scores, Q K V, M the mask, O the
# output; SCALE and P any expression (checked below). Softmax and dropout in nn.functional's two spellings.
PLACEHOLDERS = {"S", "Q", "K", "V", "M", "O"}
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


def _template(text: str) -> ast.stmt:
    return ast.parse(text).body[0]


TEMPLATES = {
    name: [_template(t) for t in texts]
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


IGNORED_FIELDS = {"ctx", "lineno", "col_offset", "end_lineno", "end_col_offset", "type_comment", "kind"}


class _NoMatch(Exception):
    pass


def _unify(template: object, node: object, bound: dict[str, object]) -> None:
    """Raises _NoMatch unless `node` is `template` with its placeholders bound consistently (a placeholder to one
    name, two placeholders to two names) and its wildcards to any expression."""
    if isinstance(template, ast.Name) and template.id in WILDCARDS:
        if template.id in bound and ast.dump(bound[template.id]) != ast.dump(node):  # type: ignore[arg-type]
            raise _NoMatch
        bound[template.id] = node
        return
    if isinstance(template, ast.Name) and template.id in PLACEHOLDERS:
        if not isinstance(node, ast.Name):
            raise _NoMatch
        if template.id in bound:
            if bound[template.id] != node.id:
                raise _NoMatch
        elif node.id in {v for k, v in bound.items() if k in PLACEHOLDERS}:
            raise _NoMatch
        bound[template.id] = node.id
        return
    if isinstance(template, list):
        if not isinstance(node, list) or len(node) != len(template):
            raise _NoMatch
        for t, n in zip(template, node):
            _unify(t, n, bound)
        return
    if isinstance(template, ast.AST):
        if type(node) is not type(template):
            raise _NoMatch
        for name, value in ast.iter_fields(template):
            if name not in IGNORED_FIELDS:
                _unify(value, getattr(node, name, None), bound)
        return
    if type(template) is not type(node) or template != node:
        raise _NoMatch


def _matches(name: str, node: ast.stmt, bound: dict[str, object]) -> bool:
    """Whether `node` is one of the templates `name`, binding into `bound` (left as it was when not)."""
    for template in TEMPLATES[name]:
        trial = dict(bound)
        try:
            _unify(template, node, trial)
        except _NoMatch:
            continue
        bound.update(trial)
        return True
    return False


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
    return not _names(node) & {v for k, v in bound.items() if k in PLACEHOLDERS}


class Core:
    """The core found in a forward: statements [start, end) of its body, and what they bind."""

    def __init__(self, start: int, end: int, bound: dict[str, object]) -> None:
        self.start, self.end, self.bound = start, end, bound


def find_core(forward: cst.FunctionDef) -> Core | str:
    """The forward's published core, or why there is none (one line)."""
    body = list(forward.body.body) if isinstance(forward.body, cst.IndentedBlock) else []
    trees = [ast.parse(code(stmt)).body[0] for stmt in body]
    matmul = [i for i, t in enumerate(trees) if _has_score_matmul(t)]
    if not matmul:
        return "no statement computes the scores as `torch.matmul(Q, K.transpose(2, 3))` at the top of its forward"
    i = matmul[0]
    bound: dict[str, object] = {}
    if not (_matches("score", trees[i], bound) or (_matches("score_alone", trees[i], bound))):
        return f"the scores `{ast.unparse(trees[i])}` are not `torch.matmul(Q, K.transpose(2, 3))` times a scale"
    start, i = i, i + 1
    if "SCALE" not in bound:
        if i >= len(trees) or not _matches("scaled", trees[i], bound):
            return f"the scores `{first_line(body[start])}` are not scaled by the next statement"
        i += 1
    if not _scalar(bound["SCALE"], bound):  # type: ignore[arg-type]
        return f"the scale `{ast.unparse(bound['SCALE'])}` is not a number SDPA can take"  # type: ignore[arg-type]

    def step(name: str, what: str) -> str | None:
        nonlocal i
        if i < len(trees) and _matches(name, trees[i], bound):
            i += 1
            return None
        found = f"`{first_line(body[i])}`" if i < len(body) else "the end of forward"
        return f"{found} where the published core has {what}"

    def optional_check(name: str) -> None:
        nonlocal i
        if i < len(trees) and _is_check(trees[i], bound.get(name)):
            i += 1

    optional_check("S")
    if i < len(trees) and _matches("assert", trees[i], bound):
        i += 1
    mask_added = False
    mask_add = trees[i] if i < len(trees) else None
    if isinstance(mask_add, ast.If) and mask_add.body and len(mask_add.body) == 2:  # the mask's own shape check
        check = mask_add.body[0]
        if _matches("mask", ast.If(test=mask_add.test, body=mask_add.body[1:], orelse=mask_add.orelse), bound):
            if not _is_check(check, bound["M"]):
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
    if _names(bound["P"]) & {v for k, v in bound.items() if k in PLACEHOLDERS}:  # type: ignore[arg-type]
        return f"the dropout rate `{ast.unparse(bound['P'])}` reads the core's tensors"  # type: ignore[arg-type]
    return _check_surroundings(forward, trees, start, i, bound)


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


def _check_surroundings(forward: cst.FunctionDef, trees: list, start: int, end: int, bound: dict) -> Core | str:
    """The mask is the forward's parameter, not rebound before the core; output_attentions is a parameter; the scores
    are read after the core only by `return` (the branch sets them to None)."""
    params = {p.name.value for p in [*forward.params.params, *forward.params.kwonly_params]}
    mask, scores = bound["M"], bound["S"]
    if mask not in params:
        return f"the mask `{mask}` is not a parameter of forward"
    if "output_attentions" not in params:
        return "forward has no `output_attentions` parameter"
    if any(mask in _names(t, stored=True) for t in trees[:start]):
        return f"`{mask}` is reassigned before the core"
    for t in trees[end:]:
        if isinstance(t, ast.Return):
            continue
        if scores in _names(t):
            return f"`{scores}` is read after the core: `{ast.unparse(t).splitlines()[0]}`"
    return Core(start, end, bound)
