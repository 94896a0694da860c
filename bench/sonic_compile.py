"""How long SonicMoE's first calls take through the generated code's sonicmoe backend (runtime/moe/backends.py):
the first forward+backward at a shape compiles its kernels; this times that, a repeat, and new token counts, to see
whether a new batch shape compiles again. Prints one line per call. Needs sonic-moe and an sm90 GPU.

    python bench/sonic_compile.py --config seed
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_moe import CONFIGS  # noqa: E402
from moe_rewrite.runtime.moe import backends, grouped_linear  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="seed")
    parser.add_argument("--tokens", default="4096,4096,4000,2048,4096")
    args = parser.parse_args()
    cfg = CONFIGS[args.config]
    E, H, inter, k = cfg["E"], cfg["H"], cfg["I"], cfg["k"]
    gate_up = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    source = grouped_linear._MoeRewriteExpertWeight
    weights = grouped_linear._MoeRewriteExpertMLP(source(gate_up), source(down), torch.nn.SiLU(), {})
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ids = torch.rand(tokens, E, device="cuda").topk(k, dim=-1).indices
        w = torch.rand(tokens, k, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = backends._moe_rewrite_sonicmoe_experts(x, ids, w, weights, torch.bfloat16)
        y.sum().backward()
        torch.cuda.synchronize()
        print(f"{args.config} tokens={tokens}: first forward+backward {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
