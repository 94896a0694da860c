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
                             per 1 x 128 tile, FP8 tensor-core products in the forward; the input gradient W8A16
  moe-rewrite-lora[fp8,compute,kmajor]  (fp8-kmajor) FP8 compute whose input gradient is W8A8 too, on a K-major copy
                             of the codes and scales ((E, in, out), made once before timing, kept: the experts' memory
                             1.0x bf16 instead of 0.5x): dy @ W as the forward kernel's dy @ (W^T)^T, the operand
                             contiguous along the reduced dim as Hopper's FP8 tensor cores take it. The best case of
                             a transposed-operand kernel; kmajor_gb is the copy, kmajor_make_ms the time to make it
  moe-rewrite-lora[fp8,compute,transpose]  (transpose) the same with the K-major copy made in every input gradient
                             and dropped after it (memory stays 0.5x): what making it just in time costs per step
  moe-rewrite-lora[fp8,dequant]  the same with MOE_REWRITE_TRITON_GEMM=0: weights dequantized per GEMM, then
                             torch._grouped_mm (the fallback off the Triton path)
  naive-loop-lora            PEFT target_modules on the --no-fuse-experts output's per-expert bf16 layers, run through
                             the per-expert loop (MOE_REWRITE_BACKEND=loop)
  transformers-fp8-experts   transformers' own FP8Experts (grouped_mm) on the same codes and scales, without LoRA,
                             where it runs (its kernels come from the Hub)
expert GB: the experts' weights as held (codes and scales, with the K-major copy where kept, or bf16); expert_vs_bf16
that over the bf16 experts'. rel err: output, input gradient and LoRA gradients against moe-rewrite-lora[bf16]; for
FP8 compute also each of them against the W8A16 row (vs_w8a16).

Each config runs in a child process of its own (--child), so that one that runs out of memory or leaves memory
behind spoils no other; in it every token count of a row runs before the next row, and the bf16 experts are freed
after the bf16 rows (room for the K-major copy at K2's sizes). The parent writes OUT/LABEL.json with every child's
rows (a child that dies leaves the rows it wrote and a note).

    python3 bench/bench_fp8.py [--configs v3,k2] [--tokens 4096,16384]
        [--rows bf16,fp8,fp8-compute,fp8-kmajor,transpose,dequant,loop,native]
        [--tiles OUT/fp8-compute-tiles.json] [--reps 10] [--label h200-fp8] [--out DIR]

--tiles: FP8 compute's tiles per mode as bench/fp8_compute_tiles.py writes them (else the generated code's own); the
K-major input gradient runs the forward's ("fwd") tile.

bench/fp8_kernels.py times the kernel's variants GEMM by GEMM.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
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


ROWS = "bf16,fp8,fp8-compute,fp8-kmajor,transpose,dequant,loop,native"
COMPUTE = {"MOE_REWRITE_FP8_COMPUTE": "1"}


def kmajor(codes, scales):
    """The K-major copy of FP8 experts' codes (E, out, in) and block scales (E, out / 128, in / 128): (E, in, out) and
    (E, in / 128, out / 128), contiguous. The input gradient dy @ W[e] is then the forward product dy @ (W[e]^T)^T,
    whose weight operand runs contiguous along the reduced dim (out), as Hopper's FP8 tensor cores take it."""
    return codes.transpose(1, 2).contiguous(), scales.transpose(1, 2).contiguous()


class KMajorDgrad:
    """In place of a generated module's _moe_rewrite_gmm while a row runs (`with KMajorDgrad(modeling, cached):`): the
    input gradient of FP8 experts in FP8 compute (W8A8) on the K-major copy of their codes and scales, through the
    module's own forward W8A8 product (_moe_rewrite_fp8_gmm, "fwd"); every other product as the module runs it.
    cached: the copy is made on the first input gradient of each weight and kept (fp8-kmajor), else made in every
    input gradient and dropped after it (transpose)."""

    def __init__(self, modeling, cached):
        self.modeling, self.cached, self.original = modeling, cached, modeling._moe_rewrite_gmm
        self.copies = {}

    def __call__(self, kernel, a, b, offsets, mode, scale=None):
        if mode != "dgrad" or scale is None or a.shape[1] % 128:  # FP8 compute quantizes whole 1 x 128 tiles
            return self.original(kernel, a, b, offsets, mode, scale)
        key = (b.data_ptr(), tuple(b.shape), scale.data_ptr())
        codes, scales = self.copies[key] if key in self.copies else kmajor(b, scale)
        if self.cached:
            self.copies[key] = codes, scales
        kernels = self.modeling._moe_rewrite_triton(a.device, a.dtype)
        return self.modeling._moe_rewrite_fp8_gmm(kernels, a, codes, offsets, "fwd", scales)

    def gb(self):
        return sum(t.numel() * t.element_size() for pair in self.copies.values() for t in pair) / 2**30

    def __enter__(self):
        self.modeling._moe_rewrite_gmm = self
        return self

    def __exit__(self, *exc):
        self.modeling._moe_rewrite_gmm = self.original
        self.copies.clear()


def make_ms(experts):
    """The time to make the K-major copies of `experts`' two FP8 weights once (ms, median of 3)."""
    params = dict(experts.named_parameters())
    pairs = [(p, params[f"{n}_scale_inv"]) for n, p in params.items() if p.dtype == torch.float8_e4m3fn]
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copies = [kmajor(*pair) for pair in pairs]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        del copies
    return round(sorted(times)[1], 3)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="v3,k2")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--label", default="h200-fp8")
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--tiles", default=None)
    parser.add_argument("--child", action="store_true", help="run --configs here (one config: what the parent runs)")
    args = parser.parse_args(argv)
    unknown = set(args.rows.split(",")) - set(ROWS.split(","))
    unknown |= set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown rows or configs: {', '.join(sorted(unknown))}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        bench_configs(args, out_dir / f"{args.label}.json")
        return
    rows, notes, record = [], [], {}
    for name in args.configs.split(","):
        path = out_dir / f"{args.label}.{name}.json"
        path.unlink(missing_ok=True)
        child = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])]
        child += ["--child", "--configs", name, "--label", f"{args.label}.{name}"]
        code = subprocess.run(child).returncode  # the last --configs and --label given win
        done = json.loads(path.read_text()) if path.is_file() else dict(rows=[], notes=[])
        rows += done["rows"]
        notes += done["notes"]
        if code:
            notes.append(f"{name}: the child process exited with {code}, after {len(done['rows'])} rows")
        print(f"{name}: {len(done['rows'])} rows, exit {code}", flush=True)
        # the record (device, versions) as the children wrote it; the parent never touches the GPU
        record = dict(record, **{k: v for k, v in done.items() if k not in ("notes", "rows")})
        record.update(command=" ".join(sys.argv), notes=notes, rows=rows)
        (out_dir / f"{args.label}.json").write_text(json.dumps(record, indent=1) + "\n")
    summary(rows)


def bench_configs(args, path):
    """Every row of every config in --configs, in this process; `path` rewritten after each row."""
    wanted = set(args.rows.split(","))
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
    plain_mod = None  # the per-expert file, for the loop row only
    if "loop" in wanted:
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
        bf16_gb = expert_gb(moe.experts)
        holders["moe-rewrite-lora[fp8]"] = with_lora(fp8, holders["moe-rewrite-lora[bf16]"])
        for impl in ("dequant", "compute", "compute,kmajor", "compute,transpose"):
            holders[f"moe-rewrite-lora[fp8,{impl}]"] = holders["moe-rewrite-lora[fp8]"]
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
            ("fp8-compute", "moe-rewrite-lora[fp8,compute]", moe, fused_mod, COMPUTE),
            ("fp8-kmajor", "moe-rewrite-lora[fp8,compute,kmajor]", moe, fused_mod, COMPUTE),
            ("transpose", "moe-rewrite-lora[fp8,compute,transpose]", moe, fused_mod, COMPUTE),
            ("dequant", "moe-rewrite-lora[fp8,dequant]", moe, fused_mod, {"MOE_REWRITE_TRITON_GEMM": "0"}),
        ]
        if plain is not None:
            impls.append(("loop", "naive-loop-lora", plain, plain_mod, {"MOE_REWRITE_BACKEND": "loop"}))
        tokens_list = list(map(int, args.tokens.split(",")))
        datas = {tokens: b.routings(dict(cfg, N=tokens), "cuda", seed=1) for tokens in tokens_list}
        refs = {tokens: {} for tokens in tokens_list}
        for short, impl, module, modeling, env in impls:
            if short not in wanted:
                continue
            for tokens in tokens_list:
                try:  # a row that fails (out of memory at 16384 tokens) is recorded as such, the others still run
                    measured = row(args, module, modeling, env, impl, holders, datas[tokens], refs[tokens], bf16_gb)
                    rows.append(dict(config=name, tokens=tokens, impl=impl, **measured))
                except Exception as error:  # noqa: BLE001
                    torch.cuda.empty_cache()
                    note = f"{type(error).__name__}: {str(error)[:200]}"
                    rows.append(dict(config=name, tokens=tokens, impl=impl, ms=None, note=note))
                print(json.dumps(rows[-1]), flush=True)
                write(path, notes, rows)
            if short == "bf16":  # no later row reads the bf16 experts: their memory goes to the K-major copies
                for n, p in holders["moe-rewrite-lora[bf16]"].experts.named_parameters():
                    if "lora" not in n:
                        p.data = p.data.new_empty(0)
                torch.cuda.empty_cache()
                print(f"bf16 experts freed: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
        if "native" in wanted:
            for tokens in tokens_list:
                ms, peak, why = native_fp8(config, codes, cfg, datas[tokens])
                rows.append(
                    dict(config=name, tokens=tokens, impl="transformers-fp8-experts", ms=ms, peak_gb=peak, note=why)
                )
                print(json.dumps(rows[-1]), flush=True)
        for modeling in (plain_mod, fused_mod):
            if modeling is not None:
                b.set_backend(modeling, {})
        del plain, moe, holders, datas, refs
        del codes, fp8
        torch.cuda.empty_cache()
        write(path, notes, rows)
    summary(rows)


def row(args, module, modeling, env, impl, holders, data, ref, bf16_gb):
    """One row's measures: ms, peak and kept memory, expert GB (and over the bf16 experts'), the largest error against
    the bf16 row (the first run), and for FP8 compute each error against the W8A16 row."""
    if impl in holders:
        module.experts = holders[impl].experts
        grads_of = holders[impl]
    else:
        grads_of = module
    b.set_backend(modeling, env)
    warm, reps = (1, max(2, args.reps // 5)) if impl == "naive-loop-lora" else (3, args.reps)
    t0 = time.time()
    fn = functools.partial(b.moe_rewrite, module)
    extra = {}
    # the K-major input gradient only in its rows: every other row runs the generated code as it is
    dgrad = KMajorDgrad(modeling, cached=impl.endswith("kmajor]")) if impl.endswith(("kmajor]", "transpose]")) else None
    with dgrad or contextlib.nullcontext():
        if dgrad is not None:
            extra["kmajor_make_ms"] = make_ms(module.experts)
        ms, host_ms, peak, kept, y, x = b.run_impl(fn, data, grads_of, None, warm, reps)
        copy_gb = dgrad.gb() if dgrad is not None else 0.0
        if dgrad is not None and dgrad.cached:
            extra["kmajor_gb"] = round(copy_gb, 3)
    grads = bl.lora_grads(grads_of)
    held = expert_gb(module.experts) + copy_gb
    result = dict(
        ms=round(ms, 3),
        host_ms=round(host_ms, 3),
        peak_gb=round(peak, 2),
        kept_gb=round(kept, 3),
        expert_gb=round(held, 2),
        expert_vs_bf16=round(held / bf16_gb, 3),
        **extra,
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
    if impl.endswith("kmajor]"):
        ref["kmajor"] = measured
    # FP8 compute's errors against W8A16; the just-in-time copy's against the kept one (the same arithmetic: 0)
    others = ["w8a16"] if impl.startswith("moe-rewrite-lora[fp8,compute") else []
    others += ["kmajor"] if impl.endswith("transpose]") else []
    for other in others:
        if other in ref:
            result[f"vs_{other}"] = dict(
                y=float(f"{b.rel(y, ref[other]['y']):.2e}"),
                x_grad=float(f"{b.rel(x.grad, ref[other]['x']):.2e}"),
                lora_grads=float(f"{max(b.rel(g, ref[other]['grads'][k]) for k, g in grads.items()):.2e}"),
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
    header = f"{'config':6} {'tokens':>6} {'impl':40} {'ms':>8} {'peak GB':>8} {'expert GB':>9} {'rel err':>9}"
    print(f"\n{header} {'vs bf16':>8} {'vs loop':>8}")
    for r in rows:
        if r.get("ms") is None:
            print(f"{r['config']:6} {r['tokens']:6} {r['impl']:40} {'-':>8} ({r.get('note')})")
            continue
        same = [x for x in rows if x["config"] == r["config"] and x["tokens"] == r["tokens"] and x.get("ms")]
        bf16 = next((x["ms"] for x in same if x["impl"] == "moe-rewrite-lora[bf16]"), float("nan"))
        loop = next((x["ms"] for x in same if x["impl"] == "naive-loop-lora"), float("nan"))
        more = [f"{k} {r[k]}" for k in ("expert_vs_bf16", "kmajor_make_ms", "vs_w8a16", "vs_kmajor") if k in r]
        print(
            f"{r['config']:6} {r['tokens']:6} {r['impl']:40} {r['ms']:8.2f} {r.get('peak_gb') or 0:8.2f} "
            f"{r.get('expert_gb', 0):9.2f} {r.get('max_rel_err', 0):9.1e} {bf16 / r['ms']:7.2f}x {loop / r['ms']:7.1f}x"
            + (f"  {'; '.join(more)}" if more else "")
        )


if __name__ == "__main__":
    main()
