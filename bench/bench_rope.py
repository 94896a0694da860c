"""RoPE forward and forward + backward: the published apply_rotary_pos_emb against the fused one the rope codemod
branches to (runtime/kernels/triton_rope.py), at Moonlight's sizes by default: batch 2, 4096 positions, q_pe of 16 heads
and k_pe of one, 64 rotated lanes, cut from MLA's projections as the attention forward cuts them, bf16.

    python bench/bench_rope.py                      # CUDA; one JSON object
    python bench/bench_rope.py --device cpu         # a tiny smoke run in Triton's interpreter (checks the script)

Median milliseconds (CUDA events) of `iters` timed calls after `warmup` calls, forward alone and forward + backward
(the gradients of q_pe and k_pe), for each implementation; the speedup; and the largest differences of the outputs and
gradients from the published function's (0 where the kernel keeps its roundings: tests/test_cuda_kernels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    if args.device == "cpu":  # before triton is imported: the kernels run in its interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        args.seq, args.heads, args.dtype, args.iters, args.warmup = 20, 3, "float32", 2, 1
    import torch

    sys.path.insert(0, str(ROOT))
    from moe_rewrite.runtime.kernels import triton_rope

    dtype = getattr(torch, args.dtype)
    nope, rope_dim, latent = 128, 64, 512

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    def published(q, k, cos, sin, position_ids):
        """apply_rotary_pos_emb as published (unsqueeze_dim 1)."""
        cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        q = q.view(*q.shape[:3], -1, 2).transpose(4, 3).reshape(q.shape)
        k = k.view(*k.shape[:3], -1, 2).transpose(4, 3).reshape(k.shape)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def fused(q, k, cos, sin, position_ids):
        """What the rewritten function runs (on the CPU the kernel is called directly: the branch is CUDA's)."""
        if args.device == "cpu" or triton_rope._moe_rewrite_rope_applies(q, k, cos, sin, position_ids, 1):
            return triton_rope._moe_rewrite_rope(q, k, cos, sin, position_ids)
        raise RuntimeError("the fused RoPE does not apply here")

    def timed(fn) -> float:
        """Median milliseconds of fn() over args.iters calls, after args.warmup calls."""
        for _ in range(args.warmup):
            fn()
        samples = []
        for _ in range(args.iters):
            if args.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(samples)

    b, s, h = args.batch, args.seq, args.heads
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, s, h * (nope + rope_dim), generator=gen).to(args.device, dtype)
    q_pe = q.view(b, s, h, nope + rope_dim).transpose(1, 2)[..., nope:]
    compressed = torch.randn(b, s, latent + rope_dim, generator=gen).to(args.device, dtype)
    k_pe = compressed[..., latent:].view(b, s, 1, rope_dim).transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    angles = torch.outer(torch.arange(s).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(args.device, dtype), angles.sin().to(args.device, dtype)
    position_ids = torch.arange(s, device=args.device).unsqueeze(0)
    grads = [torch.randn(x.shape, generator=gen).to(args.device, dtype) for x in (q_pe, k_pe)]

    results: dict = {}
    for name, rope in {"published": published, "fused": fused}.items():
        leaves = [q_pe.detach().requires_grad_(True), k_pe.detach().requires_grad_(True)]

        def forward(rope=rope, leaves=leaves):
            with torch.no_grad():
                rope(*leaves, cos, sin, position_ids)

        def step(rope=rope, leaves=leaves):
            for leaf in leaves:
                leaf.grad = None
            torch.autograd.backward(rope(*leaves, cos, sin, position_ids), grads)

        step()
        outputs = [o.detach() for o in rope(*leaves, cos, sin, position_ids)] + [leaf.grad.clone() for leaf in leaves]
        results[name] = {"forward_ms": timed(forward), "forward_backward_ms": timed(step), "outputs": outputs}
    row = {
        "batch": b,
        "seq": s,
        "q_heads": h,
        "k_heads": 1,
        "dim": rope_dim,
        "dtype": args.dtype,
        **{f"{n}_{key}": round(r[key], 4) for n, r in results.items() for key in ("forward_ms", "forward_backward_ms")},
        "speedup_forward": round(results["published"]["forward_ms"] / results["fused"]["forward_ms"], 3),
        "speedup_forward_backward": round(
            results["published"]["forward_backward_ms"] / results["fused"]["forward_backward_ms"], 3
        ),
        **{
            f"max_abs_diff_{what}": (a.float() - w.float()).abs().max().item()
            for what, a, w in zip(
                ["q", "k", "grad_q", "grad_k"], results["fused"]["outputs"], results["published"]["outputs"]
            )
        },
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
