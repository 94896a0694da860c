"""The Model's mask proved to reach the proven attention core untouched, for attention_mask.py: after the Model's
`_prepare_4d_causal_attention_mask` call, every read of the mask on its way (Model forward -> decoder layer forward
-> attention forward -> the core) is a pass-through, an argument of the call of the next module of the chain, by
keyword or by position, landing on the parameter the next forward passes on in turn; the attention forward reads it
only in its proven core. Anything else (an assignment, a subscript or attribute store, a method call on it such as
`.masked_fill_`, a test such as `if attention_mask is None: raise`, arithmetic, a call of any other function) and the
None the wrapper passes would reach code that reads it: the 4-D mask stays as published, with a line naming the class
and the use.

The chain is read from the file: the Model's loop `for layer in self.layers:` (or its enumerate, or a slice) over
`self.layers = nn.ModuleList([...])` of classes of the file (the layer called directly, through
`self._gradient_checkpointing_func(layer.__call__, ...)`, or through the gradient_checkpointing codemod's
`_moe_rewrite_checkpoint_layer(self._gradient_checkpointing_func, layer, ...)`); the layer's `self.attr(...)` where
`self.attr = ATTENTION_CLASSES[config._attn_implementation](...)`, a dict the attention codemod gave an "sdpa" entry,
or `self.attr = Class(...)` of a class it rewrote.
"""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import Index, class_methods, code, in_file_lineage, is_marked, top_classes
from moe_rewrite.codemods.model import attention
from moe_rewrite.codemods.model.attention_scale import self_assignments, tree_of

CHECKPOINT_FUNC = "_gradient_checkpointing_func"  # transformers' (partial of torch's checkpoint)
CHECKPOINT_LAYER = "_moe_rewrite_checkpoint_layer"  # the gradient_checkpointing codemod's
# where an argument lands in the next forward: a keyword, or a position among the call's own arguments
Landing = str | int


def _tree(fn: cst.FunctionDef) -> ast.FunctionDef:
    return tree_of(fn)  # type: ignore[return-value]


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _uses(fn: ast.FunctionDef, name: str) -> list[ast.Name]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name]


def _passed(use: ast.Name, parents: dict[int, ast.AST]) -> tuple[ast.Call, Landing] | None:
    """The call `use` is a plain argument of, and where it lands (keyword, or position), or None."""
    parent = parents.get(id(use))
    if isinstance(parent, ast.keyword) and parent.arg is not None:
        call = parents.get(id(parent))
        return (call, parent.arg) if isinstance(call, ast.Call) else None
    if isinstance(parent, ast.Call) and use in parent.args and isinstance(use.ctx, ast.Load):
        at = parent.args.index(use)
        if any(isinstance(a, ast.Starred) for a in parent.args[:at]):
            return None
        return parent, at
    return None


def _statement(node: ast.AST, parents: dict[int, ast.AST]) -> str:
    while not isinstance(node, ast.stmt) and id(node) in parents:
        node = parents[id(node)]
    return ast.unparse(node).splitlines()[0]


def _parameter(fn: ast.FunctionDef, landing: Landing) -> str | None:
    """The forward's parameter an argument lands on (its `self` skipped), or None (`*args`, `**kwargs`, none)."""
    args = fn.args
    positional = [a.arg for a in args.posonlyargs + args.args][1:]
    if isinstance(landing, int):
        return positional[landing] if landing < len(positional) else None
    named = [a.arg for a in args.args][1:] + [a.arg for a in args.kwonlyargs]
    return landing if landing in named else None


def _forward(cls: cst.ClassDef, module: cst.Module) -> cst.FunctionDef | None:
    """The forward the class runs: its own or its nearest base's in the file (None where a base outside the file
    could give it one)."""
    for owner in in_file_lineage(cls, module):
        forward = class_methods(owner).get("forward")
        if forward is not None:
            return forward
    return None


class Chain:
    """What the proof reads from the file once."""

    def __init__(self, module: cst.Module, sdpa_classes: tuple[str, ...], index: Index) -> None:
        self.module, self.classes, self.index = module, top_classes(module), index
        self.sdpa_classes = sdpa_classes
        # where the published Model can hand the layers no mask: why (the SDPA branch would run None as causal)
        self.unmasked: str | None = None
        self.entries: dict[str, str] = {}  # dict name -> the class its marked "sdpa" entry selects
        for stmt in module.body:
            if m.matches(stmt, attention.SDPA_ENTRY) and is_marked(stmt):
                tree = ast.parse(code(stmt).strip()).body[0]
                if isinstance(tree, ast.Assign) and isinstance(tree.value, ast.Name):
                    target = tree.targets[0]
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                        self.entries[target.value.id] = tree.value.id

    def why_not(self, model: str, forward: cst.FunctionDef, stmt: cst.SimpleStatementLine, mask: str) -> str | None:
        """None where the mask `stmt` builds in the Model's forward reaches only proven attention cores, untouched."""
        tree = _tree(forward)
        parents = _parents(tree)
        built = _build(tree, stmt)
        build = built.end_lineno or built.lineno
        guard = _unless_flash(tree, built, parents)
        if guard is not None:
            self.unmasked = f"{model}.forward builds the mask only under `{guard}`"
            return f"{self.unmasked}: None would reach the layers otherwise"
        uses = [u for u in _uses(tree, mask) if u.lineno > build]
        for use in uses:
            passed = _passed(use, parents)
            if passed is None:
                return f"{model}.forward uses the mask after building it: `{_statement(use, parents)}`"
            call, landing = passed
            layer = self._layer_call(call, landing, tree, model)
            if isinstance(layer, str):
                return layer
            classes, landing = layer
            for name in classes:
                why = self._decoder(name, landing)
                if why:
                    return why
        return None

    def _layer_call(
        self, call: ast.Call, landing: Landing, forward: ast.FunctionDef, model: str
    ) -> tuple[list[str], Landing] | str:
        """The decoder layer classes `call` runs and where the argument lands in their forward, or why not one."""
        shown = f"`{ast.unparse(call.func)}(...)`"
        layer, shift = call.func, 0
        me = forward.args.args[0].arg if forward.args.args else "self"
        checkpoint = ast.Attribute(value=ast.Name(me), attr=CHECKPOINT_FUNC)
        if _same(call.func, checkpoint) and call.args and isinstance(call.args[0], ast.Attribute):
            if call.args[0].attr == "__call__":
                layer, shift = call.args[0].value, 1
        elif isinstance(call.func, ast.Name) and call.func.id == CHECKPOINT_LAYER and len(call.args) > 1:
            if _same(call.args[0], checkpoint):
                layer, shift = call.args[1], 2
        if isinstance(landing, int):
            if landing < shift:
                return f"the mask is passed to {shown}, not to a decoder layer"
            landing -= shift
        if shift and self._defines(CHECKPOINT_FUNC):
            return f"the file defines `{CHECKPOINT_FUNC}` itself"
        if not isinstance(layer, ast.Name):
            return f"the mask is passed to {shown}, not to a decoder layer"
        attr = _loop_over(forward, layer.id, me)
        if attr is None:
            return f"the mask is passed to {shown}, not to a decoder layer of a `for` over `self.<layers>`"
        classes = self._module_list(model, attr)
        if isinstance(classes, str):
            return classes
        return classes, landing

    def _defines(self, name: str) -> bool:
        """Whether the file assigns or defines `name` anywhere (a method, an attribute store)."""
        found = [s for s in self.module.body if name in self.index.facts(s).names]
        trees = [tree_of(s) if isinstance(s, (cst.ClassDef, cst.FunctionDef)) else ast.parse(code(s)) for s in found]
        for n in (n for tree in trees for n in ast.walk(tree)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                return True
            if isinstance(n, ast.Attribute) and n.attr == name and not isinstance(n.ctx, ast.Load):
                return True
        return False

    def _module_list(self, model: str, attr: str) -> list[str] | str:
        """The classes `self.<attr> = nn.ModuleList([...])` of the Model builds, or why not known."""
        stores = self_assignments(self.classes[model], self.module, attr)
        if len(stores) != 1 or isinstance(stores[0][1], ast.stmt):
            return f"`self.{attr}` of {model} is not assigned once"
        value = stores[0][1]
        shown = f"`self.{attr} = {ast.unparse(value)}`"
        if not (
            isinstance(value, ast.Call)
            and ast.unparse(value.func) in ("nn.ModuleList", "torch.nn.ModuleList")
            and len(value.args) == 1
            and not value.keywords
        ):
            return f"{shown} is not an nn.ModuleList of decoder layers"
        items = value.args[0]
        elements = [items.elt] if isinstance(items, ast.ListComp) else items.elts if isinstance(items, ast.List) else []
        names = []
        for element in elements:
            if not (isinstance(element, ast.Call) and isinstance(element.func, ast.Name)):
                return f"{shown} is not an nn.ModuleList of decoder layers"
            if element.func.id not in self.classes:
                return f"{shown} holds `{element.func.id}`, not a class of the file"
            names.append(element.func.id)
        return names or f"{shown} is not an nn.ModuleList of decoder layers"

    def _decoder(self, name: str, landing: Landing) -> str | None:
        """Why the decoder layer class does more with the mask than pass it to its attention (None where not)."""
        cst_forward = _forward(self.classes[name], self.module)
        if cst_forward is None:
            return f"{name} has no forward in the file"
        forward = _tree(cst_forward)
        if not forward.args.args:
            return f"{name}.forward takes no `self`"
        param = _parameter(forward, landing)
        if param is None:
            return f"the mask reaches {name}.forward's `*args` or `**kwargs`"
        parents = _parents(forward)
        me = forward.args.args[0].arg
        for use in _uses(forward, param):
            passed = _passed(use, parents)
            if passed is None:
                return f"{name}.forward uses the mask: `{_statement(use, parents)}`"
            call, at = passed
            func = call.func
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == me):
                return f"{name}.forward passes the mask to `{ast.unparse(func)}(...)`, not to its attention"
            targets = self._attention(name, func.attr)
            if isinstance(targets, str):
                return targets
            for target in targets:
                why = self._attention_forward(target, at)
                if why:
                    return why
        return None

    def _attention(self, layer: str, attr: str) -> list[str] | str:
        """The attention classes `self.<attr>` of the decoder layer is under "sdpa", or why not known."""
        stores = self_assignments(self.classes[layer], self.module, attr)
        shown = f"{layer}.forward passes the mask to `self.{attr}(...)`"
        if len(stores) != 1 or isinstance(stores[0][1], ast.stmt):
            return f"{shown}, which is not assigned once"
        value = stores[0][1]
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in self.sdpa_classes:
            return [value.func.id]
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Subscript):
            lookup = value.func
            if (
                isinstance(lookup.value, ast.Name)
                and lookup.value.id in self.entries
                and isinstance(lookup.slice, ast.Attribute)
                and lookup.slice.attr == "_attn_implementation"
            ):
                return [self.entries[lookup.value.id]]
        return f"{shown}, not an attention class the SDPA rewrite proved"

    def _attention_forward(self, name: str, landing: Landing) -> str | None:
        """Why the attention class reads the mask outside its proven core (None where it does not): the core is the
        attention codemod's branch of this run, whose SDPA call takes the core's mask fourth."""
        rewritten = class_methods(self.classes[name]).get("forward") if name in self.classes else None
        if rewritten is None:
            return f"{name} has no forward of its own"
        tree = _tree(rewritten)
        calls = [
            (s, n)
            for s in tree.body
            for n in ast.walk(s)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == attention.OUR_CALL
        ]
        args = calls[0][1].args if len(calls) == 1 else []
        if len(args) < 4 or not isinstance(calls[0][0], ast.If) or not isinstance(args[3], ast.Name):
            return f"{name}.forward holds no proven core"
        branch, mask = calls[0][0], calls[0][1].args[3].id  # type: ignore[attr-defined]
        if _parameter(tree, landing) != mask:
            return f"the mask reaches {name}.forward other than as `{mask}`"
        parents = _parents(tree)
        for stmt in tree.body:
            if stmt is not branch and _uses(stmt, mask):  # type: ignore[arg-type]
                use = _uses(stmt, mask)[0]  # type: ignore[arg-type]
                return f"{name}.forward uses the mask outside its core: `{_statement(use, parents)}`"
        return None


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.unparse(a) == ast.unparse(b)


def _build(tree: ast.FunctionDef, stmt: cst.SimpleStatementLine) -> ast.Assign:
    """The build statement `stmt` in the forward's tree (found by its text)."""
    text = ast.dump(ast.parse(code(stmt.with_changes(leading_lines=[])).strip()).body[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.dump(node) == text:
            return node
    raise AssertionError("the mask's build statement is not in its forward")


def _flash(test: ast.expr) -> bool:
    """A test whether the model runs flash-attn (`self._use_flash_attention_2`, `... == "flash_attention_2"`)."""
    return "flash" in ast.unparse(test)


def _unless_flash(tree: ast.FunctionDef, build: ast.Assign, parents: dict[int, ast.AST]) -> str | None:
    """None where the build runs whenever flash-attn is off (at the forward's top level, or in the branch of an
    `if` on flash-attn taken without it); else the first test it is under."""
    node: ast.AST = build
    while id(node) in parents and parents[id(node)] is not tree:
        parent = parents[id(node)]
        if isinstance(parent, ast.If):
            negated = isinstance(parent.test, ast.UnaryOp) and isinstance(parent.test.op, ast.Not)
            test = parent.test.operand if negated else parent.test  # type: ignore[attr-defined]
            in_body = any(node is s for s in parent.body)
            if not (_flash(test) and in_body == negated):
                return ast.unparse(parent.test) if in_body else f"not ({ast.unparse(parent.test)})"
        elif not isinstance(parent, ast.Assign):
            return ast.unparse(parent).splitlines()[0]
        node = parent
    return None


def _loop_over(forward: ast.FunctionDef, name: str, me: str) -> str | None:
    """`attr` where `name` is bound in the forward only as the target of `for name in self.attr` (or of a slice of
    it, or `for i, name in enumerate(...)` of either)."""
    loops = []
    for node in ast.walk(forward):
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            loops.append(node)
    if not loops:
        return None
    found = set()
    for node in ast.walk(forward):
        if not isinstance(node, (ast.For, ast.comprehension)):
            continue
        target, source = node.target, node.iter
        if isinstance(source, ast.Call) and ast.unparse(source.func) == "enumerate" and len(source.args) == 1:
            if not (isinstance(target, ast.Tuple) and len(target.elts) == 2):
                continue
            target, source = target.elts[1], source.args[0]
        if not (isinstance(target, ast.Name) and target.id == name):
            continue
        if isinstance(source, ast.Subscript) and isinstance(source.slice, ast.Slice):
            source = source.value
        if isinstance(source, ast.Attribute) and isinstance(source.value, ast.Name) and source.value.id == me:
            loops.remove(target)
            found.add(source.attr)
    return found.pop() if not loops and len(found) == 1 else None
