"""The generated code: moe_rewrite/runtime/ holds it as real, importable Python, one file per section in a package per
concern (runtime/__init__.py's SECTION_LIST lists them); this module renders a section into CST nodes for the file
being rewritten.

A section file is a module docstring (for people reading runtime/), imports (so that the file imports, lints and
tests on its own), then the code moe-rewrite copies: module-level statements go into the generated block in front of
the MoE class, and the methods of a placeholder `class MoE:` / `class Model:` go into the file's MoE class / its
PreTrainedModel subclass. The docstring, the imports and the placeholder classes themselves are not copied.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import libcst as cst
import libcst.helpers
import libcst.matchers as m

from moe_rewrite import __version__
from moe_rewrite.options import RewriteOptions
from moe_rewrite.runtime import SECTION_LIST

# Every section of the block, in the order the block holds them: name -> what it does, in one sentence (the import
# fallbacks, which compat.py renders where the file's import fails, are not in the block).
SECTIONS = {entry.name: entry.does for entry in SECTION_LIST if not entry.fallback}
# The core's sections: moe_train and everything it calls, which every rewritten MoE layer needs
CORE_SECTIONS = frozenset(entry.name for entry in SECTION_LIST if entry.core)
PACKAGE_OF = {entry.name: entry.package for entry in SECTION_LIST}  # section -> its package under runtime/
FEATURE_OF = {entry.name: entry.feature for entry in SECTION_LIST}  # section -> the feature it serves (FEATURES)
# What a section may import at module level, since the import is not copied: the names every file moe-rewrite rewrites
# binds (`import torch`; the DeepSeek files bind more, the smallest forms it accepts only torch), and the other
# sections (`from .route import ...`, `from ..kernels.dispatch import ...`), whose code the block holds. Anything else
# goes inside the function.
FILE_IMPORTS = ("import torch",)
OPTIONS_NAME = "_moe_rewrite_options"  # dispatch.py's options dict, filled with the rewrite's options
# expert_linears.py's (gate, up, down) projection names, filled with the file's experts' own (Kimi's w1, w3, w2)
PROJECTIONS_NAME = "MOE_REWRITE_PROJECTIONS"
PLACEHOLDERS = ("MoE", "Model")
# Code generated only where the model can use it. A section's Entry.feature, or a comment line right above a statement
# (at any depth) `# generated with: FEATURE` / `# generated without: FEATURE`, ties it to a feature the options turn on
# (features()); elsewhere it is left out of the rewritten file (the runtime modules themselves hold all of it).
FEATURES = ("fp8-experts", "expert-parallel", "expert-casts")
FEATURE_TAGS = {
    f"# generated {how}: {feature}": (how == "with", feature) for feature in FEATURES for how in ("with", "without")
}


# The generated copy's docstrings keep their first sentence: the runtime module holds the whole text, and the user's
# file says where (block.py's comment above each section). A sentence ends at a period before a capital, a quote, a
# backquote or a parenthesis, or at the docstring's end.
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!\.\.)\.(?=\s+[A-Z(`\"]|\s*$)")


@dataclass(frozen=True)
class Section:
    statements: list[cst.BaseStatement]  # module-level, for the generated block
    moe_methods: list[cst.FunctionDef]  # for the MoE class
    model_methods: list[cst.FunctionDef]  # for the PreTrainedModel subclass


RUNTIME_DIR = Path(__file__).parent / "runtime"  # the sections, one module each, in a package per concern


def section_path(name: str) -> str:
    """Section `name`'s file relative to RUNTIME_DIR's parent, e.g. runtime/moe/route.py."""
    return f"runtime/{PACKAGE_OF[name]}/{name}.py"


def section_file(name: str) -> Path:
    return RUNTIME_DIR.parent / section_path(name)


@lru_cache(maxsize=None)
def load_section(name: str) -> str:
    return section_file(name).read_text(encoding="utf-8")


def _is_header(stmt: cst.BaseStatement) -> bool:
    """The section's docstring and imports: there for the section as a module, not copied."""
    return m.matches(stmt, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom() | m.Expr(m.SimpleString())]))


def imported_section(name: str, node: cst.ImportFrom) -> str | None:
    """The section that section `name`'s relative import names (`from .route import ...` in its own package,
    `from ..kernels.dispatch import ...` in another), or None where it names no section."""
    if not node.relative or node.module is None or len(node.relative) > 2:
        return None
    parts = cst.helpers.get_full_name_for_node(node.module).split(".")
    target = [PACKAGE_OF[name], *parts] if len(node.relative) == 1 else parts  # under runtime/
    if len(target) == 2 and PACKAGE_OF.get(target[1]) == target[0]:
        return target[1]
    return None


def _check_import(name: str, stmt: cst.SimpleStatementLine, module: cst.Module) -> None:
    node = stmt.body[0]
    if isinstance(node, cst.ImportFrom) and imported_section(name, node) is not None:
        return
    code = module.code_for_node(node)
    if isinstance(node, (cst.Import, cst.ImportFrom)) and code not in FILE_IMPORTS:
        raise ValueError(
            f"{section_path(name)}: `{code}` would not be in the rewritten file (module-level imports are not copied, "
            f"and the file is known to have only {', '.join(FILE_IMPORTS)}): import it inside the function using it"
        )


def _methods(cls: cst.ClassDef) -> list[cst.FunctionDef]:
    """A placeholder class's methods, each preceded by one blank line as methods are."""
    return [
        cst.ensure_type(method, cst.FunctionDef).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        for method in cls.body.body
    ]


def features(options: RewriteOptions) -> frozenset[str]:
    """The features whose code a rewrite with these (decided) options generates: FP8 experts where asked
    (fp8_experts), expert parallelism where asked (expert_parallel) and the experts fuse, the experts' dtype check
    where their forward casts x to their weights' dtype (expert_casts)."""
    on = {"fp8-experts"} if options.fp8_experts else set()
    if options.expert_casts:
        on.add("expert-casts")
    if options.expert_parallel and options.fuse_experts is not False:
        on.add("expert-parallel")
    return frozenset(on)


def generated(name: str, options: RewriteOptions) -> bool:
    """Whether section `name` is generated with these options (its feature, if it has one, is on)."""
    feature = FEATURE_OF[name]
    return feature is None or feature in features(options)


def _feature_tag(stmt: cst.CSTNode) -> tuple[bool, str] | None:
    """(with, feature) of the statement's `# generated with(out): FEATURE` line, or None."""
    for line in getattr(stmt, "leading_lines", ()):
        if line.comment is not None and line.comment.value in FEATURE_TAGS:
            return FEATURE_TAGS[line.comment.value]
    return None


class _FeatureFilter(cst.CSTTransformer):
    """Drops the statements tagged for a feature that is off (or, `without`, on) from every block."""

    def __init__(self, name: str, on: frozenset[str]):
        self.name, self.on = name, on

    def kept(self, body):
        kept = [s for s in body if (tag := _feature_tag(s)) is None or (tag[1] in self.on) == tag[0]]
        if body and not kept:
            raise ValueError(f"{section_path(self.name)}: a block holds only statements of a feature that is off")
        return kept

    def leave_IndentedBlock(self, original_node, updated_node):
        return updated_node.with_changes(body=self.kept(updated_node.body))

    def leave_Module(self, original_node, updated_node):
        return updated_node.with_changes(body=self.kept(updated_node.body))


def first_sentence(docstring: str) -> str:
    """A triple-quoted docstring literal cut after its first sentence (unchanged where that is all of it)."""
    quote = docstring[-3:]
    start = docstring.index(quote) + 3
    body = docstring[start:-3]
    end = SENTENCE_END.search(body)
    if end is None or not body[end.end() :].strip():
        return docstring
    return docstring[:start] + body[: end.end()].rstrip() + quote


class _FirstSentences(cst.CSTTransformer):
    """Every function's and class's docstring cut to its first sentence (first_sentence)."""

    def _cut(self, node):
        body = node.body
        if not isinstance(body, cst.IndentedBlock) or not body.body:
            return node
        first = body.body[0]
        if not m.matches(first, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])):
            return node
        string = cst.ensure_type(cst.ensure_type(first, cst.SimpleStatementLine).body[0], cst.Expr).value
        literal = cst.ensure_type(string, cst.SimpleString).value
        if not literal.endswith(('"""', "'''")):
            return node
        cut = first_sentence(literal)
        if cut == literal:
            return node
        line = first.with_changes(body=[cst.Expr(cst.SimpleString(cut))])  # type: ignore[attr-defined]
        return node.with_changes(body=body.with_changes(body=[line, *body.body[1:]]))

    def leave_FunctionDef(self, original_node, updated_node):
        return self._cut(updated_node)

    def leave_ClassDef(self, original_node, updated_node):
        return self._cut(updated_node)


def render_section(
    name: str,
    module: cst.Module,
    options: RewriteOptions | None = None,
    projections: tuple[str, str, str] | None = None,
) -> Section:
    """Section `name` parsed with the target module's newline and indentation; with `options`, dispatch's options dict
    holds them and the statements of features they leave off are left out (FEATURES); with `projections`,
    MOE_REWRITE_PROJECTIONS names the file's expert projections."""
    text = load_section(name).replace("\n", module.default_newline)
    parsed = cst.parse_module(text, config=module.config_for_parsing)
    if options is not None and any(tag in text for tag in FEATURE_TAGS):
        parsed = parsed.visit(_FeatureFilter(name, features(options)))
    parsed = parsed.visit(_FirstSentences())
    statements, methods = [], {placeholder: [] for placeholder in PLACEHOLDERS}
    for stmt in parsed.body:
        if _is_header(stmt):
            _check_import(name, cst.ensure_type(stmt, cst.SimpleStatementLine), parsed)
            continue
        if isinstance(stmt, cst.ClassDef) and stmt.name.value in PLACEHOLDERS:
            methods[stmt.name.value] += _methods(stmt)
            continue
        if options is not None and m.matches(
            stmt, m.SimpleStatementLine(body=[m.Assign([m.AssignTarget(m.Name(OPTIONS_NAME))])])
        ):
            assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
            stmt = stmt.with_changes(body=[assign.with_changes(value=options_literal(options))])  # type: ignore[attr-defined]
        if projections is not None and m.matches(
            stmt, m.SimpleStatementLine(body=[m.Assign([m.AssignTarget(m.Name(PROJECTIONS_NAME))])])
        ):
            assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
            quoted = ", ".join(f'"{name}"' for name in projections)  # identifiers: no escaping needed
            names = cst.ensure_type(cst.parse_expression(f"({quoted})"), cst.Tuple)
            stmt = stmt.with_changes(body=[assign.with_changes(value=names)])  # type: ignore[attr-defined]
        statements.append(stmt)
    if statements:  # the blank lines after the section's imports are not the code's
        statements[0] = statements[0].with_changes(leading_lines=[])
    return Section(statements, methods["MoE"], methods["Model"])


def render_statements(name: str, module: cst.Module) -> list[cst.BaseStatement]:
    """A section's module-level statements, rendered for `module`."""
    return render_section(name, module).statements


def options_literal(options: RewriteOptions) -> cst.Dict:
    text = json.dumps(options.as_dict(__version__))
    return cst.ensure_type(cst.parse_expression(text), cst.Dict)


def ordered(sections: set[str]) -> list[str]:
    return [name for name in SECTIONS if name in sections]


def banner_lines(moe_class: str, options: RewriteOptions) -> list[cst.EmptyLine]:
    comments = [
        f"# ---- moe-rewrite {__version__} ({options.describe()}): training path for {moe_class} ----",
        "# Generated code: edit moe_rewrite/runtime/ in moe-rewrite, not this block; a new run regenerates it.",
    ]
    return [cst.EmptyLine(), cst.EmptyLine()] + [cst.EmptyLine(comment=cst.Comment(c)) for c in comments]
