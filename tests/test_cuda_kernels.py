"""The generated core's GPU kernels against the per-expert loop in float32 on the same bf16 weights: torch._grouped_mm
(backend torch, with the Triton kernels and without) and SonicMoE (backend sonicmoe, where sonic-moe is installed on
an sm90 GPU). Outputs and the gradients of x, the routing weights and both expert parameters within 1e-2, empty
experts' weight gradients exact zeros, under random, skewed and single-token routing; and the fused RMSNorm against the
published module in bf16 and fp32. CI's CPU machine skips this file (no GPU); its runs on the H200 are recorded in
bench/results/ (h200-cuda-tests-*.txt).
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from conftest import patch_runtime, runtime_env  # noqa: E402
from helpers import tiny_moe  # noqa: E402

from moe_rewrite.runtime.kernels import dispatch, triton_swiglu  # noqa: E402
from moe_rewrite.runtime.model import lm_loss  # noqa: E402
from moe_rewrite.runtime.moe import backends  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

EXPERTS, HIDDEN, INTER, TOP_K = 8, 256, 128, 2


def routing(kind, tokens, generator):
    """(ids, weights): experts 6 and 7 never chosen; "skewed" sends nine tokens in ten to expert 0 first."""
    ids = torch.stack([torch.randperm(EXPERTS - 2, generator=generator)[:TOP_K] for _ in range(tokens)])
    if kind == "skewed":
        first = torch.rand(tokens, generator=generator) < 0.9
        ids[first] = torch.stack([torch.zeros_like(ids[first, 0]), 1 + ids[first, 0] % (EXPERTS - 3)], dim=1)
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=generator), dim=-1)
    return ids.cuda(), weights.cuda()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def step(moe, x, ids, w, probe):
    """moe_train forward and backward: the output and the gradients of x, w and the fused parameters."""
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    for p in moe.parameters():
        p.grad = None
    y = moe.moe_train(x, ids, w)
    (y.float() * probe).sum().backward()
    # copies: moe.float() converts the parameters' gradients in place
    return [t.detach().clone() for t in (y, x.grad, w.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad)]


def untuned_quack(monkeypatch):
    """SonicMoE's GEMMs on quack's default config (what its gemm(..., tuned=False) runs) instead of its autotune, which
    compiles 9-22 candidate configs per GEMM and token count: over 7 minutes on an H200 for this test's first shape
    (bench/NOTES.md). The tile changes only the rounding, not what is computed."""
    from quack import autotuner, gemm_interface

    for tuned in vars(gemm_interface).values():
        if isinstance(tuned, autotuner.Autotuner):
            monkeypatch.setattr(tuned, "configs", [autotuner.AutotuneConfig(config=None)])


@pytest.mark.parametrize("kind,tokens", [("random", 300), ("skewed", 300), ("random", 1)])
@pytest.mark.parametrize("backend,triton", [("torch", "1"), ("torch", "0"), ("sonicmoe", "1")])
def test_the_gpu_kernels_equal_the_loop(monkeypatch, backend, triton, kind, tokens):
    if backend == "sonicmoe" and dispatch._moe_rewrite_sonicmoe() is None:
        pytest.skip("sonic-moe is not installed")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm and SonicMoE are fast on sm90 and later only")
    if backend == "sonicmoe":
        untuned_quack(monkeypatch)
    generator = torch.Generator().manual_seed(tokens)
    torch.manual_seed(tokens)
    moe = tiny_moe("fused", experts=EXPERTS, hidden=HIDDEN, inter=INTER).to("cuda", torch.bfloat16)
    moe.experts.act_fn = torch.nn.SiLU()  # the module the DeepSeek files hold (ACT2FN["silu"])
    x = torch.randn(tokens, HIDDEN, generator=generator).cuda().bfloat16()
    ids, w = routing(kind, tokens, generator)
    probe = torch.randn(tokens, HIDDEN, generator=generator).cuda()
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", backend)
    runtime_env(monkeypatch, "MOE_REWRITE_TRITON", triton)
    ran = []
    sonic, swiglu = backends._moe_rewrite_sonicmoe_experts, triton_swiglu._moe_rewrite_swiglu
    patch_runtime(monkeypatch, "_moe_rewrite_sonicmoe_experts", lambda *a: ran.append("sonic") or sonic(*a))
    patch_runtime(monkeypatch, "_moe_rewrite_swiglu", lambda *a: ran.append("triton") or swiglu(*a))
    got = step(moe, x, ids, w, probe)
    # SonicMoE ran it (not the fallback), or the Triton kernels did where they are on
    assert ran == (["sonic"] if backend == "sonicmoe" else ["triton"] if triton == "1" else [])
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", "loop")
    want = step(moe.float(), x.float(), ids, w, probe)
    for name, a, b in zip(["output", "x", "routing weights", "gate_up_proj", "down_proj"], got, want):
        assert a.dtype == (torch.float32 if name in ("output", "routing weights") else torch.bfloat16), name
        assert rel(a, b) < 1e-2, (name, rel(a, b))
    for grad in got[3:]:  # experts 6 and 7 got no rows
        assert torch.count_nonzero(grad[EXPERTS - 2 :]) == 0


@pytest.mark.parametrize("triton", ["1", "0"])
def test_the_fused_loss_equals_the_published_loss_in_bf16(monkeypatch, triton):
    """The fused loss at Moonlight's vocabulary, bf16, four chunks (the float32 weight-gradient accumulation), with
    ignored labels, against the published statements on the same bf16 tensors: the loss within 1e-3, the gradients
    within bf16 rounding."""
    runtime_env(monkeypatch, "MOE_REWRITE_TRITON", triton)
    tokens, hidden_size, vocab = 2048, 512, 163840
    monkeypatch.setattr(lm_loss, "MOE_REWRITE_LOSS_CHUNK_BYTES", 512 * vocab * 2)
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(2, tokens // 2, hidden_size, generator=generator) * 0.5).cuda().bfloat16()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.02).cuda().bfloat16()
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=generator).cuda()
    labels[0, :100] = -100
    runs = []
    for fused in (True, False):
        x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if fused:
            loss = lm_loss._moe_rewrite_lm_loss(x, w, labels)[0]
        else:
            logits = torch.nn.functional.linear(x, w).float()
            loss = torch.nn.CrossEntropyLoss()(logits[..., :-1, :].reshape(-1, vocab), labels[..., 1:].reshape(-1))
        loss.backward()
        runs.append((loss.detach(), x.grad, w.grad))
    (loss, grad_x, grad_w), (want, want_x, want_w) = runs
    assert loss.dtype == torch.float32 and abs(loss.item() - want.item()) <= 1e-3 * abs(want.item())
    assert grad_x.dtype == grad_w.dtype == torch.bfloat16
    assert rel(grad_x, want_x) <= 1e-2 and rel(grad_w, want_w) <= 1e-2


@pytest.mark.parametrize("form", ["v3", "v2"])
def test_the_default_model_trains_under_gradient_checkpointing_in_bf16(tmp_path_factory, monkeypatch, form):
    """The stand-in rewritten with the defaults, bf16 on the GPU, gradient checkpointing (non-reentrant), the backend
    probes run inside the first checkpointed layer (caches emptied): loss and gradient norm within bf16 noise of the
    published attention, loss and norm (MOE_REWRITE_SDPA=0, MOE_REWRITE_FUSED_LOSS=0, MOE_REWRITE_FUSED_NORM=0) on the
    same weights and tokens."""
    from conftest import build_model, patched_checkpoint

    from moe_rewrite.runtime.model import attention

    path = patched_checkpoint(tmp_path_factory, form)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for published in ("0", "1"):
        runtime_env(monkeypatch, "MOE_REWRITE_SDPA", "0" if published == "1" else "1")
        runtime_env(monkeypatch, "MOE_REWRITE_FUSED_LOSS", "0" if published == "1" else "1")
        runtime_env(monkeypatch, "MOE_REWRITE_FUSED_NORM", "0" if published == "1" else "1")
        attention._moe_rewrite_attention_cache.clear()
        model = build_model(path).cuda().bfloat16()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append(
            (loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
        )
    (loss, grads), (want, want_grads) = runs
    assert abs(loss.item() - want.item()) <= 1e-2 * abs(want.item())
    assert grads.keys() == want_grads.keys()
    # bf16 noise can flip a near-tied expert choice, so the gradients are compared as a whole, not expert by expert
    assert all(torch.isfinite(g).all() for g in grads.values())
    norm = torch.stack([g.norm() for g in grads.values()]).norm()
    want_norm = torch.stack([g.norm() for g in want_grads.values()]).norm()
    assert abs(norm / want_norm - 1) < 5e-2


class PublishedRMSNorm(torch.nn.Module):
    """The published DeepseekV3RMSNorm, as every copy writes it."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def ulps(a, b, dtype):
    """The largest difference of a and b in units of dtype's epsilon times b's magnitude (one to two ulps of dtype
    at b)."""
    spacing = torch.finfo(dtype).eps * b.float().abs().clamp(min=torch.finfo(dtype).tiny)
    return ((a.float() - b.float()).abs() / spacing).max().item()


@pytest.mark.parametrize("width", [2048, 7168, 100])
@pytest.mark.parametrize("x_dtype,w_dtype", [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")])
def test_the_fused_rmsnorm_equals_the_published_module(monkeypatch, x_dtype, w_dtype, width):
    """The fused norm against the published module on the same bf16/fp32 inputs and weight, under non-reentrant
    checkpointing (the forward runs twice): output dtype as published (promoted); in bf16 bit for bit the published
    values but where the fp32 mean's summation order flips a rounding of the normalised row (rare); gradients of x and
    the weight within bf16 tolerance (fp32: 1e-5).
    MOE_REWRITE_FUSED_NORM=0 turns it off."""
    from moe_rewrite.runtime.kernels import triton_rmsnorm

    x_dtype, w_dtype = getattr(torch, x_dtype), getattr(torch, w_dtype)
    torch.manual_seed(width)
    norm = PublishedRMSNorm(width).cuda().to(w_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (3 * torch.randn(4, 1000, width, device="cuda")).to(x_dtype)
    probe = torch.randn(4, 1000, width, device="cuda")
    assert triton_rmsnorm._moe_rewrite_rmsnorm_applies(x, norm.weight)

    def run(fused):
        leaf = x.detach().requires_grad_(True)
        norm.weight.grad = None
        forward = (lambda h: triton_rmsnorm._moe_rewrite_rmsnorm(h, norm.weight, 1e-6)) if fused else norm
        y = torch.utils.checkpoint.checkpoint(forward, leaf, use_reentrant=False)
        (y.float() * probe).sum().backward()
        return y.detach(), leaf.grad, norm.weight.grad

    got, want = run(True), run(False)
    assert got[0].dtype == want[0].dtype == torch.promote_types(x_dtype, w_dtype)
    # a flipped rounding of the normalised row to bf16 moves the output a step of bf16 (and the weight's rounding
    # another); in fp32 the mean's summation order and rsqrt move it a few fp32 steps
    unit, steps = (torch.bfloat16, 3) if torch.bfloat16 in (x_dtype, w_dtype) else (torch.float32, 8)
    assert ulps(got[0], want[0], unit) <= steps, ulps(got[0], want[0], unit)
    if x_dtype == torch.bfloat16:
        assert torch.eq(got[0], want[0]).float().mean().item() > 0.99
    for name, a, b in zip(["x", "weight"], got[1:], want[1:]):
        assert a.dtype == b.dtype, name
        assert rel(a, b) < (1e-2 if torch.bfloat16 in (x_dtype, w_dtype) else 1e-5), (name, rel(a, b))
    runtime_env(monkeypatch, "MOE_REWRITE_FUSED_NORM", "0")
    assert not triton_rmsnorm._moe_rewrite_rmsnorm_applies(x, norm.weight)


def published_rope(q, k, cos, sin, position_ids):
    """The published apply_rotary_pos_emb (unsqueeze_dim 1) with its rotate_half, written out."""

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
    q = q.view(*q.shape[:3], -1, 2).transpose(4, 3).reshape(q.shape)
    k = k.view(*k.shape[:3], -1, 2).transpose(4, 3).reshape(k.shape)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_fused_rope_equals_the_published_function_bit_for_bit(monkeypatch, dtype):
    """The fused RoPE against the published function at Moonlight's sizes, q_pe and k_pe cut from MLA's projections
    as the attention forward cuts them (16 heads of 192 lanes, the last 64 rotated; k_pe one head of the compressed
    kv's last 64 lanes), a yarn-like table in the activations' dtype: outputs and the gradients of q_pe and k_pe bit
    for bit (the kernel rounds each product and sum as published and as autograd does), with position_ids of batch 1
    and per batch row (offsets). MOE_REWRITE_FUSED_ROPE=0 turns it off."""
    from moe_rewrite.runtime.kernels import triton_rope

    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    batch, seq, heads, rows = 2, 4096, 16, 8192
    q = torch.randn(batch, seq, heads * 192, device="cuda").to(dtype).view(batch, seq, heads, 192).transpose(1, 2)
    q_pe = q[..., 128:]
    compressed = torch.randn(batch, seq, 512 + 64, device="cuda").to(dtype)
    k_pe = compressed[..., 512:].view(batch, seq, 1, 64).transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    angles = torch.outer(torch.arange(rows, device="cuda").float(), inv_freq)
    angles = torch.cat((angles, angles * 1.5), dim=-1)  # halves that differ, as no published table has them
    cos, sin = (1.2 * angles.cos()).to(dtype), (1.2 * angles.sin()).to(dtype)
    probes = torch.randn_like(q_pe, dtype=torch.float32), torch.randn_like(k_pe, dtype=torch.float32)
    offsets = torch.arange(seq, device="cuda") + torch.tensor([[0], [3000]], device="cuda")
    for position_ids in (torch.arange(seq, device="cuda").unsqueeze(0), offsets):
        assert triton_rope._moe_rewrite_rope_applies(q_pe, k_pe, cos, sin, position_ids, 1)
        runs = []
        for rope in (triton_rope._moe_rewrite_rope, published_rope):
            leaves = [q_pe.detach().requires_grad_(True), k_pe.detach().requires_grad_(True)]
            out = rope(*leaves, cos, sin, position_ids)
            torch.autograd.backward(out, [p.to(dtype) for p in probes])
            runs.append([*out, *(leaf.grad for leaf in leaves)])
        for name, got, want in zip(["q", "k", "q grad", "k grad"], *runs):
            assert got.dtype == want.dtype == dtype and got.shape == want.shape, name
            assert torch.equal(got, want), (name, (got.float() - want.float()).abs().max().item())
    runtime_env(monkeypatch, "MOE_REWRITE_FUSED_ROPE", "0")
    assert not triton_rope._moe_rewrite_rope_applies(q_pe, k_pe, cos, sin, offsets, 1)


@pytest.mark.parametrize("kernel_on", [True, False], ids=["scaled-kernel", "dequantized"])
def test_fp8_experts_equal_their_dequantized_bf16_twins(monkeypatch, kernel_on):
    """FP8 experts in bf16 training on the GPU: forward and input gradient through the Triton kernel that multiplies
    each weight tile by its block scales, or with MOE_REWRITE_TRITON_GEMM=0 dequantized first (then
    torch._grouped_mm); output, x's and the routing weights' gradients equal those of the same experts dequantized to
    bf16 (moe_rewrite_dequantize) on the bf16 path."""
    import copy

    from fp8 import fp8_moe

    from moe_rewrite.runtime.kernels import triton_gemm

    torch.manual_seed(3)
    if not kernel_on:
        runtime_env(monkeypatch, "MOE_REWRITE_TRITON_GEMM", "0")
    moe, _ = fp8_moe(experts=16, hidden=1024, inter=256)
    moe.moe_rewrite_fuse_experts()
    moe = moe.to("cuda")
    twin = copy.deepcopy(moe)
    twin.experts.moe_rewrite_dequantize()
    twin.experts.requires_grad_(False)
    scaled, grouped_mm = [], triton_gemm._moe_rewrite_grouped_mm

    def counted(*args):  # (kernels, a, b, offsets, mode[, scale])
        scaled.append(len(args) > 5 and args[5] is not None)
        return grouped_mm(*args)

    patch_runtime(monkeypatch, "_moe_rewrite_grouped_mm", counted)
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(14, generator=generator)[:4] for _ in range(300)]).cuda()  # experts 14, 15 idle
    results = []
    for module in (moe, twin):
        x = torch.randn(300, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        x = x.to(torch.bfloat16).requires_grad_(True)
        w = torch.rand(300, 4, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).requires_grad_(True)
        y = module.moe_train(x, ids, w, out_dtype=torch.bfloat16)
        y.backward(torch.ones_like(y))
        results.append((y.float(), x.grad.float(), w.grad.float()))
    assert sum(scaled) == (4 if kernel_on else 0)  # both projections' forward and input gradient
    for got, want in zip(*results):
        assert (got - want).norm() <= 1e-2 * want.norm()


def test_fp8_compute_runs_the_fp8_kernel_within_its_bound_of_bf16_compute(monkeypatch):
    """FP8 experts under MOE_REWRITE_FP8_COMPUTE=1 on an sm89+ GPU: both projections' forward and input gradient run
    the A-is-FP8 grouped GEMM (rows quantized per 1 x 128 tile), and output, x's and the routing weights' gradients
    stay within tests/test_fp8_compute.py's W8A8_BOUND of the default bf16 compute (W8A16) on the same experts."""
    from fp8 import fp8_moe
    from test_fp8_compute import W8A8_BOUND

    from moe_rewrite.runtime.kernels import triton_gemm

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 compute needs sm89+")
    torch.manual_seed(3)
    moe, _ = fp8_moe(experts=16, hidden=1024, inter=256)
    moe.moe_rewrite_fuse_experts()
    moe = moe.to("cuda")
    fp8_rows, grouped_mm = [], triton_gemm._moe_rewrite_grouped_mm

    def counted(*args):  # (kernels, a, b, offsets, mode[, scale, a_scale, out_dtype])
        fp8_rows.append(len(args) > 6 and args[6] is not None)
        return grouped_mm(*args)

    patch_runtime(monkeypatch, "_moe_rewrite_grouped_mm", counted)
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(14, generator=generator)[:4] for _ in range(300)]).cuda()  # experts 14, 15 idle
    results = []
    for compute in ("0", "1"):
        runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", compute)
        x = torch.randn(300, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        x = x.to(torch.bfloat16).requires_grad_(True)
        w = torch.rand(300, 4, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).requires_grad_(True)
        y = moe.moe_train(x, ids, w, out_dtype=torch.bfloat16)
        y.backward(torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(4)).to(y.dtype))
        results.append((y.float(), x.grad.float(), w.grad.float()))
    assert fp8_rows == [False] * 4 + [True] * 4  # both projections' forward and input gradient, W8A16 then W8A8
    errors = [rel(got, want) for got, want in zip(*reversed(results))]
    assert all(1e-3 < e < W8A8_BOUND for e in errors), errors


def _device_assert(script: str) -> tuple[int, str]:
    """Runs `script` (after `import torch`) in a fresh process on the GPU and synchronises: (exit code, stderr). A
    device-side assert leaves the CUDA context unusable, so it never runs in this one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "import torch\n" + script + "\ntorch.cuda.synchronize()\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return done.returncode, done.stderr


# what a device-side assert leaves on stderr: the kernel's own line ("...: Assertion `t >= 0 && t < n_classes`
# failed."), and, where the next CUDA call comes before the process ends, "device-side assert triggered" (nll_loss's
# assert surfaces at the next cuBLAS call of the backward as a cuBLAS error instead)
DEVICE_ASSERT = re.compile(r"Assertion `.*` failed|device-side assert")

LOSS_SCRIPT = """
import os
from moe_rewrite.runtime.model import lm_loss
vocab = 1000
hidden = torch.randn(2, 64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
weight = torch.randn(vocab, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, vocab, (2, 64), device="cuda")
labels[0, :5] = -100
labels[1, 7] = {bad}
triton_on = lm_loss._moe_rewrite_cross_entropy_kernel(hidden.device, hidden.dtype) is not None
assert triton_on == (os.environ.get("MOE_REWRITE_TRITON") != "0"), triton_on
if {published}:
    logits = torch.nn.functional.linear(hidden, weight).float()
    loss = torch.nn.CrossEntropyLoss()(logits[..., :-1, :].reshape(-1, vocab), labels[..., 1:].reshape(-1))
else:
    loss = lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)[0]
loss.backward()
print(loss.item())
"""


@pytest.mark.parametrize("bad", ["0", "vocab", "-1"])
@pytest.mark.parametrize("triton", ["1", "0"])
def test_a_label_out_of_the_vocabulary_is_a_device_side_assert_as_published(monkeypatch, triton, bad):
    """A label equal to the vocabulary size or -1 (not the ignore index -100): the published loss on CUDA stops at a
    device-side assert (nll_loss's bounds check), and so does the fused loss, Triton kernel or torch rows, before its
    kernels compute anything (torch._assert_async: the step's later kernels never run). A valid label (0) runs.
    The check itself synchronises nothing (torch.cuda.set_sync_debug_mode("error") raises on a sync)."""
    monkeypatch.setenv("MOE_REWRITE_TRITON", triton)
    for published in (True, False):
        code, err = _device_assert(LOSS_SCRIPT.format(bad=bad, published=published))
        if bad == "0":
            assert code == 0, err[-2000:]
        else:
            assert code != 0 and DEVICE_ASSERT.search(err), (published, err[-2000:])
    target = torch.tensor([0, 5, -100, 999], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        lm_loss._moe_rewrite_check_targets(target, 1000)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


ROPE_SCRIPT = """
from moe_rewrite.runtime.kernels import triton_rope
rows, seq = 64, 32
q = torch.randn(2, 4, seq, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 1, seq, 64, device="cuda", dtype=torch.bfloat16)
cos = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16)
sin = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16)
position_ids = torch.arange(seq, device="cuda").repeat(2, 1)
position_ids[1, 5] = {bad}
if {published}:
    out = cos[position_ids] + sin[position_ids]
else:
    assert triton_rope._moe_rewrite_rope_applies(q, k, cos, sin, position_ids, 1)
    out = triton_rope._moe_rewrite_rope(q, k, cos, sin, position_ids)
"""


@pytest.mark.parametrize("bad", ["rows - 1", "-rows", "rows", "-rows - 1"])
def test_a_position_outside_the_rope_table_is_a_device_side_assert_as_published(bad):
    """Position ids past the cos/sin table (or before -rows): the published `cos[position_ids]` on CUDA stops at a
    device-side assert, and so does the fused RoPE (torch._assert_async before its kernel), where the kernel alone
    read zeros. Ids inside, negative ones counting from the end included, run. The check synchronises nothing."""
    from moe_rewrite.runtime.kernels import triton_rope

    for published in (True, False):
        code, err = _device_assert(ROPE_SCRIPT.format(bad=bad, published=published))
        if bad in ("rows - 1", "-rows"):
            assert code == 0, err[-2000:]
        else:
            assert code != 0 and DEVICE_ASSERT.search(err), (published, err[-2000:])
    position_ids = torch.arange(16, device="cuda").unsqueeze(0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_rope._moe_rewrite_rope_check_positions(position_ids, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def published_attention_core(q, k, v, mask, scale):
    """The published eager core (V3/V2 attention forward, no dropout): scores, + mask, fp32 softmax, value product."""
    weights = torch.matmul(q, k.transpose(2, 3)) * scale
    weights = weights + mask
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


@pytest.mark.parametrize("dims", [(192, 128), (128, 128)], ids=["mla", "equal"])
def test_the_sdpa_core_equals_the_published_core_with_padding_and_fully_masked_rows(dims):
    """The generated attention core (_moe_rewrite_attention, on the backend it chooses: cuDNN for MLA's 192/128 where
    it runs) against the published eager core, bf16, on the file's 4-D additive mask for a left-padded batch: the
    first `pad` queries of row 0 see no key at all (every score the lowest bf16), where the published softmax is
    uniform over every key, i.e. the mean of all values. Output and the gradients of q, k, v: each within twice the
    published core's own bf16 error against float64 (plus 1e-3), the fully masked rows too."""
    from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask

    from moe_rewrite.runtime.model import attention

    qk_dim, v_dim = dims
    batch, heads, seq, pad = 2, 4, 256, 7
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, heads, seq, qk_dim, generator=generator) for _ in range(2))
    v = torch.randn(batch, heads, seq, v_dim, generator=generator)
    probe = torch.randn(batch, heads, seq, v_dim, generator=generator).cuda()
    q, k, v = (t.cuda().bfloat16() for t in (q, k, v))
    mask2d = torch.ones(batch, seq, dtype=torch.long, device="cuda")
    mask2d[0, :pad] = 0
    embeds = torch.zeros(batch, seq, 8, device="cuda", dtype=torch.bfloat16)
    mask = _prepare_4d_causal_attention_mask(mask2d, (batch, seq), embeds, 0)
    assert mask.dtype == torch.bfloat16 and bool((mask[0, 0, :pad] == torch.finfo(torch.bfloat16).min).all())
    scale = qk_dim**-0.5
    backend = attention._moe_rewrite_attention_backend(q.device, q.dtype, qk_dim, v_dim)
    runs = {}
    for name, core, cast in (
        ("generated", lambda *a: attention._moe_rewrite_attention(*a, 0.0), torch.bfloat16),
        ("published", published_attention_core, torch.bfloat16),
        ("exact", published_attention_core, torch.float64),
    ):
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (q, k, v)]
        out = core(*leaves, mask.to(cast), scale)
        out.backward(probe.to(cast))
        runs[name] = [out.detach(), *(leaf.grad for leaf in leaves)]
    uniform = v.double().mean(dim=2, keepdim=True).expand(batch, heads, pad, v_dim)[:1]
    assert torch.allclose(runs["exact"][0][:1, :, :pad], uniform, atol=1e-12)  # the published: every key's mean
    for i, name in enumerate(["out", "q grad", "k grad", "v grad"]):
        exact = runs["exact"][i]
        for part, rows in (("fully masked rows", (0, slice(None), slice(0, pad))), ("all", (slice(None),))):
            if name in ("k grad", "v grad") and part != "all":
                continue  # a key's gradient gathers every query's: only the whole tensor
            want = exact[rows]
            err = {n: (runs[n][i][rows].double() - want).norm().item() / max(want.norm().item(), 1e-30) for n in runs}
            assert err["generated"] <= 2 * err["published"] + 1e-3, (backend, name, part, err)
