"""The whole training step on one GPU: transformers' own DeepseekV3ForCausalLM against a modeling_deepseek.py rewritten
by moe-rewrite, on the same weights and the same batches (issue #34). One process per row:

    python bench/e2e/native.py --impl native --mode full --batch 2 --seq 4096 --out row.json
    python bench/e2e/native.py --impl moe-rewrite --ckpt REWRITTEN_DIR --mode lora --out row.json

--impl native: transformers' class (sdpa attention, grouped_mm experts); native-liger: the same after Liger's
`apply_liger_kernel_to_deepseek_v3(swiglu=False)` (RMSNorm, RoPE, fused linear cross-entropy); any other name: the
rewritten file in --ckpt (a directory the CLI wrote: code + config). Weights: native's initial weights from seed 0,
loaded into the rewritten model (fused experts: the same key names; per-expert layouts get them split), so the first
losses agree. Step: forward with labels, backward, fused AdamW, gradient checkpointing (use_reentrant=False), random
token ids from a fixed seed; the time is the median of the steps after --warmup. bench/e2e/native.sh runs every row.

--compile layers: `layer.compile()` on each decoder layer (what a user adds in one line; PEFT's base model's layers
under LoRA); model: `torch.compile(model)`; both with the default inductor backend. The row records the first step's
time (compilation included), the graphs traced and the graph breaks dynamo counted, and whether steps after the
warmup traced again. A row that fails records its error (type and first line) instead of timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

# Moonlight's sizes (moonshotai/Moonlight-16B-A3B), 8 layers: 1 dense + 7 MoE
MOONLIGHT = dict(
    vocab_size=163840,
    hidden_size=2048,
    intermediate_size=11264,
    moe_intermediate_size=1408,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    n_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    first_k_dense_replace=1,
    max_position_embeddings=8192,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    num_hidden_layers=8,
)
# LoRA r16 on the attention projections and every MLP projection: modules for attention and the dense/shared MLPs,
# the fused expert parameters (both models name them mlp.experts.gate_up_proj / down_proj) through target_parameters.
TINY = dict(
    MOONLIGHT,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_hidden_layers=2,
)
LORA_MODULES = r".*\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)"
LORA_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def dtype_kwargs(dtype: torch.dtype) -> dict:
    import transformers

    return {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}


def native_model(sizes: dict, liger: bool, device: str) -> torch.nn.Module:
    import transformers

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_deepseek_v3

        apply_liger_kernel_to_deepseek_v3(swiglu=False)
    config = transformers.DeepseekV3Config(**sizes)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", **dtype_kwargs(torch.bfloat16)
        )
    model.config._experts_implementation = "grouped_mm"
    return model


def per_expert(state: dict, keys: set) -> dict:
    """Native's fused expert tensors split into the per-expert keys a --no-fuse-experts file has."""
    out = {}
    for name, tensor in state.items():
        if name in keys:
            out[name] = tensor
        elif name.endswith("experts.gate_up_proj"):
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = tensor[e, :half]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = tensor[e, half:]
        elif name.endswith("experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = tensor[e]
        else:
            out[name] = tensor
    return out


def file_model(ckpt: str, sizes: dict, device: str) -> tuple[torch.nn.Module, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    state = native_model(sizes, liger=False, device=device).state_dict()
    config = AutoConfig.from_pretrained(ckpt, trust_remote_code=True, **sizes)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, **dtype_kwargs(torch.bfloat16))
    own = set(model.state_dict())
    result = model.load_state_dict(per_expert(state, own), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise SystemExit(
            f"weights do not map: missing {result.missing_keys[:4]}, unexpected {result.unexpected_keys[:4]}"
        )
    del state
    if device == "cuda":
        torch.cuda.empty_cache()
    return model, model.config._attn_implementation


def label(args) -> str:
    return args.impl if args.compile == "none" else f"{args.impl} compiled-{args.compile}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", required=True, help="native, native-liger, or a label for the file in --ckpt")
    parser.add_argument("--ckpt", help="a directory the CLI rewrote (code + config); not for native rows")
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (the first is dense)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--profile", help="write a kernel-time table of the last two steps to this file")
    parser.add_argument("--compile", choices=["none", "layers", "model"], default="none")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: a quick smoke test)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU: a smoke test of this script")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        run(args)
    except Exception as error:  # the row says how it failed; the next row still runs
        import traceback

        traceback.print_exc()
        message = (str(error).strip().splitlines() or [""])[0][:300]
        row = dict(impl=label(args), mode=args.mode, seq=f"{args.batch}x{args.seq}", compile=args.compile)
        row["error"] = f"{type(error).__name__}: {message}"
        print(json.dumps(row))
        with open(args.out, "w") as f:
            json.dump(row, f)


def graph_counts() -> tuple[int, int]:
    """(graphs traced, graph breaks) so far in this process, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def run(args) -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    sizes = TINY if args.tiny else dict(MOONLIGHT, num_hidden_layers=args.layers)
    device = "cpu" if args.tiny else "cuda"
    if args.impl.startswith("native"):
        model, attn = native_model(sizes, liger=args.impl == "native-liger", device=device), "sdpa"
    else:
        model, attn = file_model(args.ckpt, sizes, device)
    cuda = device == "cuda"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_MODULES, target_parameters=LORA_PARAMETERS)
        model = get_peft_model(model, lora).to(torch.bfloat16)
    model.train()
    forward = model
    if args.compile == "layers":
        base = model.base_model.model if args.mode == "lora" else model
        for layer in base.model.layers:
            layer.compile(backend=args.backend)
    elif args.compile == "model":
        forward = torch.compile(model, backend=args.backend)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.0, fused=cuda)

    losses: list[float] = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(index: int) -> float:
        g = torch.Generator().manual_seed(index)
        ids = torch.randint(0, sizes["vocab_size"], (args.batch, args.seq), generator=g).to(device)
        sync()
        start = time.perf_counter()
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        losses.append(loss.item())
        return time.perf_counter() - start

    times, graphs = [], []
    for i in range(args.steps):
        times.append(step(i))
        graphs.append(graph_counts())
    if args.profile:  # two more steps, profiled, left out of the timing
        kind = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[kind]) as profiler:
            step(args.steps), step(args.steps + 1)
        order = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=order, row_limit=40, max_name_column_width=90)
        with open(args.profile, "w") as f:
            f.write(f"{args.impl} {args.mode} {args.batch}x{args.seq}, 2 steps after the timed ones\n{table}\n")
    step_s = statistics.median(times[args.warmup :])
    row = dict(
        impl=label(args),
        mode=args.mode,
        compile=args.compile,
        first_step_s=round(times[0], 2),
        graphs=graphs[-1][0],
        graph_breaks=graphs[-1][1],
        traced_after_warmup=graphs[-1][0] - graphs[args.warmup - 1][0] if args.warmup else None,
        seq=f"{args.batch}x{args.seq}",
        tokens_per_s=round(args.batch * args.seq / step_s),
        step_s=round(step_s, 4),
        peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
        losses=[round(x, 5) for x in losses[: args.steps]],
        attention=attn,
        trainable=sum(p.numel() for p in trainable),
        step_times=[round(t, 4) for t in times],
    )
    print(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
