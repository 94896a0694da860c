"""The grouped GEMM with autograd: rows sorted by expert times their expert's weight, for every expert at once, on the
kernel dispatch.py chose (grouped_mm.py's products); the weight sources it reads, and the gather of x's rows into
expert order. Always generated.

The core never asks how the expert weights are laid out: it gets them from the MoE layer's
`moe_rewrite_expert_weights()` (fused_experts.py, or per_expert.py with --no-fuse-experts) as a _MoeRewriteExpertMLP
of weight sources, objects with `tensors`, `shape` (E, out, in), `stacked(dtype)`, `scale` and `grads(compute)`;
`_MoeRewriteExpertWeight` below is the one for an (E, out, in) tensor, `_MoeRewriteFP8ExpertWeight` the one for FP8
block-quantized experts (DeepSeek-V3's checkpoints as shipped), expert_linears.py's the one for E nn.Linear weights
(and PEFT's LoRA adapters on them).
"""

import torch

from .grouped_mm import _moe_rewrite_gmm
from .route import _moe_rewrite_gather, _moe_rewrite_token_sums, _MoeRewriteRoute


class _MoeRewriteExpertWeight:
    """The weight source of one (E, out, in) tensor (a fused experts parameter): autograd connects the tensor itself,
    the GEMMs read it cast to the compute dtype, and its gradient comes back in its own dtype (as nn.Linear's does)."""

    scale = None  # not block-quantized

    def __init__(self, weight):
        self.weight, self.shape = weight, weight.shape
        self.tensors = (weight,)

    def stacked(self, dtype):
        return self.weight.to(dtype)

    def grads(self, compute):
        return (compute().to(self.weight.dtype),)


# generated with: fp8-experts
class _MoeRewriteFP8ExpertWeight:
    """The weight source of FP8 block-quantized fused experts (DeepSeek-V3, R1, Kimi-K2 as shipped): `weight`
    (E, out, in) holds float8_e4m3fn codes and `scale` (E, out / 128, in / 128) the float32 scale of each 128 x 128
    block. Frozen: the GEMMs read the codes and scales as they are (_moe_rewrite_gmm), in the forward and the input
    gradient, and no weight gradient is ever computed (the weight is kept, not copied, for backward)."""

    def __init__(self, weight, scale):
        if weight.requires_grad or scale.requires_grad:
            raise RuntimeError(
                "moe-rewrite: FP8 block-quantized experts are frozen (train adapters on them, e.g. LoRA): set "
                "requires_grad=False on their weights and scales"
            )
        self.weight, self.scale, self.shape = weight, scale, weight.shape
        self.tensors = (weight,)

    def stacked(self, dtype):
        return self.weight


class _MoeRewriteExpertMLP:
    """What the core reads of the routed experts (moe_rewrite_expert_weights()): `gate_up` and `down`, two weight
    sources (gate and up concatenated along the output dim, so one GEMM runs both), the activation `act_fn`, and
    `adapters`, the LoRA adapters: {name: (lora, ...)} on gate_up_proj and down_proj as a whole (parameter_lora.py)
    or on the gate_proj, up_proj and down_proj of every expert (expert_linears.py), each lora
    (A, B, scaling, dropout) with A and B weight sources."""

    __slots__ = ("gate_up", "down", "act_fn", "adapters")

    def __init__(self, gate_up, down, act_fn, adapters):
        self.gate_up, self.down, self.act_fn, self.adapters = gate_up, down, act_fn, adapters


def _moe_rewrite_kept(stacked, keep_stacked, tensors):
    """What an autograd node keeps of a stacked weight for backward: the weight when asked to (keep_stacked) or when it
    is one of the source's own tensors, which costs nothing to keep (autograd saves nn.Linear's weight the same way);
    else None, and backward rebuilds it."""
    return stacked if keep_stacked or any(stacked is t for t in tensors) else None


class _MoeRewriteGatherPlan:
    """How the first GEMM gathers its rows from x: along `route` (a _MoeRewriteRoute), each token's row `top_k`
    times, in `dtype` (the compute dtype), through `kernels` (the Triton kernels for x's dtype, or None)."""

    __slots__ = ("route", "top_k", "dtype", "kernels")

    def __init__(self, route, top_k, dtype, kernels):
        self.route, self.top_k, self.dtype, self.kernels = route, top_k, dtype, kernels


class _MoeRewriteGroupedLinear(torch.autograd.Function):
    """Rows sorted by expert times their expert's weight, for every expert in one grouped GEMM.

    `source` is a weight source (see the top of this section) and `tensors` its `source.tensors`, the inputs autograd
    connects this node to. With keep_stacked False, a stacked weight that is not one of those tensors is rebuilt in
    backward instead of being kept alive between forward and backward (lower peak memory). `gather` is None when x
    holds the rows, or a _MoeRewriteGatherPlan for the first GEMM: the rows are x[route.tokens] in its dtype,
    gathered here and again in backward for the weight gradient, so that x (which the router keeps anyway) is kept
    instead of them (TK x hidden), and x's gradient sums each token's row gradients.
    """

    @staticmethod
    def forward(ctx, x, offsets, kernel, keep_stacked, gather, source, *tensors):
        if gather is None:
            route, ctx.top_k, ctx.dtype, ctx.kernels = None, 1, x.dtype, None
        else:
            route, ctx.top_k, ctx.dtype, ctx.kernels = gather.route, gather.top_k, gather.dtype, gather.kernels
        stacked = source.stacked(ctx.dtype)
        ctx.kernel, ctx.source = kernel, source
        # the real and padded row counts when x's rows are gathered; backward through the Triton kernels reads only
        # the positions of the route, so order and tokens are not kept then (the step's peak is in this backward)
        ctx.rows = None if route is None else (route.order.numel(), route.tokens.numel())
        if route is None:
            kept = (None, None, None)
        elif ctx.kernels is not None and route.positions is not None:
            kept = (None, None, route.positions)
        else:
            kept = (route.order, route.tokens, route.positions)
        ctx.save_for_backward(x, offsets, _moe_rewrite_kept(stacked, keep_stacked, tensors), *kept)
        return _moe_rewrite_gmm(kernel, _moe_rewrite_rows(ctx, x, route), stacked, offsets, "fwd", source.scale)

    @staticmethod
    def backward(ctx, grad):
        x, offsets, stacked, order, tokens, positions = ctx.saved_tensors
        route = _MoeRewriteRoute(order, tokens, positions)
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            if stacked is None:
                stacked = ctx.source.stacked(ctx.dtype)
            grad_x = _moe_rewrite_gmm(ctx.kernel, grad, stacked, offsets, "dgrad", ctx.source.scale)
            del stacked  # a rebuilt copy is freed before the weight gradients are allocated
            if ctx.rows is not None:
                grad_x = _moe_rewrite_token_sums(ctx.kernels, grad_x, route, ctx.top_k, x.dtype)
        tensor_grads = ctx.needs_input_grad[6:]  # after x, offsets, kernel, keep_stacked, gather, source
        grads = (None,) * len(tensor_grads)
        if any(tensor_grads):
            # The weight gradient reads no padding row (its offsets end at the real rows, and its tile does not
            # depend on them): x's rows are gathered without them, less memory at the step's peak.
            rows = _moe_rewrite_rows(ctx, x, route, padded=False)
            grad = grad[: rows.shape[0]]
            grads = ctx.source.grads(lambda: _moe_rewrite_gmm(ctx.kernel, grad, rows, offsets, "wgrad"))
        return (grad_x, None, None, None, None, None, *grads)


def _moe_rewrite_rows(ctx, x, route, padded=True):
    """The grouped linear's input rows: x itself, or the rows x[route.tokens] in the compute dtype (ctx.rows their
    real and padded counts), with the Triton kernels in one pass that reads each token's row once; without the
    padding rows unless `padded`."""
    if ctx.rows is None:
        return x
    return _moe_rewrite_gather(ctx.kernels, x, route, ctx.dtype, count=ctx.rows[1] if padded else ctx.rows[0])


def _moe_rewrite_linear(x, offsets, kernel, keep_stacked, source, gather=None):
    return _MoeRewriteGroupedLinear.apply(x, offsets, kernel, keep_stacked, gather, source, *source.tensors)


class _MoeRewriteGather(torch.autograd.Function):
    """rows[i] = x[route.tokens[i]]: each token once per selected expert, sorted by expert (for adapters on gate_up,
    which read the rows too; without them the first grouped linear gathers them itself).

    Backward sums each token's top_k row gradients (_moe_rewrite_token_sums).
    """

    @staticmethod
    def forward(ctx, x, route, top_k, kernels):
        ctx.save_for_backward(route.order, route.tokens, route.positions)
        ctx.top_k, ctx.kernels = top_k, kernels
        return _moe_rewrite_gather(kernels, x, route, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        route = _MoeRewriteRoute(*ctx.saved_tensors)
        return _moe_rewrite_token_sums(ctx.kernels, grad, route, ctx.top_k, grad.dtype), None, None, None
