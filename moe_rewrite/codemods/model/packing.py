"""Packed batches attend per document, and the loss takes the Trainer's `num_items_in_batch` (with the attention mask
codemod: where it wrapped the Model's mask call; off with --no-sdpa).

transformers' users pack with DataCollatorWithFlattening: one row of documents, position ids restarting at 0 for
each, no attention mask, and with `return_flash_attn_kwargs=True` the keyword arguments `cu_seq_lens_q/k` and
`max_length_q/k`. The published file has the documents attend to each other, and its ForCausalLM forward may take no
`**kwargs` (the Trainer then neither passes `num_items_in_batch` nor can pass the collator's keywords)::

    # Before
    def forward(self, input_ids=None, ..., return_dict=None):                         # the Model
        ...
        attention_mask = _moe_rewrite_sdpa_mask(..., inputs_embeds, past_key_values_length)
    def forward(self, input_ids=None, ..., labels=None, ..., return_dict=None):       # the ForCausalLM
        outputs = self.model(input_ids=input_ids, ..., return_dict=return_dict)
        ...  # the loss
        if not return_dict:
    # After
    def forward(self, input_ids=None, ..., return_dict=None, **moe_rewrite_kwargs):
        moe_rewrite_positions_given = position_ids is not None
        ...
        attention_mask = _moe_rewrite_sdpa_mask(
            ...,
            inputs_embeds,
            past_key_values_length,
            position_ids=position_ids if moe_rewrite_positions_given else None,
            packed=moe_rewrite_kwargs,
        )
    def forward(self, input_ids=None, ..., return_dict=None, **moe_rewrite_kwargs):
        # moe-rewrite: the collator's keyword arguments (cu_seq_lens_*) reach the Model
        outputs = self.model(input_ids=input_ids, ..., return_dict=return_dict, **moe_rewrite_kwargs)
        ...  # the loss
        # moe-rewrite: the Trainer's num_items_in_batch (gradient accumulation): the loss summed over them
        loss = _moe_rewrite_items_loss(loss, labels, moe_rewrite_kwargs)
        if not return_dict:

A forward that already takes `**kwargs` keeps its own name for them. At run time (runtime/model/packing.py) the
mask call hands the layers the documents in place of the mask where the batch is packed, and every other batch
gets what it got before. The position ids reach it only where the caller passed them: those the forward makes
itself (arange) are never packed, so a batch without them needs no host sync to tell (and no graph break under
torch.compile(model)). Proven first: the Model's `position_ids` is its parameter, not rebound after the mask call
and passed on by keyword (the position ids RoPE reads); the ForCausalLM calls `self.model(...)` once, of a Model
class proven here, without `*`/`**` arguments, and binds `loss` in top-level statements with `labels` its
parameter, not rebound. Otherwise left as published, with a line. Every run first takes back an earlier one's
edits (attention_mask.py calls undo before its own).
"""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import MARK, Context, Field, Note, class_methods, code, replace, top_classes
from moe_rewrite.codemods.kit.index import Index
from moe_rewrite.codemods.model import lm_loss
from moe_rewrite.codemods.model.branch import unbranched

READS: tuple[Field, ...] = ("notes",)
PROVIDES: tuple[Field, ...] = ("notes",)
CONCERN = "packing"
KWARGS = "moe_rewrite_kwargs"  # the `**` parameter added where a forward has none
MASK_CALL = "_moe_rewrite_sdpa_mask"
ITEMS_CALL = "_moe_rewrite_items_loss"
MODEL_NOTE = f"{MARK}: the collator's keyword arguments (cu_seq_lens_*) reach the Model"
GIVEN = "moe_rewrite_positions_given"  # whether the caller passed position ids, bound first in the Model's forward
GIVEN_NOTE = f"{MARK}: position ids the forward makes itself are never packed (no host sync to find documents)"
ITEMS_NOTE = f"{MARK}: the Trainer's num_items_in_batch (gradient accumulation): the loss summed over them"
DONE = (
    "packed batches (DataCollatorWithFlattening: position_ids restarting without attention_mask, cu_seq_lens_*) attend "
    "per document in {models}; {heads} take num_items_in_batch; config.moe_rewrite_packed = False keeps the published"
)


def _names(stmt: cst.CSTNode, stored: bool) -> set[str]:
    tree = ast.parse(code(stmt).strip()) if not isinstance(stmt, cst.FunctionDef) else ast.parse(code(stmt))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) == stored}


def _body(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    return list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else []


def _with_kwargs(fn: cst.FunctionDef) -> tuple[cst.FunctionDef, str]:
    """The forward with a `**` parameter (its own, else **moe_rewrite_kwargs added), and that parameter's name."""
    star = fn.params.star_kwarg
    if star is not None:
        return fn, star.name.value
    star = cst.Param(cst.Name(KWARGS), star="**")
    params = list(fn.params.params)
    if params and isinstance(params[-1].comma, cst.Comma):  # laid out as the parameter before it, comma and all
        sep = params[-2].comma if len(params) > 1 and isinstance(params[-2].comma, cst.Comma) else params[-1].comma
        star = star.with_changes(comma=params[-1].comma)
        params[-1] = params[-1].with_changes(comma=sep)
    elif params:
        params[-1] = params[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    params = fn.params.with_changes(params=params, star_kwarg=star)
    return fn.with_changes(params=params), KWARGS


def _mask_statement(forward: cst.FunctionDef) -> tuple[int, cst.Call] | None:
    """The index of the top-level statement holding the wrapped mask call, and the call (None: no such call)."""
    found = []
    for i, stmt in enumerate(_body(forward)):
        for node in m.findall(stmt, m.Call(func=m.Name(MASK_CALL))):
            found.append((i, cst.ensure_type(node, cst.Call)))
    return found[0] if len(found) == 1 else None


def _prove_model(forward: cst.FunctionDef, at: int) -> str | None:
    """Why the Model's `position_ids` may not be the ones the mask call reads (None where they are)."""
    params = {p.name.value for p in [*forward.params.params, *forward.params.kwonly_params]}
    if "position_ids" not in params:
        return "its forward has no `position_ids` parameter"
    after = _body(forward)[at + 1 :]
    if any("position_ids" in _names(s, True) for s in after):
        return "`position_ids` is rebound after the mask call"
    passed = any(m.findall(s, m.Arg(keyword=m.Name("position_ids"), value=m.Name("position_ids"))) for s in after)
    if not passed:
        return "`position_ids` is not passed on by keyword after the mask call"
    star = forward.params.star_kwarg
    if star is not None and any(star.name.value in _names(s, True) for s in _body(forward)):
        return f"`{star.name.value}` is rebound in its forward"
    if m.findall(forward, m.Name(GIVEN)):
        return f"its forward already names `{GIVEN}`"
    return None


def _model_call(forward: cst.FunctionDef) -> int | str:
    """The index of the ForCausalLM forward's one `NAME = self.model(...)` statement, or why there is none."""
    calls = [
        i
        for i, s in enumerate(_body(forward))
        if m.findall(s, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("model"))))
    ]
    if len(calls) != 1:
        return "its forward does not call `self.model(...)` in exactly one statement"
    stmt = _body(forward)[calls[0]]
    shape = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call())])
    if not m.matches(stmt, shape):
        return f"`{code(stmt).strip().splitlines()[0]}` is not `NAME = self.model(...)`"
    call = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign).value
    if any(a.star for a in cst.ensure_type(call, cst.Call).args):
        return "its `self.model(...)` call passes `*` or `**` arguments"
    return calls[0]


def _loss_end(forward: cst.FunctionDef, module: cst.Module) -> int | str:
    """The index after the last top-level statement binding `loss`, or why the items loss may not go there: only
    after the published loss (lm_loss's proof, on the forward with its fused-loss branch taken back), the mean over
    the labels that num_items_in_batch turns into a sum; a loss of another form (transformers' loss_function, which
    divides by num_items_in_batch itself, a sum) is left as it is."""
    params = {p.name.value for p in [*forward.params.params, *forward.params.kwonly_params]}
    if "labels" not in params:
        return "its forward has no `labels` parameter"
    region = lm_loss._find_region(unbranched(forward, lm_loss.NOTE, lm_loss.OUR_CALL), module)
    if isinstance(region, str):
        return f"num_items_in_batch not taken: its loss is not the published one ({region})"
    if (region.bound["LOSS"], region.bound["Y"]) != ("loss", "labels"):
        return "num_items_in_batch not taken: its loss and labels are not named `loss` and `labels`"
    body = _body(forward)
    binds = [i for i, s in enumerate(body) if "loss" in _names(s, True)]
    if not binds:
        return "its forward binds no `loss`"
    if any("labels" in _names(s, True) for s in body[: binds[-1] + 1]):
        return "`labels` is rebound in its forward"
    return binds[-1] + 1


def _marked(text: str, note: str, module: cst.Module) -> cst.SimpleStatementLine:
    line = cst.ensure_type(cst.parse_statement(text, config=module.config_for_parsing), cst.SimpleStatementLine)
    return line.with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment(note))])


def _noted(stmt: cst.BaseStatement, note: str) -> bool:
    return any(line.comment is not None and line.comment.value == note for line in stmt.leading_lines)


def _undo_forward(forward: cst.FunctionDef, index: Index) -> cst.FunctionDef:
    body, changed = [], False
    for stmt in _body(forward):
        if isinstance(stmt, cst.SimpleStatementLine) and (_noted(stmt, ITEMS_NOTE) or _noted(stmt, GIVEN_NOTE)):
            changed = True
            continue
        if isinstance(stmt, cst.SimpleStatementLine) and _noted(stmt, MODEL_NOTE):
            assign = cst.ensure_type(stmt.body[0], cst.Assign)
            call = _without(cst.ensure_type(assign.value, cst.Call), lambda a: a.star == "**")
            lines = [line for line in stmt.leading_lines if not (line.comment and line.comment.value == MODEL_NOTE)]
            stmt = stmt.with_changes(body=[assign.with_changes(value=call)], leading_lines=lines)
            changed = True
        body.append(stmt)
    if changed:
        forward = forward.with_changes(body=forward.body.with_changes(body=body))
    calls = m.findall(forward, m.Call(func=m.Name(MASK_CALL))) if MASK_CALL in index.facts(forward).called else []
    for node in calls:
        call = cst.ensure_type(node, cst.Call)
        plain = _without(call, lambda a: a.keyword is not None and a.keyword.value in ("position_ids", "packed"))
        if plain is not call:
            forward = cst.ensure_type(forward.deep_replace(call, plain), cst.FunctionDef)
    star = forward.params.star_kwarg
    if star is not None and star.name.value == KWARGS:
        params = list(forward.params.params)
        if params:
            params[-1] = params[-1].with_changes(comma=star.comma)
        forward = forward.with_changes(params=forward.params.with_changes(params=params, star_kwarg=None))
    return forward


def undo(module: cst.Module, index: Index | None = None) -> cst.Module:
    """The module without an earlier run's edits."""
    index = index or Index()
    for cls in top_classes(module).values():
        forward = class_methods(cls).get("forward")
        if forward is not None:
            plain = _undo_forward(forward, index)
            if plain is not forward:
                module = replace(module, forward, plain)
    return module


def _model_class(cls: cst.ClassDef) -> str | None:
    """The class of `self.model = Class(...)` in the class's __init__."""
    init = class_methods(cls).get("__init__")
    if init is None:
        return None
    target = m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name("model")))])
    found = [cst.ensure_type(n, cst.Assign) for n in m.findall(init, target)]
    if len(found) == 1 and m.matches(found[0].value, m.Call(func=m.Name())):
        return cst.ensure_type(cst.ensure_type(found[0].value, cst.Call).func, cst.Name).value
    return None


def _appended(call: cst.Call, arg: cst.Arg) -> list[cst.Arg]:
    """The call's arguments with `arg` last, laid out as the one before it (a trailing comma stays trailing)."""
    args = list(call.args)
    last = args[-1]
    sep = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else None
    if sep is None:
        sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    args[-1] = last.with_changes(comma=sep)
    return [*args, arg.with_changes(comma=last.comma)]


def _keyword(name: str, value: str) -> cst.Arg:
    no_space = cst.SimpleWhitespace("")
    equal = cst.AssignEqual(whitespace_before=no_space, whitespace_after=no_space)
    return cst.Arg(keyword=cst.Name(name), value=cst.parse_expression(value), equal=equal)


def _without(call: cst.Call, drop) -> cst.Call:
    """The call without the trailing arguments `drop(arg)` selects, its last kept one taking the last's comma."""
    args = list(call.args)
    kept = [a for a in args if not drop(a)]
    if len(kept) == len(args) or not kept:
        return call
    kept[-1] = kept[-1].with_changes(comma=args[-1].comma)
    return call.with_changes(args=kept)


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with packed batches per document and num_items_in_batch taken where proven; notes say what."""
    module = undo(module, context.index)
    if not context.options.sdpa:
        return module
    notes, models, heads = context.notes, [], []
    for name, cls in top_classes(module).items():
        forward = class_methods(cls).get("forward")
        found = _mask_statement(forward) if forward is not None else None
        if found is None:
            continue
        why = _prove_model(forward, found[0])
        if why is not None:
            notes.append(Note(CONCERN, name, False, why))
            continue
        new, kwargs = _with_kwargs(forward)
        call = found[1]
        given = _keyword("position_ids", f"position_ids if {GIVEN} else None")
        wrapped = call.with_changes(args=_appended(call, given))
        wrapped = wrapped.with_changes(args=_appended(wrapped, _keyword("packed", kwargs)))
        new = cst.ensure_type(new.deep_replace(_mask_statement(new)[1], wrapped), cst.FunctionDef)  # type: ignore[index]
        body = _body(new)
        flag = _marked(f"{GIVEN} = position_ids is not None\n", GIVEN_NOTE, module)
        body.insert(int(new.get_docstring() is not None), flag)  # first, after a docstring
        module = replace(module, forward, new.with_changes(body=new.body.with_changes(body=body)))
        models.append(name)
    for name, cls in top_classes(module).items():
        forward = class_methods(cls).get("forward")
        if not name.endswith("ForCausalLM") or forward is None or _model_class(cls) not in models:
            continue
        at, end = _model_call(forward), _loss_end(forward, module)
        why = at if isinstance(at, str) else end if isinstance(end, str) else None
        if why is not None:
            notes.append(Note(CONCERN, name, False, why))
            continue
        new, kwargs = _with_kwargs(forward)
        body = _body(new)
        stmt = cst.ensure_type(body[at], cst.SimpleStatementLine)  # type: ignore[index]
        assign = cst.ensure_type(stmt.body[0], cst.Assign)
        call = cst.ensure_type(assign.value, cst.Call)
        args = _appended(call, cst.Arg(value=cst.Name(kwargs), star="**"))
        stmt = stmt.with_changes(
            body=[assign.with_changes(value=call.with_changes(args=args))],
            leading_lines=[*stmt.leading_lines, cst.EmptyLine(comment=cst.Comment(MODEL_NOTE))],
        )
        body[at] = stmt  # type: ignore[index]
        body.insert(end, _marked(f"loss = {ITEMS_CALL}(loss, labels, {kwargs})\n", ITEMS_NOTE, module))  # type: ignore[arg-type]
        module = replace(module, forward, new.with_changes(body=new.body.with_changes(body=body)))
        heads.append(name)
    if "attention" in context.sections or heads:
        context.sections.update(("packed_attention", "packing"))  # attention.py calls packing, packing its kernels
    if models:
        line = DONE.format(models=", ".join(models), heads=", ".join(heads) or "no ForCausalLM")
        notes.append(Note(CONCERN, ", ".join(models), True, line))
    return module
