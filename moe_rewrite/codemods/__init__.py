"""The rewrites, one module each, all with one interface (`Codemod`): `transform(module, context) -> module`, and
READS / PROVIDES, the Context fields it reads and the ones it fills (rewrite.py checks the order of its CODEMODS list
against them on import).

Each edits the syntax tree and names, in `context.sections`, the runtime sections its edits call (render.SECTIONS);
the last one, `block`, puts those sections' code into the file. `context.index` answers what a file holds without a
walk of the whole tree per question (index.py). Everything moe-rewrite generates carries the marker MARK (see
`is_marked`), so a later run finds and replaces it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, Protocol, TypeVar

import libcst as cst
import libcst.matchers as m

from moe_rewrite import __version__
from moe_rewrite.codemods.index import Index
from moe_rewrite.errors import InternalError, RewriteError
from moe_rewrite.options import RewriteOptions
from moe_rewrite.render import Section, render_section

MARK = "# moe-rewrite"  # starts the comment on (or just above) every generated statement, method and block
METHOD_MARK = "# moe-rewrite: generated method, regenerated on every run"
LEGACY_CALLS = {
    "_moe_rewrite_fuse_model",
    "_moe_rewrite_unfuse_state_dict",
}  # moe-rewrite 0.2's model methods call them
GENERATED_PREFIXES = ("MOE_REWRITE_", "_moe_rewrite_", "_MoeRewrite")  # the generated block's module-level names


@dataclass
class MoeClassInfo:
    """The file's MoE class, as moe_forward found it."""

    name: str
    gate_class: str | None
    form: str  # "v3", "v2" or "esft"


@dataclass
class CompatChanges:
    """What the compat codemod changed, for the summary."""

    imports: list[str] = field(default_factory=list)  # the guarded names
    cache_calls: int = 0
    rope_scaling_reads: int = 0
    position_ids: list[str] = field(default_factory=list)  # classes whose generation position ids are sliced
    generation_mixin: list[str] = field(default_factory=list)  # classes given GenerationMixin
    tied_keys: list[str] = field(default_factory=list)  # classes whose _tied_weights_keys became a dict

    def describe(self) -> str:
        """'compat: 2 imports guarded, 7 Cache calls, GenerationMixin on X' or '' when nothing changed."""
        parts = []
        if self.imports:
            parts.append(f"{len(self.imports)} import{'s' if len(self.imports) != 1 else ''} guarded")
        if self.cache_calls:
            parts.append(f"{self.cache_calls} Cache call{'s' if self.cache_calls != 1 else ''}")
        if self.rope_scaling_reads:
            parts.append(f"{self.rope_scaling_reads} rope_scaling read{'s' if self.rope_scaling_reads != 1 else ''}")
        if self.position_ids:
            parts.append(f"generation position_ids sliced in {', '.join(self.position_ids)}")
        if self.generation_mixin:
            parts.append(f"GenerationMixin on {', '.join(self.generation_mixin)}")
        if self.tied_keys:
            parts.append(f"_tied_weights_keys as a dict in {', '.join(self.tied_keys)}")
        return f"compat: {', '.join(parts)}" if parts else ""


# the Context fields one codemod fills for the later ones
Field = Literal["moe", "projections", "compat", "attention", "loss", "norm", "rope"]


@dataclass
class Context:
    """What the codemods share while one file is rewritten."""

    options: RewriteOptions  # the caller's, with what the file's form chose (need_per_expert_layers)
    sections: set[str] = field(default_factory=set)  # runtime sections the generated block must hold
    chosen: list[str] = field(default_factory=list)  # the options chosen for the file, a summary line each
    moe: MoeClassInfo | None = None  # filled by moe_forward
    # filled by expert_mlp: the routed experts' (gate, up, down) projection names, read from their forward's use
    projections: tuple[str, str, str] | None = None
    compat: CompatChanges | None = None  # filled by compat
    attention: list[str] | None = None  # filled by attention: its summary lines
    loss: list[str] | None = None  # filled by lm_loss: its summary lines
    norm: list[str] | None = None  # filled by rmsnorm: its summary lines
    sdpa_classes: list[str] = field(default_factory=list)  # filled by attention: the classes "sdpa" selects (rewritten)
    rope: list[str] | None = None  # filled by rope: its summary lines
    rendered: dict[str, Section] = field(default_factory=dict)
    index: Index = field(default_factory=Index)

    def section(self, name: str, module: cst.Module) -> Section:
        """Section `name` rendered for this file, once per rewrite (fused_experts takes its model methods, block the
        rest)."""
        if name not in self.rendered:
            self.rendered[name] = _rendered(name, module.config_for_parsing, self.options, self.expert_projections())
        return self.rendered[name]

    def expert_projections(self) -> tuple[str, str, str]:
        if self.projections is None:
            raise InternalError("the experts' projections were read before expert_mlp proved them")
        return self.projections

    def need_per_expert_layers(self, why: str) -> None:
        """The file cannot have fused experts (`why`, "Class.method: reason"): --no-fuse-experts is chosen for it
        where the caller left the layout to moe-rewrite, said in the summary and written into the banner (so that a
        second run is a no-op); where the caller asked for fused experts, the file is refused."""
        if self.options.fuse_experts:
            raise RewriteError(f"{why}; rewrite with --no-fuse-experts")
        if self.options.fuse_experts is None:
            chosen = dataclasses.replace(self.options, fuse_experts=False)
            if chosen.as_dict(__version__) != self.options.as_dict(__version__):  # what the sections are rendered with
                self.rendered.clear()
            self.options = chosen
            self.chosen.append(f"experts: per-expert nn.Linear, as with --no-fuse-experts ({why})")

    def moe_class(self) -> MoeClassInfo:
        if self.moe is None:  # CODEMODS' order is checked against READS, so only a bug gets here
            raise InternalError("the MoE class was read before moe_forward found it")
        return self.moe

    def attention_lines(self) -> list[str]:
        if self.attention is None:
            raise InternalError("the attention lines were read before the attention codemod ran")
        return self.attention

    def loss_lines(self) -> list[str]:
        if self.loss is None:
            raise InternalError("the loss lines were read before the lm_loss codemod ran")
        return self.loss

    def norm_lines(self) -> list[str]:
        if self.norm is None:
            raise InternalError("the norm lines were read before the rmsnorm codemod ran")
        return self.norm

    def rope_lines(self) -> list[str]:
        if self.rope is None:
            raise InternalError("the rope lines were read before the rope codemod ran")
        return self.rope

    def compat_changes(self) -> CompatChanges:
        if self.compat is None:
            raise InternalError("the compat changes were read before the compat codemod ran")
        return self.compat


@lru_cache(maxsize=256)
def _rendered(
    name: str, config: cst.PartialParserConfig, options: RewriteOptions, projections: tuple[str, str, str]
) -> Section:
    """A section rendered for files with this newline, indentation and encoding: parsing the sections is a fifth of
    a rewrite, and their nodes, immutable, can be shared between rewrites."""
    layout = cst.Module(
        body=[], encoding=config.encoding, default_indent=config.default_indent, default_newline=config.default_newline
    )
    return render_section(name, layout, options, projections)


class Codemod(Protocol):
    """One rewrite: a module with these three names."""

    READS: tuple[Field, ...]  # Context fields it reads, which an earlier codemod must provide
    PROVIDES: tuple[Field, ...]  # Context fields it fills

    def transform(self, module: cst.Module, context: Context) -> cst.Module: ...


def code(node: cst.CSTNode) -> str:
    """A node's source text (a statement's with its leading comment lines)."""
    return cst.Module(body=[]).code_for_node(node)


def first_line(node: cst.CSTNode) -> str:
    """A statement's first line of code (its comments skipped), ` ...` after it where more follow."""
    lines = [line.strip() for line in code(node).splitlines() if line.strip() and not line.strip().startswith("#")]
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""


def is_marked_branch(stmt: cst.CSTNode, note: str, call: str) -> bool:
    """Whether `stmt` is a branch an earlier run put in: an `if` under the `note` comment whose body calls `call`."""
    return (
        isinstance(stmt, cst.If)
        and any(line.comment is not None and line.comment.value == note for line in stmt.leading_lines)
        and bool(m.findall(stmt.body, m.Call(func=m.Name(call))))
    )


def unbranched(function: cst.FunctionDef, note: str, call: str) -> cst.FunctionDef:
    """`function` with each marked branch taken back: a first-statement branch (no else) removed, an if/else branch
    replaced by the published statements kept in its else (their first one gets the branch's other comments back)."""
    if not isinstance(function.body, cst.IndentedBlock):
        return function
    statements = function.body.body
    if not any(is_marked_branch(s, note, call) for s in statements):
        return function
    body: list[cst.BaseStatement] = []
    for stmt in statements:
        if not is_marked_branch(stmt, note, call):
            body.append(stmt)
            continue
        branch = cst.ensure_type(stmt, cst.If)
        if not isinstance(branch.orelse, cst.Else):
            continue
        published = list(cst.ensure_type(branch.orelse.body, cst.IndentedBlock).body)
        lines = [line for line in branch.leading_lines if not (line.comment and line.comment.value == note)]
        body += [published[0].with_changes(leading_lines=lines), *published[1:]]
    return function.with_changes(body=function.body.with_changes(body=body))


def single_method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    """The class's method `name` where it defines exactly one (none, or a second definition: None)."""
    found = [s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name]
    return found[0] if len(found) == 1 else None


def reads(node: cst.CSTNode, name: str) -> bool:
    """Whether `node` reads `name` (any use but as the plain target of an assignment)."""
    stores = m.findall(node, m.AssignTarget(target=m.Name(name)))
    return len(m.findall(node, m.Name(name))) > len(stores)


def one_line(node: cst.CSTNode) -> str:
    """A statement or expression on one line (its first line, then ` ...`), for an error message."""
    text = cst.Module(body=[]).code_for_node(node).strip()
    return " ".join(text.split("\n")[0].split()) + (" ..." if "\n" in text else "")


def top_classes(module: cst.Module) -> dict[str, cst.ClassDef]:
    """The file's top-level classes by name."""
    return {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}


def in_file_lineage(cls: cst.ClassDef, module: cst.Module) -> list[cst.ClassDef]:
    """The class and its bases defined in the file, nearest first."""
    classes = top_classes(module)
    lineage, todo = [], [cls]
    while todo:
        current = todo.pop(0)
        if current in lineage:
            continue
        lineage.append(current)
        todo += [
            classes[b.value.value] for b in current.bases if isinstance(b.value, cst.Name) and b.value.value in classes
        ]
    return lineage


def class_methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    """A class's own methods by name (not its bases')."""
    return {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}


def body_lines(fn: cst.FunctionDef, where: str) -> list[cst.BaseStatement]:
    """The statements of a function a codemod edits; one written on its `def` line (`def f(self): return x`) is
    refused by name, as the edits go on lines of their own."""
    if not isinstance(fn.body, cst.IndentedBlock):
        raise RewriteError(f"{where}: its body is on the `def` line; put it on lines of its own to rewrite the file")
    return list(fn.body.body)


def _comments(node: cst.CSTNode) -> list[str]:
    """The comments on a statement's own lines: above it, at the end of its line, or after its header's colon."""
    found = [line.comment.value for line in getattr(node, "leading_lines", ()) if line.comment]
    trailing = getattr(node, "trailing_whitespace", None)
    body = getattr(node, "body", None)
    header = getattr(body, "header", None) if isinstance(body, cst.IndentedBlock) else None
    for whitespace in (trailing, header):
        if whitespace is not None and whitespace.comment is not None:
            found.append(whitespace.comment.value)
    return found


def is_marked(node: cst.CSTNode) -> bool:
    """Whether moe-rewrite generated this statement (its marker comment is there)."""
    return any(comment.startswith(MARK) for comment in _comments(node))


def marked(method: cst.FunctionDef) -> cst.FunctionDef:
    """A generated method, with a blank line and the marker above it."""
    return method.with_changes(
        leading_lines=[cst.EmptyLine(indent=False), cst.EmptyLine(comment=cst.Comment(METHOD_MARK))]
    )


def is_generated_method(stmt: cst.BaseStatement, index: Index | None = None) -> bool:
    """A generated method: marked, or written by moe-rewrite 0.2 (no marker then: named moe_train or moe_rewrite_*
    in the MoE class, or in a model class documented "(generated by moe-rewrite)" or calling its helpers)."""
    if not isinstance(stmt, cst.FunctionDef):
        return False
    legacy_name = stmt.name.value == "moe_train" or stmt.name.value.startswith("moe_rewrite_")
    legacy_doc = "(generated by moe-rewrite)" in " ".join((stmt.get_docstring() or "").split())
    legacy_call = bool((index or Index()).facts(stmt).called & LEGACY_CALLS)
    return is_marked(stmt) or legacy_name or legacy_doc or legacy_call


Block = TypeVar("Block", cst.Module, cst.IndentedBlock)


def replace(module: cst.Module, old: cst.CSTNode, new: cst.CSTNode) -> cst.Module:
    """module.deep_replace(old, new) for a statement at the top level, in a top-level class or in one of its methods,
    looking only at those statements (deep_replace rebuilds every node of the file: most of a rewrite's time)."""

    def swapped(block: Block) -> Block:
        return block.with_changes(body=[new if s is old else s for s in block.body])

    for stmt in module.body:
        if stmt is old:
            return swapped(module)
        if not isinstance(stmt, cst.ClassDef) or not isinstance(stmt.body, cst.IndentedBlock):
            continue
        for member in stmt.body.body:
            if member is old:
                return replace(module, stmt, stmt.with_changes(body=swapped(stmt.body)))
            if isinstance(member, cst.FunctionDef) and isinstance(member.body, cst.IndentedBlock):
                if any(s is old for s in member.body.body):
                    return replace(module, member, member.with_changes(body=swapped(member.body)))
    return cst.ensure_type(module.deep_replace(old, new), cst.Module)
