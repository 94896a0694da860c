"""Probe: a Triton grouped GEMM whose tiles run expert by expert (each expert's weight strips read once, its rows
re-read from L2), with the first GEMM's gather in its loads and SwiGLU in its epilogue, against torch._grouped_mm.

Why (bench/NOTES.md, "Change 26"): at v3 torch's CUTLASS grouped GEMM takes 3.35 ms for the down projection's forward
and 6.47 for gate_up's input gradient, where SonicMoE's quack GEMMs take 2.47 and 5.44 on the same shapes; both have
outputs 7168 wide, and the skewed routing gives many experts two to seven 128-row tiles. If the tiles of one expert's
weight strip do not run together, the strip (1 MB at K=2048) is read from HBM once per row tile. This kernel orders
its tiles (expert, column strip, row tile), so that an expert's row tiles of one strip run side by side.

Times each GEMM of the step that a fwd-like kernel can run (gate_up fwd with the gather and SwiGLU fused, down fwd,
down dgrad, gate_up dgrad) for a few tile configs, interleaved with torch._grouped_mm on the rows as the generated
code runs them (padded to torch's large tile at v3), on bench_moe.py's routings; checks each result against torch's.

    python3 bench/triton_gemm.py [--configs v3,moonlight,seed] [--reps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
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
from gemm_tiles import time_variants  # noqa: E402

from moe_rewrite.runtime.kernels import dispatch, triton_gather, triton_swiglu  # noqa: E402  (the generated code's own kernels)


@triton.jit
def grouped_mm_kernel(
    a,
    b,
    out,
    h,
    offsets,
    tokens,
    num_experts,
    n_out,
    k_dim,
    a_stride,
    b_expert_stride,
    b_n_stride,
    b_k_stride,
    out_stride,
    E_BLOCK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """out[r] = a[r] @ b[e]^T for the rows r of expert e (offsets: cumulative rows per expert). b[e] is addressed
    as (n, k) by its strides, so both the forward (weight (E, N, K)) and the input gradient (weight (E, K, N)) run
    here. GATHER: a's row r is a[tokens[r]]. SWIGLU: the n_out columns are the gate, the next n_out the up
    projection; out gets both (rows of 2 * n_out) and h = silu(gate) * up from their bf16 values (n_out wide)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_BLOCK)
    ends = tl.load(offsets + experts, mask=experts < num_experts, other=0)
    starts = tl.load(offsets + experts - 1, mask=(experts > 0) & (experts < num_experts), other=0)
    row_tiles = (ends - starts + BM - 1) // BM
    col_tiles = tl.cdiv(n_out, BN)
    tiles = row_tiles * col_tiles
    last = tl.cumsum(tiles, 0)
    if pid >= tl.sum(tiles, 0):
        return
    e = tl.sum((last <= pid).to(tl.int32), 0)
    mine = experts == e
    local = pid - tl.sum(tl.where(mine, last - tiles, 0), 0)
    its_row_tiles = tl.sum(tl.where(mine, row_tiles, 0), 0)
    start = tl.sum(tl.where(mine, starts, 0), 0)
    end = tl.sum(tl.where(mine, ends, 0), 0)
    col_tile = local // its_row_tiles
    rows = start + (local % its_row_tiles) * BM + tl.arange(0, BM)
    in_rows = rows < end
    if GATHER:
        src = tl.load(tokens + rows, mask=in_rows, other=0).to(tl.int64)
    else:
        src = tl.where(in_rows, rows, 0).to(tl.int64)
    cols = col_tile * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    a_ptrs = a + src[:, None] * a_stride + ks[None, :]
    b_base = b + e.to(tl.int64) * b_expert_stride
    b_ptrs = b_base + cols[None, :] * b_n_stride + ks[:, None] * b_k_stride
    in_cols = cols[None, :] < n_out
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if SWIGLU:
        up_ptrs = b_ptrs + n_out * b_n_stride
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, k_dim, BK):
        a_tile = tl.load(a_ptrs, mask=in_rows[:, None], other=0.0)
        acc = tl.dot(a_tile, tl.load(b_ptrs, mask=in_cols, other=0.0), acc)
        if SWIGLU:
            acc_up = tl.dot(a_tile, tl.load(up_ptrs, mask=in_cols, other=0.0), acc_up)
            up_ptrs += BK * b_k_stride
        a_ptrs += BK
        b_ptrs += BK * b_k_stride
    out_rows = rows.to(tl.int64)[:, None] * out_stride
    mask = in_rows[:, None] & in_cols
    gate = acc.to(out.dtype.element_ty)
    tl.store(out + out_rows + cols[None, :], gate, mask=mask)
    if SWIGLU:
        up = acc_up.to(out.dtype.element_ty)
        tl.store(out + out_rows + n_out + cols[None, :], up, mask=mask)
        g = gate.to(tl.float32)
        act = g * tl.sigmoid(g) * up.to(tl.float32)
        tl.store(h + rows.to(tl.int64)[:, None] * n_out + cols[None, :], act.to(h.dtype.element_ty), mask=mask)


@triton.jit
def grouped_wgrad_kernel(
    a, b, out, offsets, experts, m_dim, n_dim, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr
):
    """out[e] = a[rows of e]^T @ b[rows of e] (a (rows, m), b (rows, n), out (E, m, n)): program (e, tile) reduces over
    its expert's rows only, zeros for an expert with none. Tiles of one expert in GROUP-row bands of m tiles."""
    e = tl.program_id(1)
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_dim, BN)
    m_tiles = tl.cdiv(m_dim, BM)
    band = pid // (GROUP * n_tiles)
    first_m = band * GROUP
    size = tl.minimum(m_tiles - first_m, GROUP)
    m_tile = first_m + (pid % (GROUP * n_tiles)) % size
    n_tile = (pid % (GROUP * n_tiles)) // size
    start = tl.load(offsets + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets + e)
    ms = m_tile * BM + tl.arange(0, BM)
    ns = n_tile * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(start, end, BK):
        rows = (k0 + ks).to(tl.int64)
        in_rows = rows < end
        a_t = tl.load(a + rows[:, None] * m_dim + ms[None, :], mask=in_rows[:, None] & (ms[None, :] < m_dim), other=0.0)
        b_t = tl.load(b + rows[:, None] * n_dim + ns[None, :], mask=in_rows[:, None] & (ns[None, :] < n_dim), other=0.0)
        acc = tl.dot(tl.trans(a_t), b_t, acc)
    at = out + e.to(tl.int64) * m_dim * n_dim + ms.to(tl.int64)[:, None] * n_dim + ns[None, :]
    tl.store(at, acc.to(out.dtype.element_ty), mask=(ms[:, None] < m_dim) & (ns[None, :] < n_dim))


def grouped_wgrad(a, b, offsets, config=(128, 128, 64, 8, 3, 8)):
    bm, bn, bk, warps, stages, group = config
    experts, m, n = offsets.numel(), a.shape[1], b.shape[1]
    out = a.new_empty(experts, m, n)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), experts)
    grouped_wgrad_kernel[grid](
        a, b, out, offsets, experts, m, n, BM=bm, BN=bn, BK=bk, GROUP=group, num_warps=warps, num_stages=stages
    )
    return out


WGRAD_CONFIGS = [
    (128, 128, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 8),
    (128, 128, 32, 4, 4, 8),
    (64, 128, 64, 4, 3, 8),
    (128, 128, 64, 8, 3, 1),
]


def grouped_mm(a, weight, offsets, rows, mode, tokens=None, swiglu=False, config=(128, 128, 64, 8, 3)):
    """The probe's GEMM: mode "fwd" a @ weight[e]^T (weight (E, N, K)), "dgrad" a @ weight[e] (weight (E, K, N));
    (rows, N) out, or with swiglu (gate_up (rows, N), h (rows, N / 2))."""
    bm, bn, bk, warps, stages = config
    experts = weight.shape[0]
    if mode == "fwd":
        n, k = weight.shape[1], weight.shape[2]
        b_n, b_k = weight.stride(1), weight.stride(2)
    else:
        k, n = weight.shape[1], weight.shape[2]
        b_n, b_k = weight.stride(2), weight.stride(1)
    n_out = n // 2 if swiglu else n
    assert k % bk == 0, (k, bk)
    out = a.new_empty(rows, n)
    h = a.new_empty(rows, n_out) if swiglu else out
    grid = (triton.cdiv(rows, bm) + experts) * triton.cdiv(n_out, bn)
    grouped_mm_kernel[(grid,)](
        a,
        weight,
        out,
        h,
        offsets,
        tokens if tokens is not None else offsets,
        experts,
        n_out,
        k,
        a.stride(0),
        weight.stride(0),
        b_n,
        b_k,
        out.stride(0),
        E_BLOCK=triton.next_power_of_2(experts),
        BM=bm,
        BN=bn,
        BK=bk,
        GATHER=tokens is not None,
        SWIGLU=swiglu,
        num_warps=warps,
        num_stages=stages,
    )
    return (out, h) if swiglu else out


CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (64, 256, 64, 4, 3)]
SWIGLU_CONFIGS = [(128, 128, 64, 8, 3), (128, 64, 64, 8, 4), (64, 128, 64, 4, 3)]


def route(ids, experts):
    """The tokens of the rows sorted by expert (stable), the offsets (int32), each row's place (positions)."""
    flat = ids.reshape(-1)
    order = flat.sort(stable=True).indices
    counts = torch.bincount(flat, minlength=experts)
    positions = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    return order // ids.shape[1], counts.cumsum(0).to(torch.int32), positions


def probe(name, cfg, reps, device, only_wgrad=False):
    E, H, inter = cfg["E"], cfg["H"], cfg["I"]
    g = torch.Generator(device=device).manual_seed(0)
    w_gate_up = torch.randn(E, 2 * inter, H, generator=g, device=device, dtype=torch.bfloat16) * H**-0.5
    w_down = torch.randn(E, H, inter, generator=g, device=device, dtype=torch.bfloat16) * inter**-0.5
    x, ids, _, _ = b.routings(cfg, device, seed=1)[0]
    tokens, offsets, positions = route(ids, E)
    real = tokens.numel()
    kernels = dispatch._moe_rewrite_build_triton()
    pad = 129 * E - real if 0 < 129 * E - real <= real // 8 else 0  # the generated code's padding (change 22)
    padded = torch.cat([tokens, tokens.new_zeros(pad)])
    rows = x.index_select(0, padded)
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets)
    hidden = torch.nn.functional.silu(gate_up[:, :inter].float()).mul(gate_up[:, inter:].float()).bfloat16()
    grad_out = torch.randn(real + pad, H, generator=g, device=device, dtype=torch.bfloat16) * 1e-2
    grad_gate_up = torch.randn(real + pad, 2 * inter, generator=g, device=device, dtype=torch.bfloat16) * 1e-2
    cases = [  # (gemm, torch's call as the generated code makes it, the probe's call per config, what to compare)
        (
            "gate_up fwd + gather + swiglu",
            lambda: triton_swiglu._moe_rewrite_swiglu(
                kernels,
                torch._grouped_mm(
                    triton_gather._moe_rewrite_gather_rows(kernels, x, positions, real + pad, x.dtype),
                    w_gate_up.transpose(1, 2),
                    offs=offsets,
                ),
            ),
            lambda c: grouped_mm(x, w_gate_up, offsets, real + pad, "fwd", tokens=padded, swiglu=True, config=c),
            lambda got: [(got[0], gate_up), (got[1], hidden)],
            SWIGLU_CONFIGS,
        ),
        (
            "gate_up fwd (rows gathered)",
            lambda: torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets),
            lambda c: grouped_mm(rows, w_gate_up, offsets, real + pad, "fwd", config=c),
            lambda got: [(got, gate_up)],
            CONFIGS,
        ),
        (
            "down fwd",
            lambda: torch._grouped_mm(hidden, w_down.transpose(1, 2), offs=offsets),
            lambda c: grouped_mm(hidden, w_down, offsets, real + pad, "fwd", config=c),
            lambda got: [(got, torch._grouped_mm(hidden, w_down.transpose(1, 2), offs=offsets))],
            CONFIGS,
        ),
        (
            "down dgrad",
            lambda: torch._grouped_mm(grad_out, w_down, offs=offsets),
            lambda c: grouped_mm(grad_out, w_down, offsets, real + pad, "dgrad", config=c),
            lambda got: [(got, torch._grouped_mm(grad_out, w_down, offs=offsets))],
            CONFIGS,
        ),
        (
            "gate_up dgrad",
            lambda: torch._grouped_mm(grad_gate_up, w_gate_up, offs=offsets),
            lambda c: grouped_mm(grad_gate_up, w_gate_up, offsets, real + pad, "dgrad", config=c),
            lambda got: [(got, torch._grouped_mm(grad_gate_up, w_gate_up, offs=offsets))],
            CONFIGS,
        ),
    ]
    rows_real = rows[:real]
    cases += [
        (
            "gate_up wgrad",
            lambda: torch._grouped_mm(grad_gate_up[:real].t(), rows_real, offs=offsets),
            lambda c: grouped_wgrad(grad_gate_up[:real], rows_real, offsets, config=c),
            lambda got: [(got, torch._grouped_mm(grad_gate_up[:real].t(), rows_real, offs=offsets))],
            WGRAD_CONFIGS,
        ),
        (
            "down wgrad",
            lambda: torch._grouped_mm(grad_out.t(), hidden, offs=offsets),
            lambda c: grouped_wgrad(grad_out, hidden, offsets, config=c),
            lambda got: [(got, torch._grouped_mm(grad_out.t(), hidden, offs=offsets))],
            WGRAD_CONFIGS,
        ),
    ]
    if only_wgrad:
        cases = cases[-2:]
    out = []
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    for gemm, ours, theirs, pairs, configs in cases:
        variants, errors = {"torch": ours}, {}
        for c in configs:
            try:
                got = theirs(c)
            except Exception as error:  # a config that does not compile (shared memory): recorded, not timed
                errors[str(c)] = f"{type(error).__name__}: {str(error)[:120]}"
                continue
            errors[str(c)] = max(b.rel(a[:real], ref[:real]) for a, ref in pairs(got))
            variants[str(c)] = lambda c=c, theirs=theirs: theirs(c)
        times = {name: round(ms, 3) for name, ms in time_variants(variants, reps).items()}
        best = min((t, c) for c, t in times.items() if c != "torch")
        row = dict(
            config=name, tokens=cfg["N"], gemm=gemm, torch_ms=times["torch"], ms=times, rel_err=errors, best=best[1]
        )
        row["best_vs_torch"] = round(times["torch"] / best[0], 3)
        row["rows"], row["max_rows_per_expert"] = real, int(counts.max())
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="v3,moonlight,seed")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokens", type=int, help="tokens per step instead of each config's own")
    parser.add_argument("--only-wgrad", action="store_true", help="only the weight gradients' GEMMs")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = parser.parse_args()
    rows = []
    for name in args.configs.split(","):
        cfg = {**b.CONFIGS[name], **({"N": args.tokens} if args.tokens else {})}
        rows += probe(name, cfg, args.reps, "cuda", args.only_wgrad)
        torch.cuda.empty_cache()
    result = b.record(triton=triton.__version__, rows=rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"triton-gemm{args.tokens or ''}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
