"""The expert MLPs outside the core's grouped GEMMs: SonicMoE's fused kernels (backend "sonicmoe", where they can run
what the core would) and the per-expert loop (backend "loop", and experts the core cannot read). Always generated.
"""

import torch

from ..kernels.dispatch import _moe_rewrite_sonicmoe
from .expert_output import _moe_rewrite_is_silu
from .grouped_linear import _MoeRewriteExpertWeight
from .route import _moe_rewrite_combine


def _moe_rewrite_sonicmoe_experts(x, topk_ids, topk_weight, weights, dtype):
    """The routed experts' weighted outputs through SonicMoE (kernel "sonicmoe"), or None when it cannot run them as
    the grouped GEMMs would: adapters, an activation other than SiLU, experts that are not fused parameters, sizes
    whose rows are not 16-byte aligned, or under torch.compile.

    SonicMoE gathers the rows inside its up-projection GEMM, applies SwiGLU in that GEMM's epilogue and scatters the
    weighted rows out of the down projection, with its own backward (gradients for x, both weights and the routing
    weights). It reads the fused parameters as they are: (E, 2I, H) as (2I, H, E), its layout, with concat_layout for
    the [gate; up] rows. Its first call per token count autotunes and compiles its kernels (minutes on an H200).
    """
    gate_up_w, down_w = weights.gate_up, weights.down
    experts, double, hidden = gate_up_w.shape
    if (
        any(weights.adapters.values())
        or not _moe_rewrite_is_silu(weights.act_fn)
        or type(gate_up_w) is not _MoeRewriteExpertWeight
        or type(down_w) is not _MoeRewriteExpertWeight
        or hidden % 8
        or double % 16
        or torch.compiler.is_compiling()
    ):
        return None
    sonicmoe = _moe_rewrite_sonicmoe()
    tokens, top_k = topk_ids.shape
    out, _ = sonicmoe.moe_general_routing_inputs(
        x.to(dtype).contiguous(),
        topk_weight.reshape(-1).float(),
        torch.arange(tokens, device=x.device, dtype=torch.int32).repeat_interleave(top_k),  # sorted token ids
        topk_ids.reshape(-1).to(torch.int32),
        gate_up_w.stacked(dtype).permute(1, 2, 0),
        None,
        down_w.stacked(dtype).permute(1, 2, 0),
        None,
        experts,
        torch.cuda.current_stream(x.device).cuda_stream,
        sonicmoe.enums.ActivationType.SWIGLU,
        concat_layout=True,
    )
    return out.to(torch.promote_types(dtype, topk_weight.dtype))  # the dtype the grouped GEMMs return


def _moe_rewrite_loop(experts, x, topk_ids, topk_weight):
    """The naive per-expert loop (the published V2 training path): backend "loop", and experts whose weights the core
    cannot read (quantized projections, adapters it cannot reproduce, DeepSpeed ZeRO-3 partitions) or would compute
    differently (expert_linears._moe_rewrite_experts_differ)."""
    flat_ids = topk_ids.view(-1)
    x = x.repeat_interleave(topk_ids.shape[1], dim=0)
    y = torch.empty_like(x)
    modules = experts.values() if isinstance(experts, torch.nn.ModuleDict) else experts  # expert i: the i-th value
    for i, expert in enumerate(modules):
        if expert is None:  # a slot left empty (another rank's expert): an error only when a token chose it
            if (flat_ids == i).any():
                raise RuntimeError(f"moe-rewrite: tokens are routed to expert {i}, which is None")
            continue
        y[flat_ids == i] = expert(x[flat_ids == i])
    return _moe_rewrite_combine(y, topk_weight)


# generated with: expert-casts
def _moe_rewrite_experts_cast(experts, dtype):
    """Whether some expert's forward casts its input: experts that cast x to their weights' dtype and the result back
    (DeepSeek's ESFT fork: trainable fp32 experts beside frozen bf16 ones) compute their plain MLP only where every
    projection's weight has x's `dtype`, and the grouped GEMMs then compute them exactly; else moe_train runs the
    per-expert loop, the experts' own forward (the published loop)."""
    for expert in experts._modules.values() if isinstance(experts, torch.nn.Module) else experts:
        for module in () if expert is None else expert._modules.values():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dtype != dtype:
                return True
    return False
