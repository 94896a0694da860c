"""No 4-D mask where SDPA's causal kernel computes the same (with the attention codemod; off with --no-sdpa).

The published Model forward always builds the additive (batch, 1, query, key) mask, so every layer's SDPA call takes
the masked kernel (cuDNN: 5.3 ms against 1.5 causal at 2 x 4096 tokens, bench/e2e/PLAN.md). The call gets a wrapper
that returns None, which _moe_rewrite_attention runs as causal, exactly where that mask is causal only and every layer
runs SDPA; everywhere else it calls the file's own function with the same arguments::

    # Before
    attention_mask = _prepare_4d_causal_attention_mask(
        attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length
    )
    # After
    # moe-rewrite: no mask where SDPA runs causal-only; the file's own mask otherwise
    attention_mask = _moe_rewrite_sdpa_mask(
        _prepare_4d_causal_attention_mask,
        self.config,
        output_attentions,
        attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length
    )

Proven first: the statement assigns the forward's own mask parameter from transformers'
`_prepare_4d_causal_attention_mask` (imported, or the compat codemod's copy of it), called with four positional
arguments, the first that parameter; the class is a PreTrainedModel's; after the call the mask goes untouched to the
proven attention cores (mask_flow.py: only passed on, Model -> decoder layer -> attention, which reads it only in its
core; a window, arithmetic, an in-place edit or a raise without it on the way would see None). And only where the
attention codemod rewrote the attention every "sdpa" load selects, and left no attention class as published: a None mask
would reach the published core's `assert attention_mask is not None`. Otherwise the call stays as published, with a
summary line. Every run first takes back an earlier one's wrapper (--no-sdpa gives the published call back).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import (
    MARK,
    Context,
    Field,
    Index,
    Note,
    class_methods,
    is_marked,
    one_line,
    replace,
    top_classes,
    walk,
)
from moe_rewrite.codemods.model import attention, packing
from moe_rewrite.codemods.model.attention import PRETRAINED_BASE
from moe_rewrite.codemods.model.mask_flow import Chain

READS: tuple[Field, ...] = ("notes", "sdpa_classes")  # the attention codemod's
PROVIDES: tuple[Field, ...] = ("notes",)
CONCERN = "attention mask"  # its notes' concern

BUILD = "_prepare_4d_causal_attention_mask"
BUILD_MODULE = "transformers.modeling_attn_mask_utils"
OUR_CALL = "_moe_rewrite_sdpa_mask"
NOTE = f"{MARK}: no mask where SDPA runs causal-only; the file's own mask otherwise"
ADDED = ("self.config", "output_attentions")  # after the file's function, before its own arguments
MASK_CALL = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call(func=m.Name()))])

FX_WRAP = m.Call(
    func=m.Attribute(value=m.Attribute(value=m.Name("torch"), attr=m.Name("fx")), attr=m.Name("wrap")),
    args=[m.Arg(value=m.Name(BUILD), keyword=None)],
)
FX_WRAPPED = m.Assign(targets=[m.AssignTarget(m.Name(BUILD))], value=FX_WRAP)  # `BUILD = torch.fx.wrap(BUILD)`
BINDINGS = (cst.AssignTarget, cst.AnnAssign, cst.AugAssign, cst.For, cst.AsName)  # nodes whose target binds names


def _assign(stmt: cst.SimpleStatementLine) -> tuple[str, cst.Call]:
    """The target and the call of a MASK_CALL statement."""
    assign = cst.ensure_type(stmt.body[0], cst.Assign)
    return cst.ensure_type(assign.targets[0].target, cst.Name).value, cst.ensure_type(assign.value, cst.Call)


def _ours(stmt: cst.SimpleStatementLine) -> bool:
    """An earlier run's wrapped call: our function, our marker on the line above."""
    called = _assign(stmt)[1].func
    noted = any(line.comment is not None and line.comment.value == NOTE for line in stmt.leading_lines)
    return noted and m.matches(called, m.Name(OUR_CALL)) and len(_assign(stmt)[1].args) == 1 + len(ADDED) + 4


def _published(stmt: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
    """An earlier run's wrapped call as it was published: the file's function called with its own four arguments."""
    assign = cst.ensure_type(stmt.body[0], cst.Assign)
    call = cst.ensure_type(assign.value, cst.Call)
    published = call.with_changes(func=call.args[0].value, args=call.args[1 + len(ADDED) :])
    lines = [line for line in stmt.leading_lines if not (line.comment and line.comment.value == NOTE)]
    return stmt.with_changes(body=[assign.with_changes(value=published)], leading_lines=lines)


def _wrapped(stmt: cst.SimpleStatementLine, module: cst.Module) -> cst.SimpleStatementLine:
    """The call with the file's function, self.config and output_attentions put in front of its own arguments, which
    keep their nodes (and so their formatting, for _published)."""
    assign = cst.ensure_type(stmt.body[0], cst.Assign)
    call = cst.ensure_type(assign.value, cst.Call)
    comma = call.args[0].comma
    if not isinstance(comma, cst.Comma):
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    parse = [cst.parse_expression(text, config=module.config_for_parsing) for text in ADDED]
    added = [cst.Arg(value=value, comma=comma) for value in [call.func, *parse]]
    wrapped = call.with_changes(func=cst.Name(OUR_CALL), args=[*added, *call.args])
    return stmt.with_changes(
        body=[assign.with_changes(value=wrapped)],
        leading_lines=[*stmt.leading_lines, cst.EmptyLine(comment=cst.Comment(NOTE))],
    )


def _calls(forward: cst.FunctionDef, callee: str, index: Index) -> list[cst.SimpleStatementLine]:
    """The forward's statements `NAME = callee(...)`, wherever they are in it (looked for only where it calls
    `callee`)."""
    if callee not in index.facts(forward).called:
        return []
    found = [s for s in walk(forward) if type(s) is cst.SimpleStatementLine and m.matches(s, MASK_CALL)]
    return [s for s in found if m.matches(_assign(cst.ensure_type(s, cst.SimpleStatementLine))[1].func, m.Name(callee))]


def _edited(module: cst.Module, edit) -> cst.Module:
    """The module with `edit(forward) -> forward` applied to every top-level class's forward."""
    for cls in top_classes(module).values():
        forward = class_methods(cls).get("forward")
        if forward is not None:
            new = edit(forward)
            if new is not forward:
                module = replace(module, forward, new)
    return module


def undo(module: cst.Module, index: Index | None = None) -> cst.Module:
    """The module with an earlier run's wrapped calls back as published (and packing.py's edits, which sit on them,
    taken back first)."""
    index = index or Index()
    module = packing.undo(module, index)

    def published(forward: cst.FunctionDef) -> cst.FunctionDef:
        # one at a time: deep_replace makes new nodes
        while ours := [s for s in _calls(forward, OUR_CALL, index) if _ours(s)]:
            forward = cst.ensure_type(forward.deep_replace(ours[0], _published(ours[0])), cst.FunctionDef)
        return forward

    return _edited(module, published)


def _not_imported(module: cst.Module, index: Index) -> str | None:
    """Why the module's `_prepare_4d_causal_attention_mask` may not be transformers' (None when it is): each top-level
    binding is the import from transformers.modeling_attn_mask_utils, the compat codemod's copy in that import's
    marked `except ImportError:`, or `torch.fx.wrap` of itself. Only the statements naming it, or importing `*`, can
    bind it: the others are not looked into."""
    imported = False
    for stmt in module.body:
        facts = index.facts(stmt)
        if BUILD not in facts.names and not any(isinstance(node.names, cst.ImportStar) for node in facts.imports):
            continue
        for node in facts.all_imports:
            names = node.names
            if isinstance(names, cst.ImportStar):
                return f"`{one_line(node)}` may bind `{BUILD}`"
            for alias in names:
                if BUILD in (one_line(alias.name), one_line(alias.asname.name) if alias.asname else ""):
                    exact = isinstance(node, cst.ImportFrom) and not node.relative and alias.asname is None
                    if not (exact and node.module is not None and one_line(node.module) == BUILD_MODULE):
                        return f"`{BUILD}` comes from `{one_line(node)}`"
                    imported = True
        nodes = list(walk(stmt)) if BUILD in facts.names else []
        for fn in nodes if BUILD in facts.functions | facts.classes else ():
            if not isinstance(fn, (cst.FunctionDef, cst.ClassDef)) or fn.name.value != BUILD:
                continue
            compat = [h for h in nodes if type(h) is cst.ExceptHandler and is_marked(h) and _names(h, index)]
            if not any(fn in cst.ensure_type(h, cst.ExceptHandler).body.body for h in compat):
                return f"the file defines `{BUILD}` itself"
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            continue  # names bound in there are their own
        for target in (n for n in nodes if type(n) in BINDINGS):
            bound = getattr(target, "target", None) or getattr(target, "name", None)
            if bound is not None and _names(bound, index):
                wraps = [n for n in nodes if type(n) is cst.Assign and m.matches(n, FX_WRAPPED)]
                if not any(target in cst.ensure_type(w, cst.Assign).targets for w in wraps):
                    return f"the file binds `{BUILD}` in `{one_line(stmt)}`"
    return None if imported else f"`{BUILD}` is not imported from {BUILD_MODULE}"


def _names(node: cst.CSTNode, index: Index) -> bool:
    """Whether a Name `_prepare_4d_causal_attention_mask` is in `node`."""
    return BUILD in index.facts(node).names


def _pretrained(cls: cst.ClassDef, classes: dict[str, cst.ClassDef], seen: frozenset[str] = frozenset()) -> bool:
    """Whether the class derives from PreTrainedModel (directly or through classes of the file)."""
    if any(m.matches(b.value, PRETRAINED_BASE) for b in cls.bases):
        return True
    bases = [b.value.value for b in cls.bases if isinstance(b.value, cst.Name)]
    seen = seen | {cls.name.value}
    return any(b in classes and b not in seen and _pretrained(classes[b], classes, seen) for b in bases)


class _UsesAfter(cst.CSTVisitor):
    """Finds a use of `mask` after `stmt` other than as a call's argument (a keyword's name is not a use)."""

    def __init__(self, stmt: cst.SimpleStatementLine, mask: str) -> None:
        self.stmt, self.mask, self.after, self.skip, self.found = stmt, mask, False, set(), None

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if original_node is self.stmt:
            self.after = True
        super().on_leave(original_node)

    def visit_Arg(self, node: cst.Arg) -> None:
        if m.matches(node.value, m.Name(self.mask)):
            self.skip.add(id(node.value))
        if node.keyword is not None:
            self.skip.add(id(node.keyword))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.skip.add(id(node.attr))

    def visit_Name(self, node: cst.Name) -> None:
        if self.after and self.found is None and node.value == self.mask and id(node) not in self.skip:
            self.found = node


def _prove(forward: cst.FunctionDef, stmt: cst.SimpleStatementLine, model: str, chain: Chain) -> str | None:
    """Why the statement is not the published call, its mask passed untouched to the proven attention cores (None
    when it is)."""
    target, call = _assign(stmt)
    shown = f"`{target} = {BUILD}(...)`"
    params = {p.name.value for p in [*forward.params.params, *forward.params.kwonly_params]}
    if target not in params:
        return f"{shown} does not assign a parameter of forward"
    if "output_attentions" not in params:
        return "forward has no `output_attentions` parameter"
    if len(call.args) != 4 or any(a.keyword is not None or a.star for a in call.args):
        return f"{shown} does not pass four positional arguments"
    if not m.matches(call.args[0].value, m.Name(target)):
        return f"{shown} does not build it from `{target}` itself"
    if len(stmt.body) != 1:
        return f"{shown} shares its line with another statement"
    uses = _UsesAfter(stmt, target)
    forward.visit(uses)
    if uses.found is not None:
        return f"`{target}` is used after {shown} other than passed on to a call"
    return chain.why_not(model, forward, stmt, target)


def _why_not(module: cst.Module, context: Context) -> str | None:
    """Why no mask call of the file may be wrapped, whatever its shape (None when they may)."""
    if any(note.concern == attention.CONCERN and not note.rewritten for note in context.notes):
        return "an attention class runs the published core, which needs the 4-D mask"
    if not context.sdpa_selected():
        return "the SDPA attention is not chosen through an ATTENTION_CLASSES-like dict"
    return _not_imported(module, context.index)


def _published_attention(module: cst.Module, context: Context, why: str) -> cst.Module:
    """The module with the attention back as published, and its notes saying why: the published Model can hand the
    layers no mask (`why`), which the published core reads as no mask at all (or refuses with its assert) where
    _moe_rewrite_attention would run it causal."""
    module = attention.undo(undo(module, context.index))
    context.sections.discard("attention")
    line = f"the Model can hand it no mask ({why}), which SDPA would run causal and the published core does not"
    context.notes[:] = [
        Note(attention.CONCERN, note.subject, False, line)
        if note.concern == attention.CONCERN and note.rewritten
        else note
        for note in context.notes
    ]
    return module


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with the Model's mask call wrapped where proven (with --sdpa, the default); where a mask call stays
    as published, a note in context.notes saying why."""
    index = context.index
    module = undo(module, index)
    if not context.options.sdpa:
        return module
    classes = top_classes(module)
    found = [
        (name, forward)
        for name, cls in classes.items()
        if (forward := class_methods(cls).get("forward")) is not None
        and _calls(forward, BUILD, index)
        and _pretrained(cls, classes)
    ]
    notes = context.notes
    # no eager attention (a flash-only file): nothing to do, nothing to say
    if not found or not any(note.concern == attention.CONCERN for note in notes):
        return module
    reason = _why_not(module, context)
    chain = Chain(module, context.sdpa_selected(), index)
    done = []
    for name, forward in found:
        new, i = forward, 0
        while i < len(calls := _calls(new, BUILD, index)):  # one at a time: deep_replace makes new nodes
            why = reason or _prove(new, calls[i], name, chain)
            if why is not None:
                notes.append(Note(CONCERN, name, False, why))
                i += 1  # a wrapped call is no longer one of `calls`: the next one takes its index
                continue
            new = cst.ensure_type(new.deep_replace(calls[i], _wrapped(calls[i], module)), cst.FunctionDef)
            done.append(name)
        if new is not forward:
            module = replace(module, forward, new)
    if chain.unmasked is not None:
        return _published_attention(module, context, chain.unmasked)
    if done:
        context.sections.add("attention")
        names = ", ".join(done)
        notes.append(
            Note(CONCERN, names, True, f"{names} passes none where SDPA runs causal-only (no padding, no cache)")
        )
    return module
