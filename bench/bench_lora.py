"""LoRA on every routed expert projection, expert MLP forward + backward on one GPU (issue #15).

Rows, same base weights, same routings, equivalent adapters (r=16, alpha 32), bf16:
  naive-loop-lora          PEFT target_modules on a --no-fuse-experts output, run through the per-expert loop
  moe-rewrite-lora         PEFT on the default output (fused experts) as transformers 5.x users get it: ParamWrappers
                           on the fused parameters (target_parameters; peft converts target_modules into them on 5.x),
                           grouped base and LoRA GEMMs; the same adapter weights as peft-native-grouped_mm
  moe-rewrite-lora[views]  PEFT target_modules on the default output as transformers 4.x users get it: LoRA layers on
                           the per-expert views, grouped
  moe-rewrite-lora[per-expert]  the same adapters on the --no-fuse-experts output, grouped
  peft-native-grouped_mm   PEFT target_parameters on transformers' own DeepseekV3 experts, experts_implementation
                           grouped_mm (one adapter per fused parameter; the per-expert rows get the same delta weights)
rel err: output and input gradient against naive-loop-lora, and every LoRA weight's gradient (the per-expert rows
against the loop's, moe-rewrite-lora against peft-native-grouped_mm's, the same parameters).

    python3 bench/bench_lora.py [--configs seed,moonlight] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_moe as b  # noqa: E402

RANK, ALPHA = 16, 32
PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]


def lora_grads(module):
    return {n: p.grad for n, p in module.named_parameters() if "lora" in n and p.grad is not None}


def per_expert_adapters(moe, peer):
    """Our per-expert adapters set to the delta weights of PEFT's adapters on the fused peer: expert e's gate and up
    adapters share A_e, their B_e are the rows of the joint B; down has its own. Checked against get_delta_weight."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = {m.parameter_name: m for m in peer.modules() if isinstance(m, ParamWrapper)}
    experts = len(moe.experts)
    with torch.no_grad():
        for name, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            wrapper = wrappers[name]
            a = wrapper.lora_A["default"].weight.reshape(experts, RANK, -1)  # (E, r, in) as get_delta_weight reads it
            bw = wrapper.lora_B["default"].weight.reshape(-1, RANK, experts).permute(2, 0, 1)  # (E, out, r)
            delta = wrapper.get_delta_weight("default")
            ours = torch.einsum("eor,eri->eoi", bw, a) * (ALPHA / RANK)
            if ours.shape != delta.shape:  # PEFT read the parameter as (E, in, out)
                a, bw = bw.transpose(1, 2), a.transpose(1, 2)
                ours = torch.einsum("eor,eri->eoi", bw, a) * (ALPHA / RANK)
                delta = delta.transpose(1, 2)
            assert b.rel(ours, delta) < 1e-2, "could not map PEFT's fused adapters onto per-expert ones"
            rows = bw.shape[1] // len(parts)
            for e, expert in enumerate(moe.experts):
                for i, part in enumerate(parts):
                    layer = getattr(expert, part)
                    layer.lora_A["default"].weight.copy_(a[e])
                    layer.lora_B["default"].weight.copy_(bw[e, i * rows : (i + 1) * rows])


def inject(config, module):
    """PEFT's inject_adapter_in_model, with target_modules taken as given: on transformers 5.x, peft turns
    target_modules into target_parameters for model_type deepseek_v2/v3 (transformers' own fused layout); hiding the
    config for the call gives what 4.x users get (LoRA layers on the per-expert modules)."""
    from peft import inject_adapter_in_model

    saved = module.__dict__.get("config")
    if saved is not None:
        module.__dict__["config"] = None
    try:
        inject_adapter_in_model(config, module)
    finally:
        if saved is not None:
            module.__dict__["config"] = saved


def copy_parameter_adapters(source, target):
    """target's ParamWrappers get the LoRA weights of source's (the same parameters, shapes and layout)."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = {m.parameter_name: m for m in source.modules() if isinstance(m, ParamWrapper)}
    with torch.no_grad():
        for m in target.modules():
            if isinstance(m, ParamWrapper):
                source_wrapper = wrappers[m.parameter_name]
                for lora in ("lora_A", "lora_B"):
                    getattr(m, lora)["default"].weight.copy_(getattr(source_wrapper, lora)["default"].weight)


def profile_host(fn, data, module, path):
    """cProfile of 5 forward + backward steps (host time by function, own time first)."""
    import cProfile
    import io
    import pstats

    x, ids, w, g = data[0]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        fn(x.detach().requires_grad_(True), ids, w).backward(g)
        b.clear_grads(module, None)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    path.write_text(text.getvalue())
    print(text.getvalue()[:3000])


def forward(impl, module, x, ids, w):
    if impl == "peft-native-grouped_mm":
        return module.experts(x, ids, w.to(x.dtype))
    return b.moe_rewrite(module, x, ids, w)


def main():
    from peft import LoraConfig, inject_adapter_in_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="seed,moonlight")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--profile-host", action="store_true", help="print where moe-rewrite-lora's host time goes")
    parser.add_argument("--code", default=str(b.ROOT), help="moe-rewrite checkout to measure (another commit's tree)")
    parser.add_argument("--label", default="h200-lora", help="name of the JSON written into --out")
    args = parser.parse_args()
    b.CODE = Path(args.code).resolve()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    work = Path(tempfile.mkdtemp())
    fused_mod, configuration = b.import_patched(b.rewrite_fixture(work / "lora_fused"), "lora_fused")
    plain_mod, _ = b.import_patched(b.rewrite_fixture(work / "lora_plain", "--no-fuse-experts"), "lora_plain")
    rows, notes = [], []
    for name in args.configs.split(","):
        cfg = b.CONFIGS[name]
        config = b.moe_config(configuration, cfg)
        torch.manual_seed(0)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            plain = plain_mod.DeepseekV3MoE(config).train()
            fused = fused_mod.DeepseekV3MoE(config).train()
        torch.set_default_dtype(default_dtype)
        fused.load_state_dict(plain.state_dict())
        fused.moe_rewrite_fuse_experts()
        wrapped = copy.deepcopy(fused)
        experts, what = b.build_peer(cfg, plain)
        notes.append(f"{name}: peft-native-grouped_mm = {what} + PEFT target_parameters")
        peer = torch.nn.Module()  # PEFT replaces a child module: the experts go inside a holder
        peer.experts = experts
        lora = dict(r=RANK, lora_alpha=ALPHA, init_lora_weights=False)
        torch.manual_seed(1)
        targets = ["experts.gate_up_proj", "experts.down_proj"]
        inject_adapter_in_model(LoraConfig(target_parameters=targets, **lora), peer)
        inject(LoraConfig(target_modules=PROJECTIONS, **lora), plain)
        per_expert_adapters(plain, peer)
        inject(LoraConfig(target_modules=PROJECTIONS, **lora), fused)
        fused.load_state_dict({k: v for k, v in plain.state_dict().items() if "lora" in k}, strict=False)
        inject_adapter_in_model(LoraConfig(target_parameters=targets, **lora), wrapped)
        copy_parameter_adapters(peer, wrapped)
        for module in (plain, fused, wrapped, peer):  # adapters in bf16 like the base (PEFT's default keeps fp32)
            module.to(torch.bfloat16)
            for n, p in module.named_parameters():  # LoRA trains, the base is frozen
                p.requires_grad_("lora" in n)
        data = b.routings(cfg, "cuda", seed=1)
        flops = 18 * cfg["N"] * cfg["k"] * cfg["H"] * cfg["I"]
        impls = [
            ("naive-loop-lora", plain, plain_mod, "loop"),
            ("peft-native-grouped_mm", peer, None, None),
            ("moe-rewrite-lora", wrapped, fused_mod, None),
            ("moe-rewrite-lora[views]", fused, fused_mod, None),
            ("moe-rewrite-lora[per-expert]", plain, plain_mod, None),
        ]
        ref = {}  # the loop's output, input gradient and LoRA gradients; peft-native's LoRA gradients
        for impl, module, modeling, backend in impls:
            fn = functools.partial(forward, impl, module)
            if modeling is not None:
                b.set_backend(modeling, {"MOE_REWRITE_BACKEND": backend})
            warm, reps = (1, max(2, args.reps // 5)) if impl == "naive-loop-lora" else (3, args.reps)
            t0 = time.time()
            ms, host_ms, peak, kept, y, x = b.run_impl(fn, data, module, None, warm, reps)
            grads = lora_grads(module)
            if not ref:
                ref.update(y=y, x=x.grad, grads=grads)
                err = 0.0
            else:
                errs = [b.rel(y, ref["y"]), b.rel(x.grad, ref["x"])]
                if impl == "peft-native-grouped_mm":
                    ref["native"] = grads
                else:
                    want = ref["native"] if impl == "moe-rewrite-lora" else ref["grads"]
                    errs += [b.rel(g, want[k]) for k, g in grads.items() if want[k].abs().sum() > 0]
                err = max(errs)
            b.clear_grads(module, None, x)
            if args.profile_host and impl.startswith("moe-rewrite-lora"):
                profile_host(fn, data, module, out_dir / f"host_{name}_{impl.replace('[', '_').strip(']')}.txt")
            rows.append(
                dict(
                    config=name,
                    impl=impl,
                    ms=round(ms, 3),
                    host_ms=round(host_ms, 3),
                    tflops_base=round(flops / (ms / 1e3) / 1e12, 1),
                    peak_gb=round(peak, 2),
                    kept_gb=round(kept, 3),
                    max_rel_err=float(f"{err:.2e}"),
                )
            )
            print(json.dumps(rows[-1]), f"({time.time() - t0:.1f}s)", flush=True)
        b.set_backend(plain_mod, {})
        del plain, fused, wrapped, peer, data, ref
        torch.cuda.empty_cache()
    import peft
    import transformers

    result = b.record(
        transformers=transformers.__version__,
        peft=peft.__version__,
        lora=dict(r=RANK, alpha=ALPHA, targets="every routed expert projection"),
        notes=notes,
        rows=rows,
    )
    (out_dir / f"{args.label}.json").write_text(json.dumps(result, indent=1) + "\n")
    header = f"{'config':10} {'impl':30} {'ms':>8} {'host ms':>8} {'peak GB':>8} {'rel err':>9}"
    print(f"\n{header} {'vs loop':>8} {'vs peft':>8}")
    for r in rows:
        loop = next(x["ms"] for x in rows if x["config"] == r["config"] and x["impl"] == "naive-loop-lora")
        native = next(x["ms"] for x in rows if x["config"] == r["config"] and x["impl"] == "peft-native-grouped_mm")
        print(
            f"{r['config']:10} {r['impl']:30} {r['ms']:8.2f} {r['host_ms']:8.2f} {r['peak_gb']:8.2f} "
            f"{r['max_rel_err']:9.1e} {loop / r['ms']:7.1f}x {native / r['ms']:7.2f}x"
        )


if __name__ == "__main__":
    main()
