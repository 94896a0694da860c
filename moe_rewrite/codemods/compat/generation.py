"""What generate() needs on transformers 4.50 and later: GenerationMixin as a base of the classes that define
prepare_inputs_for_generation (and its import), and generate()'s position ids cut to the uncached tokens."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.compat.imports import module_name
from moe_rewrite.codemods.kit import MARK, CompatChanges, Index, body_lines, replace
from moe_rewrite.errors import RewriteError

MIXIN_IMPORT = (
    "from transformers.generation import GenerationMixin  # moe-rewrite: generate() needs it since transformers 4.50\n"
)
POSITION_IDS_HELPER = "_moe_rewrite_generation_position_ids"
POSITION_IDS_GET = m.Call(
    func=m.Attribute(value=m.Name("kwargs"), attr=m.Name("get")),
    args=[
        m.Arg(m.SimpleString('"position_ids"') | m.SimpleString("'position_ids'")),
        m.ZeroOrOne(m.Arg(m.Name("None"))),
    ],
)


def is_our_mixin_import(stmt: cst.CSTNode) -> bool:
    return (
        m.matches(
            stmt, m.SimpleStatementLine(body=[m.ImportFrom(names=[m.ImportAlias(name=m.Name("GenerationMixin"))])])
        )
        and stmt.trailing_whitespace.comment is not None  # type: ignore[attr-defined]
        and stmt.trailing_whitespace.comment.value.startswith(MARK)  # type: ignore[attr-defined]
    )


def add_generation_mixin(module: cst.Module, changes: CompatChanges, index: Index) -> cst.Module:
    generating = {
        id(s)
        for s in module.body
        if isinstance(s, cst.ClassDef)
        and s.bases
        and any(m.matches(f, m.FunctionDef(name=m.Name("prepare_inputs_for_generation"))) for f in s.body.body)
        and not any(
            m.matches(b.value, m.Name("GenerationMixin") | m.Attribute(attr=m.Name("GenerationMixin"))) for b in s.bases
        )
    }
    if not generating:
        return module
    if index.count(module, "GenerationMixin"):
        raise RewriteError(
            "compat: the file names GenerationMixin already, but not as a base of its generating classes"
        )
    body: list[cst.BaseStatement] = []
    last_import = max(i for i, s in enumerate(module.body) if _imports_transformers(s, index))
    for i, stmt in enumerate(module.body):
        if id(stmt) in generating:
            assert isinstance(stmt, cst.ClassDef)
            bases = [*stmt.bases]
            bases[-1] = bases[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            stmt = stmt.with_changes(bases=[*bases, cst.Arg(cst.Name("GenerationMixin"))])
            changes.generation_mixin.append(stmt.name.value)
        body.append(stmt)
        if i == last_import:
            body.append(
                cst.parse_statement(
                    MIXIN_IMPORT.replace("\n", module.default_newline), config=module.config_for_parsing
                )
            )
    return module.with_changes(body=body)


def _imports_transformers(stmt: cst.CSTNode, index: Index) -> bool:
    """A top-level `from transformers... import` line, or one of our guarded ones."""
    return isinstance(stmt, (cst.SimpleStatementLine, cst.Try)) and any(
        module_name(n).split(".")[0] == "transformers" for n in index.facts(stmt).imports
    )


def slice_generation_position_ids(module: cst.Module, changes: CompatChanges) -> cst.Module:
    """In prepare_inputs_for_generation, `kwargs.get("position_ids", None)` -> the helper that cuts generate()'s
    position ids to the uncached tokens; only where the get comes after every statement that assigns input_ids (the
    file's own slicing), so the helper sees the tokens the model is given."""
    for cls in [s for s in module.body if isinstance(s, cst.ClassDef)]:
        for fn in cls.body.body:
            if not m.matches(fn, m.FunctionDef(name=m.Name("prepare_inputs_for_generation"))):
                continue
            fn = cst.ensure_type(fn, cst.FunctionDef)
            if not m.findall(fn, POSITION_IDS_GET):
                continue
            body = body_lines(fn, f"compat: {cls.name.value}.prepare_inputs_for_generation")
            gets = [i for i, s in enumerate(body) if m.findall(s, POSITION_IDS_GET)]
            slicing = [i for i, s in enumerate(body) if m.findall(s, m.AssignTarget(target=m.Name("input_ids")))]
            if len(gets) != 1 or (slicing and max(slicing) > gets[0]):
                continue
            stmt = body[gets[0]]
            new = cst.ensure_type(
                m.replace(
                    stmt,
                    POSITION_IDS_GET,
                    lambda node, _: cst.Call(
                        func=cst.Name(POSITION_IDS_HELPER),
                        args=[
                            cst.Arg(node, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                            cst.Arg(cst.Name("input_ids")),
                        ],  # type: ignore[arg-type]
                    ),
                ),
                cst.BaseStatement,
            )
            module = replace(module, stmt, new)
            changes.position_ids.append(cls.name.value)
    return module
