"""Tile sweep for FP8 compute (issue #49): the A-is-FP8 grouped GEMM (rows quantized per 1 x 128 tile, FP8 experts'
codes with their 128 x 128 block scales, W8A8) GEMM by GEMM at V3/K2's expert sizes, for a few (BM, BN, BK, warps,
stages) tiles, timed interleaved with the bf16 Triton kernel and torch._grouped_mm on the dequantized weights, the
W8A16 kernel on the codes, the rows' quantization itself, and for the input gradients the same kernel on a K-major
copy of the codes (what the FP8 tensor cores read without a transpose; not the runtime's: twice the memory). Writes
the best tile per mode ("fwd", "dgrad"; summed over the GEMMs and token counts of that mode) to
OUT/fp8-compute-tiles.json, which bench_fp8.py --tiles reads.

    python3 bench/fp8_compute_tiles.py [--configs v3] [--tokens 4096,16384] [--reps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_moe as b  # noqa: E402
from bench_fp8 import CONFIGS, quantize  # noqa: E402
from gemm_tiles import time_variants  # noqa: E402

from moe_rewrite.runtime.kernels import dispatch, triton_gemm  # noqa: E402
from moe_rewrite.runtime.moe import grouped_mm  # noqa: E402

# (BM, BN, BK, warps, stages); BK divides 128 (a scale block): 128 promotes once per block
TILES = [
    (128, 128, 128, 8, 4),
    (128, 128, 128, 4, 4),
    (128, 128, 128, 8, 3),
    (128, 256, 128, 8, 3),
    (64, 128, 128, 4, 4),
    (128, 64, 128, 4, 4),
    (64, 256, 128, 8, 3),
    (128, 128, 64, 8, 5),
]
GEMMS = (
    ("gate_up fwd", "gate_up", "fwd"),
    ("down fwd", "down", "fwd"),
    ("down dgrad", "down", "dgrad"),
    ("gate_up dgrad", "gate_up", "dgrad"),
)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="v3")
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = parser.parse_args()
    kernels = dispatch._moe_rewrite_build_triton()
    rows_out, totals = [], {"fwd": {}, "dgrad": {}}
    for name in args.configs.split(","):
        e, h, i = (CONFIGS[name][key] for key in ("E", "H", "I"))
        torch.manual_seed(0)
        quantized = {
            "gate_up": quantize(torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02),
            "down": quantize(torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02),
        }
        real = {k: grouped_mm._moe_rewrite_dequantize(*q, torch.bfloat16) for k, q in quantized.items()}
        for tokens in map(int, args.tokens.split(",")):
            _, ids, _, _ = b.routings(dict(CONFIGS[name], N=tokens), "cuda", seed=1)[0]
            counts = torch.bincount(ids.flatten(), minlength=e)
            offsets = counts.cumsum(0).to(torch.int32)
            for gemm, which, mode in GEMMS:
                codes, scales = quantized[which]
                depth = codes.shape[2] if mode == "fwd" else codes.shape[1]
                a = torch.randn(int(counts.sum()), depth, device="cuda").to(torch.bfloat16)
                a_codes, a_scales = triton_gemm._moe_rewrite_quantize_rows(kernels, a)
                want = grouped_mm._moe_rewrite_gmm("torch", a, real[which], offsets, mode)
                w = real[which] if mode == "dgrad" else real[which].transpose(1, 2)
                variants = {
                    "bf16 torch": functools.partial(torch._grouped_mm, a, w, offs=offsets),
                    "bf16 triton": functools.partial(
                        triton_gemm._moe_rewrite_grouped_mm, kernels, a, real[which], offsets, mode
                    ),
                    "w8a16": functools.partial(
                        triton_gemm._moe_rewrite_grouped_mm, kernels, a, codes, offsets, mode, scales
                    ),
                    "quantize rows": functools.partial(triton_gemm._moe_rewrite_quantize_rows, kernels, a),
                }
                errors = {}
                for tile in TILES:
                    fn = functools.partial(
                        triton_gemm._moe_rewrite_grouped_mm, kernels, a_codes, codes, offsets, mode, scales, a_scales,
                        torch.bfloat16, tile,
                    )  # fmt: skip
                    try:  # a tile that does not compile or fit here is left out, with why
                        errors[str(tile)] = round(b.rel(fn(), want), 5)
                        variants[str(tile)] = fn
                    except Exception as error:  # noqa: BLE001
                        print(gemm, tile, "does not run:", str(error).splitlines()[0][:200], flush=True)
                if mode == "dgrad":  # the ideal the kernel's transposed weight tiles are measured against: a K-major
                    # copy of the codes (twice their memory, not what the runtime does), run as a forward product
                    codes_t, scales_t = codes.transpose(1, 2).contiguous(), scales.transpose(1, 2)
                    variants["k-major copy"] = functools.partial(
                        triton_gemm._moe_rewrite_grouped_mm, kernels, a_codes, codes_t, offsets, "fwd", scales_t,
                        a_scales, torch.bfloat16, TILES[0],
                    )  # fmt: skip
                errors["w8a16"] = round(b.rel(variants["w8a16"](), want), 5)
                timed = time_variants(variants, args.reps)
                row = dict(
                    config=name, tokens=tokens, gemm=gemm, ms={k: round(v, 3) for k, v in timed.items()}, rel=errors
                )
                rows_out.append(row)
                for tile in TILES:
                    if str(tile) in timed:
                        totals[mode][str(tile)] = totals[mode].get(str(tile), 0.0) + timed[str(tile)]
                best = min([(v, k) for k, v in timed.items() if k.startswith("(")], default=(float("nan"), "none ran"))
                print(
                    f"{name} {tokens} {gemm}: best {best[1]} {best[0]:.3f} ms"
                    f" (+ quantize {timed['quantize rows']:.3f}),"
                    f" bf16 triton {timed['bf16 triton']:.3f}, bf16 torch {timed['bf16 torch']:.3f},"
                    f" w8a16 {timed['w8a16']:.3f}; rel err {errors.get(best[1])}",
                    flush=True,
                )
                del a, a_codes, a_scales, want
        del quantized, real
        torch.cuda.empty_cache()
    best = {mode: json.loads(min(t, key=t.get).replace("(", "[").replace(")", "]")) for mode, t in totals.items() if t}
    print("best tiles:", best, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8-compute-tiles.json").write_text(json.dumps(best) + "\n")
    (out / "fp8-compute-tile-sweep.json").write_text(
        json.dumps(b.record(rows=rows_out, totals=totals), indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
