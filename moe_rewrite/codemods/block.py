"""Put the generated code into the file: the module-level statements of the sections the other codemods asked for,
as one block in front of the MoE class, and their MoE-class methods right after its forward()::

    # ---- moe-rewrite 0.4.0 (backend=auto, stacking=stack): training path for DeepseekV3MoE ----
    # Generated code: edit moe_rewrite/runtime/ in moe-rewrite, not this block; a new run regenerates it.
    _moe_rewrite_options = {...}
    # moe_rewrite/runtime/kernels/dispatch.py
    ...                                  # dispatch, route, ...: the sections in runtime/__init__.py SECTION_LIST order,
                                         # each under a comment naming its module (whose docstrings are whole; here
                                         # each keeps its first sentence)

    class DeepseekV3MoE(nn.Module):
        def forward(self, hidden_states): ...

        # moe-rewrite: generated method, regenerated on every run
        def moe_train(self, x, topk_ids, topk_weight): ...

An earlier run's block (removed by `strip` before the other codemods run) and methods are replaced, so a run with
other options rewrites them and a run with the same options changes nothing. A later section's method replaces an
earlier one of the same name (per_expert.py's moe_rewrite_expert_weights replaces fusing.py's).
"""

from __future__ import annotations

import libcst as cst

from moe_rewrite.codemods.kit import GENERATED_PREFIXES, Context, Field, is_generated_method, marked
from moe_rewrite.codemods.kit.index import Index
from moe_rewrite.render import banner_lines, ordered, section_path

BANNER = "# ---- moe-rewrite"  # the first line above the generated block (render.banner_lines)
READS: tuple[Field, ...] = ("moe", "projections")
PROVIDES: tuple[Field, ...] = ()


def _is_generated(stmt: cst.BaseStatement) -> bool:
    names: list[str] = []
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        names.append(stmt.name.value)
    elif isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                names += [t.target.value for t in small.targets if isinstance(t.target, cst.Name)]
    return bool(names) and all(n.startswith(GENERATED_PREFIXES) for n in names)


def _generated_block(module: cst.Module) -> set[int]:
    """ids of the statements of an earlier run's block: from the one under the banner on, while their names are
    generated ones. A name with the generated prefix elsewhere in the file is the user's and stays."""
    found: set[int] = set()
    inside = False
    for stmt in module.body:
        if any(line.comment and line.comment.value.startswith(BANNER) for line in getattr(stmt, "leading_lines", ())):
            inside = True
        inside = inside and _is_generated(stmt)
        if inside:
            found.add(id(stmt))
    return found


def strip(module: cst.Module) -> cst.Module:
    """The module without an earlier run's generated block. rewrite.py calls it before the other codemods: the block
    is most of a rewritten file, and none of them has anything to do in it."""
    generated = _generated_block(module)
    return module.with_changes(body=[stmt for stmt in module.body if id(stmt) not in generated])


def _with_methods(moe: cst.ClassDef, methods: list[cst.FunctionDef], index: Index) -> cst.ClassDef:
    """The class with the generated methods right after its forward (replacing earlier ones)."""
    body: list[cst.BaseStatement] = []
    for stmt in moe.body.body:
        if is_generated_method(stmt, index):
            continue
        body.append(stmt)
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
            body += methods
    return moe.with_changes(body=moe.body.with_changes(body=body))


def transform(module: cst.Module, context: Context) -> cst.Module:
    moe = context.moe_class()
    names = ordered(context.sections)
    sections = [context.section(name, module) for name in names]
    statements: list[cst.BaseStatement] = []
    for name, section in zip(names, sections):
        if section.statements:  # two blank lines between top-level definitions, then where the section's source is
            source = cst.EmptyLine(indent=False, comment=cst.Comment(f"# moe_rewrite/{section_path(name)}"))
            leading = [cst.EmptyLine(indent=False)] * 2 + [source]
            if not statements:
                leading = banner_lines(moe.name, context.options) + [source]
            statements.append(section.statements[0].with_changes(leading_lines=leading))
            statements += section.statements[1:]
    methods = {method.name.value: marked(method) for section in sections for method in section.moe_methods}
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == moe.name:
            body += [*statements, _with_methods(stmt, list(methods.values()), context.index)]
        else:
            body.append(stmt)
    return module.with_changes(body=body)
