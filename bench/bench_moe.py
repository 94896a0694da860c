"""Expert-MLP forward + backward on one GPU: naive loop vs moe-rewrite's generated code vs transformers' grouped_mm.

Runs in one device call (bench/RESULTS.md gives the exact commands of each recorded run) and prints a table last.
The moe-rewrite rows run the code the tool wrote into our V3-form stand-in fixture (rewritten here with the CLI), at
the sizes below.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "seed": dict(E=128, H=2048, I=512, k=8, N=4096),
    "moonlight": dict(E=64, H=2048, I=1408, k=6, N=8192),
    "v3": dict(E=256, H=7168, I=2048, k=8, N=4096),
}
ROUTING_SETS = 4  # rotate among several routings so no run measures one lucky load pattern


CODE = ROOT  # the moe-rewrite checkout whose generated code is measured (--code)


def rewrite_fixture(out: Path, *options: str) -> Path:
    """The V3 stand-in rewritten with --no-fuse-experts: its MoE layers start per-expert (the bracketed rows), and
    moe_rewrite_fuse_experts() fuses them for the fused row, as from_pretrained does with the defaults."""
    fixture = str(CODE / "fixtures" / "deepseek_v3")
    cmd = [sys.executable, "-m", "moe_rewrite", fixture, "--out", str(out.resolve()), *options]
    # In CODE: `python -m` puts the working directory first on sys.path, before PYTHONPATH.
    env = {**os.environ, "PYTHONPATH": f"{CODE}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(cmd, check=True, env=env, cwd=CODE)
    return out


def import_patched(directory: Path, name: str):
    """Import the patched modeling file as a package module (it imports .configuration_deepseek)."""
    # The stand-in imports helpers that transformers 5 removed, as the real files do; the MoE code does not use them.
    import transformers.pytorch_utils as pytorch_utils
    import transformers.utils.import_utils as import_utils

    import_utils.is_torch_fx_available = getattr(import_utils, "is_torch_fx_available", lambda: True)
    pytorch_utils.is_torch_greater_or_equal_than_1_13 = True
    pytorch_utils.ALL_LAYERNORM_LAYERS = getattr(pytorch_utils, "ALL_LAYERNORM_LAYERS", [])
    package = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    (directory / "__init__.py").touch()
    sys.modules[name] = importlib.util.module_from_spec(package)
    package.loader.exec_module(sys.modules[name])
    return importlib.import_module(f"{name}.modeling_deepseek"), importlib.import_module(
        f"{name}.configuration_deepseek"
    )


def moe_config(configuration, cfg, **more):
    """The patched file's DeepseekV3Config for a MoE layer of `cfg`'s sizes (CONFIGS): routed experts only, one
    group, SiLU; `more` sets other fields."""
    return configuration.DeepseekV3Config(
        hidden_size=cfg["H"],
        moe_intermediate_size=cfg["I"],
        n_routed_experts=cfg["E"],
        num_experts_per_tok=cfg["k"],
        n_shared_experts=None,
        n_group=1,
        topk_group=1,
        hidden_act="silu",
        **more,
    )


def kernel_of(modeling, x):
    kernel = modeling._moe_rewrite_kernel
    try:
        return kernel(x.device, x.dtype)
    except AttributeError:  # the generated code before 0.3 took the activations
        return kernel(x, x.dtype)


# what a row's env may set for the generated code
RUNTIME_VARIABLES = ("MOE_REWRITE_BACKEND", "MOE_REWRITE_TRITON", "MOE_REWRITE_TRITON_GEMM", "MOE_REWRITE_FP8_COMPUTE")


def set_backend(modeling, env):
    """The generated code's environment variables for the next rows, from a row's env (unset ones: the file's own
    choice); the generated code reads them once per process, so its caches are emptied here, as a new process would
    start."""
    for variable in RUNTIME_VARIABLES:
        os.environ.pop(variable, None)
        if env.get(variable) is not None:
            os.environ[variable] = env[variable]
    for name, cache in list(vars(modeling).items()):  # every cache of the generated code is a _moe_rewrite_*_cache
        if name.startswith("_moe_rewrite_") and name.endswith("_cache") and isinstance(cache, dict):
            cache.clear()


def routings(cfg, device, seed):
    """Top-k experts drawn without replacement from a softmax over random logits with per-expert popularity."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(ROUTING_SETS):
        popularity = torch.randn(cfg["E"], generator=g)
        probs = torch.softmax(torch.randn(cfg["N"], cfg["E"], generator=g) + popularity, dim=-1)
        ids = torch.multinomial(probs, cfg["k"], replacement=False, generator=g)
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        x = torch.randn(cfg["N"], cfg["H"], generator=g) * 0.5
        grad = torch.randn(cfg["N"], cfg["H"], generator=g) * 1e-2
        out.append(tuple(t.to(device) for t in (x.bfloat16(), ids, weights.float(), grad.bfloat16())))
    return out


def naive_loop(moe, x, ids, w):
    """The per-expert loop users write (the V2 training path's pattern) over per-expert nn.Linear layers."""
    flat = ids.view(-1)
    rows = x.repeat_interleave(ids.shape[1], dim=0)
    y = torch.empty_like(rows)
    for i, expert in enumerate(moe.experts):
        y[flat == i] = expert(rows[flat == i])
    return (y.view(*w.shape, -1) * w.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def moe_rewrite(moe, x, ids, w):
    """What the patched forward runs in training: moe_train returning the activations' dtype (before out_dtype,
    moe_train's promoted result cast back)."""
    if takes_out_dtype(type(moe).moe_train):
        return moe.moe_train(x, ids, w, out_dtype=x.dtype)
    return moe.moe_train(x, ids, w).type(x.dtype)


@functools.cache
def takes_out_dtype(moe_train):
    return "out_dtype" in inspect.signature(moe_train).parameters


def build_peer(cfg, moe):
    """transformers' own DeepseekV3 experts module, experts_implementation grouped_mm, with the same weights."""
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = transformers.DeepseekV3Config(
        hidden_size=cfg["H"],
        moe_intermediate_size=cfg["I"],
        n_routed_experts=cfg["E"],
        num_experts_per_tok=cfg["k"],
        hidden_act="silu",
    )
    config._experts_implementation = "grouped_mm"
    classes = [
        c
        for n, c in vars(hf).items()
        if isinstance(c, type) and issubclass(c, torch.nn.Module) and ("Experts" in n or "NaiveMoe" in n)
    ]
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            peer = next(m for m in (c(config) for c in classes) if hasattr(m, "gate_up_proj"))
    finally:
        torch.set_default_dtype(default_dtype)
    classes = [type(peer)]
    with torch.no_grad():
        for e, expert in enumerate(moe.experts):
            peer.gate_up_proj[e].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
            peer.down_proj[e].copy_(expert.down_proj.weight)
    peer.config._experts_implementation = "grouped_mm"
    return peer, f"{classes[0].__name__} (transformers {transformers.__version__}, _experts_implementation=grouped_mm)"


def flatten_experts(moe):
    """Lay every expert's weights out in one buffer, in registration order, as an FSDP flat parameter holds them."""
    params = [p for e in moe.experts for p in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def liger_fused_moe():
    """Liger's fused MoE autograd Function (liger-kernel, Triton), or None when it is not installed. Its autotune runs
    minutes per shape on first use: LIGER_FUSED_MOE_AUTOTUNE=0 (set before import) pins its default config."""
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError:
        return None
    return LigerFusedMoEFunction


def liger_forward(function, peer, x, ids, w):
    """Liger on the transformers peer's own parameters (their layout: gate_up (E, 2I, H) as [gate; up], down
    (E, H, I))."""
    return function.apply(x, peer.gate_up_proj, peer.down_proj, ids.to(torch.int32), w.to(x.dtype))


def sonic_moe():
    """SonicMoE (Tri Dao's lab; CuTe-DSL kernels for Hopper), or None when it is not installed (docs/backends.md
    has the install line that worked on the H200). Its first call per shape JIT-compiles (~20 s at seed, ~60 s at
    moonlight)."""
    try:
        import sonicmoe
    except ImportError:
        return None
    return sonicmoe


class SonicPeer(torch.nn.Module):
    """The peer's experts in SonicMoE's layout: w1 (E, 2I, H) with gate and up rows interleaved (gate at even rows),
    w2 (E, H, I); the same weights as the transformers peer."""

    def __init__(self, peer):
        super().__init__()
        gate_up = peer.gate_up_proj.detach()
        experts, double, hidden = gate_up.shape
        interleaved = torch.stack([gate_up[:, : double // 2], gate_up[:, double // 2 :]], dim=2)
        self.w1 = torch.nn.Parameter(interleaved.reshape(experts, double, hidden).contiguous())
        self.w2 = torch.nn.Parameter(peer.down_proj.detach().clone())

    def forward(self, sonicmoe, x, ids, w):
        tokens, k = ids.shape
        token_idx = torch.arange(tokens, device=x.device, dtype=torch.int32).repeat_interleave(k)
        out, _ = sonicmoe.moe_general_routing_inputs(
            x,
            w.reshape(-1).float(),
            token_idx,
            ids.reshape(-1).to(torch.int32),
            self.w1.permute(1, 2, 0),
            None,
            self.w2.permute(1, 2, 0),
            None,
            self.w1.shape[0],
            torch.cuda.current_stream().cuda_stream,
            sonicmoe.enums.ActivationType.SWIGLU,
        )
        return out

    def gate_up_grad(self):
        """w1's gradient in the [gate; up] layout of the other rows."""
        experts, double, hidden = self.w1.shape  # a view, (E, 2, I, H): rel() copies it a few experts at a time
        return self.w1.grad.view(experts, double // 2, 2, hidden).transpose(1, 2)


def grads_of(impl, moe, peer, x):
    if impl == "sonicmoe":
        return [x.grad, peer.gate_up_grad(), peer.w2.grad]
    if impl in ("transformers-grouped_mm", "liger-fused_moe"):
        gu, d = peer.gate_up_proj.grad, peer.down_proj.grad
    elif impl.startswith("moe-rewrite[fused"):
        gu, d = moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad
    else:
        gu = torch.stack([torch.cat([e.gate_proj.weight.grad, e.up_proj.weight.grad]) for e in moe.experts])
        d = torch.stack([e.down_proj.weight.grad for e in moe.experts])
    return [x.grad, gu, d]


def clear_grads(moe, peer, x=None):
    for p in list(moe.parameters()) + (list(peer.parameters()) if peer is not None else []):
        p.grad = None
    if x is not None:
        x.grad = None


def rel(a, b):
    """||a - b|| / ||b||, accumulated over chunks of dim 0 (v3's gradients are 15 GB in bf16); a may be b's shape or a
    view of the same elements in b's order with more dimensions (SonicPeer.gate_up_grad)."""
    num = den = 0.0
    for ca, cb in zip(a.split(16), b.split(16)):
        num += (ca.float().reshape(cb.shape) - cb.float()).square().sum().item()
        den += cb.float().square().sum().item()
    return (num / den) ** 0.5


def record(**fields):
    """A result record: the device, date, commit (BENCH_COMMIT), command and torch version, then `fields`."""
    return dict(
        device=torch.cuda.get_device_name(),
        date=time.strftime("%Y-%m-%d"),
        commit=os.environ.get("BENCH_COMMIT", "unknown"),
        command=" ".join(sys.argv),
        torch=torch.__version__,
        **fields,
    )


def run_impl(fn, data, moe, peer, warmup, reps):
    """Median ms of forward+backward over `reps` timed steps, rotating routings; the step's extra peak memory, and the
    memory forward keeps for backward."""
    times, host = [], []
    for i in range(warmup + reps):
        x, ids, w, g = data[i % len(data)]
        x = x.detach().requires_grad_(True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn(x, ids, w).backward(g)
        t1 = time.perf_counter()
        end.record()
        clear_grads(moe, peer)
        if i >= warmup:
            end.synchronize()
            times.append(start.elapsed_time(end))
            host.append((t1 - t0) * 1e3)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    x, ids, w, g = data[0]
    x = x.detach().requires_grad_(True)
    y = fn(x, ids, w)
    kept = (torch.cuda.memory_allocated() - base) / 2**30  # what forward leaves for backward, the output included
    y.backward(g)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return sorted(times)[len(times) // 2], sorted(host)[len(host) // 2], peak, kept, y.detach(), x


def matmul_tflops():
    a, b = (
        torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16),
        torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16),
    )
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    end.synchronize()
    return 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3) / 1e12


def check_empty_experts(module, kernels):
    """wgrad of an expert that got no rows must be exactly zero on every kernel (the loop gives zeros)."""
    E, out, inp, rows = 8, 64, 128, 40
    counts = torch.tensor([0, 10, 0, 0, 30, 0, 0, 0])
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    a = torch.randn(rows, out, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(rows, inp, device="cuda", dtype=torch.bfloat16)
    result = {}
    for kernel in kernels:
        for _ in range(3):  # poison the allocator's memory first: unwritten outputs would show garbage
            torch.full((E, out, inp), float("nan"), device="cuda", dtype=torch.bfloat16)
        grad_w = module._moe_rewrite_gmm(kernel, a, b, offsets, "wgrad")
        empty = grad_w[counts == 0]
        ref = torch.stack(
            [a[s:e].float().t() @ b[s:e].float() for s, e in zip([0, 0, 10, 10, 10, 40, 40, 40], offsets.tolist())]
        )
        result[kernel] = (
            bool(torch.count_nonzero(empty) == 0 and not torch.isnan(grad_w).any()) and rel(grad_w, ref) < 1e-2
        )
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="seed,moonlight,v3")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--profile", action="store_true", help="also write a kernel-time profile per config")
    parser.add_argument("--code", default=str(ROOT), help="moe-rewrite checkout to measure (another commit's tree)")
    parser.add_argument("--label", default="h200", help="name of the JSON written into --out")
    parser.add_argument(
        "--only", help="comma-separated rows to run besides naive-loop (the reference): sonicmoe,moe-rewrite[fused]"
    )
    args = parser.parse_args()
    global CODE
    CODE = Path(args.code).resolve()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False

    work = Path(tempfile.mkdtemp())
    modeling, configuration = import_patched(
        rewrite_fixture(work / "patched_bench", "--no-fuse-experts"), "patched_bench"
    )
    has_gg = modeling._moe_rewrite_grouped_gemm() is not None
    kernels = ["torch"] + (["grouped_gemm"] if has_gg else [])
    empty_ok = check_empty_experts(modeling, kernels)
    print("empty-expert wgrad exactly zero and correct:", empty_ok, flush=True)
    rate = matmul_tflops()
    print(f"bf16 matmul 8192^3: {rate:.0f} TFLOP/s", flush=True)
    liger, sonic = liger_fused_moe(), sonic_moe()

    rows, notes = [], []
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        torch.manual_seed(0)
        config = moe_config(configuration, cfg)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            moe = modeling.DeepseekV3MoE(config).train()
        torch.set_default_dtype(default_dtype)
        data = routings(cfg, "cuda", seed=1)
        flops = 18 * cfg["N"] * cfg["k"] * cfg["H"] * cfg["I"]
        reps = args.reps if name != "v3" else max(3, args.reps // 4)

        impls = [("naive-loop", lambda x, i, w, moe=moe: naive_loop(moe, x, i, w), {})]
        impls.append(("moe-rewrite", lambda x, i, w, moe=moe: moe_rewrite(moe, x, i, w), {}))
        impls.append(("moe-rewrite (again, for noise)", lambda x, i, w, moe=moe: moe_rewrite(moe, x, i, w), {}))
        for kernel in kernels:
            for stacking in ("stack", "sequential"):
                impls.append(
                    (
                        f"moe-rewrite[{kernel},{stacking}]",
                        lambda x, i, w, moe=moe: moe_rewrite(moe, x, i, w),
                        {"MOE_REWRITE_BACKEND": kernel, "stacking": stacking},
                    )
                )
        impls.append(
            ("moe-rewrite[torch,stack,flat-params]", lambda x, i, w, moe=moe: moe_rewrite(moe, x, i, w), {"flat": True})
        )
        impls.append(("transformers-grouped_mm", None, {}))
        if liger is not None:
            impls.append(("liger-fused_moe", None, {}))
        # our own kernels on the fused parameters (backend torch, what auto picks here)
        fused = {"fused": True, "MOE_REWRITE_BACKEND": "torch"}
        impls.append(("moe-rewrite[fused]", lambda x, i, w, moe=moe: moe_rewrite(moe, x, i, w), fused))
        no_triton = {**fused, "MOE_REWRITE_TRITON": "0"}  # the same steps as torch ops (what 0.3's first cut ran)
        torch_gemm = {**fused, "MOE_REWRITE_TRITON_GEMM": "0"}  # torch's GEMMs where the Triton one runs (change 26)
        impls.append(("moe-rewrite[fused,torch-gemm]", lambda x, i, w, moe=moe: moe_rewrite(moe, x, i, w), torch_gemm))
        impls.append(("moe-rewrite[fused,no-triton]", lambda x, i, w, moe=moe: moe_rewrite(moe, x, i, w), no_triton))
        if sonic is not None:  # last: its first call per token count autotunes for minutes (a timeout keeps the rest)
            impls.append(("sonicmoe", None, {}))
            # the generated code's sonicmoe backend on the same fused parameters (SonicMoE's compiled kernels by now)
            impls.append(
                (
                    "moe-rewrite[fused,sonicmoe]",
                    lambda x, i, w, moe=moe: moe_rewrite(moe, x, i, w),
                    {"fused": True, "MOE_REWRITE_BACKEND": "sonicmoe"},
                )
            )
        if args.only:
            wanted = {"naive-loop", *re.split(r",(?![^\[]*\])", args.only)}  # commas inside [...] are the name's
            if wanted & {"liger-fused_moe", "sonicmoe"}:
                wanted.add("transformers-grouped_mm")  # their weights come from the transformers peer
            impls = [impl for impl in impls if impl[0] in wanted]

        ref = None
        peer = None
        to_profile = []
        for impl, fn, env in impls:
            if env.get("fused"):  # last, as fusing is irreversible
                set_backend(modeling, {})
                modeling._moe_rewrite_options["stacking"] = "stack"
                for p in moe.parameters():  # undo flatten_experts: profile the default layout
                    p.data = p.data.clone()
                for impl_, fn_, peer_ in to_profile:  # the profiler's hooks must not slow down the timed rows
                    profile(fn_, data, moe, peer_, out_dir / f"profile_{name}_{safe_name(impl_)}.txt")
                to_profile = []  # the transformers peer stays: the SonicMoE row after these reads its weights
                torch.cuda.empty_cache()
                moe.moe_rewrite_fuse_experts()
            if impl == "transformers-grouped_mm":
                peer, what = build_peer(cfg, moe)
                notes.append(f"{name}: transformers-grouped_mm = {what}")
                fn = lambda x, i, w, peer=peer: peer(x, i, w.to(x.dtype))  # noqa: E731
            if impl == "liger-fused_moe":  # the same parameters as the transformers row
                fn = functools.partial(liger_forward, liger, peer)
            if impl == "sonicmoe":  # the same weights as the transformers peer, in its layout
                sonic_peer = SonicPeer(peer)
                fn = functools.partial(sonic_peer.forward, sonic)
            run_peer = sonic_peer if impl == "sonicmoe" else peer
            set_backend(modeling, env)
            modeling._moe_rewrite_options["stacking"] = env.get("stacking", "stack")
            if env.get("flat"):
                flatten_experts(moe)
            warm, r = (1, max(2, reps // 5)) if impl == "naive-loop" else (3, reps)
            t0 = time.time()
            ms, host_ms, peak, kept, y, x = run_impl(fn, data, moe, run_peer, warm, r)
            if impl == "moe-rewrite":
                notes.append(f"{name}: moe-rewrite default kernel = {kernel_of(modeling, x)}")
            grads = grads_of(impl, moe, run_peer, x)
            if ref is None:
                ref = [y] + grads
                err = 0.0
            else:
                err = max(rel(a, b) for a, b in zip([y] + grads, ref))
            clear_grads(moe, run_peer, x)
            row = dict(
                config=name,
                impl=impl,
                ms=round(ms, 3),
                host_ms=round(host_ms, 3),
                tflops=round(flops / (ms / 1e3) / 1e12, 1),
                frac_matmul=round(flops / (ms / 1e3) / 1e12 / rate, 3),
                peak_gb=round(peak, 3),
                kept_gb=round(kept, 3),
                max_rel_err=float(f"{err:.2e}"),
            )
            rows.append(row)
            print(json.dumps(row), f"({time.time() - t0:.1f}s)", flush=True)
            if args.profile and impl in ("moe-rewrite", "transformers-grouped_mm", "moe-rewrite[fused]", "sonicmoe"):
                to_profile.append((impl, fn, run_peer))
            if impl == "sonicmoe":
                del sonic_peer, run_peer
        set_backend(modeling, {})
        modeling._moe_rewrite_options["stacking"] = "stack"
        for impl, fn, peer_ in to_profile:
            profile(fn, data, moe, peer_, out_dir / f"profile_{name}_{safe_name(impl)}.txt")
        del moe, peer, ref, data
        torch.cuda.empty_cache()

    liger_note = []
    if liger:  # tuned or not: LIGER_FUSED_MOE_AUTOTUNE as liger_fused_moe() left it ("0" unless asked otherwise)
        tune = os.environ["LIGER_FUSED_MOE_AUTOTUNE"]
        liger_note = [f"liger-fused_moe: liger-kernel {version('liger-kernel')}, LIGER_FUSED_MOE_AUTOTUNE={tune}"]
    result = record(
        matmul_tflops=round(rate, 1),
        empty_expert_wgrad_ok=empty_ok,
        notes=notes + liger_note + ([f"sonicmoe: sonic-moe {version('sonic-moe')}"] if sonic else []),
        rows=rows,
    )
    (out_dir / f"{args.label}.json").write_text(json.dumps(result, indent=1) + "\n")
    print()
    for n in notes:
        print(n)
    print(
        f"\n{'config':10} {'impl':40} {'ms':>9} {'host ms':>8} {'TFLOP/s':>8} {'of mm':>6} {'peak GB':>8} "
        f"{'kept GB':>8} {'rel err':>9} {'vs loop':>8} {'vs hf':>6}"
    )
    for r in rows:
        loop = next(x["ms"] for x in rows if x["config"] == r["config"] and x["impl"] == "naive-loop")
        hf = [x["ms"] for x in rows if x["config"] == r["config"] and x["impl"] == "transformers-grouped_mm"]
        print(
            f"{r['config']:10} {r['impl']:40} {r['ms']:9.2f} {r['host_ms']:8.2f} {r['tflops']:8.1f} "
            f"{r['frac_matmul']:6.2f} "
            f"{r['peak_gb']:8.3f} {r['kept_gb']:8.3f} {r['max_rel_err']:9.1e} {loop / r['ms']:7.1f}x "
            + (f"{hf[0] / r['ms']:5.2f}x" if hf else "    -")
        )


def safe_name(impl):
    """A row name as a file name: moe-rewrite[fused,sonicmoe] -> moe-rewrite_fused_sonicmoe."""
    return impl.replace("[", "_").replace("]", "").replace(",", "_").replace(" ", "_")


def profile(fn, data, moe, peer, path):
    """A kernel-time table over 3 steps, each timed as run_impl times it (synchronized before and after), headed by
    where each step's GPU time goes: kernels busy, and the idle gaps between them (launch waits, host syncs)."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    x, ids, w, g = data[0]
    for _ in range(2):
        fn(x.detach().requires_grad_(True), ids, w).backward(g)
        clear_grads(moe, peer)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.cuda.synchronize()
            with record_function("bench_step"):
                fn(x.detach().requires_grad_(True), ids, w).backward(g)
                torch.cuda.synchronize()
            clear_grads(moe, peer)
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    path.write_text(
        timeline(json.loads(trace.read_text()))
        + "\n\n"
        + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    )


def timeline(trace):
    """Per profiled step (a bench_step range on the host): its span from the step's start to its last GPU event, the
    time some kernel, copy or memset ran, and the longest idle gaps with the kernel that ended each wait."""
    events = trace["traceEvents"]
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("name") == "bench_step" and e.get("cat") != "gpu_user_annotation" and "dur" in e
    )
    gpu = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    )
    host = [(e["ts"], e["dur"], e["name"]) for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    lines = []
    for i, (start, end) in enumerate(steps):
        mine = [ev for ev in gpu if start <= ev[0] <= end]
        busy, gaps, cursor = 0.0, [], start
        for ev_start, ev_end, name in mine:
            if ev_start > cursor:
                gaps.append((ev_start - cursor, cursor, name))
            busy += max(0.0, ev_end - max(ev_start, cursor))
            cursor = max(cursor, ev_end)
        gaps.sort(reverse=True)
        top = ", ".join(f"{gap:.0f} us at +{(at - start) / 1e3:.2f} ms before {nm[:50]}" for gap, at, nm in gaps[:6])
        lines.append(
            f"step {i}: span {(cursor - start) / 1e3:.3f} ms, GPU busy {busy / 1e3:.3f} ms, idle "
            f"{sum(gap for gap, _, _ in gaps) / 1e3:.3f} ms in {len(gaps)} gaps; longest: {top}"
        )
        if gaps:  # what the host ran while the GPU waited longest: the longest host ops that started in that gap
            gap, at, _ = gaps[0]
            ops = sorted((op for op in host if at <= op[0] < at + gap), key=lambda op: -op[1])[:8]
            lines.append("  host in the longest gap: " + ", ".join(f"{name[:50]} {dur:.0f} us" for _, dur, name in ops))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
