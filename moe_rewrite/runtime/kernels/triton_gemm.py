"""A grouped GEMM in Triton (forward and input-gradient products over rows sorted by expert) that runs its tiles
expert by expert, for few rows per expert on sm90 (dispatch.py's _moe_rewrite_gemm_by_triton decides), and for FP8
block-quantized experts at any size (grouped_linear.py's _moe_rewrite_gmm: it reads the FP8 codes and their block
scales, and multiplies each weight tile by its scales in registers: half the weights' memory, not faster); and in
FP8 compute (W8A8, --fp8-compute) FP8 rows times FP8 weights on the FP8 tensor cores, with the kernel that quantizes
the rows per 1 x 128 tile (and its torch ops, which run off CUDA). CUDA with triton; triton is imported when the
kernels are built, never at import.
"""

import torch

from .triton_block import _moe_rewrite_triton_modules

# The grouped GEMM's tile (rows, columns, depth), warps and pipeline stages: the best of bench/triton_gemm.py's at
# V3's sizes on an H200 (bench/NOTES.md, change 26); for FP8 weights the best of bench/fp8_kernels.py's (change 36)
MOE_REWRITE_GEMM_TILE = (128, 256, 64, 8, 3)
MOE_REWRITE_FP8_GEMM_TILE = (128, 128, 64, 4, 3)
# FP8 compute (W8A8, _moe_rewrite_fp8_compute): the tile of each product, forward and input gradient, its depth one
# scale block (each block's product is promoted to the float32 sum with its scales); the fastest of
# bench/fp8_compute_tiles.py's sweep at V3's sizes, 4096 tokens, on an H100 (bench/NOTES.md change 39)
MOE_REWRITE_FP8_COMPUTE_TILES = {"fwd": (64, 128, 128, 4, 4), "dgrad": (128, 64, 128, 4, 4)}
# generated with: fp8-experts
# elsewhere than sm90 (sm89's and sm120's 99 KiB of shared memory per block; not measured): a tile that fits them
MOE_REWRITE_FP8_COMPUTE_SMALL_TILE = (64, 128, 128, 4, 3)
# generated with: fp8-experts
MOE_REWRITE_FP8_MAX = 448.0  # the largest float8_e4m3fn


def _moe_rewrite_gemm_kernels():
    """{"grouped_mm": the jitted kernel, and with FP8 experts "quantize_rows"}. triton must be installed (dispatch.py's
    _moe_rewrite_build_triton asks)."""
    triton, tl = _moe_rewrite_triton_modules()

    @triton.jit
    def grouped_mm(
        a,
        b,
        out,
        offsets,
        experts,
        n,
        k,
        b_expert_stride,
        b_n_stride,
        b_k_stride,
        scales,
        s_expert_stride,
        s_n_stride,
        s_k_stride,
        a_scales,
        a_s_stride,
        EXPERTS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        SCALED: tl.constexpr,
        A_FP8: tl.constexpr,
    ):
        """out[r] = a[r] @ b[e]^T for the rows r of expert e (offsets: the cumulative rows per expert), b[e] read as
        (n, k) through its strides; a (rows, k) and out (rows, n) contiguous, k a multiple of BK. Program p takes the
        p-th (BM x BN) tile in the order (expert, column strip, row tile), counted from the offsets here (no host
        work): an expert's row tiles of one weight strip run side by side and read it from HBM once (bench/NOTES.md,
        change 26). Programs past the last tile return; rows past the last offset are neither read nor written.
        SCALED: b holds FP8 codes and `scales` the scale of each of its 128 x 128 blocks (read through its strides as
        (E, n / 128, k / 128)); each weight tile is multiplied by its scales in float32 and rounded to a's dtype (the
        weights exactly as dequantized to it), then multiplied as usual. BK divides 128. The conversion in registers
        costs more than the halved weight bytes save: 1.3x (forward) to 1.85x (input gradient) the bf16 weights'
        time at v3; none of bench/fp8_kernels.py's variants (weights as the first operand, scales applied to the
        sums, other tiles, Triton's warp specialization) did better (bench/NOTES.md, change 36).
        A_FP8 (with SCALED; FP8 compute, W8A8): a holds FP8 codes too, and `a_scales` the scale of each row's 1 x 128
        tiles, read as (k / 128, rows) through a_s_stride; each BK-deep product of codes runs on the FP8 tensor cores
        and is added to the float32 sum times its row and column scales (DeepSeek-V3's promotion). BK divides 128."""
        pid = tl.program_id(0)
        e_all = tl.arange(0, EXPERTS)
        ends = tl.load(offsets + e_all, mask=e_all < experts, other=0)
        starts = tl.load(offsets + e_all - 1, mask=(e_all > 0) & (e_all < experts), other=0)
        row_tiles = (ends - starts + BM - 1) // BM
        tiles = row_tiles * tl.cdiv(n, BN)
        last = tl.cumsum(tiles, 0)
        if pid < tl.sum(tiles, 0):
            e = tl.sum((last <= pid).to(tl.int32), 0)  # the first expert whose tiles end after p
            mine = e_all == e
            local = pid - tl.sum(tl.where(mine, last - tiles, 0), 0)
            its_row_tiles = tl.sum(tl.where(mine, row_tiles, 0), 0)
            rows = tl.sum(tl.where(mine, starts, 0), 0) + (local % its_row_tiles) * BM + tl.arange(0, BM)
            in_rows = rows < tl.sum(tl.where(mine, ends, 0), 0)
            cols = (local // its_row_tiles) * BN + tl.arange(0, BN)
            in_cols = cols[None, :] < n
            ks = tl.arange(0, BK)
            a_at = a + tl.where(in_rows, rows, 0).to(tl.int64)[:, None] * k + ks[None, :]
            b_at = b + e.to(tl.int64) * b_expert_stride + cols[None, :] * b_n_stride + ks[:, None] * b_k_stride
            s_at = scales + e.to(tl.int64) * s_expert_stride + (cols // 128) * s_n_stride
            as_at = a_scales + tl.where(in_rows, rows, 0)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for depth in range(0, k, BK):
                a_tile = tl.load(a_at, mask=in_rows[:, None], other=0.0)
                b_tile = tl.load(b_at, mask=in_cols, other=0.0)
                if A_FP8:
                    scale = tl.load(s_at + (depth // 128) * s_k_stride, mask=cols < n, other=0.0)
                    a_scale = tl.load(as_at + (depth // 128) * a_s_stride, mask=in_rows, other=0.0)
                    acc += tl.dot(a_tile, b_tile) * (a_scale[:, None] * scale[None, :])
                elif SCALED:
                    scale = tl.load(s_at + (depth // 128) * s_k_stride, mask=cols < n, other=0.0)
                    b_tile = (b_tile.to(tl.float32) * scale[None, :]).to(a_tile.dtype)
                    acc = tl.dot(a_tile, b_tile, acc)
                else:
                    acc = tl.dot(a_tile, b_tile, acc)
                a_at += BK
                b_at += BK * b_k_stride
            at = out + rows.to(tl.int64)[:, None] * n + cols[None, :]
            tl.store(at, acc.to(out.dtype.element_ty), mask=in_rows[:, None] & in_cols)

    kernels = {"grouped_mm": grouped_mm}

    # generated with: fp8-experts
    @triton.jit
    def quantize_rows(x, codes, scales, rows, k, BR: tl.constexpr):
        """FP8 compute's activations: each row's 1 x 128 tiles of x (rows, k) as float8_e4m3fn codes (rows, k) and
        their float32 scales (k / 128, rows), amax / 448 (zero for a zero tile, whose codes are zeros). Program
        (i, j) takes rows i * BR.. of column tile j; k a multiple of 128."""
        tile = tl.program_id(1)
        at = tl.program_id(0) * BR + tl.arange(0, BR)
        in_rows = at < rows
        cols = tile * 128 + tl.arange(0, 128)
        offsets = at.to(tl.int64)[:, None] * k + cols[None, :]
        value = tl.load(x + offsets, mask=in_rows[:, None], other=0.0).to(tl.float32)
        scale = tl.div_rn(tl.max(tl.abs(value), 1), 448.0)
        quotient = tl.div_rn(value, tl.where(scale > 0, scale, 1.0)[:, None])
        code = tl.minimum(tl.maximum(quotient, -448.0), 448.0)
        tl.store(codes + offsets, code.to(codes.dtype.element_ty), mask=in_rows[:, None])
        tl.store(scales + tile * rows + at, scale, mask=in_rows)

    # generated with: fp8-experts
    kernels["quantize_rows"] = quantize_rows
    return kernels


def _moe_rewrite_gemm_fits(n, k, scaled=False):
    """Whether the grouped GEMM's tile fits a product n wide and k deep: whole tiles deep, and for bf16 weights at least
    one tile wide (where it was measured faster than torch's)."""
    _, bn, bk, _, _ = MOE_REWRITE_FP8_GEMM_TILE if scaled else MOE_REWRITE_GEMM_TILE
    return (scaled or n >= bn) and k % bk == 0


def _moe_rewrite_grouped_mm(kernels, a, b, offsets, mode, scale=None, a_scale=None, out_dtype=None, tile=None):
    """grouped_linear.py's _moe_rewrite_gmm's "fwd" (a @ b[e]^T, b (E, n, k)) or "dgrad" (a @ b[e], b (E, k, n)) product
    for rows `a` sorted by expert, `offsets` their cumulative counts per expert (int32): the same rows as
    torch._grouped_mm gives, those past the last offset left unwritten as there. `scale`: b's FP8 block scales
    (E, out / 128, in / 128) of b (E, out, in). `a_scale` (FP8 compute, with `scale`): a holds FP8 codes and this
    their scales (k / 128, rows) (_moe_rewrite_quantize_rows); the product is written in `out_dtype`. `tile`: (BM,
    BN, BK, warps, stages) instead of the mode's own (bench/bench_fp8.py's sweep)."""
    if tile is None and a_scale is not None:
        tile = MOE_REWRITE_FP8_COMPUTE_TILES[mode]
    bm, bn, bk, warps, stages = tile or (MOE_REWRITE_GEMM_TILE if scale is None else MOE_REWRITE_FP8_GEMM_TILE)
    a = a.contiguous()
    experts = b.shape[0]
    n_dim, k_dim = (1, 2) if mode == "fwd" else (2, 1)  # b read as (E, n, k)
    n = b.shape[n_dim]
    # without scales the kernel reads none (SCALED, A_FP8 off): b stands in for them
    scales, s_strides = (
        (b, (0, 0, 0)) if scale is None else (scale, (scale.stride(0), scale.stride(n_dim), scale.stride(k_dim)))
    )
    out = a.new_empty(a.shape[0], n, dtype=out_dtype or a.dtype)
    tiles = (-(-a.shape[0] // bm) + experts) * -(-n // bn)  # at least every expert's tiles
    if a.shape[0] and tiles:
        kernels["grouped_mm"][(tiles,)](
            a,
            b,
            out,
            offsets,
            experts,
            n,
            a.shape[1],
            b.stride(0),
            b.stride(n_dim),
            b.stride(k_dim),
            scales,
            *s_strides,
            b if a_scale is None else a_scale,
            0 if a_scale is None else a_scale.stride(0),
            EXPERTS=1 << max(experts - 1, 0).bit_length(),
            BM=bm,
            BN=bn,
            BK=bk,
            SCALED=scale is not None,
            A_FP8=a_scale is not None,
            num_warps=warps,
            num_stages=stages,
        )
    return out


# generated with: fp8-experts
def _moe_rewrite_quantize_rows(kernels, x):
    """FP8 compute's activations, DeepSeek-V3's recipe: each row's 1 x 128 tiles of x (rows, k), k a multiple of 128,
    as (codes, scales): float8_e4m3fn codes (rows, k) of x / scale and float32 scales (k / 128, rows), each tile's
    amax / 448 (zero for a tile of zeros, whose codes are zeros), divided and rounded as IEEE float32 does (to nearest,
    then to the nearest code). Through the Triton kernel where `kernels` are given, else as torch ops."""
    rows, k = x.shape
    if kernels is None:
        tiles = x.to(torch.promote_types(x.dtype, torch.float32)).view(rows, k // 128, 128)  # float64 stays
        scales = (tiles.abs().amax(-1) / MOE_REWRITE_FP8_MAX).float()
        quotient = tiles / torch.where(scales > 0, scales, 1.0).to(tiles.dtype).unsqueeze(-1)
        codes = quotient.clamp(-MOE_REWRITE_FP8_MAX, MOE_REWRITE_FP8_MAX).to(torch.float8_e4m3fn)
        return codes.view(rows, k), scales.t().contiguous()
    x = x.contiguous()
    codes = x.new_empty(rows, k, dtype=torch.float8_e4m3fn)
    scales = x.new_empty(k // 128, rows, dtype=torch.float32)
    if rows:
        kernels["quantize_rows"][(-(-rows // 32), k // 128)](x, codes, scales, rows, k, BR=32)
    return codes, scales


# generated with: fp8-experts
def _moe_rewrite_dequantize_rows(codes, scales, dtype):
    """The real numbers of _moe_rewrite_quantize_rows' (codes, scales) in `dtype`: each code times its scale in
    float32, or float64 (exact) for float64."""
    rows, k = codes.shape
    compute = torch.promote_types(dtype, torch.float32)
    tiles = codes.to(compute).view(rows, k // 128, 128) * scales.t().to(compute).unsqueeze(-1)
    return tiles.view(rows, k).to(dtype)
