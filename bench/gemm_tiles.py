"""Which CUTLASS tile torch._grouped_mm runs for our forward and input-gradient GEMMs, and what the other one would do.

torch's sm90 grouped GEMM (aten/src/ATen/native/cuda/GroupMM.cu) picks its tile from the average group size: for a
2-D x 3-D product it divides the rows by the number of groups and takes a 64x128x128 ping-pong tile when that is
<= 128 (or the output width is), else a 128x256x64 cooperative one. At v3's sizes (E=256, k=8, 4096 tokens) the
average is exactly 128 rows per expert, so four of the step's six GEMMs (both projections' forward and input
gradient; the weight gradients are 2-D x 2-D and take the large tile) ran the small tile, where SonicMoE's autotune
picked 128x256 for the same shapes. Rows past the last offset belong to no group and are never read, so a few padding
rows (enough to lift the average above 128) make torch take the large tile on the same problem: the generated code
pads its route so since change 22 (bench/NOTES.md), where that adds at most an eighth of the rows.

This times both, on bench_moe.py's skewed routings at v3's widths, for token counts around the boundary: "called" is
the GEMM on the rows alone (the small tile up to 128 rows per expert; what the generated code ran before change 22),
"padded" the same GEMM on a tensor with the padding rows already there (the large tile; what change 22's padded
gather costs), "padded+copy" with the padding added by a copy inside the timed region (what padding inside the GEMM
wrapper would cost). Above 128 rows
per expert nothing is padded and the two are the same call (a control). Variants are interleaved within every
repetition (the A/B order effect, bench/NOTES.md change 20).
Also checks that the real rows' results agree.

    python3 bench/gemm_tiles.py [--tokens 2048,3072,4096,6144] [--reps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe as b  # noqa: E402


def gemms(cfg, w_gate_up, w_down):
    """(name, rows' width, weight, call) for the four GEMMs whose tile depends on the rows per expert."""
    fwd = lambda w: lambda a, offs: torch._grouped_mm(a, w.transpose(1, 2), offs=offs)  # noqa: E731
    dgrad = lambda w: lambda a, offs: torch._grouped_mm(a, w, offs=offs)  # noqa: E731
    return [
        ("gate_up fwd", cfg["H"], fwd(w_gate_up)),
        ("down fwd", cfg["I"], fwd(w_down)),
        ("down dgrad", cfg["H"], dgrad(w_down)),
        ("gate_up dgrad", 2 * cfg["I"], dgrad(w_gate_up)),
    ]


def time_variants(variants, reps):
    """Median ms of each zero-argument callable, the variants interleaved within every repetition."""
    times = {name: [] for name in variants}
    for rep in range(reps + 3):
        for name, fn in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if rep >= 3:  # warm-up
                times[name].append(start.elapsed_time(end))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def compare(call, a, offs, pad, reps):
    """The GEMM on rows `a` as called, on `a` with `pad` zero rows after it, and padded by a copy in the timed region:
    median ms of each, and the padded result's relative difference from the called one on the real rows."""
    padded = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    agree = b.rel(call(padded, offs)[: a.shape[0]], call(a, offs))
    variants = {"called": lambda: call(a, offs), "padded": lambda: call(padded, offs)}
    if pad:
        variants["padded+copy"] = lambda: call(torch.cat([a, a.new_empty(pad, a.shape[1])]), offs)
    return time_variants(variants, reps), agree


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="v3")
    parser.add_argument("--tokens", default="2048,3072,4096,6144")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = parser.parse_args()
    torch.manual_seed(0)
    base = b.CONFIGS[args.config]
    experts = base["E"]
    w_gate_up = torch.randn(experts, 2 * base["I"], base["H"], device="cuda", dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(experts, base["H"], base["I"], device="cuda", dtype=torch.bfloat16) * 0.02
    rows_out = []
    for tokens in map(int, args.tokens.split(",")):
        cfg = dict(base, N=tokens)
        ids = b.routings(cfg, "cuda", seed=1)[0][1]
        rows = ids.numel()
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        pad = max(0, 129 * experts - rows)  # the smallest padding with rows // E > 128
        for name, width, call in gemms(cfg, w_gate_up, w_down):
            a = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
            ms, agree = compare(call, a, offs, pad, args.reps)
            row = dict(
                tokens=tokens,
                rows_per_expert=rows / experts,
                max_rows=int(counts.max()),
                empty_experts=int((counts == 0).sum()),
                gemm=name,
                pad_rows=pad,
                **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                padded_vs_called=round(ms["called"] / ms["padded"], 3),
                rel_diff=float(f"{agree:.1e}"),
            )
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    result = b.record(config=base, rows=rows_out)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gemm-tiles-{args.config}.json").write_text(json.dumps(result, indent=1) + "\n")
    header = (
        f"{'tokens':>6} {'rows/E':>6} {'gemm':14} {'called':>7} {'padded':>7} {'+copy':>7} {'padded vs called':>16}"
    )
    print("\n" + header)
    for r in rows_out:
        copy = f"{r['padded+copy_ms']:7.3f}" if "padded+copy_ms" in r else f"{'-':>7}"
        print(
            f"{r['tokens']:6} {r['rows_per_expert']:6.0f} {r['gemm']:14} {r['called_ms']:7.3f} {r['padded_ms']:7.3f} "
            f"{copy} {r['padded_vs_called']:15.2f}x"
        )


if __name__ == "__main__":
    main()
