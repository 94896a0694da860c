# ruff: noqa: B023, E741, E402
# (a probe script: closures time the loop's current tensors inside the same iteration)
"""Device probe (2026-12-06, issues #48 and #49): variable-length attention at MLA's shapes (q/k 192, v 128, 16
heads, 8192 tokens: per-document SDPA loop, torch's varlen_attn, compiled FlexAttention with a document mask, SDPA over
the whole row) and FP8 scaled GEMMs (torch._scaled_mm rowwise and blockwise, F.scaled_mm, torch._scaled_grouped_mm,
F.scaled_grouped_mm blockwise). `python3 bench/probe_varlen_fp8.py` on the device; writes $OUT/probe_round21.json.
Recorded: results/h100-probe-varlen-fp8.json (NOTES change 38)."""

import json
import math
import os
import time

import torch  # noqa: E402
import torch.nn.functional as F

out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "cap": torch.cuda.get_device_capability()}
dev = "cuda"


def timeit(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    evs = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        evs.append((a, b))
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in evs)
    return ts[len(ts) // 2]


def lengths_lognormal(total, median=500, sigma=1.0, cap=8192, seed=0):
    g = torch.Generator().manual_seed(seed)
    ls = []
    while sum(ls) < total:
        l = int(min(cap, max(16, math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item()))))
        ls.append(min(l, total - sum(ls)))
    return [l for l in ls if l > 0]


H, DQK, DV = 16, 192, 128
res = {}
try:
    import inspect

    import torch.nn.attention.varlen as vl

    out["varlen_sig"] = str(inspect.signature(vl.varlen_attn))
except Exception as e:
    out["varlen_import"] = repr(e)

mixes = {"16x512": [512] * 16, "lognormal": lengths_lognormal(8192), "one8192": [8192]}
out["lognormal_lengths"] = mixes["lognormal"]
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

flex_c = torch.compile(flex_attention)
for name, ls in mixes.items():
    T = sum(ls)
    cu = torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device=dev)
    q = torch.randn(T, H, DQK, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, H, DQK, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, H, DV, device=dev, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(T, H, DV, device=dev, dtype=torch.bfloat16)
    r = {}

    # reference: per-document SDPA loop
    def per_doc():
        outs = []
        for i in range(len(ls)):
            s, e = cu[i].item(), cu[i + 1].item()
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None], is_causal=True
            )
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    ref = per_doc()
    ref.backward(go)
    gref = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    def fb(f):
        def run():
            o = f()
            o.backward(go)
            for t in (q, k, v):
                t.grad = None

        return run

    r["per_doc_sdpa_ms"] = timeit(fb(per_doc), reps=5)
    # varlen_attn
    for vname, vpad in (("varlen", False), ("varlen_vpad", True)):
        try:

            def f(vpad=vpad):
                vv = F.pad(v, (0, DQK - DV)) if vpad else v
                o = vl.varlen_attn(q, k, vv, cu, cu, max(ls), max(ls), is_causal=True)
                if isinstance(o, tuple):
                    o = o[0]
                return o[..., :DV]

            o = f()
            o.backward(go)
            r[vname + "_err"] = [(o - ref).abs().max().item()] + [
                (t.grad - g).abs().max().item() / g.abs().max().item() for t, g in zip((q, k, v), gref)
            ]
            for t in (q, k, v):
                t.grad = None
            r[vname + "_ms"] = timeit(fb(f))
        except Exception as e:
            r[vname] = repr(e)[:300]
    # flex with document mask
    try:
        doc = torch.repeat_interleave(torch.arange(len(ls), device=dev), torch.tensor(ls, device=dev))

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        t0 = time.time()
        bm = create_block_mask(mask_mod, 1, 1, T, T, device=dev)
        r["flex_mask_ms"] = (time.time() - t0) * 1e3

        def f():
            return flex_c(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=bm)[
                0
            ].transpose(0, 1)

        t0 = time.time()
        o = f()
        o.backward(go)
        torch.cuda.synchronize()
        r["flex_first_s"] = time.time() - t0
        r["flex_err"] = [(o - ref).abs().max().item()] + [
            (t.grad - g).abs().max().item() / g.abs().max().item() for t, g in zip((q, k, v), gref)
        ]
        for t in (q, k, v):
            t.grad = None
        r["flex_ms"] = timeit(fb(f))
        t0 = time.time()
        bm2 = create_block_mask(mask_mod, 1, 1, T, T, device=dev)
        torch.cuda.synchronize()
        r["flex_mask2_ms"] = (time.time() - t0) * 1e3
    except Exception as e:
        r["flex"] = repr(e)[:300]
    # whole-row causal SDPA (cuDNN/flash) for scale
    try:

        def f():
            return F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
            )[0].transpose(0, 1)

        r["sdpa_whole_row_ms"] = timeit(fb(f))
    except Exception as e:
        r["sdpa_whole_row"] = repr(e)[:300]
    res[name] = r
    print(name, json.dumps(r), flush=True)
out["attention"] = res

# FP8 (#49)
f8 = {}
f8["has_scaled_grouped_mm"] = hasattr(torch, "_scaled_grouped_mm")
f8["F_scaled_mm"] = hasattr(F, "scaled_mm")
f8["F_scaled_grouped_mm"] = hasattr(F, "scaled_grouped_mm")
try:
    from torch.nn.functional import ScalingType

    f8["ScalingType"] = [s.name for s in ScalingType]
except Exception as e:
    f8["ScalingType"] = repr(e)[:200]
M, K, N = 4096, 7168, 2048
a = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
b = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)
abf = a.to(torch.bfloat16)
bbf = b.to(torch.bfloat16)
f8["bf16_mm_ms"] = timeit(lambda: abf @ bbf.t())
try:
    sa = torch.ones(M, 1, device=dev)
    sb = torch.ones(1, N, device=dev)
    f8["rowwise_mm_ms"] = timeit(lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16))
except Exception as e:
    f8["rowwise_mm"] = repr(e)[:300]
try:
    sa = torch.rand(M, K // 128, device=dev) + 0.5
    sb = torch.rand(N // 128, K // 128, device=dev) + 0.5
    o = torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=torch.bfloat16)
    ref = (abf.float() * sa.repeat_interleave(128, 1)) @ (
        bbf.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)
    ).t()
    f8["blockwise_mm_err"] = ((o.float() - ref).abs().max() / ref.abs().max()).item()
    f8["blockwise_mm_ms"] = timeit(lambda: torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=torch.bfloat16))
except Exception as e:
    f8["blockwise_mm"] = repr(e)[:300]
try:
    from torch.nn.functional import ScalingType

    sa = torch.rand(M, K // 128, device=dev) + 0.5
    sb = torch.rand(N // 128, K // 128, device=dev) + 0.5
    o = F.scaled_mm(
        a, b.t(), sa, ScalingType.BlockWise1x128, sb.t(), ScalingType.BlockWise128x128, output_dtype=torch.bfloat16
    )
    f8["F_blockwise_ok"] = True
    f8["F_blockwise_ms"] = timeit(
        lambda: F.scaled_mm(
            a, b.t(), sa, ScalingType.BlockWise1x128, sb.t(), ScalingType.BlockWise128x128, output_dtype=torch.bfloat16
        )
    )
except Exception as e:
    f8["F_blockwise"] = repr(e)[:300]
# grouped: 32 experts, 256 tokens each, rowwise
try:
    E, m = 32, 512
    A = torch.randn(E * m, K, device=dev).to(torch.float8_e4m3fn)
    B = torch.randn(E, N, K, device=dev).to(torch.float8_e4m3fn)
    offs = torch.arange(m, E * m + 1, m, device=dev, dtype=torch.int32)
    sA = torch.ones(E * m, device=dev)
    sB = torch.ones(E, N, device=dev)
    o = torch._scaled_grouped_mm(A, B.transpose(-2, -1), sA, sB, offs=offs, out_dtype=torch.bfloat16)
    f8["grouped_rowwise_ms"] = timeit(
        lambda: torch._scaled_grouped_mm(A, B.transpose(-2, -1), sA, sB, offs=offs, out_dtype=torch.bfloat16)
    )
    Abf = A.to(torch.bfloat16)
    Bbf = B.to(torch.bfloat16)
    f8["grouped_bf16_ms"] = timeit(lambda: torch._grouped_mm(Abf, Bbf.transpose(-2, -1), offs=offs))
except Exception as e:
    f8["grouped_rowwise"] = repr(e)[:300]
try:
    from torch.nn.functional import ScalingType

    sA = torch.rand(E * m, K // 128, device=dev) + 0.5
    sB = torch.rand(E, N // 128, K // 128, device=dev) + 0.5
    o = F.scaled_grouped_mm(
        A,
        B.transpose(-2, -1),
        sA,
        ScalingType.BlockWise1x128,
        sB.transpose(-2, -1),
        ScalingType.BlockWise128x128,
        offs=offs,
        output_dtype=torch.bfloat16,
    )
    f8["F_grouped_blockwise_ms"] = timeit(
        lambda: F.scaled_grouped_mm(
            A,
            B.transpose(-2, -1),
            sA,
            ScalingType.BlockWise1x128,
            sB.transpose(-2, -1),
            ScalingType.BlockWise128x128,
            offs=offs,
            output_dtype=torch.bfloat16,
        )
    )
except Exception as e:
    f8["F_grouped_blockwise"] = repr(e)[:300]
out["fp8"] = f8
print(json.dumps(f8), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_round21.json"), "w"), indent=1)
