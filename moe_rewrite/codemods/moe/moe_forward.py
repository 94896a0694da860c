"""Give the MoE class a grouped-GEMM training path: `moe_train`, its helper block, and a training branch calling it.

V3 form (the training output is never defined)::

    # Before
    if not self.training:
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
    # After
    if not self.training:
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
    else:
        y = self.moe_train(hidden_states, topk_idx, topk_weight, out_dtype=hidden_states.dtype).view(*orig_shape)

V2 form (a Python loop over the experts)::

    # Before
    if self.training:
        hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
        y = torch.empty_like(hidden_states)
        for i, expert in enumerate(self.experts):
            y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        y = y.to(hidden_states.dtype).view(*orig_shape)     # kept: this revision's dtype behaviour
        y = AddAuxiliaryLoss.apply(y, aux_loss)             # kept: the aux-loss semantics
    # After
    if self.training:
        y = self.moe_train(hidden_states, topk_idx, topk_weight)
        y = y.to(hidden_states.dtype).view(*orig_shape)
        y = AddAuxiliaryLoss.apply(y, aux_loss)

V1 form (DeepSeekMoE 16B): the V2 form's training loop (without the dtype cast), rewritten the same way; its eval
call passes flat ids and `topk_weight.view(-1, 1)` to a moe_infer that takes them so. moe_train's arguments are read
off the training loop (the tokens it indexes, the ids its flat ids view, the weights of its weighted sum), and the
eval call's are checked against them in the shapes its moe_infer's body takes (moe_infer_body.FLAT_ARGUMENTS).

All forms get the `moe_train` method and its module-level helpers (render.CORE_SECTIONS, put in by the block
codemod). `moe_infer` is untouched; eval mode calls it through `moe_rewrite_infer` (runtime/experts/parameter_lora.py),
which runs the grouped GEMMs instead only where moe_infer cannot index the experts (PEFT wrapped their parameters)::

    y = self.moe_rewrite_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)  # moe-rewrite: ...
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import Context, Field, Form, MoeClassInfo, class_methods
from moe_rewrite.codemods.moe.eval_call import (
    EVAL_NOTE,
    bind_moe_infer_args,
    eval_through_moe_rewrite,
    moe_infer_args,
    single_moe_infer_assign,
)
from moe_rewrite.codemods.moe.gate import SELF_TRAINING, drop_training_guards
from moe_rewrite.codemods.moe.loop_forms import check_eval_args, loop_training_body, rewrite_esft
from moe_rewrite.codemods.moe.moe_class import (
    MOE_TRAIN_CALL,
    NOT_SELF_TRAINING,
    as_block,
    find_moe_class,
    gate_arity,
    gate_class_name,
    is_training_refusal,
    refuse_overriding_subclasses,
    training_if,
)
from moe_rewrite.codemods.moe.moe_infer_body import check_moe_infer
from moe_rewrite.codemods.moe.v3_form import refuse_helpers_reading_training, v3_training_else
from moe_rewrite.errors import RewriteError
from moe_rewrite.options import RewriteOptions
from moe_rewrite.render import CORE_SECTIONS

__all__ = ["EVAL_NOTE", "READS", "PROVIDES", "find_moe_class", "rewrite_forward", "transform"]

READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ("moe",)


def rewrite_forward(
    moe: cst.ClassDef, options: RewriteOptions, module: cst.Module | None = None
) -> tuple[cst.FunctionDef, Form]:
    """The MoE forward with its training branch calling moe_train, and its form (Form.V3, Form.V2 for the loop
    forms, Form.ESFT). `module`, the file, is where the eval branch's helpers are looked up."""
    name = moe.name.value
    where = f"{name}.forward"
    forward = drop_training_guards(class_methods(moe)["forward"], where)
    if "moe_infer" not in class_methods(moe):
        return rewrite_esft(forward, options, where), Form.ESFT
    moe_infer = class_methods(moe)["moe_infer"]
    params = [p.name.value for p in moe_infer.params.params][1:]  # proved below: (self, tokens, ids, weights)

    def bind(call: cst.Call) -> list[cst.Arg]:
        return bind_moe_infer_args(call, params, where)

    arity = gate_arity(forward, where)
    published = branch = training_if(forward, where)
    if arity == 2 and m.matches(branch.test, NOT_SELF_TRAINING):
        if is_training_refusal(branch.orelse):
            branch = branch.with_changes(orelse=None)  # Kimi form: the training path goes where it refused
        if branch.orelse is not None and not m.findall(branch.orelse, MOE_TRAIN_CALL):
            raise RewriteError(
                f"{where}: `if not self.training:` already has an else branch that moe-rewrite did not write"
            )
        if module is not None:
            refuse_helpers_reading_training(as_block(branch.body).body, moe, module, where)
        new_branch = branch.with_changes(
            body=eval_through_moe_rewrite(branch.body, bind),
            orelse=v3_training_else(branch.body, options, bind, where),
        )
        form = Form.V3
    elif arity == 3 and m.matches(branch.test, SELF_TRAINING):
        if options.aux_loss or options.bias_update is not None:
            raise RewriteError(
                f"{where}: --aux-loss and --bias-update apply to the V3 form; this V2-form file trains its own aux loss"
            )
        if branch.orelse is None:
            raise RewriteError(f"{where}: `if self.training:` has no else branch calling self.moe_infer(...)")
        infer_args = moe_infer_args(single_moe_infer_assign(branch.orelse.body, where), params, where)
        training_body, names = loop_training_body(as_block(branch.body), forward, branch, where)
        new_branch = branch.with_changes(
            body=training_body,
            orelse=branch.orelse.with_changes(body=eval_through_moe_rewrite(branch.orelse.body, bind)),
        )
        form = Form.V2
    else:
        raise RewriteError(
            f"{where}: unrecognised structure (self.gate returns {arity} values; "
            "expected 2 with `if not self.training:` (V3 form) or 3 with `if self.training:` (V2 form))"
        )
    # last, so that a file of another structure is told what in its forward is not recognised
    kind = check_moe_infer(cst.Module(body=[moe_infer]).code, f"{name}.moe_infer")
    if form is Form.V2:
        check_eval_args(infer_args, kind, names, forward, branch, where)
    elif kind != "topk":
        raise RewriteError(
            f"{name}.moe_infer takes flat ids and weights (the V1 form's), but {where} has the V3 form's structure, "
            "which trains through moe_infer's arguments"
        )
    return cst.ensure_type(forward.deep_replace(published, new_branch), cst.FunctionDef), form


def transform(module: cst.Module, context: Context) -> cst.Module:
    moe = find_moe_class(module)
    refuse_overriding_subclasses(module, moe)
    if "moe_infer" not in class_methods(moe):  # the ESFT form (rewrite_forward)
        context.need_per_expert_layers(
            f"{moe.name.value}.forward: ESFT form: it trains selected experts (requires_grad per expert), which "
            "fused experts cannot express"
        )
    forward, form = rewrite_forward(moe, context.options, module)
    old_forward = class_methods(moe)["forward"]
    new_moe = moe.with_changes(
        body=moe.body.with_changes(body=[forward if s is old_forward else s for s in moe.body.body])
    )
    context.moe = MoeClassInfo(name=moe.name.value, gate_class=gate_class_name(moe), form=form)
    context.sections |= CORE_SECTIONS
    if context.options.aux_loss:
        context.sections.add("aux_loss")
    if context.options.bias_update is not None:
        context.sections.add("bias_update")
    return module.with_changes(body=[new_moe if s is moe else s for s in module.body])
