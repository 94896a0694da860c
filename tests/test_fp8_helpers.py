"""tests/fp8.py, the FP8 reference the FP8 tests and benches compare against: DeepSeek-V3's 128 x 128 block
quantization, its dequantization, and the stand-in FP8 checkpoints written from a rewritten model."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from conftest import build_model, per_expert_checkpoint  # noqa: E402
from fp8 import (  # noqa: E402
    FP8,
    QUANTIZATION_CONFIG,
    dequantize_blockwise,
    fp8_config_overrides,
    fp8_standin,
    quantize_blockwise,
    write_fp8_checkpoint,
)


def error_bound(w, scale_inv):
    """Largest |w - dequantize(quantize(w))| allowed per element. The code c = w / s (s = the block's amax / 448) is
    rounded to nearest in e4m3fn (3 mantissa bits): for |c| >= 2^-6 (normal) the spacing is 2^(e-3) with
    2^e <= |c|, so the error is at most half of it, <= |c| / 16; below that (subnormal) the spacing is 2^-9, the
    error <= 2^-10. Times s: max(|w| / 16, s / 1024); 1e-5 relative slack covers fp32's roundings of w / s and
    c * s."""
    m, n = w.shape[-2:]
    s = scale_inv.repeat_interleave(128, -2)[..., :m, :].repeat_interleave(128, -1)[..., :n]
    return torch.maximum(w.abs() / 16, s / 1024) * (1 + 1e-5)


def block_loop_dequantize(q, s):
    """Dequantization written block by block, independently of dequantize_blockwise's vectorised indexing."""
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 3), (576, 129), (3, 130, 260)])
def test_round_trip_error_is_within_e4m3_rounding(shape):
    # magnitudes spread over 8 decades, so codes land in e4m3fn's normal and subnormal ranges
    w = torch.randn(shape) * torch.logspace(-6, 2, shape[-1])
    q, s = quantize_blockwise(w)
    assert q.dtype == FP8 and q.shape == w.shape
    assert s.dtype == torch.float32
    assert s.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    deq = dequantize_blockwise(q, s)
    assert deq.dtype == torch.float32
    err = (w - deq).abs()
    assert (err <= error_bound(w, s)).all(), (err / error_bound(w, s)).max()
    assert err.max() > 0  # lossy: the bound is what is checked, not an identity
    assert torch.equal(dequantize_blockwise(q, s, torch.bfloat16), deq.to(torch.bfloat16))


def test_dequantize_matches_a_block_by_block_loop_on_partial_blocks():
    w = torch.randn(300, 200)
    q, s = quantize_blockwise(w)
    assert s.shape == (3, 2)
    assert torch.equal(dequantize_blockwise(q, s), block_loop_dequantize(q, s))
    with pytest.raises(ValueError, match=r"scale_inv shape \(2, 2\) does not match weight \(300, 200\)"):
        dequantize_blockwise(q, s[:2])


def test_each_block_scales_by_its_own_amax_partial_blocks_too():
    w = torch.randn(300, 200) * 0.01
    w[5, 7] = 3.0  # block (0, 0) only
    w[299, 199] = -0.5  # the partial corner block (2, 1), 44 x 72
    q, s = quantize_blockwise(w)
    amax = torch.tensor([[w[r : r + 128, c : c + 128].abs().max() for c in (0, 128)] for r in (0, 128, 256)])
    assert torch.allclose(s, amax / 448, rtol=1e-6, atol=0)
    assert s[0, 0] == torch.tensor(3.0) / 448 and s[2, 1] == torch.tensor(0.5) / 448
    # each block's largest element takes the largest code
    assert q[5, 7].float() == 448 and q[299, 199].float() == -448
    codes = q.float().abs()
    for i, r in enumerate((0, 128, 256)):
        for j, c in enumerate((0, 128)):
            assert codes[r : r + 128, c : c + 128].max() == 448, (i, j)


def test_an_all_zero_block_gets_scale_one_and_exact_zeros():
    w = torch.randn(256, 256)
    w[128:, :128] = 0
    q, s = quantize_blockwise(w)
    assert s[1, 0] == 1.0 and (s[[0, 0, 1], [0, 1, 1]] < 1).all()
    assert torch.equal(q[128:, :128].float(), torch.zeros(128, 128))
    deq = dequantize_blockwise(q, s)
    assert torch.isfinite(deq).all() and torch.equal(deq[128:, :128], torch.zeros(128, 128))
    zq, zs = quantize_blockwise(torch.zeros(3, 5))
    assert torch.equal(zs, torch.ones(1, 1)) and torch.equal(zq.float(), torch.zeros(3, 5))


def test_bf16_weights_quantize_like_their_float32_values():
    w = torch.randn(130, 260).to(torch.bfloat16)
    (q16, s16), (q32, s32) = quantize_blockwise(w), quantize_blockwise(w.float())
    assert torch.equal(q16.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s16, s32)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """The V3 fixture rewritten, built at the FP8 stand-in's sizes with per-expert experts, written as FP8."""
    code = per_expert_checkpoint(tmp_path_factory, "v3")
    return (*fp8_standin(tmp_path_factory, code), code)


def test_the_stand_in_is_quantized_like_the_published_v3_checkpoint(fp8_checkpoint):
    from safetensors import safe_open

    model, directory, _ = fp8_checkpoint
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json",
        "configuration_deepseek.py",
        "model.safetensors",
        "modeling_deepseek.py",
    ]
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV3ForCausalLM"
    assert (config["hidden_size"], config["moe_intermediate_size"], config["intermediate_size"]) == (256, 128, 256)
    state = model.state_dict()
    with safe_open(directory / "model.safetensors", "pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}
    quantized = {k[: -len(".weight_scale_inv")] for k in stored if k.endswith(".weight_scale_inv")}
    assert stored.keys() == state.keys() | {f"{name}.weight_scale_inv" for name in quantized}
    layer = "model.layers.1."
    expected = {"model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"} | {
        f"{layer}{m}"
        for m in [
            "self_attn.q_a_proj",
            "self_attn.q_b_proj",
            "self_attn.kv_a_proj_with_mqa",
            "self_attn.kv_b_proj",
            "self_attn.o_proj",
            "mlp.shared_experts.down_proj",
            "mlp.experts.0.gate_proj",
            "mlp.experts.3.up_proj",
            "mlp.experts.3.down_proj",
        ]
    }
    assert expected <= quantized
    assert quantized == {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    assert len(quantized) == 2 * 5 + 3 + 3 * (4 + 1)  # attention x2 layers, dense MLP, 4 experts + 1 shared
    for name in quantized:
        q, s = stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"]
        w = state[f"{name}.weight"].float()
        assert q.dtype == FP8 and s.dtype == torch.float32, name
        assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128)), name
        assert ((w - dequantize_blockwise(q, s)).abs() <= error_bound(w, s)).all(), name
    assert stored[f"{layer}mlp.experts.0.gate_proj.weight_scale_inv"].shape == (1, 2)  # (128, 256): whole blocks
    assert stored[f"{layer}self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 2)  # (24, 256): partial
    unquantized = stored.keys() - {f"{n}.weight" for n in quantized} - {f"{n}.weight_scale_inv" for n in quantized}
    assert {"lm_head.weight", "model.embed_tokens.weight", f"{layer}mlp.gate.weight", "model.norm.weight"} <= (
        unquantized
    )
    for key in unquantized:
        want = torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16
        assert stored[key].dtype == want, key
        assert torch.equal(stored[key], state[key].to(want)), key


def test_writing_refuses_fused_experts_and_unfilled_tensors(fp8_checkpoint, tmp_path):
    model, _, code = fp8_checkpoint
    gate = model.model.layers[1].mlp.gate
    saved = gate.e_score_correction_bias.data.clone()
    gate.e_score_correction_bias.data[0] = float("nan")
    try:
        with pytest.raises(ValueError, match="e_score_correction_bias holds non-finite values"):
            write_fp8_checkpoint(model, tmp_path / "nan")
    finally:
        gate.e_score_correction_bias.data.copy_(saved)
    from moe_rewrite.training import fuse_experts

    fused = build_model(code)
    assert fuse_experts(fused)
    with pytest.raises(ValueError, match="needs per-expert nn.Linear experts, got fused"):
        write_fp8_checkpoint(fused, tmp_path / "fused")
    assert not (tmp_path / "nan").exists() and not (tmp_path / "fused").exists()


def test_overrides_refuse_other_forms():
    class V2:
        model_type = "deepseek_v2"

    with pytest.raises(ValueError, match="expects the V3 fixture's config, got 'deepseek_v2'"):
        fp8_config_overrides(V2())
