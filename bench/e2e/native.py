"""The whole training step on one GPU: transformers' own DeepseekV3ForCausalLM against a modeling_deepseek.py rewritten
by moe-rewrite, on the same weights and the same batches (issue #34). One process per row:

    python bench/e2e/native.py --impl native --mode full --batch 2 --seq 4096 --out row.json
    python bench/e2e/native.py --impl moe-rewrite --ckpt REWRITTEN_DIR --mode lora --out row.json
    python bench/e2e/native.py --impl fp8-compute --ckpt REWRITTEN_DIR --fp8 compute --mode lora --out row.json

--impl native: transformers' class (sdpa attention, grouped_mm experts); native-liger: the same after Liger's
`apply_liger_kernel_to_deepseek_v3(swiglu=False)` (RMSNorm, RoPE, fused linear cross-entropy); any other name: the
rewritten file in --ckpt (a directory the CLI wrote: code + config). Weights: native's initial weights from seed 0,
loaded into the rewritten model (fused experts: the same key names; per-expert layouts get them split), so the first
losses agree. Step: forward with labels, backward, fused AdamW, gradient checkpointing (use_reentrant=False; off with
--checkpointing none, to see what recomputation costs and holds; --checkpointing selective keeps the products' and
attention's outputs), random token ids from a fixed seed; the time is the median of the steps after --warmup.
bench/e2e/native.sh runs every row.

--fp8 w8a16|compute (issue #49; --ckpt rewritten with --fp8-experts): the same initial weights as an FP8 checkpoint as
DeepSeek ships V3/R1 (every nn.Linear's weight but lm_head's, the routed experts' expert by expert, float8_e4m3fn codes
with a float32 weight_scale_inv per 128 x 128 block; config.json with V3's quantization_config), written once into
--fp8-dir and loaded with from_pretrained: the routed experts stay FP8 (half their bf16 memory) and every other layer
is dequantized to bf16; w8a16 runs MOE_REWRITE_FP8_COMPUTE=0 (the FP8 codes times bf16 rows), compute =1 (W8A8 in the
experts' forward GEMMs). Every row records experts_gb, the routed experts' weights as held (codes and scales, or bf16).

--compile layers: `layer.compile()` on each decoder layer (what a user adds in one line; PEFT's base model's layers
under LoRA); model: `torch.compile(model)`; both with the default inductor backend. The row records the first step's
time (compilation included), the graphs traced and the graph breaks dynamo counted, and whether steps after the
warmup traced again. A row that fails records its error (type and first line) instead of timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

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
# fp8_config_overrides' sizes for a tiny FP8 run on the CPU (--tiny --fp8): the experts' and dense MLPs' whole 128 x 128
# blocks, attention's partial ones
TINY_FP8 = dict(TINY, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, q_lora_rank=32)
# DeepSeek-V3's and R1's config.json
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
LORA_MODULES = r".*\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)"
LORA_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def saved_ops() -> set:
    """--checkpointing selective: the operators whose outputs a checkpointed layer keeps instead of recomputing them,
    the matrix products and the attention kernels (torchtitan's selective policy, every product kept): what is left to
    recompute is elementwise. Both models reach them as the same aten operators (grouped_mm for the experts)."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_cudnn_attention"]
    names += ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"]
    return {getattr(aten, name).default for name in names if hasattr(aten, name)}


def checkpointing_kwargs(how: str) -> dict:
    """gradient_checkpointing_kwargs for --checkpointing `how` (layers or selective)."""
    kwargs = {"use_reentrant": False}
    if how == "selective":
        import functools

        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        keep = saved_ops()

        def policy(ctx, op, *args, **kw):
            return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    return kwargs


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


def fp8_tensors(native: torch.nn.Module) -> dict:
    """`native`'s weights as DeepSeek's FP8 checkpoints store them (tests/fp8.py's quantize_blockwise): each nn.Linear
    but lm_head as `weight` (float8_e4m3fn) and `weight_scale_inv` (float32, per 128 x 128 block), the fused expert
    tensors (transformers 5.x) as each expert's gate_proj, up_proj and down_proj so, e_score_correction_bias in
    float32, the rest as they are; on the CPU."""
    from fp8 import quantize_blockwise

    linears = {n for n, m in native.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    out = {}
    for name, tensor in native.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in linears and leaf == "weight":
            out[name], out[f"{module}.weight_scale_inv"] = quantize_blockwise(tensor)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            half = tensor.shape[1] // 2
            parts = (
                {"down_proj": tensor}
                if leaf == "down_proj"
                else {"gate_proj": tensor[:, :half], "up_proj": tensor[:, half:]}
            )
            for projection, part in parts.items():
                codes, scales = quantize_blockwise(part)  # (E, out, in): each expert its own blocks
                for e in range(part.shape[0]):
                    out[f"{module}.{e}.{projection}.weight"] = codes[e]
                    out[f"{module}.{e}.{projection}.weight_scale_inv"] = scales[e]
        else:
            out[name] = tensor.float() if leaf == "e_score_correction_bias" else tensor
    return {name: tensor.detach().contiguous().cpu() for name, tensor in out.items()}


def fp8_checkpoint(args, sizes: dict, device: str) -> Path:
    """The FP8 checkpoint of native's initial weights at `sizes` for the file in --ckpt: the weights written once into
    --fp8-dir (kept for the next FP8 row at the same sizes), and a directory of the row's own code, its config at
    `sizes` with V3's quantization_config, and a link to them."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    shared = Path(args.fp8_dir)
    stamp = json.dumps(dict(sizes, seed=0), sort_keys=True)
    if not (shared / "stamp.json").is_file() or (shared / "stamp.json").read_text() != stamp:
        shutil.rmtree(shared, ignore_errors=True)
        shared.mkdir(parents=True)
        start = time.perf_counter()
        native = native_model(sizes, liger=False, device=device)
        tensors = fp8_tensors(native)
        del native
        if device == "cuda":
            torch.cuda.empty_cache()
        save_file(tensors, shared / "model.safetensors", {"format": "pt"})
        (shared / "stamp.json").write_text(stamp)
        print(f"FP8 checkpoint: {len(tensors)} tensors in {time.perf_counter() - start:.1f}s", flush=True)
    row = shared / f"{args.impl}-checkpoint"
    shutil.rmtree(row, ignore_errors=True)
    row.mkdir()
    for source in Path(args.ckpt).glob("*.py"):
        shutil.copyfile(source, row / source.name)
    config = AutoConfig.from_pretrained(args.ckpt, trust_remote_code=True, **sizes).to_dict()
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (row / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (row / "model.safetensors").symlink_to((shared / "model.safetensors").resolve())
    return row


def fp8_file_model(args, sizes: dict, device: str) -> tuple[torch.nn.Module, str]:
    """The rewritten file loaded from the FP8 checkpoint (fp8_checkpoint) with from_pretrained, on `device`; its routed
    experts FP8 (else the row fails)."""
    import importlib.util

    from transformers import AutoModelForCausalLM
    from transformers.quantizers import quantizer_finegrained_fp8

    if device == "cpu" or importlib.util.find_spec("accelerate") is None:
        # transformers' FP8 quantizer refuses the CPU (4.x) and asks for accelerate, which loading it does not use
        # (5.x): its check only, skipped as tests/test_fp8.py skips it
        quantizer_finegrained_fp8.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    directory = fp8_checkpoint(args, sizes, device)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, **dtype_kwargs(torch.bfloat16))
    model.to(device)
    codes = [n for n, p in model.named_parameters() if ".experts." in n and p.dtype == torch.float8_e4m3fn]
    if not codes:
        raise RuntimeError(f"the routed experts of {directory} did not load as FP8 (rewritten without --fp8-experts?)")
    return model, model.config._attn_implementation


def experts_gb(model: torch.nn.Module) -> float:
    """The routed experts' weights as held (FP8 codes and scales, or bf16; adapters left out), GB."""
    held = [p for n, p in model.named_parameters() if ".experts." in n and "lora" not in n]
    return sum(p.numel() * p.element_size() for p in held) / 1e9


def label(args) -> str:
    compiled = "" if args.compile == "none" else f" compiled-{args.compile}"
    checkpointing = {"layers": "", "none": " no-ckpt", "selective": " selective-ckpt"}[args.checkpointing]
    return f"{args.impl}{compiled}{checkpointing}"


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
    parser.add_argument(
        "--checkpointing",
        choices=["layers", "selective", "none"],
        default="layers",
        help="gradient checkpointing of every decoder layer (the default), selective (keeping the outputs of "
        "saved_ops(): torch's selective activation checkpointing, eager layers only) or none: what recomputation costs",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: a quick smoke test)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU: a smoke test of this script")
    parser.add_argument("--fp8", choices=["w8a16", "compute"], help="the file in --ckpt on an FP8 checkpoint")
    parser.add_argument("--fp8-dir", default="/tmp/e2e-native/fp8-checkpoint", help="where --fp8 writes the weights")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.fp8 and not args.ckpt:
        parser.error("--fp8 needs --ckpt (a file rewritten with --fp8-experts)")
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
    sizes = (TINY_FP8 if args.fp8 else TINY) if args.tiny else dict(MOONLIGHT, num_hidden_layers=args.layers)
    device = "cpu" if args.tiny else "cuda"
    if args.fp8:
        # the row measures the mode it names, whatever the rewrite's --fp8-compute said
        os.environ["MOE_REWRITE_FP8_COMPUTE"] = "1" if args.fp8 == "compute" else "0"
        model, attn = fp8_file_model(args, sizes, device)
    elif args.impl.startswith("native"):
        model, attn = native_model(sizes, liger=args.impl == "native-liger", device=device), "sdpa"
    else:
        model, attn = file_model(args.ckpt, sizes, device)
    cuda = device == "cuda"
    if args.checkpointing != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(args.checkpointing))
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
        kinds = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=kinds, record_shapes=True) as profiler:
            step(args.steps), step(args.steps + 1)
        order = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=order, row_limit=40, max_name_column_width=90)
        # the operators (with their input shapes) that launched the time: where a kernel of the first table comes from
        total = "cuda_time_total" if cuda else "cpu_time_total"
        ops = profiler.key_averages(group_by_input_shape=True).table(
            sort_by=total, row_limit=60, max_name_column_width=60, max_shapes_column_width=100
        )
        with open(args.profile, "w") as f:
            f.write(f"{args.impl} {args.mode} {args.batch}x{args.seq}, 2 steps after the timed ones\n{table}\n")
            f.write(f"\nBy operator and input shapes (time including what each launched):\n{ops}\n")
    step_s = statistics.median(times[args.warmup :])
    row = dict(
        impl=label(args),
        mode=args.mode,
        compile=args.compile,
        checkpointing=args.checkpointing,
        first_step_s=round(times[0], 2),
        graphs=graphs[-1][0],
        graph_breaks=graphs[-1][1],
        traced_after_warmup=graphs[-1][0] - graphs[args.warmup - 1][0] if args.warmup else None,
        seq=f"{args.batch}x{args.seq}",
        tokens_per_s=round(args.batch * args.seq / step_s),
        step_s=round(step_s, 4),
        peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
        experts_gb=float(f"{experts_gb(model):.4g}"),
        fp8=args.fp8,
        losses=[round(x, 5) for x in losses[: args.steps]],
        attention=attn,
        trainable=sum(p.numel() for p in trainable),
        step_times=[round(t, 4) for t in times],
    )
    print(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tests/fp8.py: DeepSeek's quantization
    main()
