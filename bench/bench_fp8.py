"""FP8 block-quantized experts (issue #37): the expert MLP forward + backward with LoRA r16 on every routed expert, one
GPU, at V3/R1's and Kimi-K2's sizes (E 256 / 384, H 7168, I 2048, k 8, 4096 tokens).

The weights are drawn in bf16, quantized as DeepSeek's checkpoints are (tests/fp8.py: float8_e4m3fn, a scale per
128 x 128 block), and every row computes with the same weights: the bf16 rows hold the FP8 weights dequantized to bf16
(what the FP8 rows' kernels multiply by), so the rows differ only by rounding. Rows (bf16 activations, LoRA r16 alpha
32 in bf16, base frozen, the same adapters):
  moe-rewrite-lora[bf16]     bf16 fused experts, PEFT target_parameters: our fastest bf16 LoRA path (bench_lora.py)
  moe-rewrite-lora[fp8]      FP8 fused experts (codes + scales), the same adapters: the Triton grouped GEMM reads the
                             codes and multiplies each tile by its scales (forward and input gradient)
  moe-rewrite-lora[fp8,compute]  the same in FP8 compute (MOE_REWRITE_FP8_COMPUTE=1, W8A8, issue #49): rows quantized
                             per 1 x 128 tile, FP8 tensor-core products (forward and input gradient of the base)
  moe-rewrite-lora[fp8,dequant]  the same with MOE_REWRITE_TRITON_GEMM=0: weights dequantized per GEMM, then
                             torch._grouped_mm (the fallback off the Triton path)
  naive-loop-lora            PEFT target_modules on the --no-fuse-experts output's per-expert bf16 layers, run through
                             the per-expert loop (MOE_REWRITE_BACKEND=loop)
  transformers-fp8-experts   transformers' own FP8Experts (grouped_mm) on the same codes and scales, without LoRA,
                             where it runs (its kernels come from the Hub)
expert GB: the experts' weights as held (codes and scales, or bf16). rel err: output, input gradient and LoRA
gradients against moe-rewrite-lora[bf16]; for FP8 compute also each of them against the W8A16 row (vs_w8a16).

    python3 bench/bench_fp8.py [--configs v3,k2] [--tokens 4096,16384] [--rows bf16,fp8,fp8-compute,dequant,loop,native]
        [--tiles OUT/fp8-compute-tiles.json] [--reps 10] [--out DIR]

--tiles: FP8 compute's tiles per mode as bench/fp8_compute_tiles.py writes them (else the generated code's own).

bench/fp8_kernels.py times the kernel's variants GEMM by GEMM.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import bench_lora as bl  # noqa: E402
import bench_moe as b  # noqa: E402
from fp8 import quantize_blockwise  # noqa: E402

CONFIGS = {"v3": b.CONFIGS["v3"], "k2": dict(b.CONFIGS["v3"], E=384), "seed": b.CONFIGS["seed"]}


def quantize(weight, chunk=16):
    """(codes, scales) of an (E, out, in) weight, a few experts at a time (float32 temporaries)."""
    parts = [quantize_blockwise(weight[i : i + chunk]) for i in range(0, weight.shape[0], chunk)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def expert_gb(module):
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if "lora" not in n) / 2**30


def fp8_experts(modeling, bf16_experts, dtype=torch.bfloat16):
    """FP8 fused experts quantized from `bf16_experts`, whose weights become the dequantized FP8 ones."""
    inter = bf16_experts.down_proj.shape[2]
    (gate_up, gate_up_s), (down, down_s) = quantize(bf16_experts.gate_up_proj), quantize(bf16_experts.down_proj)
    with torch.no_grad():
        for name, codes, scales in (("gate_up_proj", gate_up, gate_up_s), ("down_proj", down, down_s)):
            getattr(bf16_experts, name).copy_(modeling._moe_rewrite_dequantize(codes, scales, dtype))
    blocks = inter // 128
    experts = modeling._MoeRewriteFusedExperts(
        bf16_experts.act_fn,
        list(gate_up[:, :inter]),
        list(gate_up[:, inter:]),
        list(down),
        scales=(list(gate_up_s[:, :blocks]), list(gate_up_s[:, blocks:]), list(down_s)),
        dtype=dtype,
    )
    del gate_up, down
    return experts


def with_lora(experts, source=None):
    """`experts` inside a holder, PEFT's target_parameters LoRA on its two parameters (bf16 adapters, LoRA only
    trains), the adapters copied from `source` (another holder) when given."""
    from peft import LoraConfig, inject_adapter_in_model

    holder = torch.nn.Module()
    holder.experts = experts
    config = LoraConfig(
        r=bl.RANK,
        lora_alpha=bl.ALPHA,
        init_lora_weights=False,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    torch.manual_seed(1)
    inject_adapter_in_model(config, holder)
    for name, p in holder.named_parameters():
        if "lora" in name:
            p.data = p.data.to(torch.bfloat16)
        p.requires_grad_("lora" in name)
    if source is not None:
        bl.copy_parameter_adapters(source, holder)
    return holder


def native_fp8(config, codes, cfg, data):
    """transformers' own FP8Experts (grouped_mm) on the same codes and scales, forward + backward without LoRA: (ms,
    None) or (None, why it does not run)."""
    try:
        import copy

        from transformers.integrations.finegrained_fp8 import FP8Experts

        native_config = copy.copy(config)
        native_config.num_experts, native_config._experts_implementation = cfg["E"], "grouped_mm"
        with torch.device("cuda"):
            experts = FP8Experts(native_config, block_size=(128, 128))
        with torch.no_grad():
            for name, value in codes.items():
                getattr(experts, name).copy_(value)
        experts.requires_grad_(False)
        fn = lambda x, ids, w: experts(x, ids, w.to(x.dtype))  # noqa: E731
        ms, _, peak, _, _, _ = b.run_impl(fn, data, experts, None, 2, 5)
        return ms, peak, None
    except Exception as error:  # noqa: BLE001 (whatever stops it is the row's result)
        return None, None, f"{type(error).__name__}: {str(error).splitlines()[0][:240]}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="v3,k2")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--label", default="h200-fp8")
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--rows", default="bf16,fp8,fp8-compute,dequant,loop,native")
    parser.add_argument("--tiles", default=None)
    args = parser.parse_args()
    wanted = set(args.rows.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    work = Path(tempfile.mkdtemp())
    rows, notes = [], []
    fused_mod, configuration = b.import_patched(b.rewrite_fixture(work / "fp8_fused", "--fp8-experts"), "fp8_fused")
    if args.tiles and not Path(args.tiles).is_file():
        notes.append(f"--tiles {args.tiles}: no such file, the generated code's own tiles")
    elif args.tiles:
        tiles = {mode: tuple(tile) for mode, tile in json.loads(Path(args.tiles).read_text()).items()}
        fused_mod.MOE_REWRITE_FP8_COMPUTE_TILES.update(tiles)
        notes.append(f"FP8 compute tiles: {tiles}")
    print("FP8 compute tiles:", fused_mod.MOE_REWRITE_FP8_COMPUTE_TILES, flush=True)
    plain_mod, _ = b.import_patched(b.rewrite_fixture(work / "fp8_plain", "--no-fuse-experts"), "fp8_plain")
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        config = b.moe_config(configuration, cfg)
        torch.manual_seed(0)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            moe = fused_mod.DeepseekV3MoE(config).train()
        moe.moe_rewrite_fuse_experts()
        fp8 = fp8_experts(fused_mod, moe.experts)  # moe's bf16 experts now hold the dequantized FP8 weights
        codes = {n: p.detach() for n, p in fp8.named_parameters()}
        holders = {"moe-rewrite-lora[bf16]": with_lora(moe.experts)}
        holders["moe-rewrite-lora[fp8]"] = with_lora(fp8, holders["moe-rewrite-lora[bf16]"])
        holders["moe-rewrite-lora[fp8,dequant]"] = holders["moe-rewrite-lora[fp8]"]
        plain = None
        # at k2 a third copy of the experts (and PEFT's delta check) does not fit beside the others
        if cfg["E"] <= 256 and "loop" in wanted:
            with torch.device("cuda"):
                plain = plain_mod.DeepseekV3MoE(config).train()
        torch.set_default_dtype(default_dtype)
        if plain is not None:
            with torch.no_grad():
                inter = cfg["I"]
                for e, expert in enumerate(plain.experts):
                    expert.gate_proj.weight.copy_(moe.experts.gate_up_proj[e, :inter])
                    expert.up_proj.weight.copy_(moe.experts.gate_up_proj[e, inter:])
                    expert.down_proj.weight.copy_(moe.experts.down_proj[e])
            from peft import LoraConfig

            bl.inject(LoraConfig(r=bl.RANK, lora_alpha=bl.ALPHA, target_modules=bl.PROJECTIONS), plain)
            bl.per_expert_adapters(plain, holders["moe-rewrite-lora[bf16]"])
            for n, p in plain.named_parameters():
                if "lora" in n:
                    p.data = p.data.to(torch.bfloat16)
                p.requires_grad_("lora" in n)
        elif "loop" in wanted:
            notes.append(f"{name}: naive-loop-lora left out (a third copy of the experts does not fit)")
        impls = [
            ("bf16", "moe-rewrite-lora[bf16]", moe, fused_mod, {}),
            ("fp8", "moe-rewrite-lora[fp8]", moe, fused_mod, {}),
            ("fp8-compute", "moe-rewrite-lora[fp8,compute]", moe, fused_mod, {"MOE_REWRITE_FP8_COMPUTE": "1"}),
            ("dequant", "moe-rewrite-lora[fp8,dequant]", moe, fused_mod, {"MOE_REWRITE_TRITON_GEMM": "0"}),
        ]
        holders["moe-rewrite-lora[fp8,compute]"] = holders["moe-rewrite-lora[fp8]"]
        if plain is not None:
            impls.append(("loop", "naive-loop-lora", plain, plain_mod, {"MOE_REWRITE_BACKEND": "loop"}))
        for tokens in map(int, args.tokens.split(",")):
            data = b.routings(dict(cfg, N=tokens), "cuda", seed=1)
            ref = {}
            for short, impl, module, modeling, env in impls:
                if short not in wanted:
                    continue
                try:  # a row that fails (out of memory at 16384 tokens) is recorded as such, the others still run
                    rows.append(
                        dict(
                            config=name,
                            tokens=tokens,
                            impl=impl,
                            **row(args, module, modeling, env, impl, holders, data, ref),
                        )
                    )
                except Exception as error:  # noqa: BLE001
                    torch.cuda.empty_cache()
                    rows.append(
                        dict(
                            config=name,
                            tokens=tokens,
                            impl=impl,
                            ms=None,
                            note=f"{type(error).__name__}: {str(error)[:200]}",
                        )
                    )
                print(json.dumps(rows[-1]), flush=True)
            if "native" in wanted:
                ms, peak, why = native_fp8(config, codes, cfg, data)
                rows.append(
                    dict(config=name, tokens=tokens, impl="transformers-fp8-experts", ms=ms, peak_gb=peak, note=why)
                )
                print(json.dumps(rows[-1]), flush=True)
            del data, ref
            torch.cuda.empty_cache()
        b.set_backend(plain_mod, {})
        b.set_backend(fused_mod, {})
        del plain, moe, holders
        del codes, fp8
        torch.cuda.empty_cache()
        write(out_dir / f"{args.label}.json", notes, rows)
    summary(rows)


def row(args, module, modeling, env, impl, holders, data, ref):
    """One row's measures: ms, peak and kept memory, expert GB, the largest error against the bf16 row (the first
    run), and for FP8 compute each error against the W8A16 row."""
    if impl in holders:
        module.experts = holders[impl].experts
        grads_of = holders[impl]
    else:
        grads_of = module
    b.set_backend(modeling, env)
    warm, reps = (1, max(2, args.reps // 5)) if impl == "naive-loop-lora" else (3, args.reps)
    t0 = time.time()
    fn = functools.partial(b.moe_rewrite, module)
    ms, host_ms, peak, kept, y, x = b.run_impl(fn, data, grads_of, None, warm, reps)
    grads = bl.lora_grads(grads_of)
    result = dict(
        ms=round(ms, 3),
        host_ms=round(host_ms, 3),
        peak_gb=round(peak, 2),
        kept_gb=round(kept, 3),
        expert_gb=round(expert_gb(module.experts), 2),
    )
    measured = dict(y=y, x=x.grad, grads=grads)
    if impl == "moe-rewrite-lora[fp8]":
        ref["w8a16"] = measured
    if "bf16" not in ref:
        ref["bf16"] = measured
        err = 0.0
    elif impl == "naive-loop-lora":
        err = max(b.rel(y, ref["bf16"]["y"]), b.rel(x.grad, ref["bf16"]["x"]))
    else:
        errs = [b.rel(y, ref["bf16"]["y"]), b.rel(x.grad, ref["bf16"]["x"])]
        err = max(errs + [b.rel(g, ref["bf16"]["grads"][k]) for k, g in grads.items()])
    result["max_rel_err"] = float(f"{err:.2e}")
    if impl == "moe-rewrite-lora[fp8,compute]" and "w8a16" in ref:
        w8a16 = ref["w8a16"]
        result["vs_w8a16"] = dict(
            y=float(f"{b.rel(y, w8a16['y']):.2e}"),
            x_grad=float(f"{b.rel(x.grad, w8a16['x']):.2e}"),
            lora_grads=float(f"{max(b.rel(g, w8a16['grads'][k]) for k, g in grads.items()):.2e}"),
        )
    b.clear_grads(grads_of, None, x)
    print(f"({impl}: {time.time() - t0:.1f}s)", flush=True)
    return result


def write(path, notes, rows):
    import peft
    import transformers

    result = b.record(
        transformers=transformers.__version__,
        peft=peft.__version__,
        lora=dict(r=bl.RANK, alpha=bl.ALPHA),
        notes=notes,
        rows=rows,
    )
    path.write_text(json.dumps(result, indent=1) + "\n")


def summary(rows):
    header = f"{'config':6} {'tokens':>6} {'impl':32} {'ms':>8} {'peak GB':>8} {'expert GB':>9} {'rel err':>9}"
    print(f"\n{header} {'vs bf16':>8} {'vs loop':>8}")
    for r in rows:
        if r["ms"] is None:
            print(f"{r['config']:6} {r['tokens']:6} {r['impl']:32} {'-':>8} ({r['note']})")
            continue
        same = [x for x in rows if x["config"] == r["config"] and x["tokens"] == r["tokens"] and x["ms"]]
        bf16 = next((x["ms"] for x in same if x["impl"] == "moe-rewrite-lora[bf16]"), float("nan"))
        loop = next((x["ms"] for x in same if x["impl"] == "naive-loop-lora"), float("nan"))
        print(
            f"{r['config']:6} {r['tokens']:6} {r['impl']:32} {r['ms']:8.2f} {r['peak_gb'] or 0:8.2f} "
            f"{r.get('expert_gb', 0):9.2f} {r.get('max_rel_err', 0):9.1e} {bf16 / r['ms']:7.2f}x {loop / r['ms']:7.1f}x"
            + (f"  vs W8A16 {r['vs_w8a16']}" if "vs_w8a16" in r else "")
        )


if __name__ == "__main__":
    main()
