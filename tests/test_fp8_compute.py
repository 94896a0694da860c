"""FP8 compute (--fp8-compute, MOE_REWRITE_FP8_COMPUTE; issue #49): FP8 experts' grouped GEMMs in W8A8, rows quantized
per 1 x 128 tile as DeepSeek-V3 trains. Its quantization against a float64 reference; moe_train under it against an
explicit reference of the same arithmetic and against the default bf16 compute (W8A16, the dequantized weights'
numbers), LoRA gradients included; the option, the banner and the refusals. The Triton kernels themselves:
tests/test_triton_kernels.py (the grouped GEMM in the interpreter, the quantization on a GPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import V3_DIR, runtime_env  # noqa: E402
from fp8 import FP8_MAX, HIDDEN, fp8_moe, quantize_rows  # noqa: E402
from helpers import routing  # noqa: E402

from moe_rewrite.errors import RewriteError  # noqa: E402
from moe_rewrite.options import RewriteOptions  # noqa: E402
from moe_rewrite.rewrite import fp8_choice, rewrite_source  # noqa: E402
from moe_rewrite.runtime.kernels import dispatch, triton_gemm  # noqa: E402

EXPERTS, TOP_K = 6, 2
# FP8 compute against bf16 compute (W8A16) on the same FP8 weights, relative error of the norm: e4m3 keeps 3 mantissa
# bits, each activation is rounded by up to 1/16 of itself, twice on the way (the rows, then SwiGLU's output): 4.2e-2
# to 4.4e-2 measured here without adapters, 1.1e-2 to 1.6e-2 with LoRA r4 (whose own products stay exact)
W8A8_BOUND = 8e-2


def test_rows_quantize_per_1x128_tile_like_the_float64_reference():
    """Codes and scales equal the float64 reference's (IEEE float32 division rounds as float64 rounded once more);
    a zero tile gets scale 0 and zero codes (no NaN); every value comes back within half an e4m3 step (1/16 of it)
    or, below e4m3's normal range, within half its subnormal step; the largest of each tile up to the float32
    rounding of its scale."""
    torch.manual_seed(0)
    x = (torch.randn(37, 384) * torch.logspace(-3, 3, 37).unsqueeze(1)).to(torch.bfloat16)
    x[5, 128:256] = 0
    x[6, :128] = 0
    x[6, 7] = -3e-30  # a tile whose amax is tiny
    codes, scales = triton_gemm._moe_rewrite_quantize_rows(None, x)
    want_codes, want_scales = quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32 and scales.shape == (3, 37)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales, want_scales.t())
    assert scales[1, 5] == 0 and not codes[5, 128:256].float().any()
    back = triton_gemm._moe_rewrite_dequantize_rows(codes, scales, torch.float64)
    tile_scale = scales.t().double().repeat_interleave(128, 1)
    error = (back - x.double()).abs()
    assert (error <= x.double().abs() / 16 + tile_scale * 2.0**-10).all()
    amax_at = x.double().abs().view(37, 3, 128).argmax(-1, keepdim=True)
    largest = [t.view(37, 3, 128).gather(-1, amax_at) for t in (back, x.double())]
    assert torch.allclose(*largest, rtol=2.0**-23, atol=0)  # up to the scale's float32 rounding
    assert codes.float().abs().max() == FP8_MAX


def _moe_step(moe, x, ids, w, probe):
    """moe_train's output and the gradients of x, the routing weights and any LoRA parameter."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = moe.moe_train(x, ids, w)
    (y * probe).sum().backward()
    grads = {n: p.grad for n, p in moe.named_parameters() if p.grad is not None}
    for p in moe.parameters():
        p.grad = None
    return y.detach(), x.grad, w.grad, grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_moe_train_quantizes_each_gemms_rows_and_multiplies_the_codes(monkeypatch):
    """Under MOE_REWRITE_FP8_COMPUTE=1 the forward equals an explicit reference of the W8A8 arithmetic: the gathered
    rows quantized along hidden, gate_up's product, SwiGLU, its rows quantized along intermediate, down's product,
    the weighted sum; in float64 (the CPU runs it as torch ops, exact products). The input gradient is the
    reference's with the quantization passed straight through: the output gradients times the weights' values."""
    moe, ref = fp8_moe()
    moe.moe_rewrite_fuse_experts()
    torch.manual_seed(3)
    tokens = 11
    x = torch.randn(tokens, HIDDEN, dtype=torch.float64)
    ids, w = routing(tokens, EXPERTS, TOP_K)
    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", "1")
    x_grad = x.clone().requires_grad_(True)
    y = moe.moe_train(x_grad, ids, w)
    probe = torch.randn(tokens, HIDDEN, dtype=torch.float64)
    y.backward(probe)

    def real(rows):  # the value its codes hold; in the backward the rows themselves (straight through)
        codes, scales = quantize_rows(rows.detach())
        return rows + (codes.double() * scales.double().repeat_interleave(128, 1) - rows).detach()

    x_ref = x.clone().requires_grad_(True)
    want = []
    for t in range(tokens):
        row = torch.zeros(HIDDEN, dtype=torch.float64)
        for j in range(TOP_K):
            expert = ref[int(ids[t, j])]
            rows = real(x_ref[t : t + 1])
            hidden = torch.nn.functional.silu(expert.gate_proj(rows)) * expert.up_proj(rows)
            row = row + w[t, j] * expert.down_proj(real(hidden))[0]
        want.append(row)
    want = torch.stack(want)
    want.backward(probe)
    assert _rel(y, want) < 1e-12
    # the input gradients multiply the output gradients by the weights' own values (W8A16, not quantized)
    assert _rel(x_grad.grad, x_ref.grad) < 1e-12


@pytest.mark.parametrize("with_lora", [False, True])
def test_fp8_compute_stays_within_its_bound_of_bf16_compute(monkeypatch, with_lora):
    """FP8 compute against the default (W8A16: the dequantized weights' numbers) on the same FP8 experts: output, x's
    and the routing weights' gradients and, with LoRA r4 on both fused parameters, its gradients, within W8A8_BOUND
    but not equal (the rows are quantized); float32 activations, experts 4 and 5 without tokens."""
    from peft import LoraConfig, inject_adapter_in_model

    moe, _ = fp8_moe()
    moe.moe_rewrite_fuse_experts()
    if with_lora:
        config = LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False, target_parameters=["experts.gate_up_proj", "experts.down_proj"]
        )
        torch.manual_seed(1)
        inject_adapter_in_model(config, moe)
        for name, p in moe.named_parameters():
            p.requires_grad_("lora" in name)
            if "lora" in name:
                p.data = p.data.float()
    torch.manual_seed(2)
    tokens = 64
    x = torch.randn(tokens, HIDDEN)
    ids, w = routing(tokens, EXPERTS, TOP_K)
    w = w.float()
    probe = torch.randn(tokens, HIDDEN)
    bf16_compute = _moe_step(moe, x, ids, w, probe)
    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", "1")
    fp8_compute = _moe_step(moe, x, ids, w, probe)
    pairs = list(zip(fp8_compute[:3], bf16_compute[:3]))
    assert fp8_compute[3].keys() == bf16_compute[3].keys() and len(fp8_compute[3]) == (4 if with_lora else 0)
    pairs += [(fp8_compute[3][name], grad) for name, grad in bf16_compute[3].items()]
    errors = [_rel(got, want) for got, want in pairs]
    assert all(1e-3 < e < W8A8_BOUND for e in errors), errors


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_the_option_asks_for_fp8_experts_and_is_said_in_the_banner_and_the_options():
    options = RewriteOptions(fp8_compute=True)
    decided, line = fp8_choice(options, None, "")
    assert decided.fp8_experts and line == "FP8 experts: generated, as --fp8-compute asks"
    assert decided.describe().endswith("fp8-experts, fp8-compute")
    assert decided.as_dict("1")["fp8_compute"] == 1 and "fp8_compute" not in RewriteOptions().as_dict("1")
    result = rewrite_source((V3_DIR / "modeling_deepseek.py").read_text(), options)
    assert result.chosen == (line,) and result.options.fp8_compute
    assert "fp8-experts, fp8-compute): training path for DeepseekV3MoE" in result.text
    assert '"stacking": "stack", "fp8_compute": 1}' in result.text
    assert "def _moe_rewrite_fp8_gmm(" in result.text and "def quantize_rows(" in result.text
    plain = rewrite_source((V3_DIR / "modeling_deepseek.py").read_text()).text
    assert (
        '"fp8_compute"' not in plain and "def _moe_rewrite_fp8_gmm(" not in plain and "def quantize_rows(" not in plain
    )
    with pytest.raises(RewriteError, match="--fp8-compute .* cannot go with --no-fp8-experts"):
        RewriteOptions(fp8_compute=True, fp8_experts=False)
    # a second run keeps what the banner records, saying so; --no-fp8-compute drops it (the FP8 experts stay)
    again = rewrite_source(result.text)
    assert again.text == result.text and again.options.fp8_compute
    assert again.chosen == (
        "FP8 experts: kept, as the earlier rewrite's banner records them (--no-fp8-experts drops them)",
        "FP8 compute: kept, as the earlier rewrite's banner records it (--no-fp8-compute drops it)",
    )
    dropped = rewrite_source(result.text, RewriteOptions(fp8_compute=False))
    assert '"fp8_compute": 1' not in dropped.text and "def _moe_rewrite_fp8_gmm(" in dropped.text


def test_the_cli_refuses_fp8_compute_without_fp8_experts(capsys):
    from moe_rewrite.cli import main

    assert main([str(V3_DIR / "modeling_deepseek.py"), "--check", "--fp8-compute", "--no-fp8-experts"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        "moe-rewrite: error: --fp8-compute runs FP8 experts' GEMMs in FP8: it cannot go with --no-fp8-experts"
    ]


def test_fp8_compute_is_chosen_by_the_environment_over_the_option(monkeypatch):
    cpu = torch.device("cpu")
    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", None)
    assert not dispatch._moe_rewrite_fp8_compute(cpu, None)
    monkeypatch.setitem(dispatch._moe_rewrite_options, "fp8_compute", 1)
    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", None)
    assert dispatch._moe_rewrite_fp8_compute(cpu, None)
    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", "0")
    assert not dispatch._moe_rewrite_fp8_compute(cpu, None)
    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", "yes")
    with pytest.raises(ValueError, match="MOE_REWRITE_FP8_COMPUTE='yes'; use 1"):
        dispatch._moe_rewrite_fp8_compute(cpu, None)


@pytest.mark.parametrize(
    "capability,kernels,error",
    [
        (
            (8, 0),
            {},
            "needs a GPU with FP8 tensor cores \\(sm89\\+: L4, L40S, H100, H200, B200\\), not sm80; "
            "set MOE_REWRITE_FP8_COMPUTE=0",
        ),
        (
            (9, 0),
            None,
            "needs the Triton kernels \\(triton installed, MOE_REWRITE_TRITON unset or 1, not under torch.compile",
        ),
    ],
)
def test_fp8_compute_refuses_gpus_without_fp8_tensor_cores(monkeypatch, capability, kernels, error):
    """On CUDA it runs only on FP8 tensor cores (sm89+) through the Triton kernels; asked elsewhere, it raises a
    one-line error saying how to turn it off, rather than run another arithmetic; asked once per device."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or capability)
    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", "1")
    gpu = torch.device("cuda", 0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=f"^moe-rewrite: FP8 compute {error}"):
            dispatch._moe_rewrite_fp8_compute(gpu, kernels)
    assert asked == [gpu]
    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", "0")
    assert not dispatch._moe_rewrite_fp8_compute(gpu, kernels)


def test_an_input_width_off_the_128_grid_runs_w8a16(monkeypatch):
    """FP8 compute quantizes whole 1 x 128 tiles of the rows: a projection 192 wide (a partial last scale block, which
    FP8 experts load) runs the W8A16 arithmetic under MOE_REWRITE_FP8_COMPUTE=1, the dequantized weights' product
    exactly, where the W8A8 path would fail on the partial tile; a 256-wide one is quantized."""
    from moe_rewrite.runtime.moe import grouped_mm

    runtime_env(monkeypatch, "MOE_REWRITE_FP8_COMPUTE", "1")
    generator = torch.Generator().manual_seed(5)
    offsets = torch.tensor([3, 7], dtype=torch.int32)
    for width, quantized in ((192, False), (256, True)):
        codes = (torch.randn(2, 128, width, generator=generator) * 100).clamp(-FP8_MAX, FP8_MAX)
        codes = codes.to(torch.float8_e4m3fn)
        scale = torch.rand(2, 1, -(-width // 128), generator=generator, dtype=torch.float64) + 0.5
        rows = torch.randn(7, width, generator=generator, dtype=torch.float64)
        got = grouped_mm._moe_rewrite_gmm("sorted", rows, codes, offsets, "fwd", scale)
        weights = grouped_mm._moe_rewrite_dequantize(codes, scale, torch.float64)
        w8a16 = torch.cat([rows[:3] @ weights[0].t(), rows[3:] @ weights[1].t()])
        assert torch.equal(got, w8a16) != quantized, width
        if quantized:
            assert _rel(got, w8a16) < 0.1
