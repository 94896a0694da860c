"""Packed attention at MLA's shapes on one GPU (issue #48 part 2): each candidate of runtime/model/packing.py timed
forward + backward at several document-length mixes, with its error against a per-document float32 reference, so that
the default can be picked in one device call. From the repository root on the GPU machine:

    python bench/packing_probe.py --out $OUT/packing_probe.json

Candidates: flex (compiled flex_attention, our document block mask built from the documents once per step: its build
time is reported apart, and create_block_mask's for comparison), varlen (torch.nn.attention.varlen.varlen_attn with
window (-1, 0), v padded to 192; and "varlen_v128", v unpadded, to see whether the kernel takes 192/128), sdpa_docs
(SDPA per document through _moe_rewrite_attention: cuDNN causal per document), and causal_row (cuDNN causal over the
whole row: NOT per document, the lower bound packing pays against). auto: what _moe_rewrite_packed_backend picks.
Rows print as they finish; a failing candidate records its error and the others go on.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from moe_rewrite.runtime.model import attention, packed_attention, packing


def lognormal(total: int, median: float, tail: int, seed: int) -> list[int]:
    """Document lengths, log-normal (sigma 1) with this median, clipped to [16, tail], filling `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(math.exp(math.log(median) + torch.randn((), generator=g).item()))
        lengths.append(max(16, min(tail, n, total - sum(lengths))))
    return lengths


def documents(lengths: list[int], device) -> packing._MoeRewriteDocuments:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
    return packing._MoeRewriteDocuments(starts, ids[None].to(device))


def timed(fn, repeat: int) -> float:
    """Median ms of fn() over `repeat` runs after two warm-ups (the first compiles)."""
    fn(), fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def probe(mix, lengths, args, run_flat, core, scale, device, heads) -> list[dict]:
    """One length mix: every candidate's row, and the block mask's build."""
    dtype, qk, vd, rows = torch.bfloat16, 192, 128, []
    tokens = sum(lengths)
    g = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(1, heads, tokens, qk, device=device, dtype=dtype, generator=g) for _ in range(2))
    v = torch.randn(1, heads, tokens, vd, device=device, dtype=dtype, generator=g)
    grad = torch.randn(1, heads, tokens, vd, device=device, dtype=dtype, generator=g)
    docs = documents(lengths, device)
    # the reference: float32 math SDPA per document
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        want = packing._moe_rewrite_attention_per_document(
            *leaves,
            docs,
            lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale),
        )
    want.backward(grad.float())
    want_grads = [t.grad for t in leaves]
    candidates = {
        "flex": run_flat("flex", docs),
        "varlen": run_flat("varlen", docs),
        "varlen_v128": run_flat("varlen_v128", docs),
        "sdpa_docs": lambda a, b, c: packing._moe_rewrite_attention_per_document(a, b, c, docs, core),
        "causal_row": core,
    }
    mix_row = dict(mix=mix, tokens=tokens, documents=len(lengths), longest=max(lengths))
    try:
        mix_row["auto"] = packing._moe_rewrite_packed_backend(q, v, docs, 0.0)
    except Exception as e:  # noqa: BLE001
        mix_row["auto"] = f"error: {type(e).__name__}: {e}"[:300]
    for name, fn in candidates.items():
        row = dict(mix_row, candidate=name)
        try:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            started = time.perf_counter()
            out = fn(*leaves)
            out.backward(grad)
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - started, 2)
            errors = [(out.float() - want).abs().max().item() / want.abs().max().item()]
            errors += [
                (t.grad.float() - w).abs().max().item() / w.abs().max().item() for t, w in zip(leaves, want_grads)
            ]
            row["rel_err_out_dq_dk_dv"] = [round(e, 5) for e in errors]

            def step(fn=fn, leaves=leaves):
                for t in leaves:
                    t.grad = None
                fn(*leaves).backward(grad)

            row["fwd_bwd_ms"] = round(timed(step, args.repeat), 3)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        print(json.dumps(row), flush=True)
        rows.append(row)
    # the block mask's build: ours (tensor ops) against create_block_mask, per step
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        padded = -(-tokens // 128) * 128
        ids = torch.cat([docs.ids.reshape(-1), docs.ids.new_full((padded - tokens,), len(lengths))])
        ours = timed(lambda: packed_attention._moe_rewrite_document_block_mask(docs, padded, device), args.repeat)
        mod = lambda b, h, i, j: (i >= j) & (ids[i] == ids[j])  # noqa: E731
        theirs = timed(lambda: create_block_mask(mod, 1, 1, padded, padded, device=device), 3)
        same = torch.equal(
            packed_attention._moe_rewrite_document_block_mask(docs, padded, device).to_dense(),
            create_block_mask(mod, 1, 1, padded, padded, device=device).to_dense(),
        )
        row = dict(
            mix_row,
            candidate="block_mask_build",
            ours_ms=round(ours, 3),
            create_block_mask_ms=round(theirs, 3),
            same=same,
        )
    except Exception as e:  # noqa: BLE001
        row = dict(mix_row, candidate="block_mask_build", error=f"{type(e).__name__}: {e}"[:400])
    print(json.dumps(row), flush=True)
    rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    device, heads = torch.device("cuda"), args.heads
    scale = 192**-0.5
    mixes = {
        "16x512": [512] * 16,
        "lognormal_8192": lognormal(8192, 500, 8192, seed=1),
        "lognormal_16384": lognormal(16384, 500, 8192, seed=2),
        "one_8192": [8192],
        "long_and_short_8192": [6144] + [256] * 8,
    }
    core = lambda q, k, v: attention._moe_rewrite_attention(q, k, v, None, scale, 0.0)  # noqa: E731

    def run_flat(name, docs):
        def fn(q, k, v):  # (1, heads, tokens, dim) -> same
            flat = [t.transpose(1, 2).reshape(-1, heads, t.shape[-1]) for t in (q, k, v)]
            if name == "flex":
                out = packing._moe_rewrite_flex(*flat, docs, scale)
            elif name == "varlen":
                out = packing._moe_rewrite_varlen(*flat, docs, scale)
            else:  # varlen_v128: the kernel given v at its own width
                from torch.nn.attention.varlen import varlen_attn

                cu = docs.cu_seqlens(device)
                m = docs.max_length
                out = varlen_attn(*flat, cu, cu, m, m, scale=scale, window_size=(-1, 0))
            return out.reshape(1, -1, heads, out.shape[-1]).transpose(1, 2)

        return fn

    rows = []
    for mix, lengths in mixes.items():
        rows += probe(mix, lengths, args, run_flat, core, scale, device, heads)
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
