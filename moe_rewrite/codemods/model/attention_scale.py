"""The softmax scale proved a Python number, which SDPA's `scale=` takes (a tensor there fails at the first step).

The published scale is `self.softmax_scale`, set in `__init__` from the config (the head dim's inverse square root,
times YaRN's temperature from the file's `yarn_get_mscale`). A learnable temperature (`nn.Parameter`) or a per-head
scale buffer multiplied into it is a tensor: the core stays as published then, with a line saying why. What is a
number here, read on the syntax tree: a constant; a value read from the config (`config.x`, `self.config.x[...]`,
`.get(...)`, the compat codemod's `_moe_rewrite_rope_scaling(config)`: a config holds what its JSON holds, never a
tensor); arithmetic, `math.*`, `float()`, `int()`, `abs`, `min`, `max` of numbers; a conditional expression of numbers;
a local name every assignment in its function gives a number; `self.x` every assignment in the class and its bases in
the file gives a number (and no `register_buffer` / `register_parameter` names); a call of a function of the file every
`return` of which gives a number from the arguments passed (numbers themselves).
"""

from __future__ import annotations

import ast

import libcst as cst

from moe_rewrite.codemods.kit import code, in_file_lineage

NUMBER_CALLS = {"float", "int", "abs", "min", "max", "round"}
ROPE_SCALING = "_moe_rewrite_rope_scaling"  # the compat codemod's read of config.rope_scaling
DEPTH = 8  # nested helpers and attributes followed, at most


_TREES: dict[int, tuple[cst.CSTNode, ast.stmt]] = {}  # id(node) -> (node, its tree): code() is the cost here


def tree_of(node: cst.FunctionDef | cst.ClassDef) -> ast.stmt:
    """The function's or class's `ast` tree (without its decorators and comments above), kept per node object."""
    known = _TREES.get(id(node))
    if known is not None and known[0] is node:
        return known[1]
    if len(_TREES) > 4096:
        _TREES.clear()
    tree = ast.parse(code(node.with_changes(leading_lines=[], decorators=[])).strip()).body[0]
    _TREES[id(node)] = (node, tree)
    return tree


def _tree(fn: cst.FunctionDef) -> ast.FunctionDef:
    return tree_of(fn)  # type: ignore[return-value]


def self_assignments(cls: cst.ClassDef, module: cst.Module, attr: str) -> list[tuple[ast.FunctionDef, ast.AST]]:
    """(method, the assigned value, or the statement where it is not a plain `=`) for each store into `self.attr` in
    the class and its bases in the file."""
    found = []
    for owner in in_file_lineage(cls, module):
        for fn in tree_of(owner).body:  # type: ignore[attr-defined]
            if not isinstance(fn, ast.FunctionDef):
                continue
            me = fn.args.args[0].arg if fn.args.args else "self"
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                for target in targets:
                    for t in ast.walk(target):
                        if (
                            isinstance(t, ast.Attribute)
                            and t.attr == attr
                            and isinstance(t.ctx, ast.Store)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == me
                        ):
                            plain = isinstance(node, ast.Assign) and target is t and len(node.targets) == 1
                            found.append((fn, node.value if plain else node))
    return found


class _Numbers:
    """Proves expressions numbers (None) or says which part may not be one."""

    def __init__(self, cls: cst.ClassDef, module: cst.Module) -> None:
        self.cls, self.module = cls, module
        self.functions = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
        self.attrs: dict[str, str | None] = {}

    def why_not(self, node: ast.AST, fn: ast.FunctionDef, env: dict[str, bool], depth: int = 0) -> str | None:
        """None where `node`, in function `fn`, is a number; else the part that may not be (`env`: names known)."""
        shown = ast.unparse(node)
        if depth > DEPTH:
            return f"`{shown}` is followed too far"
        if isinstance(node, ast.Constant):
            return None if isinstance(node.value, (int, float)) else _not_number(shown)
        if _from_config(node, fn):
            return None
        if isinstance(node, ast.BinOp):
            return self.why_not(node.left, fn, env, depth) or self.why_not(node.right, fn, env, depth)
        if isinstance(node, ast.UnaryOp):
            return self.why_not(node.operand, fn, env, depth)
        if isinstance(node, ast.IfExp):
            return self.why_not(node.body, fn, env, depth) or self.why_not(node.orelse, fn, env, depth)
        if isinstance(node, ast.Name):
            return self._local(node.id, fn, env, depth)
        if isinstance(node, ast.Attribute) and _is_self(node.value, fn):
            return self._attribute(node.attr, depth)
        if isinstance(node, ast.Call) and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args):
            func, bound = node.func, _bound(fn)
            known = (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == "math"
                and "math" not in bound
            ) or (isinstance(func, ast.Name) and func.id in NUMBER_CALLS and func.id not in bound)
            helper = isinstance(func, ast.Name) and func.id in self.functions and func.id not in bound
            if known or helper:
                for arg in node.args:
                    why = self.why_not(arg, fn, env, depth)
                    if why:
                        return why
                return self._helper(func.id, len(node.args), depth) if helper else None  # type: ignore[attr-defined]
        return _not_number(shown)

    def _local(self, name: str, fn: ast.FunctionDef, env: dict[str, bool], depth: int) -> str | None:
        if name in env:
            return None if env[name] else _not_number(name)
        values = _assigned(fn, name)
        if values is None:
            return f"`{name}` is not only assigned numbers"
        env[name] = True  # assumed while its own assignments are read (`x = x * 2`)
        for value in values:
            why = self.why_not(value, fn, env, depth + 1)
            if why:
                env[name] = False
                return why
        return None

    def _attribute(self, attr: str, depth: int) -> str | None:
        if attr in self.attrs:
            return self.attrs[attr]
        self.attrs[attr] = None  # assumed while its own assignments are read (`self.s = self.s * m`)
        why = None
        stores = self_assignments(self.cls, self.module, attr)
        if not stores:
            why = f"`self.{attr}` is set nowhere in the class (a buffer?)"
        elif any(_registers(owner, attr) for owner in in_file_lineage(self.cls, self.module)):
            why = f"`self.{attr}` is a registered buffer or parameter"
        for fn, value in stores:
            if why:
                break
            if isinstance(value, ast.stmt) or self.why_not(value, fn, {}, depth + 1):
                why = f"`{ast.unparse(value).splitlines()[0]}` is not proved a number"
                if not isinstance(value, ast.stmt):
                    why = f"`self.{attr} = {ast.unparse(value).splitlines()[0]}` is not proved a number"
        self.attrs[attr] = why
        return why

    def _helper(self, name: str, count: int, depth: int) -> str | None:
        fn = _tree(self.functions[name])
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if count > len(params) or fn.args.vararg or fn.args.kwarg:
            return f"`{name}(...)` is not proved a number"
        env = {p: True for p in params}  # the arguments passed, numbers; the defaults read below
        defaults = fn.args.defaults
        for p, default in zip(params[len(params) - len(defaults) :], defaults):
            if params.index(p) >= count and self.why_not(default, fn, {}, depth + 1):
                return f"`{name}(...)` is not proved a number"
        returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
        if not returns or any(n.value is None for n in returns) or _nested(fn):
            return f"`{name}(...)` is not proved a number"
        for r in returns:
            if self.why_not(r.value, fn, dict(env), depth + 1):  # type: ignore[arg-type]
                return f"`{name}(...)` is not proved a number"
        return None


def _not_number(shown: str) -> str:
    return f"`{shown}` is not proved a number"


def _is_self(node: ast.AST, fn: ast.FunctionDef) -> bool:
    return isinstance(node, ast.Name) and bool(fn.args.args) and node.id == fn.args.args[0].arg


def _from_config(node: ast.AST, fn: ast.FunctionDef) -> bool:
    """`config.x`, `self.config.x`, and subscripts and method calls on them (`.get(...)`): a config's JSON value."""
    read = False
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == ROPE_SCALING:
            if len(node.args) != 1 or node.keywords:
                return False
            node = node.args[0]
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Attribute):
            if node.attr == "config" and _is_self(node.value, fn):
                return read
            node = node.value
        else:
            return read and isinstance(node, ast.Name) and node.id == "config" and _is_parameter(fn, "config")
        read = True


def _is_parameter(fn: ast.FunctionDef, name: str) -> bool:
    args = fn.args
    return any(a.arg == name for a in args.posonlyargs + args.args + args.kwonlyargs) and not any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(fn)
    )


def _bound(fn: ast.FunctionDef) -> set[str]:
    """The names the function binds (parameters, assignments, imports): those shadow builtins and modules."""
    args = fn.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for n in ast.walk(fn):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return names


def _nested(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for n in ast.walk(fn) if n is not fn)


def _assigned(fn: ast.FunctionDef, name: str) -> list[ast.expr] | None:
    """The values every binding of `name` in the function assigns, or None where one is not a plain `name = value`
    (a parameter, a loop, an augmented assignment, an unpacking, an import)."""
    if _is_parameter(fn, name) or any(a.arg == name for a in [fn.args.vararg, fn.args.kwarg] if a):
        return None
    values = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            owner = next(
                (a for a in ast.walk(fn) if isinstance(a, ast.Assign) and len(a.targets) == 1 and a.targets[0] is node),
                None,
            )
            if owner is None:
                return None
            values.append(owner.value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name).split(".")[0] == name for a in node.names
        ):
            return None
    return values or None


def _registers(cls: cst.ClassDef, attr: str) -> bool:
    """Whether the class holds the string `attr` (register_buffer, register_parameter, setattr name it so)."""
    return any(isinstance(n, ast.Constant) and n.value == attr for n in ast.walk(tree_of(cls)))


def why_not_number(scale: ast.expr, forward: cst.FunctionDef, cls: cst.ClassDef, module: cst.Module) -> str | None:
    """None where the core's scale, in `forward` of `cls`, is proved a Python number; else one line saying why."""
    why = _Numbers(cls, module).why_not(scale, _tree(forward), {})
    if why is None:
        return None
    shown = ast.unparse(scale)
    return f"the softmax scale `{shown}` may be a tensor, which SDPA's scale= does not take: {why}"
