"""The products of the grouped GEMM, without autograd: rows sorted by expert times their expert's (E, out, in) weight,
forward ("fwd"), input gradient ("dgrad") and weight gradient ("wgrad"), on the kernel dispatch.py chose ("torch",
"grouped_gemm", "sorted") or the Triton grouped GEMM; FP8 experts' codes read as they are (W8A16) or, in FP8 compute,
against quantized rows (W8A8); under torch.compile one custom operator. grouped_linear.py's autograd Function calls
them. Always generated.
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
