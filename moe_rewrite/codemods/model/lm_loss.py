"""The causal-LM loss without float32 logits over the vocabulary in training (on by default; --no-fused-loss).

Where a `*ForCausalLM` class's forward holds exactly the published loss (proven statement by statement on the syntax
tree, up to names, formatting and comments), those statements go into the else of a branch taken in training with
labels::

    # Before
    logits = self.lm_head(hidden_states)
    logits = logits.float()
    loss = None
    if labels is not None:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss_fct = CrossEntropyLoss()
        shift_logits = shift_logits.view(-1, self.config.vocab_size)
        shift_labels = shift_labels.view(-1)
        shift_labels = shift_labels.to(shift_logits.device)
        loss = loss_fct(shift_logits, shift_labels)
    # After
    # moe-rewrite: the loss without float32 logits in training with labels; the published loss otherwise
    if labels is not None and self.training and _moe_rewrite_fused_loss_applies(self):
        loss, logits = _moe_rewrite_lm_loss(hidden_states, self.lm_head.weight, labels)
    else:
        logits = self.lm_head(hidden_states)
        ...  # the published statements, untouched

In that branch no logits are computed: in their place an object whose every use raises an error naming the opt-outs
(runtime/model/lm_loss.py, _MoeRewriteNoLogits); eval, generate and labels=None run the published statements. A
forward that differs in any way, or reads the logits afterwards other than to return them, is left as published, and
the summary says so; the file is still rewritten. Every run first takes back what an earlier one added, so
--no-fused-loss gives the published loss back and a second run changes nothing.
"""

from __future__ import annotations

import ast

import libcst as cst

from moe_rewrite.codemods.kit import MARK, Context, Field, Note, code, replace, single_method
from moe_rewrite.codemods.kit.prove import Differs, Proof, Template, closest, prove
from moe_rewrite.codemods.model.branch import around, unbranched

READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ("notes",)
CONCERN = "loss"  # its notes' concern

NOTE = f"{MARK}: the loss without float32 logits in training with labels; the published loss otherwise"
OUR_CALL = "_moe_rewrite_lm_loss"
BRANCH = (
    "if {labels} is not None and self.training and _moe_rewrite_fused_loss_applies(self):\n"
    "    {loss}, {logits} = _moe_rewrite_lm_loss({hidden}, self.lm_head.weight, {labels})\n"
    "else:\n"
    "    pass\n"
)
DONE = "no logits in training with labels, reading them says why; config.moe_rewrite_fused_loss = False keeps them"

# The published statements, in capitals the names they bind: L the logits, H the hidden states, LOSS, Y the labels,
# SL / SY the shifted logits and labels, F the loss module; `self` is the forward's. The loss class in its three
# spellings, read as the globals the published file imports.
PLACEHOLDERS = {"L", "H", "LOSS", "Y", "SL", "SY", "F", "self"}
PUBLISHED = """\
L = self.lm_head(H)
L = L.float()
LOSS = None
if Y is not None:
    SL = L[..., :-1, :].contiguous()
    SY = Y[..., 1:].contiguous()
    F = {loss_class}()
    SL = SL.view(-1, self.config.vocab_size)
    SY = SY.view(-1)
    SY = SY.to(SL.device)
    LOSS = F(SL, SY)
"""
LOSS_CLASSES = ("CrossEntropyLoss", "nn.CrossEntropyLoss", "torch.nn.CrossEntropyLoss")
TEMPLATES = {name: Template(PUBLISHED.format(loss_class=name), PLACEHOLDERS) for name in LOSS_CLASSES}


def _loss_class_imported(module: cst.Module) -> bool:
    """`from torch.nn import CrossEntropyLoss` at the top of the file (the published import)."""
    for stmt in module.body:
        for small in getattr(stmt, "body", ()) if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                if small.module is not None and code(small.module) == "torch.nn":
                    if any(a.asname is None and code(a.name) == "CrossEntropyLoss" for a in small.names):
                        return True
    return False


class _Region:
    def __init__(self, start: int, bound: dict[str, str]) -> None:
        self.start, self.bound = start, bound


def _find_region(forward: cst.FunctionDef, module: cst.Module) -> _Region | str:
    """Where the forward's published loss starts (four statements), or why there is none (one line)."""
    body = list(forward.body.body) if isinstance(forward.body, cst.IndentedBlock) else []
    trees = [ast.parse(code(stmt)) for stmt in body]  # each line whole: `a = 1; labels = b` is two statements
    starts = [i for i, t in enumerate(trees) if "self.lm_head(" in ast.unparse(t)]
    if len(starts) != 1:
        return "its forward does not call `self.lm_head(...)` in exactly one statement"
    start = starts[0]
    found = {name: prove(t, body[start : start + 4], {"self": "self"}, within=forward) for name, t in TEMPLATES.items()}
    for name, proof in found.items():
        if not isinstance(proof, Proof):
            continue
        if name == "CrossEntropyLoss" and not _loss_class_imported(module):
            return "`CrossEntropyLoss` is not imported from torch.nn"
        return _check_surroundings(forward, trees, start, proof.names)
    differs = closest(d for d in found.values() if isinstance(d, Differs))
    why = f": {differs.why}" if differs.why else ""
    return f"the statements from `{ast.unparse(trees[start])}` on are not the published loss{why}"


def _loads(name: ast.Name) -> bool:
    return isinstance(name.ctx, ast.Load)


def _check_surroundings(forward: cst.FunctionDef, trees: list, start: int, bound: dict[str, str]) -> _Region | str:
    """The labels are the forward's parameter, not rebound before; after the loss the logits are only returned (an
    element of a tuple or a keyword argument), since the branch leaves them None."""
    params = {p.name.value for p in [*forward.params.params, *forward.params.kwonly_params]}
    labels, logits = bound["Y"], bound["L"]
    if labels not in params:
        return f"the labels `{labels}` are not a parameter of forward"
    stored = {n.id for t in trees[:start] for n in ast.walk(t) if isinstance(n, ast.Name) and not _loads(n)}
    if labels in stored:
        return f"`{labels}` is reassigned before the loss"
    for tree in trees[start + 4 :]:
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == logits:
                if not (_loads(node) and isinstance(parents.get(id(node)), (ast.Tuple, ast.keyword))):
                    return f"`{logits}` is used after the loss: `{ast.unparse(tree).splitlines()[0]}`"
    return _Region(start, bound)


def _branch(forward: cst.FunctionDef, region: _Region, module: cst.Module) -> cst.FunctionDef:
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    statements = body[region.start : region.start + 4]
    b = region.bound
    text = BRANCH.format(labels=b["Y"], loss=b["LOSS"], logits=b["L"], hidden=b["H"])
    branch = around(statements, text, NOTE, module)
    body[region.start : region.start + 4] = [branch]
    return forward.with_changes(body=forward.body.with_changes(body=body))


def undo(module: cst.Module) -> cst.Module:
    """The module without an earlier run's branches."""
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            forward = single_method(stmt, "forward")
            if forward is not None:
                plain = unbranched(forward, NOTE, OUR_CALL)
                if plain is not forward:
                    module = replace(module, forward, plain)
    return module


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with each proven loss in its branch (with --fused-loss, the default); what was left, and why, in
    context.notes."""
    module = undo(module)
    notes, start = context.notes, len(context.notes)
    if not context.options.fused_loss:
        return module
    rewritten = []
    for cls in [s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value.endswith("ForCausalLM")]:
        forward = single_method(cls, "forward")
        if forward is None:
            continue
        region = _find_region(forward, module)
        if isinstance(region, str):
            notes.append(Note(CONCERN, cls.name.value, False, region))
            continue
        module = replace(module, forward, _branch(forward, region, module))
        rewritten.append(cls.name.value)
    if rewritten:
        context.sections.update({"lm_loss", "triton_cross_entropy"})
        names = ", ".join(rewritten)
        notes.insert(start, Note(CONCERN, names, True, f"fused linear cross-entropy in {names} ({DONE})"))
    return module
