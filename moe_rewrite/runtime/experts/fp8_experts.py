"""FP8 block-quantized checkpoints, as DeepSeek-V3, R1 and Kimi-K2 ship them (quantization_config quant_method "fp8",
weight_block_size [128, 128]): transformers' FP8 quantizer loads each nn.Linear but lm_head as an FP8Linear holding
float8_e4m3fn codes and weight_scale_inv, the scale of each 128 x 128 block. The routed experts are fused with their
codes and scales and stay FP8 and frozen (fused_experts.py; the grouped GEMMs read them, grouped_linear.py); every
other FP8 layer becomes an nn.Linear holding its dequantized weight, which trains and takes PEFT's adapters as in a
bf16 checkpoint (a few percent of V3's weights). Generated where the checkpoint's config asks for FP8, or with
--fp8-experts; elsewhere from_pretrained refuses FP8 checkpoints (fused_loading.py).
"""

import torch

from ..moe.grouped_mm import MOE_REWRITE_FP8_BLOCK, _moe_rewrite_dequantize
from .expert_linears import _moe_rewrite_projections


def _moe_rewrite_fp8_linear(module):
    """(codes, scales) of a layer holding an FP8 block-quantized weight as transformers' FP8Linear holds it: an
    nn.Linear with no bias, whose weight is float8_e4m3fn and weight_scale_inv one scale per 128 x 128 block (float32
    in the checkpoint; transformers 4.x loads it in the model's dtype, bf16: a relative change of up to 2^-8, which
    stays, so the weights are then those of bf16-rounded scales, not DeepSeek's fp8_cast_bf16 output); None for
    anything else (other block sizes, static activation scales, other parameters or buffers)."""
    if not isinstance(module, torch.nn.Linear):
        return None
    params = {k: v for k, v in module._parameters.items() if v is not None}
    weight, scale = params.get("weight"), params.get("weight_scale_inv")
    if weight is None or scale is None or weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        return None
    out, inner = weight.shape
    block = MOE_REWRITE_FP8_BLOCK
    blocks = (-(-out // block), -(-inner // block))
    block_size = getattr(module, "block_size", None) or (block, block)
    if set(params) != {"weight", "weight_scale_inv"} or any(b is not None for b in module._buffers.values()):
        return None
    if tuple(block_size) != (block, block) or tuple(scale.shape) != blocks or not scale.is_floating_point():
        return None
    return weight, scale


def _moe_rewrite_fp8_experts(experts):
    """The experts' FP8 codes and scales, (gate, up, down) lists of each, when their projections are FP8
    block-quantized layers (_moe_rewrite_fp8_linear); None when none is. Raises where they are but cannot be fused
    with their scales: some projections FP8 and others not, or sizes that are not whole blocks (gate's and up's
    blocks would share rows of gate_up_proj's scales)."""
    found = [[_moe_rewrite_fp8_linear(m) for m in column] for column in _moe_rewrite_projections(experts)]
    held = [f is not None for column in found for f in column]
    if not any(held):
        return None
    if not all(held):
        raise RuntimeError("some expert projections are FP8 block-quantized layers and others are not")
    codes = tuple([f[0] for f in column] for column in found)
    scales = tuple([f[1] for f in column] for column in found)
    inter, hidden = codes[0][0].shape
    block = MOE_REWRITE_FP8_BLOCK
    if inter % block or hidden % block:
        raise RuntimeError(
            f"FP8 experts of intermediate size {inter} and hidden size {hidden}: fused FP8 experts need whole "
            f"{block} x {block} blocks"
        )
    shapes = {(0, tuple(w.shape)) for w in codes[0] + codes[1]} | {(2, tuple(w.shape)) for w in codes[2]}
    if shapes != {(0, (inter, hidden)), (2, (hidden, inter))}:
        raise RuntimeError("the FP8 experts' projections differ in shape")
    return codes, scales


class _MoeRewriteDequantized(torch.Tensor):
    """One FP8 expert's projection weight as real numbers (an expert view's weight: what moe_infer multiplies by and
    PEFT's LoRA layers read), a plain tensor in every operation. Its .data cannot be read: that is how PEFT merges an
    adapter into a layer's weight, and the sum would go to this copy and be lost (FP8 codes cannot hold W + BA)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self):
        raise RuntimeError(
            "moe-rewrite: LoRA adapters cannot be merged into FP8 block-quantized experts (the FP8 codes cannot hold "
            "W + BA); save the adapters as they are, or call model.moe_rewrite_dequantize_experts() first to merge "
            "into bf16 experts"
        )


def _moe_rewrite_fp8_loading(config, kwargs):
    """from_pretrained's keyword arguments for the FP8 checkpoint of `config` on transformers 5.x, whose FP8 quantizer
    replaces every module named `experts` by its own FP8Experts, which cannot load or run this file's experts: unless
    the user passes a quantization_config, the checkpoint's is passed with the routed experts' ModuleList left as it
    is (each projection in it becomes an FP8Linear, as on 4.x, which fused_experts.py fuses). A user's
    modules_to_not_convert replaces transformers' default, so lm_head is named too."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5 or "quantization_config" in kwargs:
        return kwargs
    settings = config.quantization_config
    settings = dict(settings) if isinstance(settings, dict) else settings.to_dict()
    keep = [*(settings.get("modules_to_not_convert") or []), "lm_head", r"(.*\.)?layers\.\d+\.mlp\.experts$"]
    # transformers keeps the checkpoint's own settings and takes only the loading ones (this list) from this config
    quantization = transformers.FineGrainedFP8Config(modules_to_not_convert=list(dict.fromkeys(keep)))
    return {**kwargs, "quantization_config": quantization}


def _moe_rewrite_model_dtype(model):
    """The dtype the model computes in, which FP8 weights are dequantized to: its input embeddings' (never quantized),
    else its first floating parameter's that is not FP8, else bfloat16."""
    try:
        weight = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):  # a model without input embeddings (or not saying which)
        weight = None
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1), torch.bfloat16)


def _moe_rewrite_dequantize_fp8_layers(model):
    """Every FP8 block-quantized layer left in `model` (all but the fused experts) becomes an nn.Linear holding its
    dequantized weight in the model's dtype, trainable as in a bf16 checkpoint. Once none of transformers' FP8 layers
    is left the model is no longer marked quantized: Trainer refuses to train a model quantized by a method that
    cannot train (transformers 4.x says so of FP8), and save_pretrained writes a checkpoint of real numbers
    (fused_checkpoint.py), which a quantization_config would misdescribe. Returns the number of layers converted;
    from_pretrained calls it where the model's config describes an FP8 checkpoint."""
    dtype = _moe_rewrite_model_dtype(model)
    converted = 0
    for module in list(model.modules()):
        for name, child in list(module._modules.items()):
            found = _moe_rewrite_fp8_linear(child)
            if found is None:
                continue
            linear = torch.nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
            linear.weight = torch.nn.Parameter(_moe_rewrite_dequantize(*found, dtype))
            module._modules[name] = linear
            converted += 1
    left = any(type(m).__name__.startswith("FP8") for m in model.modules())  # transformers' FP8Linear, FP8Experts
    if converted and not left:
        # transformers' own reset when it dequantizes a model (HfQuantizer.dequantize)
        model.hf_quantizer, model.is_quantized = None, False
        if hasattr(model, "quantization_method"):
            del model.quantization_method
        for name in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(model.config, name):
                delattr(model.config, name)
    return converted


class Model:
    def moe_rewrite_dequantize_experts(self):
        """Make every layer's FP8 block-quantized routed experts real numbers in the model's dtype, trainable: twice
        their memory; LoRA adapters can then be merged into them (model.merge_and_unload()). Returns the model."""
        for module in self.modules():
            if callable(getattr(module, "moe_rewrite_dequantize", None)):
                module.moe_rewrite_dequantize()
        return self
