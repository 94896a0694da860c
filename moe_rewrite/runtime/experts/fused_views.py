"""The fused experts' views: expert i of fused experts as a module (experts[i]) whose gate, up and down projections
are nn.Linear views of the fused parameters, what moe_infer calls one by one and PEFT's target_modules adapt under the
checkpoint's names; and the record of the views as made, which the fused experts compare with what they hold on every
step. Always generated (with fused_experts.py).
"""

import torch

from ..moe.grouped_mm import MOE_REWRITE_FP8_BLOCK, _moe_rewrite_dequantize
from .expert_linears import MOE_REWRITE_PROJECTIONS
from .fp8_experts import _MoeRewriteDequantized


class _MoeRewriteMadeViews:
    """Fused experts' views and their projections as made (_moe_rewrite_own_projections compares them with what the
    module holds now): the views' `keys` and the `views`, their `view_modules` dicts, `own` (each view's gate, up and
    down projections), `flat` (those projections in one list) and their `flat_modules` dicts."""

    __slots__ = ("keys", "views", "view_modules", "own", "flat", "flat_modules")

    def __init__(self, experts, count):
        self.keys = tuple(str(experts.first_expert + i) for i in range(count))
        self.views = [experts._modules[key] for key in self.keys]
        self.view_modules = [view._modules for view in self.views]
        self.own = [tuple(view._modules[name] for name in MOE_REWRITE_PROJECTIONS) for view in self.views]
        self.flat = [p for column in self.own for p in column]
        self.flat_modules = [p._modules for p in self.flat]


class _MoeRewriteFusedExpert(torch.nn.Module):
    """Expert `index` of fused experts, called like the expert MLP it replaced: down(act(gate(x)) * up(x))."""

    def __init__(self, experts, index):
        super().__init__()
        inter = experts.down_proj.shape[2]
        rows = (slice(0, inter), slice(inter, 2 * inter), None)  # gate, up (in gate_up_proj), down
        for name, part in zip(MOE_REWRITE_PROJECTIONS, rows):  # the checkpoint's names, for PEFT and hooks
            self.add_module(name, _MoeRewriteExpertProjection(experts, index, name, part))
        object.__setattr__(self, "_moe_rewrite_experts", experts)  # not a submodule: the experts hold this view

    def forward(self, x):
        act_fn = self._moe_rewrite_experts.act_fn
        gate, up, down = (self._modules[name] for name in MOE_REWRITE_PROJECTIONS)
        return down(act_fn(gate(x)) * up(x))


class _MoeRewriteExpertProjection(torch.nn.Linear):
    """One projection of one fused expert as an nn.Linear (what PEFT adapts): its weight is a view of the fused
    parameter, read on every use, so it has no parameter or state-dict key of its own and follows .to() and FSDP."""

    def __init__(self, experts, index, name, rows):
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "_moe_rewrite_experts", experts)  # not a submodule (experts holds this)
        self.index, self.name, self.rows = index, name, rows
        out_features, in_features = self.codes().shape
        self.in_features, self.out_features, self.bias = in_features, out_features, None

    def codes(self):
        """This projection's slice of the fused parameter (FP8 experts: their codes)."""
        experts = self._moe_rewrite_experts
        if self.rows is None:
            return experts.down_proj[self.index]
        return experts.gate_up_proj[self.index, self.rows]

    @property
    def weight(self):
        experts = self._moe_rewrite_experts
        # generated with: fp8-experts
        if experts.moe_rewrite_fp8():  # the codes times their blocks' scales, a copy that refuses merges
            if self.rows is None:
                scale = experts.down_proj_scale_inv[self.index]
            else:
                block = MOE_REWRITE_FP8_BLOCK
                scale = experts.gate_up_proj_scale_inv[self.index, self.rows.start // block : self.rows.stop // block]
            real = _moe_rewrite_dequantize(self.codes(), scale, experts.dequantized_dtype)
            return torch.Tensor._make_subclass(_MoeRewriteDequantized, real)
        return self.codes()
