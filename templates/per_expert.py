"""The per-expert adapter (only with --no-fuse-experts): the grouped-GEMM core reads the experts' own nn.Linear
weights, so state-dict keys, LoRA adapters and hooks see one module per expert. It replaces fused_experts.py's
moe_rewrite_expert_weights (fused experts still work: moe_rewrite.training.fuse_experts fuses them at run time).
"""

import torch

from .fused_experts import _moe_rewrite_linear_weights, _MoeRewriteFusedExperts
from .grouped_gemm import _moe_rewrite_setting


class _MoeRewriteExpertLinears:
    """The weight source of E experts' nn.Linear weights for one projection, or `parts` of them concatenated along the
    output dim (gate and up: parts=2); `weights` lists part 0 of every expert, then part 1.

    stacked(dtype) is one (E, parts * out, in) tensor: a view when the weights already lie at a fixed stride in one
    buffer (an FSDP flat parameter) in that dtype, else a copy. With direct gradients (see
    _moe_rewrite_direct_grads) autograd connects one weight only and grads() writes every expert's .grad itself.
    """

    def __init__(self, weights, parts):
        self.weights, self.parts = tuple(weights), parts
        self.direct = _moe_rewrite_direct_grads(self.weights)
        trainable = [w for w in self.weights if w.requires_grad]
        self.tensors = tuple(trainable[:1] if self.direct else self.weights)

    def stacked(self, dtype):
        weights, parts = self.weights, self.parts
        experts = len(weights) // parts
        first = weights[0]
        rows, cols = first.shape
        base = first.storage_offset()
        stride = weights[1].storage_offset() - base if experts > 1 else 0
        if (
            stride >= parts * rows * cols
            and (stride * first.element_size()) % 16 == 0
            and all(
                w.is_contiguous()
                and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and w.storage_offset() == base + (i % experts) * stride + (i // experts) * rows * cols
                for i, w in enumerate(weights)
            )
        ):
            return first.as_strided((experts, parts * rows, cols), (stride, cols, 1), base).to(dtype)
        # Interleaved as (expert, part), one stack lays them out exactly as (E, parts * out, in).
        interleaved = [weights[p * experts + e] for e in range(experts) for p in range(parts)]
        return torch.stack(interleaved).view(experts, parts * rows, cols).to(dtype)

    def grads(self, compute):
        if self.direct:
            # Only when this backward accumulates into parameters (not autograd.grad, not backward(inputs=...)).
            # torch._C._will_engine_execute_node is private; torch has no public way to ask
            # (tests/test_private_apis.py checks the behaviour relied on).
            node = torch.autograd.graph.get_gradient_edge(self.tensors[0]).node
            if torch._C._will_engine_execute_node(node):
                _moe_rewrite_accumulate(self.weights, self.per_weight(compute()))
            return (None,) * len(self.tensors)
        return tuple(self.per_weight(compute()))

    def per_weight(self, grad_w):
        """Each weight's gradient, in the weights' own dtype (fp32 weights under autocast get fp32 gradients)."""
        grad_w = grad_w.to(self.weights[0].dtype)
        per_part = grad_w.view(len(self.weights) // self.parts, self.parts, -1, grad_w.shape[-1]).unbind(1)
        return [g for part in per_part for g in part.unbind(0)]


def _moe_rewrite_direct_grads(weights):
    """Whether backward may write the experts' weight gradients itself rather than hand them to autograd.

    Each autograd leaf costs several microseconds of host time per step (one engine node per expert weight: 384 for
    128 experts, about 2.5 ms on an H200 host, more than the layer's GPU time; see moe-rewrite's bench/NOTES.md).
    Only for plain leaf tensors without hooks and outside torch.distributed, whose wrappers (DDP, FSDP, DeepSpeed)
    hook gradient accumulation. Tensor hooks are read from the tensors' own `_backward_hooks` and
    `_post_accumulate_grad_hooks` (private; torch has no public query). torch.autograd.grad asking for an expert weight
    needs MOE_REWRITE_DIRECT_GRADS=0. As with any .grad, gradients accumulate.
    """
    if _moe_rewrite_setting("MOE_REWRITE_DIRECT_GRADS", "1") == "0":
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    return all(
        w.is_leaf and not w._backward_hooks and getattr(w, "_post_accumulate_grad_hooks", None) is None for w in weights
    )


def _moe_rewrite_accumulate(weights, grads):
    """w.grad = g, or w.grad += g (one multi-tensor add, torch._foreach_add_ as torch's optimizers use it) where a
    gradient is already there."""
    existing, added = [], []
    for w, g in zip(weights, grads):
        if not w.requires_grad:
            continue
        if w.grad is None:
            w.grad = g
        else:
            existing.append(w.grad)
            added.append(g)
    if existing:
        torch._foreach_add_(existing, added)


class MoE:
    def moe_rewrite_expert_weights(self):
        """The experts' weights for the grouped-GEMM core, (gate_up, down, act_fn), or None: the per-expert loop runs
        (projections that are not plain nn.Linear layers: LoRA adapters, quantized layers, ZeRO-3 partitions)."""
        experts = self.experts
        if isinstance(experts, _MoeRewriteFusedExperts):
            return experts.moe_rewrite_weights()
        weights = _moe_rewrite_linear_weights(experts)
        if weights is None:
            return None
        gate_w, up_w, down_w = weights
        return _MoeRewriteExpertLinears(gate_w + up_w, 2), _MoeRewriteExpertLinears(down_w, 1), experts[0].act_fn


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
