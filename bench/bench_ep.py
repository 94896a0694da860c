"""One MoE layer's routed experts, forward + backward, under expert parallelism against FSDP2 without it, on the GPUs
of one host (issue #38's layer rows). Launch with torchrun, one process per GPU:

    torchrun --nproc-per-node 2 bench/bench_ep.py --config moonlight --out $OUT

Every rank runs bench_moe.py's tokens per rank (N at the config), its own routing. Rows:
  ep     config.ep_size = world: each rank holds E / world experts; rows go to them by all-to-all and back
  fsdp2  ep_size = 1: every rank holds every expert, sharded by FSDP2 over all ranks and gathered each step
Both hold the same weights (expert e drawn from seed 1000 + e), so their outputs and input gradients agree within bf16
rounding (the EP path rounds each expert output to bf16 before the weighted sum, as the published moe_infer does).
Also timed: the all-to-all alone with the step's split sizes (4 exchanges of rows: dispatch and combine, forward and
backward), against the traffic model of ../shared/EXPERT_PARALLEL.md (bytes a rank sends and receives). On CPU
(backend gloo, --config tiny), or with --backend gloo on one GPU, it checks itself; its times mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import CONFIGS, import_patched, moe_config, rewrite_fixture, routings  # noqa: E402

SIZES = {**CONFIGS, "tiny": dict(E=8, H=64, I=32, k=2, N=64)}


def build(modeling, configuration, cfg, ep, device):
    """The fixture's DeepseekV3MoE at the config's sizes, ep_size = ep, fused, in bf16 on `device`, expert e's
    weights drawn from seed 1000 + e (so any layout holds the same experts)."""
    config = moe_config(configuration, cfg, ep_size=ep)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            moe = modeling.DeepseekV3MoE(config)
        moe.to_empty(device=device)
    finally:
        torch.set_default_dtype(default)
    experts = moe.moe_rewrite_fuse_experts(allow_meta=True)
    with torch.no_grad():
        for i in range(len(experts)):
            g = torch.Generator(device=device).manual_seed(1000 + experts.first_expert + i)
            experts.gate_up_proj[i].normal_(0, 0.02, generator=g)
            experts.down_proj[i].normal_(0, 0.02, generator=g)
    return moe.train()


def step(moe, x, ids, w, grad):
    x = x.detach().requires_grad_(True)
    y = moe.moe_train(x, ids, w, out_dtype=x.dtype)
    y.backward(grad)
    return y.detach(), x.grad


def timed(fn, reps, device):
    """Mean seconds per call over `reps` after two warm-up calls, every rank in step (a barrier before each)."""
    for _ in range(2):
        fn()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    import time

    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    return (time.perf_counter() - start) / reps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="moonlight", choices=sorted(SIZES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--backend", help="nccl (default on CUDA) or gloo (default on CPU; on one GPU, ranks share it)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    args.backend = args.backend or ("nccl" if cuda else "gloo")
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = SIZES[args.config]
    work = Path(tempfile.mkdtemp())
    patched = rewrite_fixture(work / f"patched_ep{rank}", "--expert-parallel")
    modeling, configuration = import_patched(patched, f"patched_ep{rank}")
    x, ids, w, grad = routings(cfg, device, seed=1 + rank)[0]  # this rank's tokens, routing, output gradient
    name = torch.cuda.get_device_name() if cuda else "cpu"
    results = {"config": args.config, "sizes": cfg, "world": world, "backend": args.backend, "device": name}

    # expert parallelism, ep = world
    moe = build(modeling, configuration, cfg, world, device)
    y_ep, gx_ep = step(moe, x, ids, w, grad)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    results["ep_s"] = timed(lambda: step(moe, x, ids, w, grad), args.reps, device)
    results["ep_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del moe

    # the all-to-all alone, with this routing's split sizes
    local = cfg["E"] // world
    send = torch.bincount(ids.reshape(-1) // local, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send, recv = send.tolist(), recv.tolist()
    rows = x.new_empty(sum(send), cfg["H"])
    back = x.new_empty(sum(recv), cfg["H"])

    def exchanges():
        for _ in range(2):  # forward's dispatch and combine; backward does the same again
            dist.all_to_all_single(back, rows, recv, send)
            dist.all_to_all_single(rows, back, send, recv)

    results["a2a_s"] = timed(exchanges, args.reps, device)
    remote = sum(n for r, n in enumerate(send) if r != rank) + sum(n for r, n in enumerate(recv) if r != rank)
    results["a2a_gb_per_rank"] = 2 * remote * cfg["H"] * 2 / 1e9  # two round trips (fwd + bwd), bf16, out + in

    # FSDP2 without expert parallelism: the experts a unit over every rank
    try:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard, register_fsdp_forward_method
    moe = build(modeling, configuration, cfg, 1, device)
    fully_shard(moe.experts)
    register_fsdp_forward_method(moe.experts, "moe_rewrite_run")
    if args.backend == "gloo" and world > 1:
        moe.experts.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
    y_fsdp, gx_fsdp = step(moe, x, ids, w, grad)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    results["fsdp2_s"] = timed(lambda: step(moe, x, ids, w, grad), args.reps, device)
    results["fsdp2_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    errors = torch.tensor([rel(y_ep, y_fsdp), rel(gx_ep, gx_fsdp)], device=device)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    results["rel_err_y"], results["rel_err_grad_x"] = errors.tolist()
    if rank == 0:
        flops = 18 * cfg["N"] * cfg["k"] * cfg["H"] * cfg["I"]
        results["ep_tflops_per_gpu"] = flops / results["ep_s"] / 1e12
        results["fsdp2_tflops_per_gpu"] = flops / results["fsdp2_s"] / 1e12
        results["a2a_gb_per_s"] = results["a2a_gb_per_rank"] / results["a2a_s"]
        print(json.dumps(results, indent=1), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / f"ep-{args.config}-{world}.json", "w") as f:
            json.dump(results, f, indent=1)
    # every rank out of its collectives before any tears down: a gloo peer torn down mid-exchange aborts the other
    # ("terminate called without an active exception", SIGABRT; seen once in tests/test_expert_parallel.py)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
