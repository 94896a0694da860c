"""RMSNorm forward and forward + backward: the published module against the same module with the fused branch the
rmsnorm codemod inserts (runtime/kernels/triton_rmsnorm.py), at the row widths of Moonlight (hidden 2048, q_a 1536,
kv_a 512) and DeepSeek-V3 (hidden 7168), 8192 rows (2 x 4096 tokens), bf16 activations and weights by default.

    python bench/bench_norm.py                      # CUDA; one JSON object per width, then one with all of them
    python bench/bench_norm.py --device cpu         # a tiny smoke run in Triton's interpreter (checks the script)

Each row: median milliseconds (CUDA events) of `iters` timed calls after `warmup` calls, forward alone and forward +
backward (the gradients of x and the weight), for each implementation; the speedup; and the largest differences of
the output and gradients from the published module's (the fused one keeps its roundings:
tests/test_cuda_kernels.py).
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
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--widths", default="2048,1536,512,7168")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--weight-dtype", default=None, help="the norm weight's dtype (default: --dtype)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    if args.device == "cpu":  # before triton is imported: the kernels run in its interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        args.rows, args.widths, args.dtype, args.iters, args.warmup = 16, "64,100", "float32", 2, 1
    import torch

    sys.path.insert(0, str(ROOT))
    from moe_rewrite.runtime.kernels import triton_rmsnorm

    dtype = getattr(torch, args.dtype)
    weight_dtype = getattr(torch, args.weight_dtype or args.dtype)

    class Published(torch.nn.Module):
        """DeepseekV3RMSNorm as published."""

        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class Rewritten(Published):
        """What the rewritten file runs: the codemod's branch first, the published body where it does not apply
        (on the CPU, the kernels are called directly: the branch applies on CUDA only)."""

        def forward(self, hidden_states):
            if args.device == "cpu" or triton_rmsnorm._moe_rewrite_rmsnorm_applies(hidden_states, self.weight):
                return triton_rmsnorm._moe_rewrite_rmsnorm(hidden_states, self.weight, self.variance_epsilon)
            raise RuntimeError("the fused RMSNorm does not apply here")

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

    rows = []
    for width in [int(w) for w in args.widths.split(",")]:
        gen = torch.Generator(device="cpu").manual_seed(width)
        x = torch.randn(args.rows, width, generator=gen).to(args.device, dtype)
        grad = torch.randn(args.rows, width, generator=gen).to(args.device, torch.promote_types(dtype, weight_dtype))
        weight = (0.5 + torch.rand(width, generator=gen)).to(args.device, weight_dtype)
        modules = {"published": Published(width), "fused": Rewritten(width)}
        results: dict = {}
        for name, module in modules.items():
            module.to(args.device)
            with torch.no_grad():
                module.weight.data = weight.clone()
            leaf = x.clone().requires_grad_(True)

            def forward(module=module, leaf=leaf):
                with torch.no_grad():
                    module(leaf)

            def step(module=module, leaf=leaf, grad=grad):
                leaf.grad = module.weight.grad = None
                module(leaf).backward(grad)

            step()
            outputs = (module(leaf).detach(), leaf.grad.clone(), module.weight.grad.clone())
            results[name] = {"forward_ms": timed(forward), "forward_backward_ms": timed(step), "outputs": outputs}
        diffs = {
            f"max_abs_diff_{what}": (a.float() - b.float()).abs().max().item()
            for what, a, b in zip(
                ["out", "grad_x", "grad_weight"], results["fused"]["outputs"], results["published"]["outputs"]
            )
        }
        row = {
            "rows": args.rows,
            "width": width,
            "dtype": args.dtype,
            "weight_dtype": str(weight_dtype).removeprefix("torch."),
            **{
                f"{name}_{key}": round(r[key], 4)
                for name, r in results.items()
                for key in ("forward_ms", "forward_backward_ms")
            },
            "speedup_forward": round(results["published"]["forward_ms"] / results["fused"]["forward_ms"], 3),
            "speedup_forward_backward": round(
                results["published"]["forward_backward_ms"] / results["fused"]["forward_backward_ms"], 3
            ),
            **diffs,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    print(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
