"""Probe (issue #37, bench/NOTES.md change 36): variants of the FP8-weight grouped GEMM (bf16 rows times FP8 codes with
a float32 scale per 128 x 128 block; W8A16), to find what the Triton kernel in
moe_rewrite/runtime/kernels/triton_gemm.py should do. The tile order is the runtime kernel's (expert, column strip, row
tile). Variants (constexprs):
  SWAP  0: rows first, out = a W^T (the converted weights are the second operand: through shared memory on sm90)
        1: weights first, out^T = W a^T (the converted weights can be the first operand, from registers)
  POST  0: each weight tile times its scales in float32, rounded to bf16, then multiplied (the weights exactly as
           dequantized to bf16)
        1: the codes converted to bf16 (exact), multiplied, and each k block's partial product times its scales
           added to the float32 sum (BK = 128: one scale block per step; DeepSeek's fp8_gemm does this)
Timed against the bf16 kernel and torch._grouped_mm on the dequantized weights, GEMM by GEMM, interleaved.

    python3 bench/fp8_kernels.py [--configs v3,k2] [--reps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_moe as b  # noqa: E402
from bench_fp8 import CONFIGS, quantize  # noqa: E402
from gemm_tiles import time_variants  # noqa: E402

from moe_rewrite.runtime.kernels import dispatch, triton_gemm  # noqa: E402
from moe_rewrite.runtime.moe import grouped_mm  # noqa: E402


@triton.jit
def w8_grouped_mm(
    a, b, out, offsets, scales, experts, n, k,
    b_e, b_n, b_k, s_e, s_n, s_k,
    EXPERTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SWAP: tl.constexpr, POST: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    e_all = tl.arange(0, EXPERTS)
    ends = tl.load(offsets + e_all, mask=e_all < experts, other=0)
    starts = tl.load(offsets + e_all - 1, mask=(e_all > 0) & (e_all < experts), other=0)
    row_tiles = (ends - starts + BM - 1) // BM
    tiles = row_tiles * tl.cdiv(n, BN)
    last = tl.cumsum(tiles, 0)
    if pid < tl.sum(tiles, 0):
        e = tl.sum((last <= pid).to(tl.int32), 0)
        mine = e_all == e
        local = pid - tl.sum(tl.where(mine, last - tiles, 0), 0)
        its_row_tiles = tl.sum(tl.where(mine, row_tiles, 0), 0)
        rows = tl.sum(tl.where(mine, starts, 0), 0) + (local % its_row_tiles) * BM + tl.arange(0, BM)
        in_rows = rows < tl.sum(tl.where(mine, ends, 0), 0)
        cols = (local // its_row_tiles) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        safe_rows = tl.where(in_rows, rows, 0).to(tl.int64)
        s_at = scales + e.to(tl.int64) * s_e + (cols // 128) * s_n
        if SWAP:
            w_at = b + e.to(tl.int64) * b_e + cols[:, None] * b_n + ks[None, :] * b_k
            x_at = a + safe_rows[None, :] * k + ks[:, None]
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for depth in tl.range(0, k, BK, warp_specialize=WS):
                w = tl.load(w_at, mask=cols[:, None] < n, other=0.0)
                s = tl.load(s_at + (depth // 128) * s_k, mask=cols < n, other=0.0)
                x = tl.load(x_at, mask=in_rows[None, :], other=0.0)
                if POST:
                    acc += tl.dot(w.to(a.dtype.element_ty), x) * s[:, None]
                else:
                    acc = tl.dot((w.to(tl.float32) * s[:, None]).to(a.dtype.element_ty), x, acc)
                w_at += BK * b_k
                x_at += BK
            at = out + rows.to(tl.int64)[None, :] * n + cols[:, None]
            tl.store(at, acc.to(out.dtype.element_ty), mask=in_rows[None, :] & (cols[:, None] < n))
        else:
            x_at = a + safe_rows[:, None] * k + ks[None, :]
            w_at = b + e.to(tl.int64) * b_e + cols[None, :] * b_n + ks[:, None] * b_k
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for depth in tl.range(0, k, BK, warp_specialize=WS):
                x = tl.load(x_at, mask=in_rows[:, None], other=0.0)
                w = tl.load(w_at, mask=cols[None, :] < n, other=0.0)
                s = tl.load(s_at + (depth // 128) * s_k, mask=cols < n, other=0.0)
                if POST:
                    acc += tl.dot(x, w.to(a.dtype.element_ty)) * s[None, :]
                else:
                    acc = tl.dot(x, (w.to(tl.float32) * s[None, :]).to(a.dtype.element_ty), acc)
                x_at += BK
                w_at += BK * b_k
            at = out + rows.to(tl.int64)[:, None] * n + cols[None, :]
            tl.store(at, acc.to(out.dtype.element_ty), mask=in_rows[:, None] & (cols[None, :] < n))


def w8_mm(a, codes, scales, offsets, mode, config):
    bm, bn, bk, warps, stages, swap, post, ws = (*config, 0)[:8]
    n_dim, k_dim = (1, 2) if mode == "fwd" else (2, 1)
    n, experts = codes.shape[n_dim], codes.shape[0]
    out = a.new_empty(a.shape[0], n)
    tiles = (-(-a.shape[0] // bm) + experts) * -(-n // bn)
    w8_grouped_mm[(tiles,)](
        a, codes, out, offsets, scales, experts, n, a.shape[1],
        codes.stride(0), codes.stride(n_dim), codes.stride(k_dim),
        scales.stride(0), scales.stride(n_dim), scales.stride(k_dim),
        EXPERTS=1 << max(experts - 1, 0).bit_length(), BM=bm, BN=bn, BK=bk, SWAP=swap, POST=post, WS=bool(ws),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# (BM rows, BN weight columns, BK, warps, stages, SWAP, POST[, WS: Triton's warp specialization of the k loop])
VARIANTS = [
    (128, 128, 64, 4, 4, 0, 0),
    (128, 128, 64, 4, 3, 0, 0),
    (128, 128, 64, 4, 5, 0, 0),
    (128, 128, 64, 4, 4, 0, 1),
    (64, 128, 64, 4, 4, 0, 0),
    (128, 64, 64, 4, 4, 0, 0),
    (128, 128, 32, 4, 6, 0, 0),
    (128, 128, 64, 4, 4, 0, 0, 1),
    (128, 256, 64, 8, 3, 0, 0, 1),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="v3,k2")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = parser.parse_args()
    kernels = dispatch._moe_rewrite_build_triton()
    rows_out = []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        torch.manual_seed(0)
        e, h, i = cfg["E"], cfg["H"], cfg["I"]
        quantized = {
            "gate_up": quantize(torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02),
            "down": quantize(torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02),
        }
        real = {k: grouped_mm._moe_rewrite_dequantize(*q, torch.bfloat16) for k, q in quantized.items()}
        _, ids, _, _ = b.routings(cfg, "cuda", seed=1)[0]
        counts = torch.bincount(ids.flatten(), minlength=e)
        offsets = counts.cumsum(0).to(torch.int32)
        for gemm, which, mode in (
            ("gate_up fwd", "gate_up", "fwd"),
            ("down fwd", "down", "fwd"),
            ("down dgrad", "down", "dgrad"),
            ("gate_up dgrad", "gate_up", "dgrad"),
        ):
            codes, scales = quantized[which]
            a = torch.randn(int(counts.sum()), codes.shape[2] if mode == "fwd" else codes.shape[1], device="cuda")
            a = a.to(torch.bfloat16)
            want = grouped_mm._moe_rewrite_gmm("torch", a, real[which], offsets, mode)
            variants = {}
            for v in VARIANTS:
                try:  # a variant that does not compile here (warp specialization) is left out, with why
                    w8_mm(a, codes, scales, offsets, mode, v)
                    variants[str(v)] = functools.partial(w8_mm, a, codes, scales, offsets, mode, v)
                except Exception as error:  # noqa: BLE001
                    print(v, "does not run:", str(error).splitlines()[0][:200], flush=True)
            variants["bf16 triton"] = functools.partial(
                triton_gemm._moe_rewrite_grouped_mm, kernels, a, real[which], offsets, mode
            )
            w = real[which] if mode == "dgrad" else real[which].transpose(1, 2)
            variants["bf16 torch"] = functools.partial(torch._grouped_mm, a, w, offs=offsets)
            errors = {label: round(b.rel(fn(), want), 5) for label, fn in variants.items()}
            timed = time_variants(variants, args.reps)
            rows_out.append(dict(config=name, gemm=gemm, ms={k: round(v, 3) for k, v in timed.items()}, rel=errors))
            best = min((v, k) for k, v in timed.items() if k.startswith("("))
            print(name, gemm, "best", best, "bf16 triton", round(timed["bf16 triton"], 3), flush=True)
        del quantized, real
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200-fp8-kernels.json").write_text(json.dumps(b.record(rows=rows_out), indent=1) + "\n")


if __name__ == "__main__":
    main()
