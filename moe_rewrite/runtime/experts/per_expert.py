"""The per-expert layout (only with --no-fuse-experts): the grouped-GEMM core reads the experts' own nn.Linear
weights (and PEFT's LoRA adapters on them), so state-dict keys, adapters and hooks see one module per expert. It
replaces fused_experts.py's moe_rewrite_expert_weights (fused experts still work: moe_rewrite.training.fuse_experts
fuses them at run time).
"""

import torch

from ..moe.expert_parallel import _moe_rewrite_unwrap
from ..moe.grouped_linear import _MoeRewriteExpertMLP
from .expert_linears import (
    _moe_rewrite_adapters,
    _moe_rewrite_experts_differ,
    _moe_rewrite_linear_weights,
    _moe_rewrite_projections,
    _MoeRewriteExpertLinears,
)
from .fused_experts import _MoeRewriteFusedExperts
from .fusing import _moe_rewrite_warn_unfused


class MoE:
    def moe_rewrite_expert_weights(self):
        """The experts' weights for the grouped-GEMM core, a _MoeRewriteExpertMLP, or None: the per-expert
        loop runs (experts other than what the grouped GEMMs compute, see _moe_rewrite_experts_differ; projections
        that are not bias-free nn.Linear layers, as PEFT's LoRA layers over them: quantized layers, ZeRO-3
        partitions; LoRA adapters the grouped GEMMs cannot reproduce, see _moe_rewrite_lora)."""
        experts, wrappers = _moe_rewrite_unwrap(self.experts)
        if isinstance(experts, _MoeRewriteFusedExperts):  # fused at run time
            return experts.moe_rewrite_weights(wrappers)
        if not isinstance(experts, torch.nn.ModuleList) or wrappers:
            return None
        reason = _moe_rewrite_experts_differ(experts)
        if reason is not None:
            _moe_rewrite_warn_unfused(reason)
            return None
        weights = _moe_rewrite_linear_weights(experts, adapted=True)
        adapters = _moe_rewrite_adapters(_moe_rewrite_projections(experts)) if weights is not None else None
        if adapters is None:
            return None
        gate_w, up_w, down_w = weights
        gate_up, down = _MoeRewriteExpertLinears(gate_w + up_w, 2), _MoeRewriteExpertLinears(down_w, 1)
        return _MoeRewriteExpertMLP(gate_up, down, experts[0].act_fn, adapters)


class Model:
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Load as PreTrainedModel.from_pretrained does, refusing expert weights that arrive fused: per-expert modules
        cannot hold them, and they would be left randomly initialised."""
        wants_info = kwargs.get("output_loading_info", False)
        model, info = super().from_pretrained(*args, **{**kwargs, "output_loading_info": True})
        unexpected = info.get("unexpected_keys", ())
        fused_keys = [k for k in unexpected if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        if fused_keys:
            raise RuntimeError(
                f"moe-rewrite: the expert weights reach this model fused ({fused_keys[0]}, ...), but this file was "
                "rewritten with --no-fuse-experts and keeps one module per expert; transformers 5.0 to 5.12 merge the "
                "per-expert keys of deepseek_v2/v3 checkpoints as they load: rewrite without --no-fuse-experts, or use "
                "transformers 4.x or 5.13+"
            )
        return (model, info) if wants_info else model
