"""FP8 block quantization as the published DeepSeek-V3 / R1 / Kimi-K2 checkpoints store it, in pure torch (CPU), for
tests and bench scripts: the explicit reference (quantize, dequantize) and tiny stand-in FP8 checkpoints.

The scheme (DeepSeek-V3 inference/kernel.py weight_quant / weight_dequant; transformers' FineGrainedFP8 quantizer
reads the same layout): a weight (out, in) is cut into 128 x 128 blocks over (out, in), partial last blocks kept as
they are (no padding stored); each block's scale is amax(|block|) / 448 (448 = largest float8_e4m3fn);
`weight` = (w / scale).to(float8_e4m3fn) and `weight_scale_inv` = scale in float32, shape
(ceil(out / 128), ceil(in / 128)); dequantization multiplies (despite the name, `weight_scale_inv` is the factor).
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
BLOCK = 128
QUANTIZATION_CONFIG = {  # as in the published DeepSeek-V3 / R1 config.json
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


HIDDEN, INTER = 256, 128  # fp8_moe's sizes: whole 128 x 128 blocks


def fp8_linear(weight):
    """transformers' own FP8Linear (what its FP8 quantizer loads each nn.Linear of an FP8 checkpoint as) holding the
    block-quantized `weight`."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    out, inner = weight.shape
    layer = FP8Linear(inner, out, block_size=(128, 128))
    codes, scales = quantize_blockwise(weight)
    layer.weight = torch.nn.Parameter(codes, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
    return layer


def fp8_moe(experts=6, hidden=HIDDEN, inter=INTER):
    """(a MoE layer of the runtime's methods whose experts are FP8Linear layers, not yet fused; the same experts in
    float64 with the dequantized weights, the reference)."""
    from helpers import Expert, tiny_moe

    moe = tiny_moe("unfused", experts=experts, hidden=hidden, inter=inter)
    ref = torch.nn.ModuleList(Expert(hidden, inter) for _ in range(experts)).double()
    for expert, ref_expert in zip(moe.experts, ref):
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = fp8_linear(getattr(expert, name).weight.detach() * 0.2)
            setattr(expert, name, layer)
            dequantized = dequantize_blockwise(layer.weight, layer.weight_scale_inv, torch.float64)
            getattr(ref_expert, name).weight = torch.nn.Parameter(dequantized)
    return moe, ref


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., M, N) zero-padded to whole blocks and viewed as (..., M/b, b, N/b, b)."""
    *lead, m, n = x.shape
    mb, nb = math.ceil(m / block), math.ceil(n / block)
    padded = torch.nn.functional.pad(x, (0, nb * block - n, 0, mb * block - m))
    return padded.reshape(*lead, mb, block, nb, block)


def _expand(scale: torch.Tensor, m: int, n: int, block: int) -> torch.Tensor:
    """scale (..., ceil(M/b), ceil(N/b)) repeated over each block and cut to (..., M, N)."""
    return scale.repeat_interleave(block, dim=-2)[..., :m, :].repeat_interleave(block, dim=-1)[..., :n]


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn shaped like w, scale_inv float32 (..., ceil(M/block), ceil(N/block))) for w (..., M, N).

    Leading dimensions (stacked experts (E, M, N)) are independent matrices. Zero padding of partial blocks does not
    change their amax, so a partial block's scale is its own elements' amax / 448. An all-zero block gets scale 1
    (DeepSeek's kernel divides by zero there and writes NaN): its codes are 0 whatever the scale, it dequantizes to
    exact zeros, and 1 stays a safe divisor for anything that inverts the scale; a tiny floor instead would also
    change blocks whose amax is merely small.
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_blockwise needs a (..., out, in) weight, got shape {tuple(w.shape)}")
    w = w.detach().float()
    amax = _blocks(w.abs(), block).amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, *w.shape[-2:], block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # clamp: fp32 rounding of w/s
    return q, scale


def dequantize_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK
) -> torch.Tensor:
    """q.float() times its block's scale_inv (partial last blocks included), returned in `dtype`: the reference."""
    m, n = q.shape[-2:]
    expected = (*q.shape[:-2], math.ceil(m / block), math.ceil(n / block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)}: {expected}")
    return (q.float() * _expand(scale_inv.float(), m, n, block)).to(dtype)


def quantize_rows(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 compute's activation quantization (DeepSeek-V3's 1 x 128 tiles) in float64: (codes float8_e4m3fn like x,
    scales float32 (rows, k / block)), each tile's scale amax / 448 rounded once to float32 (0 for a zero tile, whose
    codes are 0), each code x / scale rounded once to e4m3."""
    rows, k = x.shape
    tiles = x.detach().double().view(rows, k // block, block)
    scales = (tiles.abs().amax(-1) / FP8_MAX).float()
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).double().unsqueeze(-1)
    codes = (tiles / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view(rows, k), scales


def fp8_config_overrides(config) -> dict:
    """Overrides for the V3 fixture's config (fixtures/deepseek_v3, rewritten) giving a model whose expert and dense
    MLP weights are whole 128 x 128 blocks, as in V3/R1/K2 (H 7168, I 2048), while attention keeps small partial
    blocks like V3's kv_a_proj_with_mqa (576 rows: 4 whole blocks and a partial one). Builds in well under a second.
    """
    if getattr(config, "model_type", None) != "deepseek_v3":
        raise ValueError(f"fp8_config_overrides expects the V3 fixture's config, got {config.model_type!r}")
    return {
        "hidden_size": 256,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 32,  # q_a_proj (32, 256), q_b_proj (48, 32): partial blocks
        "kv_lora_rank": 16,  # kv_a_proj_with_mqa (16 + 8, 256), kv_b_proj (64, 16)
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "vocab_size": 256,
    }


def _quantized_linears(model) -> list[str]:
    """Names of the nn.Linear modules the published V3/R1 checkpoints store in FP8: every one (attention q_a/q_b/
    kv_a/kv_b/o, dense MLPs, shared and routed experts) except lm_head. The router (MoEGate) is not an nn.Linear;
    embeddings, norms, the router weight (bf16) and e_score_correction_bias (float32) stay unquantized there."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head"
    ]


def write_fp8_checkpoint(model, directory) -> Path:
    """Write `model` (a rewritten V3-form model loaded with per-expert nn.Linear experts, MOE_REWRITE_FUSE_EXPERTS=0)
    to `directory` as a stand-in of a published DeepSeek-V3 FP8 checkpoint: config.json with V3's
    quantization_config, model.safetensors with each quantized linear's `weight` (float8_e4m3fn) and
    `weight_scale_inv` (float32), e_score_correction_bias in float32 (as published), every other tensor in the
    model's dtype, and the model's modeling/configuration files so that it loads with trust_remote_code."""
    from safetensors.torch import save_file

    state = model.state_dict()
    fused = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    if fused:
        raise ValueError(f"write_fp8_checkpoint needs per-expert nn.Linear experts, got fused {fused[0]}")
    tensors = {}
    for key, value in state.items():
        if not torch.isfinite(value).all():  # e.g. e_score_correction_bias, left uninitialised by from_config
            raise ValueError(f"{key} holds non-finite values: fill it before writing a checkpoint")
        tensors[key] = value.detach().to(torch.float32 if key.endswith("e_score_correction_bias") else value.dtype)
    for name in _quantized_linears(model):
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = quantize_blockwise(tensors[f"{name}.weight"])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors", {"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for source in (inspect.getfile(type(model)), inspect.getfile(type(model.config))):
        shutil.copyfile(source, directory / Path(source).name)
    return directory


def fp8_standin(tmp_path_factory, code: Path, dtype=torch.bfloat16) -> tuple[torch.nn.Module, Path]:
    """(the model, the directory) of an FP8 stand-in checkpoint written from the V3 fixture rewritten into `code`,
    built at fp8_config_overrides' sizes with per-expert experts (MOE_REWRITE_FUSE_EXPERTS=0 while it is built) in
    `dtype`; its files are `code`'s, so it loads as that rewrite."""
    import pytest
    from conftest import build_model
    from transformers import AutoConfig

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MOE_REWRITE_FUSE_EXPERTS", "0")
    try:
        model = build_model(code, **fp8_config_overrides(AutoConfig.from_pretrained(code, trust_remote_code=True)))
    finally:
        monkeypatch.undo()
    for module in model.modules():  # from_config leaves it uninitialised (a published checkpoint fills it)
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data.normal_(0, 0.1)
    model = model.to(dtype)
    out = tmp_path_factory.mktemp("fp8") / f"fp8_standin_{code.name}"
    return model, write_fp8_checkpoint(model, out)
