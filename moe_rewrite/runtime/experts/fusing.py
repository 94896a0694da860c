"""Fusing: the MoE layer's moe_rewrite_fuse_experts, which puts the routed experts into fused experts
(fused_experts.py; FP8 block-quantized ones with their scales, fp8_experts.py), and the seam
moe_rewrite_expert_weights for the default layout (per_expert.py's replaces it with --no-fuse-experts). Always
generated.
"""

import torch

from ..moe.expert_parallel import _moe_rewrite_unwrap
from .expert_linears import MOE_REWRITE_PROJECTIONS, _moe_rewrite_experts_differ, _moe_rewrite_linear_weights
from .fp8_experts import _moe_rewrite_fp8_experts
from .fused_experts import _MoeRewriteFusedExperts
from .parameter_lora import _moe_rewrite_load_expert_lora


def _moe_rewrite_warn_unfused(reason=None):
    """Experts that are not fused run through the per-expert loop: say so, and why, once per process and reason.
    No `reason`: they could be fused."""
    import warnings

    if reason is not None:
        message = (
            f"moe-rewrite: these routed experts are not what the grouped GEMMs compute ({reason}), so they stay "
            "unfused and train through the slow per-expert loop, as the modules themselves compute"
        )
    else:
        message = (
            "moe-rewrite: these routed experts are not fused, so they train through the slow per-expert loop; fuse "
            "them with moe_rewrite.training.fuse_experts(model), or rewrite with --no-fuse-experts to train them as "
            "they are"
        )
    warnings.warn(message, stacklevel=4)


def _moe_rewrite_held_experts(moe):
    """(the experts this rank holds as an nn.ModuleList, the first one's number): all of them, or under expert
    parallelism (ep_size > 1: the published __init__ leaves the other ranks' experts None) this rank's block, which
    must be experts [ep_rank * E / ep, (ep_rank + 1) * E / ep), the ones expert_parallel.py sends it rows for."""
    experts, ep = moe.experts, getattr(moe, "ep_size", 1)  # V1-form classes have no ep_size
    if ep <= 1:
        return experts, 0
    count = moe.config.n_routed_experts // ep
    first = moe.ep_rank * count
    held = [i for i, expert in enumerate(experts) if expert is not None]
    if held != list(range(first, first + count)) or len(experts) != moe.config.n_routed_experts:
        raise RuntimeError(
            f"moe-rewrite: under expert parallelism this rank should hold experts {first} to {first + count - 1} of "
            f"{moe.config.n_routed_experts} (the block expert_parallel.py sends it rows for), and holds {held}"
        )
    return torch.nn.ModuleList([experts[i] for i in held]), first


class MoE:
    def moe_rewrite_expert_weights(self):
        """The experts' weights for the grouped-GEMM core, a _MoeRewriteExpertMLP, or None: the per-expert
        loop runs (experts that are not fused: quantized, other than what the grouped GEMMs compute, or loaded with
        MOE_REWRITE_FUSE_EXPERTS=0)."""
        experts, wrappers = _moe_rewrite_unwrap(self.experts)
        if isinstance(experts, _MoeRewriteFusedExperts):
            return experts.moe_rewrite_weights(wrappers)
        reason = _moe_rewrite_experts_differ(experts)
        if reason is not None:
            _moe_rewrite_warn_unfused(reason)
        elif _moe_rewrite_linear_weights(experts) is not None:
            _moe_rewrite_warn_unfused()
        return None

    def moe_rewrite_fuse_experts(self, allow_meta=False):
        """Hold the routed experts' weights in two parameters instead of 3 * E nn.Linear weights (see
        _MoeRewriteFusedExperts): faster training, most of all under FSDP.

        Call it once the weights are loaded and before the model is wrapped (FSDP, DDP, DeepSpeed) or handed to an
        optimizer; moe_rewrite.training.fuse_experts(model) does it for every layer. Returns the fused experts; calling
        it again does nothing. Outputs and gradients stay the same; save_pretrained still writes per-expert keys.
        `allow_meta`: fuse meta-device weights too, for a loader that fills the fused parameters.
        """
        experts = self.experts
        if isinstance(experts, _MoeRewriteFusedExperts):
            return experts
        if getattr(getattr(self, "config", None), "pretraining_tp", 1) > 1:  # V1 experts: slices, another rounding
            raise NotImplementedError("moe-rewrite: fused experts do not support pretraining_tp > 1 (set it to 1)")
        experts, first = _moe_rewrite_held_experts(self)
        # An explicit check first: experts the grouped GEMMs would compute differently (another class, a None
        # expert, a ModuleDict) stay as they are, and fusing never drops a parameter or buffer.
        reason = _moe_rewrite_experts_differ(experts)
        if reason is not None:
            raise RuntimeError(f"moe-rewrite: these experts cannot be fused: {reason}")
        fp8 = None
        # generated with: fp8-experts
        try:  # FP8 block-quantized projections (transformers' FP8Linear) fuse with their block scales
            fp8 = _moe_rewrite_fp8_experts(experts)
        except RuntimeError as error:
            raise RuntimeError(f"moe-rewrite: these experts cannot be fused: {error}") from None
        own = {f"{name}.{suffix}" for name in MOE_REWRITE_PROJECTIONS for suffix in ("weight", "weight_scale_inv")}
        for i, expert in enumerate(experts):
            held = {name for name, _ in expert.named_parameters()} | {name for name, _ in expert.named_buffers()}
            extra = held - {f"{name}.weight" for name in MOE_REWRITE_PROJECTIONS} if fp8 is None else held - own
            if extra:
                raise RuntimeError(
                    f"moe-rewrite: expert {i} holds {', '.join(sorted(extra))}, which the grouped GEMMs do not "
                    "compute; fusing would drop it, so these experts stay as they are"
                )
        weights, scales = fp8 or (_moe_rewrite_linear_weights(experts), None)
        if weights is None:
            raise RuntimeError(
                "moe-rewrite: only experts made of plain, whole, bias-free nn.Linear layers can be fused (not LoRA "
                "adapters, quantized layers or DeepSpeed ZeRO-3 partitions)"
            )
        flat = [w for part in weights for w in part]
        if getattr(self, "_is_fsdp_managed_module", False) or any(type(w) is not torch.nn.Parameter for w in flat):
            raise RuntimeError("moe-rewrite: fuse the experts before wrapping the model (FSDP, DDP, DeepSpeed)")
        # accelerate's dispatch (device_map) marks the modules it moves or offloads with `_hf_hook` (its own,
        # undocumented attribute: accelerate has no public "is this module dispatched" query).
        if any(hasattr(m, "_hf_hook") for m in experts.modules()):
            raise RuntimeError("moe-rewrite: experts dispatched or offloaded by accelerate (device_map) are not fused")
        if not allow_meta and any(w.is_meta for w in flat):
            raise RuntimeError("moe-rewrite: the expert weights are on the meta device; fuse them once they are loaded")
        if len({(w.dtype, w.device, w.requires_grad or scales is not None) for w in flat}) != 1:
            raise RuntimeError("moe-rewrite: fusing needs every expert weight in one dtype, device and requires_grad")
        dtype = getattr(getattr(self, "gate", None), "weight", None)  # the router's: the model's dtype
        dtype = dtype.dtype if isinstance(dtype, torch.Tensor) and dtype.is_floating_point() else None
        self.experts = _MoeRewriteFusedExperts(experts[0].act_fn, *weights, first, scales, dtype)
        self.register_load_state_dict_pre_hook(_moe_rewrite_load_expert_lora)
        return self.experts
