"""Prove that a file's code is the published code, up to names, formatting, comments and docstrings.

A `Template` is the published code written as Python source with declared placeholders: a placeholder stands for a
name the file may spell otherwise, a wildcard for any expression. `prove` compares statements with it one by one on
the syntax tree (`ast`), so formatting, comments and parentheses do not matter, and everything else does: every
attribute name, constant, operator, keyword (in the published order: `f(a=1, b=2)` is not `f(b=2, a=1)`) and every
name that is not a placeholder. It returns the bindings (`Proof`) or where the code first differs (`Differs`)::

    published = Template("L = self.lm_head(H)\\nL = L.float()", placeholders={"self", "L", "H"})
    found = prove(published, statements, bound={"self": "self"}, within=forward)
    if isinstance(found, Differs):  # "`logits = logits.half()` where the published loss has `L = L.float()`"
        context.notes.append(Note("loss", name, False, found.describe("loss", "the end of forward")))
    else:
        logits = found.names["L"]  # the file's name for it, "logits"

The binding rule: a placeholder binds exactly one name, the same wherever it appears; two placeholders never bind
the same name; a placeholder never binds a name the template uses literally (`torch`, `self`, `F`). With `within`,
no name the template uses literally is bound in that function (a parameter, an assignment, an import, a `def`): it is
the global the published code reads. A wildcard binds one expression, the same (as a tree) wherever it appears. Each
statement of the file is one published statement: a line holding two (`a = 1; b = 2`) differs.

A function proven whole (`prove_function`, the template made with `params`): the template's parameters and every name
it binds are its placeholders, the function's parameters are bound to them by position and docstrings are skipped,
so the body is proven up to the names of its locals while globals and attributes stay literal.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import libcst as cst

from moe_rewrite.codemods.kit.syntax import code, first_line

Statement = cst.BaseStatement | ast.stmt
Function = cst.FunctionDef | ast.FunctionDef | ast.AsyncFunctionDef
IGNORED_FIELDS = frozenset({"ctx", "lineno", "col_offset", "end_lineno", "end_col_offset", "type_comment", "kind"})


class Template:
    """Published statements, parsed once, with their placeholders (names) and wildcards (expressions); with `params`,
    a function body: those parameters and every name the body binds are placeholders too."""

    def __init__(
        self,
        source: str,
        placeholders: Iterable[str] = (),
        wildcards: Iterable[str] = (),
        params: Sequence[str] | None = None,
    ) -> None:
        source = textwrap.dedent(source)
        self.trees: list[ast.stmt] = skip_docstring(ast.parse(source).body)
        self.lines = [_first(ast.get_source_segment(source, t) or ast.unparse(t)) for t in self.trees]
        self.params = tuple(params or ())
        names = {*placeholders, *self.params, *(bound_in(self.trees) if params is not None else ())}
        self.placeholders, self.wildcards = frozenset(names), frozenset(wildcards)
        if self.placeholders & self.wildcards:
            raise ValueError(f"both a placeholder and a wildcard: {sorted(self.placeholders & self.wildcards)}")
        used = {n.id for t in self.trees for n in ast.walk(t) if isinstance(n, ast.Name)}
        self.literals = frozenset(used - self.placeholders - self.wildcards)

    def first_use(self, name: str) -> int:
        """The index of the first statement reading or binding `name` (0 if none does)."""
        uses = (i for i, t in enumerate(self.trees) for n in ast.walk(t) if isinstance(n, ast.Name) and n.id == name)
        return next(uses, 0)


@dataclass
class Proof:
    """What the placeholders stand for in the file."""

    names: dict[str, str] = field(default_factory=dict)  # placeholder -> the file's name
    expressions: dict[str, ast.expr] = field(default_factory=dict)  # wildcard -> the file's expression


@dataclass(frozen=True)
class Differs:
    """Where the file's statements first differ from the template."""

    at: int  # the index of that statement in both lists (where one list ends first: its length)
    found: str | None  # its first line, None where the file's statements end first
    published: str | None  # the template's statement there, None where the template ends first
    why: str = ""  # the binding rule that failed, "" where the trees differ

    def describe(self, what: str = "code", end: str = "the end of the statements") -> str:
        """One line: "`found` where the published {what} has `published`" (and why, where a binding rule failed)."""
        found = f"`{self.found}`" if self.found is not None else end
        published = f"`{self.published}`" if self.published is not None else "nothing more"
        return f"{found} where the published {what} has {published}" + (f" ({self.why})" if self.why else "")


class _Mismatch(Exception):
    """The trees differ; its message names the binding rule that failed ("" where their shapes differ)."""


def prove(
    template: Template,
    statements: Sequence[Statement],
    bound: Mapping[str, str] | Proof | None = None,
    within: Function | None = None,
) -> Proof | Differs:
    """The bindings proving `statements` are the template's, one for one, or where they first differ. `bound`: names
    already bound (or an earlier template's proof, its expressions too), held to the rule; `within`: the function
    holding the statements, which must not bind the template's literals."""
    proof = Proof(dict(bound.names), dict(bound.expressions)) if isinstance(bound, Proof) else Proof(dict(bound or {}))
    if set(proof.names) & template.literals:
        raise ValueError(f"bound names the template uses literally: {sorted(set(proof.names) & template.literals)}")
    literal = sorted(set(proof.names.values()) & template.literals, key=template.first_use)
    if literal:
        return _differs(template, statements, template.first_use(literal[0]), _literal(literal[0]))
    for i, tree in enumerate(template.trees):
        if i >= len(statements):
            return Differs(i, None, template.lines[i])
        try:
            _unify(tree, _tree(statements[i]), template, proof)
        except _Mismatch as mismatch:
            return _differs(template, statements, i, str(mismatch))
    if len(statements) > len(template.trees):
        return Differs(len(template.trees), _shown(statements[len(template.trees)]), None)
    function = _function_tree(within) if within is not None else None
    local = bound_in(function.args, *function.body) if function is not None else set()
    rebound = sorted(template.literals & local, key=template.first_use)
    if rebound:
        where = template.first_use(rebound[0])
        return _differs(template, statements, where, f"`{rebound[0]}` is bound in the function")
    return proof


def prove_function(template: Template, function: Function) -> Proof | Differs:
    """The bindings proving the function's body (its docstring skipped) is the template's, written with
    `params=`: the function's parameters bound to those by position."""
    tree = _function_tree(function)
    args = tree.args
    params = [a.arg for a in [*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg] if a]
    body = skip_docstring(list(function.body.body) if isinstance(function, cst.FunctionDef) else function.body)  # type: ignore[arg-type]
    if len(params) != len(template.params):
        return Differs(0, f"def {tree.name}({', '.join(params)})", f"({', '.join(template.params)})")
    return prove(template, body, dict(zip(template.params, params)), within=tree)


def closest(found: Iterable[Differs]) -> Differs:
    """Of several templates' differences, the one that got furthest (the first of those)."""
    return max(found, key=lambda d: d.at)


def same(node: cst.CSTNode | ast.AST, *sources: str) -> bool:
    """Whether a statement or expression is one of `sources` up to formatting, comments and parentheses."""
    text = code(node) if isinstance(node, cst.CSTNode) else ast.unparse(node)
    expression = isinstance(node, (cst.BaseExpression, ast.expr))
    try:
        tree = _parsed(text.strip().rstrip(";"), expression)  # a line's every statement (`a = 1; b = 2`: two)
    except SyntaxError:  # a cst node that is not code on its own
        return False
    for source in sources:
        try:
            _unify(_parsed(source, expression), tree, None, Proof())
            return True
        except _Mismatch:
            continue
    return False


def skip_docstring(body: list) -> list:
    """The statements after a docstring (cst or ast statements)."""
    try:
        first = _tree(body[0]) if body else None
    except _Mismatch:
        return body
    is_string = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return body[1:] if is_string and isinstance(first.value.value, str) else body  # type: ignore[union-attr]


def bound_in(*nodes: ast.AST | Iterable[ast.AST]) -> set[str]:
    """Every name the nodes bind, nested scopes included: assigned, deleted, imported, defined, caught, parameters."""
    found: set[str] = set()
    for top in nodes:
        for node in (n for t in ([top] if isinstance(top, ast.AST) else top) for n in ast.walk(t)):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                found.add(node.id)
            elif isinstance(node, ast.alias):
                found.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
            elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
                found.add(node.name)
            elif isinstance(node, ast.MatchMapping) and node.rest:
                found.add(node.rest)
    return found


def _unify(template: object, node: object, names: Template | None, proof: Proof) -> None:
    """Raises _Mismatch unless `node` is `template` with the placeholders and wildcards of `names` (None: no
    placeholders) bound by the rule, into `proof`."""
    if names is not None and isinstance(template, ast.Name) and template.id in names.wildcards:
        if not isinstance(node, ast.expr):
            raise _Mismatch("")
        earlier = proof.expressions.setdefault(template.id, node)
        try:
            _unify(earlier, node, None, proof)
        except _Mismatch:
            both = f"`{ast.unparse(earlier)}` and `{ast.unparse(node)}`"
            raise _Mismatch(f"{both} in the places of one published expression") from None
        return
    if names is not None and isinstance(template, ast.Name) and template.id in names.placeholders:
        if not isinstance(node, ast.Name):
            raise _Mismatch("")
        earlier = proof.names.setdefault(template.id, node.id)
        if earlier != node.id:
            raise _Mismatch(f"`{earlier}` and `{node.id}` in the places of one published name")
        if node.id in names.literals:
            raise _Mismatch(_literal(node.id))
        if any(other != template.id and value == node.id for other, value in proof.names.items()):
            raise _Mismatch(f"`{node.id}` in the places of two published names")
        return
    if isinstance(template, list):
        if not isinstance(node, list) or len(node) != len(template):
            raise _Mismatch("")
        for t, n in zip(template, node):
            _unify(t, n, names, proof)
    elif isinstance(template, ast.AST):
        if type(node) is not type(template):
            raise _Mismatch("")
        for name, value in ast.iter_fields(template):
            if name not in IGNORED_FIELDS:
                _unify(value, getattr(node, name, None), names, proof)
    elif type(template) is not type(node) or template != node:
        raise _Mismatch("")


def _literal(name: str) -> str:
    return f"`{name}` in the place of a published name, but the published code reads `{name}` itself"


def _differs(template: Template, statements: Sequence[Statement], at: int, why: str) -> Differs:
    return Differs(at, _shown(statements[at]) if at < len(statements) else None, template.lines[at], why)


def _tree(statement: Statement) -> ast.stmt:
    """A statement's tree; a line holding several (`a = 1; b = 2`) raises _Mismatch."""
    if isinstance(statement, ast.stmt):
        return statement
    body = ast.parse(code(statement)).body
    if len(body) != 1:
        raise _Mismatch(f"{len(body)} statements on one line")
    return body[0]


def _function_tree(function: Function) -> ast.FunctionDef | ast.AsyncFunctionDef:
    if isinstance(function, cst.FunctionDef):
        return ast.parse(code(function.with_changes(leading_lines=[], decorators=[])).strip()).body[0]  # type: ignore[return-value]
    return function


def _shown(statement: Statement) -> str:
    return first_line(statement) if isinstance(statement, cst.CSTNode) else _first(ast.unparse(statement))


def _first(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines()]
    return lines[0] + (" ..." if len(lines) > 1 else "")


def _parsed(source: str, expression: bool) -> ast.AST | list[ast.stmt]:
    return ast.parse(source, mode="eval").body if expression else ast.parse(source).body
