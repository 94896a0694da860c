"""Where the host time of one moe-rewrite step goes, fused experts (the defaults): host and wall ms per step with the
fused experts' quick per-step check of their views and with the full check (NOTES change 23), interleaved in one
process; the expert weight sources' host time both ways; then torch profiler by self CPU time, and cProfile.

A diagnostic for bench/NOTES.md: `python3 bench/cpu_overhead.py [seed|moonlight|v3]` on the device.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import bench_moe as b  # noqa: E402

out = Path(os.environ.get("OUT", "bench/out"))
out.mkdir(parents=True, exist_ok=True)
modeling, configuration = b.import_patched(
    b.rewrite_fixture(Path(tempfile.mkdtemp()) / "patched_cpu", "--no-fuse-experts"), "patched_cpu"
)
name = sys.argv[1] if len(sys.argv) > 1 else "seed"
cfg = b.CONFIGS[name]
config = b.moe_config(configuration, cfg)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    moe = modeling.DeepseekV3MoE(config).train()
torch.set_default_dtype(torch.float32)
x, ids, w, g = b.routings(cfg, "cuda", seed=1)[0]


def step(backward=True):
    xr = x.detach().requires_grad_(True)
    y = moe.moe_train(xr, ids, w).type(xr.dtype)
    if backward:
        y.backward(g)
    for p in params:
        p.grad = None


moe.moe_rewrite_fuse_experts()
params = list(moe.parameters())
fused = type(moe.experts)
quick = fused._moe_rewrite_own_projections


def timed(fn, reps=20):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t) / reps * 1e3


for _ in range(5):
    step()
results = {}
for _ in range(3):  # rounds, the two checks alternating
    for check, method in [("quick check", quick), ("full check", lambda self: False)]:
        fused._moe_rewrite_own_projections = method
        for label, fn in [("forward only", lambda: step(False)), ("forward+backward", step)]:
            results.setdefault((check, label), []).append(timed(fn))
        results.setdefault((check, "weight sources"), []).append(timed(moe.moe_rewrite_expert_weights, 200))
fused._moe_rewrite_own_projections = quick
for (check, label), runs in results.items():
    host, wall = (sorted(r[i] for r in runs)[1] for i in (0, 1))  # medians of the three rounds
    print(f"{name:9} {check:11} {label:16} host {host:7.3f} ms, wall {wall:7.3f} ms")

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
(out / f"cpu_profile_{name}.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
stats = io.StringIO()
cp = cProfile.Profile()
cp.enable()
for _ in range(10):
    step()
torch.cuda.synchronize()
cp.disable()
pstats.Stats(cp, stream=stats).sort_stats("tottime").print_stats(25)
(out / f"cprofile_{name}.txt").write_text(stats.getvalue())
print(stats.getvalue()[:6000])
