"""What the codemods share while one file is rewritten: `Context` and the dataclasses it holds, and `Codemod`, the
interface every codemod module has."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from typing import Literal, Protocol

import libcst as cst

from moe_rewrite import __version__
from moe_rewrite.codemods.kit.index import Index
from moe_rewrite.errors import InternalError, RewriteError
from moe_rewrite.options import RewriteOptions
from moe_rewrite.render import Section, features, render_section


class Form(str, Enum):
    """The MoE forward's form (docs/forms.md), by the name RewriteResult.form and the CLI's summary give it."""

    V3 = "v3"  # `if not self.training:` calls moe_infer; training gets an else calling moe_train (V3, Kimi)
    V2 = "v2"  # `if self.training:` loops over the experts (V2; V1, whose moe_infer takes flat ids, too)
    ESFT = "esft"  # one loop for training and eval under `if self.ep_size == 1:` (ESFT, no moe_infer)


@dataclass
class MoeClassInfo:
    """The file's MoE class, as moe_forward found it."""

    name: str
    gate_class: str | None
    form: Form


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


@dataclass(frozen=True)
class Note:
    """What a whole-model codemod did with one class or function, or left as published and why: one summary line
    (`str`). The CLI prints a note left as published always, one rewritten with -v; a codemod reads another's notes
    by these fields, never by their text."""

    concern: str  # what it is about: "attention", "attention mask", "loss", "norm", "rope"
    subject: str  # the class or function (for a rewritten note, those rewritten, ", "-joined)
    rewritten: bool  # False: left as published
    why: str  # why it was left as published, or (rewritten) the whole line after the concern: what was done

    def __str__(self) -> str:
        if self.rewritten:
            return f"{self.concern}: {self.why}"
        return f"{self.concern}: {self.subject} left as published: {self.why}"


# the Context fields one codemod fills for the later ones (notes: each codemod appends its own), in READS / PROVIDES
Field = Literal["moe", "projections", "compat", "notes", "sdpa_classes"]
# the Context's shared parts, which every codemod may use without declaring them
SHARED = frozenset({"options", "sections", "chosen", "rendered", "index", "need_per_expert_layers"})
# the Context's methods that read a Field (they raise InternalError where no codemod filled it yet)
ACCESSORS: dict[str, Field] = {
    "moe_class": "moe",
    "expert_projections": "projections",
    "section": "projections",
    "compat_changes": "compat",
    "sdpa_selected": "sdpa_classes",
}


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
    # what the whole-model codemods (attention, attention_mask, lm_loss, rmsnorm, rope) did or left, in CODEMODS order
    notes: list[Note] = field(default_factory=list)
    # filled by attention: the classes "sdpa" selects, rewritten to run SDPA (None before attention runs)
    sdpa_classes: tuple[str, ...] | None = None
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
        if self.options.expert_parallel:
            raise RewriteError(f"{why}; expert parallelism needs fused experts: rewrite without --expert-parallel")
        if self.options.fuse_experts is None:
            chosen = dataclasses.replace(self.options, fuse_experts=False)
            # what the sections are rendered with: the options dict, and the features they generate
            if (chosen.as_dict(__version__), features(chosen)) != (
                self.options.as_dict(__version__),
                features(self.options),
            ):
                self.rendered.clear()
            self.options = chosen
            self.chosen.append(f"experts: per-expert nn.Linear, as with --no-fuse-experts ({why})")

    def moe_class(self) -> MoeClassInfo:
        if self.moe is None:  # CODEMODS' order is checked against READS, so only a bug gets here
            raise InternalError("the MoE class was read before moe_forward found it")
        return self.moe

    def sdpa_selected(self) -> tuple[str, ...]:
        if self.sdpa_classes is None:
            raise InternalError("the SDPA classes were read before the attention codemod ran")
        return self.sdpa_classes

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
