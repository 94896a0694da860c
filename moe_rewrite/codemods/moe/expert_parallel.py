"""Let the MoE layer's __init__ build its experts for any expert-parallel size, not only ep_size == world size.

The published V2/V3-form __init__ builds experts [ep_rank * E / ep, (ep_rank + 1) * E / ep) under
`if ... config.ep_size > 1:`, with the global rank as ep_rank, after asserting that ep_size is the world size. The
generated runtime (runtime/moe/expert_parallel.py) groups ranks in blocks of ep consecutive ranks, so the assert goes
and ep_rank is the rank's place in its block::

    # Before
    if hasattr(config, "ep_size") and config.ep_size > 1:
        assert config.ep_size == dist.get_world_size()
        self.ep_size = config.ep_size
        self.experts_per_rank = config.n_routed_experts // config.ep_size
        self.ep_rank = dist.get_rank()
    # After
    if hasattr(config, "ep_size") and config.ep_size > 1:
        self.ep_size = config.ep_size
        self.experts_per_rank = config.n_routed_experts // config.ep_size
        # moe-rewrite: expert-parallel rank in a group of ep consecutive ranks (no ep_size == world size restriction)
        self.ep_rank = _moe_rewrite_ep_rank(config)

`_moe_rewrite_ep_rank(config)` is `dist.get_rank() % config.ep_size` once it has checked that torch.distributed is
initialized and that ep divides the world size and the number of experts: the published ep_rank wherever the assert
held. Changed only where the branch holds exactly that assert and that assignment (compared as syntax trees), sets
`self.ep_size = config.ep_size`, reads no other rank or world size in __init__, and `dist` is the file's
`import torch.distributed as dist`; otherwise __init__ stays as published (ep_size must equal the world size there)
and the summary says why (with --expert-parallel; without it, ep_size > 1 is refused at the first forward). The ESFT
form keeps it too: its own moe_ep exchanges rows over the whole world. Done with or without --expert-parallel, so that
a rewrite with it and one without differ only in the generated block and the banner.
"""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import MARK, Context, Field, Form, class_methods, code, one_line, replace, top_classes
from moe_rewrite.codemods.kit.index import Index
from moe_rewrite.codemods.kit.prove import same
from moe_rewrite.render import features

READS: tuple[Field, ...] = ("moe",)
PROVIDES: tuple[Field, ...] = ()
OUR_CALL = "_moe_rewrite_ep_rank"
NOTE = f"{MARK}: expert-parallel rank in a group of ep consecutive ranks (no ep_size == world size restriction)"
GREATER_THAN_ONE = m.Comparison(comparisons=[m.ComparisonTarget(operator=m.GreaterThan(), comparator=m.Integer("1"))])
DIST_IMPORT = "import torch.distributed as dist"


def _self_attr(name: str) -> m.BaseMatcherNode:
    """An assignment of any kind to self.<name>."""
    target = m.Attribute(value=m.Name("self"), attr=m.Name(name))
    return (
        m.Assign(targets=[m.ZeroOrMore(), m.AssignTarget(target), m.ZeroOrMore()])
        | m.AugAssign(target=target)
        | m.AnnAssign(target=target)
    )


def _ep_branches(init: cst.FunctionDef) -> list[cst.If]:
    """The __init__'s top-level `if`s whose test compares something naming ep_size `> 1`."""
    body = init.body.body if isinstance(init.body, cst.IndentedBlock) else ()
    return [
        stmt
        for stmt in body
        if isinstance(stmt, cst.If)
        and any("ep_size" in one_line(c.left) for c in m.findall(stmt.test, GREATER_THAN_ONE))  # type: ignore
    ]


def _binds_dist(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "dist" and not isinstance(node.ctx, ast.Load)
    if isinstance(node, ast.alias):  # `import dist.x` binds dist too
        return (node.asname or node.name.split(".")[0]) == "dist"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)):
        return node.name == "dist"
    return isinstance(node, ast.arg) and node.arg == "dist"


def _module_level(tree: ast.Module) -> list[ast.AST]:
    """The nodes of the module's own scope: not inside a function, class or lambda (their bindings are local)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo += ast.iter_child_nodes(node)
    return found


def _dist_is_torch_distributed(module: cst.Module, init: cst.FunctionDef, index: Index) -> bool:
    """The __init__'s `dist` is the module's, bound once: by a top-level `import torch.distributed as dist`, nowhere
    else at module level (nor through `global dist`) or in __init__ (the generated code's locals are its own). Only
    the top-level statements naming `dist` are parsed (the only ones that can bind it): parsing the whole 4000-line
    file took a quarter of a second."""
    tree = ast.parse("".join(code(stmt) for stmt in module.body if index.mentions(stmt, "dist")))
    expected = ast.dump(ast.parse(DIST_IMPORT).body[0])
    return (
        sum(map(_binds_dist, _module_level(tree))) == 1
        and any(ast.dump(stmt) == expected for stmt in tree.body)
        and not any(isinstance(n, ast.Global) and "dist" in n.names for n in ast.walk(tree))
        and not any(map(_binds_dist, ast.walk(ast.parse(code(init.with_changes(leading_lines=[], decorators=[]))))))
    )


def _edited(
    init: cst.FunctionDef, branch: cst.If, cfg: str, module: cst.Module, index: Index
) -> tuple[cst.FunctionDef | None, str]:
    """(the __init__ with the branch edited, "") or (None, why it stays as published)."""
    if not isinstance(branch.body, cst.IndentedBlock):
        return None, "the branch is on its `if` line"
    statements = list(branch.body.body)
    restriction = f"assert {cfg}.ep_size == dist.get_world_size()"
    asserts = [a for a in m.findall(branch.body, m.Assert()) if same(a, restriction)]
    if len(asserts) != 1:
        return None, f"{len(asserts)} `{restriction}` in the branch, not one"
    ranks = m.findall(branch.body, _self_attr("ep_rank"))
    if len(ranks) != 1 or not same(ranks[0], "self.ep_rank = dist.get_rank()"):
        found = ", ".join(f"`{one_line(r)}`" for r in ranks) or "none"
        return None, f"the branch's ep_rank is not set once as `self.ep_rank = dist.get_rank()` ({found})"
    sizes = m.findall(branch.body, _self_attr("ep_size"))
    if len(sizes) != 1 or not same(sizes[0], f"self.ep_size = {cfg}.ep_size"):
        return None, f"the branch does not set `self.ep_size = {cfg}.ep_size` once"
    for name in ("get_rank", "get_world_size"):
        if index.facts(init).names[name] != 1:
            return None, f"{name} is read again in __init__"
    lines = {}
    for which, node in (("assert", asserts[0]), ("rank", ranks[0])):
        line = next(
            (s for s in statements if isinstance(s, cst.SimpleStatementLine) and any(n is node for n in s.body)), None
        )
        if line is None or len(line.body) != 1:
            return None, f"`{one_line(node)}` is not a statement line of its own in the branch"
        lines[which] = line
    if not _dist_is_torch_distributed(module, init, index):
        return None, f"`dist` is not bound by `{DIST_IMPORT}` alone"
    note = cst.EmptyLine(comment=cst.Comment(NOTE))
    ours = cst.ensure_type(ranks[0], cst.Assign).with_changes(value=cst.parse_expression(f"{OUR_CALL}({cfg})"))
    body: list[cst.BaseStatement] = []
    carried: list[cst.EmptyLine] = []  # the assert's comment lines, kept above the statement after it
    for stmt in statements:
        if stmt is lines["assert"]:
            carried = list(stmt.leading_lines)
            continue
        if stmt is lines["rank"]:
            stmt = lines["rank"].with_changes(body=[ours], leading_lines=[*lines["rank"].leading_lines, note])
        body.append(stmt.with_changes(leading_lines=[*carried, *stmt.leading_lines]) if carried else stmt)
        carried = []
    new_branch = branch.with_changes(body=branch.body.with_changes(body=body))
    return init.deep_replace(branch, new_branch), ""  # type: ignore[return-value]


def transform(module: cst.Module, context: Context) -> cst.Module:
    moe = top_classes(module).get(context.moe_class().name)
    init = class_methods(moe).get("__init__") if moe is not None else None
    branches = _ep_branches(init) if init is not None else []
    if init is None or not branches:
        return module  # no expert-parallel branch (V1 form, Kimi): nothing to lift
    if any(OUR_CALL in context.index.facts(b).called for b in branches):
        return module  # an earlier run's edit
    params = init.params.params
    if len(branches) != 1:
        why = f"{len(branches)} `if ... ep_size > 1:` branches"
    elif context.moe_class().form == Form.ESFT:
        why = "ESFT form: its moe_ep exchanges rows over the whole world"
    elif len(params) < 2:
        why = "__init__ takes no config"
    else:
        new_init, why = _edited(init, branches[0], params[1].name.value, module, context.index)
        if new_init is not None:
            return replace(module, init, new_init)
    if "expert-parallel" not in features(context.options):
        return module  # said only where expert parallelism is generated: elsewhere ep_size > 1 is refused anyway
    where = f"{context.moe_class().name}.__init__"
    context.chosen.append(f"expert parallelism: {where} left as published (ep_size must equal the world size): {why}")
    return module
