"""Where the host time of one moe-rewrite step goes (seed size): torch profiler by self CPU time, and cProfile.

A diagnostic for bench/NOTES.md, not a result: `python3 bench/cpu_overhead.py` on the device.
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
cfg = b.CONFIGS[sys.argv[1] if len(sys.argv) > 1 else "seed"]
config = configuration.DeepseekV3Config(
    hidden_size=cfg["H"],
    moe_intermediate_size=cfg["I"],
    n_routed_experts=cfg["E"],
    num_experts_per_tok=cfg["k"],
    n_shared_experts=None,
    n_group=1,
    topk_group=1,
    hidden_act="silu",
)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    moe = modeling.DeepseekV3MoE(config).train()
torch.set_default_dtype(torch.float32)
x, ids, w, g = b.routings(cfg, "cuda", seed=1)[0]
params = list(moe.parameters())


def step(backward=True):
    xr = x.detach().requires_grad_(True)
    y = moe.moe_train(xr, ids, w).type(xr.dtype)
    if backward:
        y.backward(g)
    for p in params:
        p.grad = None


for _ in range(5):
    step()
torch.cuda.synchronize()
for label, fn in [("forward only", lambda: step(False)), ("forward+backward", step)]:
    t = time.perf_counter()
    for _ in range(20):
        fn()
    host = (time.perf_counter() - t) / 20 * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 20 * 1e3
    print(f"{label:18} host {host:6.2f} ms/step, wall {wall:6.2f} ms/step")
t = time.perf_counter()
for _ in range(20):
    moe.moe_rewrite_expert_weights()
print(f"expert weight sources: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms")
gate_up, down, _ = moe.moe_rewrite_expert_weights()
t = time.perf_counter()
for _ in range(20):
    gate_up.stacked(torch.bfloat16)
print(f"stack gate+up (host): {(time.perf_counter() - t) / 20 * 1e3:.3f} ms")

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
(out / "cpu_profile.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
stats = io.StringIO()
cp = cProfile.Profile()
cp.enable()
for _ in range(10):
    step()
torch.cuda.synchronize()
cp.disable()
pstats.Stats(cp, stream=stats).sort_stats("tottime").print_stats(25)
(out / "cprofile.txt").write_text(stats.getvalue())
print(stats.getvalue()[:6000])
