"""End-to-end training steps with FSDP: a DeepSeek-V3-form model built with trust_remote_code from our stand-in fixture
(rewritten by the CLI) at Moonlight sizes, bf16, synthetic tokens from a fixed seed, AdamW, gradient accumulation.

    torchrun --nproc-per-node 2 bench/e2e/train.py --ckpt PATCHED_DIR --impl moe-rewrite --fsdp fsdp2 --out row.json

`--ep N` (with fsdp2, and a file rewritten with --expert-parallel) trains under expert parallelism, ep_size N: the same
initial weights (the whole model's, each rank loading its experts), FSDP2 through the model's moe_rewrite_fully_shard().

One run = one implementation (the patched file decides: rewritten with `--backend loop` for the naive-loop baseline,
with the defaults for moe-rewrite) and one FSDP flavour. bench/e2e/run.sh runs all four and writes the table.
`--lora-rank R` trains PEFT LoRA adapters of rank R (alpha 2R) on the attention projections and every routed expert's
gate, up and down projections, with the base frozen (LORA_TARGETS); without it every parameter trains.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time

import torch
import torch.distributed as dist

MOONLIGHT = dict(
    hidden_size=2048,
    intermediate_size=11264,
    moe_intermediate_size=1408,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.446,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    vocab_size=32000,
    first_k_dense_replace=1,
    max_position_embeddings=8192,
)
# PEFT target_modules: attention and the routed experts (experts.{i}.*), not the shared experts or the dense MLP
LORA_TARGETS = r".*\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|experts\.\d+\.(gate|up|down)_proj)"
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    vocab_size=256,
    first_k_dense_replace=1,
    max_position_embeddings=512,
)


def busy_summary(events, step_times: list[float]) -> str:
    """How much of the profiled wall time the GPU spent in compute kernels, in communication, and in neither."""

    def union(intervals: list[tuple[float, float]]) -> float:
        total, end = 0.0, float("-inf")
        for a, b in sorted(intervals):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    # GPU-side user annotations (FSDP's record_function ranges) mirror a CPU event's name; kernels do not.
    cpu_names = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in cpu_names]
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    wall_ms = sum(step_times) * 1e3
    ms = lambda us: us / 1e3  # noqa: E731
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:30]
    lines = [f"{ms(sum(t)):9.2f} ms {len(t):6d} x  {name[:150]}" for name, t in top]
    return (
        f"profiled steps wall {wall_ms:.1f} ms; GPU compute busy {ms(union(compute)):.1f} ms; "
        f"communication {ms(union(comm)):.1f} ms; compute or communication {ms(union(compute + comm)):.1f} ms; "
        f"{len(compute)} compute kernels\nkernels by total time:\n" + "\n".join(lines)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True, help="a directory the CLI rewrote (code + config)")
    parser.add_argument("--impl", required=True, help="label of the row: naive-loop or moe-rewrite")
    parser.add_argument("--fsdp", choices=["fsdp1", "fsdp2"], required=True)
    parser.add_argument("--moe-layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--no-grad-ckpt", action="store_true")
    parser.add_argument(
        "--sync-each-micro-batch",
        action="store_true",
        help="reduce-scatter gradients after every micro-batch, not only the last one",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU (gloo): a smoke test of this script")
    parser.add_argument("--cpu", action="store_true", help="run on CPU with gloo (smoke tests; FSDP2 only)")
    parser.add_argument("--adamw", choices=["fused", "foreach"], default="fused", help="AdamW implementation (both)")
    parser.add_argument("--profile", help="write a kernel-time table of the last two steps (rank 0) to this file")
    parser.add_argument("--trace", help="with --profile: also write the Chrome trace (Python stacks on) to this file")
    parser.add_argument("--forward-prefetch", action="store_true", help="FSDP1: forward_prefetch=True (both rows)")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0: full training)")
    parser.add_argument(
        "--ep", type=int, default=1, help="expert parallelism: ep_size (FSDP2 through model.moe_rewrite_fully_shard)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cuda = not (args.tiny or args.cpu)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    sizes = TINY if args.tiny else MOONLIGHT
    config = AutoConfig.from_pretrained(
        args.ckpt, trust_remote_code=True, num_hidden_layers=sizes["first_k_dense_replace"] + args.moe_layers, **sizes
    )
    torch.manual_seed(0)  # every rank builds the same initial weights
    with device:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, torch_dtype=torch.bfloat16)
    if args.ep > 1:  # the same weights, each rank holding its experts: the whole model's per-expert state dict
        import sys

        if args.fsdp != "fsdp2":
            raise SystemExit("--ep needs --fsdp fsdp2")
        whole = sys.modules[type(model).__module__]._moe_rewrite_unfuse_state_dict(None, model)
        del model
        config.ep_size = args.ep
        with device:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, torch_dtype=torch.bfloat16)
        loaded = model.load_state_dict(whole, strict=False)
        assert not loaded.missing_keys, loaded.missing_keys[:3]
        del whole
    # Files rewritten with the defaults build the model with fused experts (two parameters per MoE layer).
    fused = any(type(m).__name__ == "_MoeRewriteFusedExperts" for m in model.modules())
    grad_ckpt = not args.no_grad_ckpt
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    decoder = model.model
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=LORA_TARGETS)
        model = get_peft_model(model, lora).to(torch.bfloat16)  # adapters in the base's dtype
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model.train()
    layer_cls = type(decoder.layers[0])
    if args.ep > 1:  # experts over the ranks holding them, the rest over all ranks; expert gradients / world
        model.moe_rewrite_fully_shard()
    elif args.fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
        model = FSDP(
            model,
            auto_wrap_policy=policy,
            use_orig_params=True,
            device_id=device if cuda else None,
            forward_prefetch=args.forward_prefetch,
        )
    fused_adamw = args.adamw == "fused" and cuda
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=1e-4,
        weight_decay=0.0,
        fused=fused_adamw,
        foreach=not fused_adamw,
    )

    def batch(step: int, micro: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
        return torch.randint(0, config.vocab_size, (args.micro_batch, args.seq), generator=g).to(device)

    losses, times = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    profiler = None
    for step in range(args.steps):
        if args.profile and rank == 0 and step == args.steps - 2:
            profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                record_shapes=False,
                with_stack=bool(args.trace),
            )
            profiler.__enter__()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for micro in range(args.accum):
            ids = batch(step, micro)
            # As accelerate's gradient accumulation does: gradients are reduced once, after the last micro-batch.
            sync = args.sync_each_micro_batch or micro == args.accum - 1
            if args.fsdp == "fsdp2":
                model.set_requires_gradient_sync(sync)
            with contextlib.nullcontext() if sync or args.fsdp == "fsdp2" else model.no_sync():
                loss = model(input_ids=ids, labels=ids).loss / args.accum
                loss.backward()
            total += loss.detach().float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / world)  # .item() synchronizes: the step is done
        times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"[{args.impl} {args.fsdp}] step {step}: loss {losses[-1]:.5f}, {times[-1]:.3f} s", flush=True)

    if profiler is not None:
        profiler.__exit__(None, None, None)
        averages = profiler.key_averages()
        with open(args.profile, "w") as f:
            f.write(busy_summary(profiler.events(), times[-2:]) + "\n\n")
            f.write(averages.table(sort_by="cuda_time_total", row_limit=40) + "\n\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
        if args.trace:
            profiler.export_chrome_trace(args.trace)
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    timed = sorted(times[args.warmup :])
    step_s = timed[len(timed) // 2]
    if rank == 0:
        tokens = args.micro_batch * args.seq * args.accum
        row = dict(
            impl=args.impl,
            fsdp=args.fsdp,
            ep_size=args.ep,
            step_s=round(step_s, 4),
            tokens_per_s_per_gpu=round(tokens / step_s, 1),
            peak_gb=round(peak.item(), 2),
            losses=[round(v, 6) for v in losses],
            world_size=world,
            gradient_checkpointing=grad_ckpt,
            fused_experts=fused,
            layers=config.num_hidden_layers,
            accum=args.accum,
            sync_each_micro_batch=args.sync_each_micro_batch,
            forward_prefetch=args.forward_prefetch,
            lora_rank=args.lora_rank,
            trainable_params=trainable,
            step_times_s=[round(t, 4) for t in times],
        )
        with open(args.out, "w") as f:
            json.dump(row, f)
        print(json.dumps(row), flush=True)
    # every rank out of its collectives before any tears down: a gloo peer torn down mid-exchange aborts the other
    # ("terminate called without an active exception", SIGABRT; seen once in tests/test_expert_parallel.py)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
