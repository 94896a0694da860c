"""Compile Liger's fused-MoE autotune candidates for one of bench_moe.py's sizes in parallel, so that a tuned Liger row
(LIGER_FUSED_MOE_AUTOTUNE=1) only has to time them.

Liger's autotuned kernels (liger_kernel/ops/fused_moe_kernels.py) take the hidden and intermediate sizes as
constexprs, so each size compiles every candidate config again, one after another in the tuning process: at V3's sizes
that took over five minutes here. Each of N worker processes keeps its share of every autotuned kernel's configs and
runs one forward and backward on a few tokens and 16 experts (the expert count and token count are runtime arguments
of those kernels: the same compiled kernels), which fills TRITON_CACHE_DIR; the tuning run then finds each candidate
compiled. Prints the workers' exit codes and the total time.

    TRITON_CACHE_DIR=DIR python3 bench/liger_compile.py v3 [WORKERS]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(name, index, count):
    os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "1"  # before the import: the full config lists
    os.environ.pop("TRITON_CACHE_AUTOTUNING", None)  # this worker's timings over its share are not the tuning
    import torch
    import triton
    from bench_moe import CONFIGS
    from liger_kernel.ops import fused_moe_kernels
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    for kernel in vars(fused_moe_kernels).values():
        if isinstance(kernel, triton.runtime.autotuner.Autotuner):
            share = kernel.configs[index::count] or kernel.configs[index % len(kernel.configs) :][:1]
            kernel.configs = share
    cfg = CONFIGS[name]
    experts, hidden, inter, top_k, tokens = 16, cfg["H"], cfg["I"], cfg["k"], 64
    with torch.device("cuda"):
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, requires_grad=True)
        down = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, requires_grad=True)
        ids = torch.rand(tokens, experts).topk(top_k, dim=-1).indices.to(torch.int32)
        w = torch.rand(tokens, top_k, dtype=torch.bfloat16, requires_grad=True)
    LigerFusedMoEFunction.apply(x, gate_up, down, ids, w).sum().backward()
    torch.cuda.synchronize()


def main():
    name = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else os.cpu_count() or 8
    if len(sys.argv) > 3:  # a worker: name count index
        worker(name, int(sys.argv[3]), count)
        return
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, name, str(count), str(i)]) for i in range(count)]
    codes = [p.wait() for p in procs]
    print(f"liger_compile {name}: {count} workers, exit codes {codes}, {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
