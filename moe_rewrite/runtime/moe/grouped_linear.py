"""The grouped GEMM with autograd: rows sorted by expert times their expert's weight, for every expert at once, on the
kernel dispatch.py chose ("torch", "grouped_gemm" or "sorted"); the weight sources it reads, and the gather of x's
rows into expert order. Always generated.

The core never asks how the expert weights are laid out: it gets them from the MoE layer's
`moe_rewrite_expert_weights()` (fused_experts.py, or per_expert.py with --no-fuse-experts) as a _MoeRewriteExpertMLP
of weight sources, objects with `tensors`, `shape` (E, out, in), `stacked(dtype)`, `scale` and `grads(compute)`;
`_MoeRewriteExpertWeight` below is the one for an (E, out, in) tensor, `_MoeRewriteFP8ExpertWeight` the one for FP8
block-quantized experts (DeepSeek-V3's checkpoints as shipped), expert_linears.py's the one for E nn.Linear weights
(and PEFT's LoRA adapters on them).
"""

import torch

from ..kernels.dispatch import (
    _moe_rewrite_custom_op,
    _moe_rewrite_fp8_compute,
    _moe_rewrite_gemm_by_triton,
    _moe_rewrite_grouped_gemm,
    _moe_rewrite_hopper,
    _moe_rewrite_setting,
    _moe_rewrite_triton,
)
from ..kernels.triton_gemm import (
    MOE_REWRITE_FP8_COMPUTE_SMALL_TILE,
    _moe_rewrite_dequantize_rows,
    _moe_rewrite_gemm_fits,
    _moe_rewrite_grouped_mm,
    _moe_rewrite_quantize_rows,
)
from .route import _moe_rewrite_gather, _moe_rewrite_token_sums, _MoeRewriteRoute


def _moe_rewrite_gmm(kernel, a, b, offsets, mode, scale=None):
    """One grouped GEMM over rows sorted by expert; `offsets` holds the cumulative row counts per expert (int32).

    mode "fwd":   a (rows, in),  b (E, out, in) -> (rows, out), each row times its expert's weight transposed
    mode "dgrad": a (rows, out), b (E, out, in) -> (rows, in)
    mode "wgrad": a (rows, out), b (rows, in)   -> (E, out, in), per expert a_e^T @ b_e (zero for empty experts)

    `scale`: b holds FP8 codes and this its 128 x 128 block scales (FP8 experts' weight source): the Triton kernel
    reads b as it is and multiplies each tile by its scales where it runs (CUDA sm89+, bf16 or fp16 rows),
    else b is dequantized to a's dtype first (a transient copy of the weights) and the GEMM runs on `kernel`; in FP8
    compute (dispatch.py's _moe_rewrite_fp8_compute) _moe_rewrite_fp8_gmm runs the forward products; the input
    gradients stay W8A16 (bf16 rows times the codes' tiles), 1.5-2x faster than W8A8 there on an H100, where the FP8
    tensor cores need the weights K-major and Triton transposes each FP8 tile (bench/NOTES.md change 39).
    """
    if torch.compiler.is_compiling() and _moe_rewrite_gmm_op():  # one opaque node of the compiled graph
        return torch.ops.moe_rewrite.grouped_mm(a, b, offsets, scale, kernel, mode)
    # generated with: fp8-experts
    if scale is not None:
        kernels = _moe_rewrite_triton(a.device, a.dtype)
        # FP8 compute quantizes whole 1 x 128 tiles of a's rows: an input width off the grid runs W8A16
        if mode == "fwd" and a.shape[1] % 128 == 0 and _moe_rewrite_fp8_compute(a.device, kernels):
            return _moe_rewrite_fp8_gmm(kernels, a, b, offsets, mode, scale)
        n, k = (b.shape[1], b.shape[2]) if mode == "fwd" else (b.shape[2], b.shape[1])
        fits = kernels is not None and _moe_rewrite_gemm_fits(n, k, scaled=True)
        fits = fits and a.dtype in (torch.bfloat16, torch.float16)
        fits = fits and torch.cuda.get_device_capability(a.device) >= (8, 9)  # Triton's float8 needs sm89+
        if fits and _moe_rewrite_setting("MOE_REWRITE_TRITON_GEMM", "1") != "0":
            return _moe_rewrite_grouped_mm(kernels, a, b, offsets, mode, scale)
        b = _moe_rewrite_dequantize(b, scale, a.dtype)
    if kernel == "torch":
        if mode != "wgrad" and b.stride(2) == 1:
            n, k = (b.shape[1], b.shape[2]) if mode == "fwd" else (b.shape[2], b.shape[1])
            kernels = _moe_rewrite_triton(a.device, a.dtype)
            if kernels is not None and _moe_rewrite_gemm_by_triton(a.device, a.shape[0], b.shape[0], n, k):
                return _moe_rewrite_grouped_mm(kernels, a, b, offsets, mode)
        if mode == "fwd":
            return torch._grouped_mm(a, b.transpose(1, 2), offs=offsets)
        if mode == "dgrad":
            return torch._grouped_mm(a, b, offs=offsets)
        return torch._grouped_mm(a.t(), b, offs=offsets)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).cpu()
    if kernel == "grouped_gemm":
        gg = _moe_rewrite_grouped_gemm()
        counts = counts.long()
        if mode == "fwd":
            return gg.gmm(a, b, counts, trans_b=True)
        if mode == "dgrad":
            return gg.gmm(a, b, counts)
        return gg.gmm(a, b, counts, trans_a=True)
    # "sorted": one pass over contiguous per-expert slices; portable to any device and dtype. Rows past the last
    # offset (padding, _moe_rewrite_padding) are in no group: zeros out, as the grouped kernels leave them unread.
    total = int(counts.sum())
    a_parts, padding = a[:total].split(counts.tolist()), a.shape[0] - total
    if mode == "fwd":
        return torch.cat([*(part @ w.t() for part, w in zip(a_parts, b)), a.new_zeros(padding, b.shape[1])])
    if mode == "dgrad":
        return torch.cat([*(part @ w for part, w in zip(a_parts, b)), a.new_zeros(padding, b.shape[2])])
    return torch.stack([part.t() @ rows for part, rows in zip(a_parts, b[:total].split(counts.tolist()))])


# generated with: fp8-experts
def _moe_rewrite_fp8_gmm(kernels, a, b, offsets, mode, scale):
    """FP8 compute (W8A8) of a "fwd" product (what _moe_rewrite_gmm sends; "dgrad" runs too) of FP8 experts (b's codes,
    `scale` their 128 x 128 block scales), as DeepSeek-V3 trains: a's rows quantized per 1 x 128 tile along the
    product's depth (in dgrad the output gradient's columns), each 128-deep product of codes on the FP8 tensor cores,
    added to the float32 sum times its row's and block's scales, rounded once to a's dtype. Off CUDA the same real
    numbers multiply as torch ops, in float32 or float64 (exact products, another order of sums)."""
    codes, a_scale = _moe_rewrite_quantize_rows(kernels, a)
    if kernels is not None:
        tile = None if _moe_rewrite_hopper(a.device) else MOE_REWRITE_FP8_COMPUTE_SMALL_TILE
        return _moe_rewrite_grouped_mm(kernels, codes, b, offsets, mode, scale, a_scale, a.dtype, tile)
    dtype = torch.promote_types(a.dtype, torch.float32)
    real, weights = _moe_rewrite_dequantize_rows(codes, a_scale, dtype), _moe_rewrite_dequantize(b, scale, dtype)
    return _moe_rewrite_gmm("sorted", real, weights, offsets, mode).to(a.dtype)


@torch.compiler.assume_constant_result  # run at tracing, not traced: the graph holds only the operator's call
def _moe_rewrite_gmm_op():
    """Whether torch.ops.moe_rewrite.grouped_mm (_moe_rewrite_gmm as a custom operator) is registered. Traced as it
    is, the grouped GEMM's row counts per expert would become the graph's shapes ("sorted", "grouped_gemm") or break
    it, and the routing of each step would compile again."""

    def gmm(a, b, offsets, scale, kernel, mode):
        return _moe_rewrite_gmm(kernel, a, b, offsets, mode, scale)

    def fake(a, b, offsets, scale, kernel, mode):
        if mode == "wgrad":
            return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])
        return a.new_empty(a.shape[0], b.shape[1] if mode == "fwd" else b.shape[2])

    schema = "(Tensor a, Tensor b, Tensor offsets, Tensor? scale, str kernel, str mode) -> Tensor"
    return _moe_rewrite_custom_op("grouped_mm", schema, gmm, fake)


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
MOE_REWRITE_FP8_BLOCK = 128  # the side of FP8 checkpoints' square scale blocks (weight_block_size [128, 128])


# generated with: fp8-experts
def _moe_rewrite_dequantize(weight, scale, dtype, block=MOE_REWRITE_FP8_BLOCK):
    """FP8 block-quantized weights as real numbers: `weight` (..., out, in) holds the codes (float8_e4m3fn, or any
    dtype holding them exactly), `scale` (..., ceil(out / block), ceil(in / block)) each block's scale (the
    checkpoint's weight_scale_inv, a multiplier despite its name): codes times their block's scale in float32, rounded
    once to `dtype`, as DeepSeek's weight_dequant computes it (partial last blocks use their own scale). A few experts
    at a time, so that the float32 products stay small."""
    out, inner = weight.shape[-2:]
    result = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    codes, scales = weight.reshape(-1, out, inner), scale.reshape(-1, *scale.shape[-2:]).float()
    results = result.view(-1, out, inner)
    step = max(1, (1 << 28) // max(1, out * inner))  # about 1 GiB of float32 products at a time
    for start in range(0, codes.shape[0], step):
        part, s = codes[start : start + step].float(), scales[start : start + step]
        if out % block == 0 and inner % block == 0:  # whole blocks (fused experts): each scale broadcast over its own
            blocks = part.view(-1, out // block, block, inner // block, block)
            results[start : start + step] = (blocks * s[:, :, None, :, None]).view(-1, out, inner)
        else:
            s = s.repeat_interleave(block, -2)[:, :out].repeat_interleave(block, -1)[:, :, :inner]
            results[start : start + step] = part * s
    return result


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
