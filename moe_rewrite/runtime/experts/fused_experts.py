"""Fused experts: a layer's routed experts held in two parameters, (E, 2 * intermediate, hidden) gate_up_proj and
(E, hidden, intermediate) down_proj, which the grouped-GEMM core reads as they are. Always generated; fusing.py makes
them, checkpoint keys are converted by fused_checkpoint.py.
"""

import torch

from ..kernels.dispatch import _moe_rewrite_compute_dtype, _moe_rewrite_kernel
from ..moe.backends import _moe_rewrite_loop
from ..moe.grouped_linear import (
    _MoeRewriteExpertMLP,
    _MoeRewriteExpertWeight,
    _MoeRewriteFP8ExpertWeight,
)
from ..moe.grouped_mm import _moe_rewrite_dequantize
from ..moe.moe_train import _moe_rewrite_grouped_experts
from .expert_linears import (
    MOE_REWRITE_PROJECTIONS,
    _moe_rewrite_adapters,
    _moe_rewrite_projections,
)
from .fused_checkpoint import _moe_rewrite_merge_experts, _moe_rewrite_stack_experts
from .fused_views import _MoeRewriteExpertProjection, _MoeRewriteFusedExpert, _MoeRewriteMadeViews
from .parameter_lora import _moe_rewrite_parameter_adapters


class _MoeRewriteFusedExperts(torch.nn.Module):
    """The routed experts as two parameters, made by the MoE layer's moe_rewrite_fuse_experts():
    gate_up_proj (E, 2 * intermediate, hidden) holds every expert's gate_proj then up_proj weight, down_proj
    (E, hidden, intermediate) every expert's down_proj weight.

    The grouped GEMMs read them as they are (no stacking copy per step), and a layer has 2 expert parameters instead of
    3 * E: FSDP, DDP and the optimizer handle each parameter separately, at a host cost per parameter and step.
    experts[i] is expert i as a module whose gate_proj, up_proj and down_proj are nn.Linear views of the parameters
    (no parameters of their own): moe_infer calls them one by one in eval mode, and PEFT's target_modules find and
    adapt them under the checkpoint's names (experts.{i}.gate_proj). PEFT's target_parameters wrap this module itself
    (parameter_lora.py). state_dict() uses the parameters' own names, as FSDP and torch.distributed.checkpoint expect;
    load_state_dict also takes the checkpoint's per-expert keys (experts.{i}.gate_proj.weight, ...), and the model's
    save_pretrained writes them.

    Under expert parallelism a rank holds experts first_expert, first_expert + 1, ... of the layer: the views, the
    checkpoint keys and PEFT's names keep those global numbers; len(), iteration and experts[i] count the held ones.

    FP8 block-quantized experts (`scales`: the per-expert weight_scale_inv of FP8 checkpoints, fp8_experts.py) keep
    their float8_e4m3fn codes in gate_up_proj and down_proj and their scales in gate_up_proj_scale_inv
    (E, 2 * intermediate / 128, hidden / 128) and down_proj_scale_inv (E, hidden / 128, intermediate / 128), as
    transformers' own FP8 experts name them; all four are frozen. The views dequantize to `dtype`, the model's.
    """

    def __init__(self, act_fn, gate_w, up_w, down_w, first_expert=0, scales=None, dtype=None):
        super().__init__()
        self.act_fn, self.first_expert = act_fn, first_expert
        gate_up, down = _moe_rewrite_stack_experts(gate_w, up_w, down_w)
        trainable = gate_w[0].requires_grad and scales is None
        self.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=trainable)
        self.down_proj = torch.nn.Parameter(down, requires_grad=trainable)
        # generated with: fp8-experts
        if scales is not None:
            gate_up_scale, down_scale = _moe_rewrite_stack_experts(*scales)
            # float32, as checkpoints hold them (transformers 4.x loads them in the model's dtype)
            self.gate_up_proj_scale_inv = torch.nn.Parameter(gate_up_scale.float(), requires_grad=False)
            self.down_proj_scale_inv = torch.nn.Parameter(down_scale.float(), requires_grad=False)
            self.dequantized_dtype = dtype or torch.bfloat16
        for i in range(len(gate_w)):
            self.add_module(str(first_expert + i), _MoeRewriteFusedExpert(self, i))
        # The views and their projections as made, for _moe_rewrite_own_projections (a plain attribute, not a module)
        self._moe_rewrite_made = _MoeRewriteMadeViews(self, len(gate_w))
        self.register_load_state_dict_pre_hook(_moe_rewrite_merge_experts)

    def __len__(self):
        return self.gate_up_proj.shape[0]

    def __getitem__(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"expert {index} out of range for {len(self)} experts")
        return self._modules[str(self.first_expert + index % len(self))]

    def __iter__(self):
        return (self._modules[str(self.first_expert + i)] for i in range(len(self)))

    def __repr__(self):  # one line, not one per expert view
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self):
        experts, double_inter, hidden = self.gate_up_proj.shape
        fp8 = ", fp8 (block-quantized)" if self.moe_rewrite_fp8() else ""
        return f"experts={experts}, hidden={hidden}, intermediate={double_inter // 2}{fp8}"

    def moe_rewrite_fp8(self):
        """Whether the experts hold FP8 block-quantized weights (codes and scales)."""
        return "gate_up_proj_scale_inv" in self._parameters

    # generated with: fp8-experts
    def _apply(self, fn, recurse=True):
        """nn.Module._apply (.to(), .cuda(), .bfloat16(), ...): FP8 experts' codes and scales are moved, never cast (a
        cast would double their memory and round the scales); the views then dequantize to the dtype asked for."""
        if not self.moe_rewrite_fp8():
            return super()._apply(fn, recurse)
        names = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
        before = {name: self._parameters[name].data for name in names}
        result = super()._apply(fn, recurse)
        for name, data in before.items():
            param = self._parameters[name]
            if param.dtype != data.dtype:
                if name == "gate_up_proj":
                    self.dequantized_dtype = param.dtype
                param.data = data.to(param.device)
        return result

    # generated with: fp8-experts
    def moe_rewrite_dequantize(self):
        """FP8 experts become bf16 (the model's dtype) experts, trainable: twice the memory; LoRA adapters can then be
        merged into them. Nothing happens to experts that are not FP8."""
        if not self.moe_rewrite_fp8():
            return
        for name in ("gate_up_proj", "down_proj"):
            scale = self._parameters.pop(f"{name}_scale_inv")
            weight = _moe_rewrite_dequantize(self._parameters[name], scale, self.dequantized_dtype)
            self._parameters[name] = torch.nn.Parameter(weight)

    def forward(self, x, topk_ids, topk_weight, out_dtype=None):
        """The experts' weighted outputs (moe_rewrite_run), what PEFT's wrappers call with their adapters applied to
        the parameters (then expert by expert through the views)."""
        return self.moe_rewrite_run(x, topk_ids, topk_weight, out_dtype)

    def moe_rewrite_run(self, x, topk_ids, topk_weight, out_dtype=None, wrappers=()):
        """The experts' weighted outputs for rows x (topk_ids count the held experts from 0), in `out_dtype` or the
        promoted dtype of x and topk_weight, PEFT's `wrappers` of the parameters with their adapters: through the
        grouped-GEMM core where it runs them, else expert by expert (through the wrappers' own forward where they
        hold adapters the core cannot run). moe_train calls it where FSDP2 shards the experts as a unit of their own
        (moe_rewrite_fully_shard registers it as a forward method, so that FSDP2 gathers them) and under expert
        parallelism."""
        if x.shape[0] == 0:  # no row (a rank that received none): an empty output with every parameter (LoRA's
            # too) in its graph, so that backward's exchanges run here and each gets a gradient (zeros) as on the
            # ranks holding the same experts, whose FSDP2 reductions it joins
            empty = x.new_zeros(0, self.down_proj.shape[1], dtype=out_dtype or x.dtype) + x.sum()
            held = (wrappers[0] if wrappers else self).parameters()
            return empty + sum(p.reshape(-1)[:0].sum() for p in held if p.requires_grad)
        dtype = _moe_rewrite_compute_dtype(x)
        kernel = _moe_rewrite_kernel(x.device, dtype)
        parametrized = torch.nn.utils.parametrize.is_parametrized(self)  # inside PEFT's forward: merged weights
        weights = None if kernel == "loop" or parametrized else self.moe_rewrite_weights(wrappers)
        if weights is not None:
            return _moe_rewrite_grouped_experts(x, topk_ids, topk_weight, weights, len(self), kernel, dtype, out_dtype)
        # generated with: fp8-experts
        if (wrappers or parametrized) and self.moe_rewrite_fp8():
            raise RuntimeError(
                "moe-rewrite: PEFT's own forward over FP8 block-quantized experts adds its adapters to the FP8 codes, "
                "ignoring their scales; the grouped GEMMs run one active LoRA adapter without dropout on the fused "
                "parameters (or use target_modules on the experts' projections)"
            )
        if wrappers and not parametrized:  # PEFT's forward: its adapters merged into the parameters, then this
            y = wrappers[0](x, topk_ids, topk_weight)
        else:
            y = _moe_rewrite_loop(self, x, topk_ids, topk_weight)
        return y.to(out_dtype or y.dtype)

    def moe_rewrite_weights(self, wrappers=()):
        """The _MoeRewriteExpertMLP the grouped-GEMM core reads: the two parameters as weight sources, and the LoRA
        adapters on the expert views (expert_linears._moe_rewrite_adapters) and in PEFT's `wrappers` of the
        parameters (parameter_lora.py); None when the loop must run them."""
        if self._moe_rewrite_own_projections():
            adapters = {}
        else:
            projections = _moe_rewrite_projections(self)
            # A projection replaced by another module (not this module's view, under PEFT's layer if adapted) must
            # run as that module, through the loop.
            intact = all(
                p is not None and type(p._modules.get("base_layer", p)) is _MoeRewriteExpertProjection
                for column in projections
                for p in column
            )
            adapters = _moe_rewrite_adapters(projections) if intact else None
        fused_adapters = _moe_rewrite_parameter_adapters(wrappers) if adapters is not None else None
        if fused_adapters is None:
            return None
        for name, loras in fused_adapters.items():
            adapters[name] = adapters.get(name, ()) + loras
        gate_up, down = _MoeRewriteExpertWeight(self.gate_up_proj), _MoeRewriteExpertWeight(self.down_proj)
        # generated with: fp8-experts
        if self.moe_rewrite_fp8():
            gate_up = _MoeRewriteFP8ExpertWeight(self.gate_up_proj, self.gate_up_proj_scale_inv)
            down = _MoeRewriteFP8ExpertWeight(self.down_proj, self.down_proj_scale_inv)
        return _MoeRewriteExpertMLP(gate_up, down, self.act_fn, adapters)

    def _moe_rewrite_own_projections(self):
        """Whether every expert view is in place and holds the projections it was made with, of their own type and
        with no submodule (PEFT's target_modules put its layer in their place): the usual case, where no expert
        projection has an adapter. Checked in C loops (map) over the 3 * E modules, not in Python: this runs for every
        layer and step, and on an H200's host at E = 256 the full check in moe_rewrite_weights took 0.5 ms, this one
        0.1 (bench/NOTES.md, change 23)."""
        import operator

        made = self.__dict__.get("_moe_rewrite_made")
        if made is None:
            return False
        if list(map(self._modules.get, made.keys)) != made.views:
            return False
        try:
            held = list(map(operator.itemgetter(*MOE_REWRITE_PROJECTIONS), made.view_modules))
        except KeyError:  # a projection deleted
            return False
        types = [_MoeRewriteExpertProjection] * len(made.flat)
        return held == made.own and list(map(type, made.flat)) == types and not any(map(len, made.flat_modules))
