"""The core's entry: MoE.moe_train, the routed experts in training mode, and the path it takes through the sections
above (the route, the grouped GEMMs with the LoRA adapters' own, the expert output), SonicMoE or the per-expert loop.
Always generated.
"""

import torch

from ..kernels.dispatch import (
    _moe_rewrite_compute_dtype,
    _moe_rewrite_gemm_by_triton,
    _moe_rewrite_hopper,
    _moe_rewrite_kernel,
    _moe_rewrite_options,
    _moe_rewrite_triton,
)
from .backends import _moe_rewrite_experts_cast, _moe_rewrite_loop, _moe_rewrite_sonicmoe_experts
from .expert_output import _moe_rewrite_is_silu, _MoeRewriteCombine, _MoeRewriteExpertOutput, _MoeRewriteSwiGLU
from .expert_parallel import (
    _moe_rewrite_expert_parallel,
    _moe_rewrite_fsdp2_unit,
    _moe_rewrite_no_expert_parallel,
    _moe_rewrite_run_experts,
)
from .grouped_linear import _moe_rewrite_linear, _MoeRewriteGather, _MoeRewriteGatherPlan
from .route import _moe_rewrite_combine, _moe_rewrite_padding, _moe_rewrite_route, _moe_rewrite_unsort


def _moe_rewrite_grouped_experts(x, topk_ids, topk_weight, weights, num_experts, kernel, dtype, out_dtype):
    """The routed experts' weighted outputs for tokens x, `weights` a _MoeRewriteExpertMLP (the weight sources, the
    activation and the LoRA adapters), through the grouped GEMMs on `kernel`, or through SonicMoE where it is chosen
    and can run them."""
    if kernel == "sonicmoe":
        out = _moe_rewrite_sonicmoe_experts(x, topk_ids, topk_weight, weights, dtype)
        if out is not None:
            return out.to(out_dtype or out.dtype)
        kernel = "torch"
    gate_up_w, down_w, act_fn, adapters = weights.gate_up, weights.down, weights.act_fn, weights.adapters
    top_k = topk_ids.shape[1]
    # The kernels for the rows (in the compute dtype: every step but x's gradient) and for x's gradient (in x's dtype:
    # there only where the rows' are too, so the route holds the positions whenever either reads them).
    kernels, x_kernels = _moe_rewrite_triton(x.device, dtype), _moe_rewrite_triton(x.device, x.dtype)
    # Padding rows for torch's GEMMs on sm90, not for the Triton one (the first GEMM's shapes decide where it runs);
    # not under anomaly detection (the padding rows' gradients are left unwritten, and it checks every row for NaN).
    _, double, hidden = gate_up_w.shape
    padded = kernels is not None and kernel == "torch" and _moe_rewrite_hopper(x.device)
    padded = padded and not _moe_rewrite_gemm_by_triton(x.device, topk_ids.numel(), num_experts, double, hidden)
    padding = _moe_rewrite_padding(topk_ids.numel(), num_experts) if padded and not torch.is_anomaly_enabled() else 0
    offsets, route = _moe_rewrite_route(topk_ids, num_experts, kernels is not None, kernels, padding)
    # "stack" keeps stacked weights from forward to backward (fastest), except under torch.distributed, where the
    # weights are usually sharded (FSDP, ZeRO) and a kept copy per layer would undo the sharding.
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    keep = _moe_rewrite_options["stacking"] == "stack" and not distributed
    if not (adapters.get("gate_up_proj") or adapters.get("gate_proj") or adapters.get("up_proj")):
        gather = _MoeRewriteGatherPlan(route, top_k, dtype, x_kernels)
        gate_up = _moe_rewrite_linear(x, offsets, kernel, keep, gate_up_w, gather=gather)
    else:  # the adapters read the gathered rows too
        rows = _MoeRewriteGather.apply(x, route, top_k, x_kernels).to(dtype)
        gate_up = _moe_rewrite_linear(rows, offsets, kernel, keep, gate_up_w)
        gate_up = _moe_rewrite_add_lora(gate_up, rows, offsets, kernel, keep, adapters.get("gate_up_proj", ()))
    if adapters.get("gate_proj") or adapters.get("up_proj"):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = _moe_rewrite_add_lora(gate, rows, offsets, kernel, keep, adapters.get("gate_proj", ()))
        up = _moe_rewrite_add_lora(up, rows, offsets, kernel, keep, adapters.get("up_proj", ()))
        gate_up = torch.cat([gate, up], dim=-1)
    if not adapters.get("down_proj"):
        return _MoeRewriteExpertOutput.apply(
            gate_up, topk_weight, route, offsets, kernel, keep, act_fn, out_dtype, down_w, *down_w.tensors
        )
    if kernels is not None and _moe_rewrite_is_silu(act_fn):
        hidden = _MoeRewriteSwiGLU.apply(gate_up, kernels)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = act_fn(gate) * up
    out = _moe_rewrite_linear(hidden, offsets, kernel, keep, down_w)
    out = _moe_rewrite_add_lora(out, hidden, offsets, kernel, keep, adapters.get("down_proj", ()))
    if kernels is not None:
        return _MoeRewriteCombine.apply(out, topk_weight, route, out_dtype, kernels)
    out = _moe_rewrite_combine(_moe_rewrite_unsort(out, route.order), topk_weight)
    return out.to(out_dtype or out.dtype)


def _moe_rewrite_add_lora(y, x, offsets, kernel, keep_stacked, loras):
    """y + B(A(dropout(x))) * scaling for each (A, B, scaling, dropout) of `loras`, each row through its expert's
    adapter (PEFT's LoRA forward), as two grouped GEMMs of the adapter's rank: W + BA is never formed. In the compute
    dtype, as the base GEMM."""
    for a, b, scaling, dropout in loras:
        rank = a.shape[1]
        # torch._grouped_mm needs 16-byte aligned strides
        rank_kernel = "sorted" if kernel == "torch" and (rank * x.element_size()) % 16 else kernel
        low = _moe_rewrite_linear(dropout(x), offsets, rank_kernel, keep_stacked, a)
        y = y + _moe_rewrite_linear(low, offsets, rank_kernel, keep_stacked, b) * scaling
    return y


class MoE:
    def moe_train(self, x, topk_ids, topk_weight, out_dtype=None):
        """Routed experts in training mode (helpers: the moe-rewrite block above this class).

        x: (tokens, hidden); topk_ids, topk_weight: (tokens, top_k). Returns the weighted sum of each token's expert
        outputs, exactly what a loop over the experts computes, with autograd: in the promoted dtype of x and
        topk_weight, or cast to `out_dtype` (the V3 form's training branch asks for x's dtype, as moe_infer returns
        it; the grouped path then writes that dtype straight from its float32 sums, with the same one rounding).
        The expert MLPs run as grouped GEMMs over tokens sorted by expert: gate and up fused in one, down in another.
        """
        # generated with: expert-parallel
        if getattr(self, "ep_size", 1) > 1:  # expert parallelism (V1-form classes have no ep_size)
            return _moe_rewrite_expert_parallel(self, x, topk_ids, topk_weight, out_dtype)
        # generated without: expert-parallel
        if getattr(self, "ep_size", 1) > 1:
            _moe_rewrite_no_expert_parallel()
        if getattr(getattr(self, "config", None), "pretraining_tp", 1) > 1:  # V1 experts: slices, another rounding
            raise NotImplementedError("moe-rewrite: moe_train does not support pretraining_tp > 1 (set it to 1)")
        if _moe_rewrite_fsdp2_unit(self.experts):  # gathered around its moe_rewrite_run
            return _moe_rewrite_run_experts(self, x, topk_ids, topk_weight, out_dtype)
        dtype = _moe_rewrite_compute_dtype(x)
        kernel = _moe_rewrite_kernel(x.device, dtype)
        # generated with: expert-casts
        kernel = "loop" if _moe_rewrite_experts_cast(self.experts, x.dtype) else kernel  # ESFT's fp32 and bf16 experts
        weights = None if kernel == "loop" else self.moe_rewrite_expert_weights()
        if weights is not None:
            experts = weights.gate_up.shape[0]
            return _moe_rewrite_grouped_experts(x, topk_ids, topk_weight, weights, experts, kernel, dtype, out_dtype)
        if isinstance(self.experts, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            y = _moe_rewrite_loop(self.experts, x, topk_ids, topk_weight)
        else:  # fused experts, or PEFT's wrappers around them: their own forward (a loop over the experts)
            y = self.experts(x, topk_ids, topk_weight)
        return y.to(out_dtype or y.dtype)
