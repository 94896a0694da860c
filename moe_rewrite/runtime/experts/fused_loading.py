"""Fused loading (the default; not with --no-fuse-experts): every model class of the file (the base model,
ForCausalLM, ...) comes out of from_pretrained and from_config with each MoE layer's experts fused.
"""

import torch

from .fp8_experts import _moe_rewrite_dequantize_fp8_layers, _moe_rewrite_fp8_loading


def _moe_rewrite_fuse_model(model, loading=False):
    """Fuse the routed experts of every MoE layer that can be fused (on loading).

    Layers whose experts cannot be fused (quantized or adapter-wrapped projections, DeepSpeed ZeRO-3 partitions,
    weights offloaded to the meta device) stay as they are, with one warning. MOE_REWRITE_FUSE_EXPERTS=0 turns it off.
    `loading`: the model is being built for a loader that fills the fused parameters, so meta weights are fused too.
    """
    import os
    import warnings

    if os.environ.get("MOE_REWRITE_FUSE_EXPERTS", "1") == "0":
        return model
    kept = []
    for name, module in model.named_modules():
        if callable(getattr(module, "moe_rewrite_fuse_experts", None)):
            try:
                module.moe_rewrite_fuse_experts(allow_meta=loading)
            except (RuntimeError, NotImplementedError) as error:
                kept.append(f"{name}: {error}")
    if kept:
        warnings.warn(f"moe-rewrite: {len(kept)} MoE layers keep per-expert weights ({kept[0]})", stacklevel=2)
    return model


def _moe_rewrite_fp8_checkpoint(config):
    """Whether `config` describes an FP8 checkpoint (quantization_config with quant_method "fp8": a dict as the
    checkpoint's configuration file holds it, or transformers' config object)."""
    settings = getattr(config, "quantization_config", None)
    method = settings.get("quant_method") if isinstance(settings, dict) else getattr(settings, "quant_method", None)
    return method == "fp8"  # transformers' QuantizationMethod is a str enum


def _moe_rewrite_loading_config(cls, path, kwargs):
    """The config from_pretrained(path, **kwargs) loads with, to see whether the checkpoint is FP8: the one passed,
    else the one at the path passed as `config`, else the checkpoint's; None where none can be read here (no path,
    a GGUF file, a Hub error): transformers' own loading then says what is wrong, as it did before."""
    import os

    import transformers

    config = kwargs.get("config")
    if isinstance(config, transformers.PretrainedConfig):
        return config
    source = config if isinstance(config, (str, os.PathLike)) else path
    if source is None or kwargs.get("gguf_file") is not None:
        return None
    hub = ("cache_dir", "force_download", "local_files_only", "token", "use_auth_token", "revision", "subfolder")
    hub += ("proxies", "trust_remote_code")
    try:
        return cls.config_class.from_pretrained(source, **{k: kwargs[k] for k in hub if k in kwargs})
    except (OSError, ValueError):
        return None


def _moe_rewrite_loader_fuses_experts(config):
    """Whether this transformers' from_pretrained may merge per-expert checkpoint keys into fused ones for this remote
    code: 5.0 to 5.12 apply their deepseek_v2/v3 conversion to models of that model_type (5.0.0 always, 5.12 when the
    model has fused parameters); 5.13 skips remote code."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    if getattr(config, "ep_size", 1) > 1:  # each rank fuses its own experts after loading them
        return False
    if _moe_rewrite_fp8_checkpoint(config):  # the loader would drop the experts' scales: fused after loading
        return False
    return major == 5 and minor < 13 and getattr(config, "model_type", None) in ("deepseek_v2", "deepseek_v3")


def _moe_rewrite_ignore_other_experts(model):
    """Under expert parallelism: from_pretrained leaves the checkpoint's keys of the experts other ranks hold unloaded
    without a warning about them (transformers 4.x reads the class's _keys_to_ignore_on_load_unexpected, 5.x the
    model's)."""
    held = set()
    for module in model.modules():
        experts = module._modules.get("experts") if getattr(module, "ep_size", 1) > 1 else None
        if isinstance(experts, torch.nn.ModuleList):  # the published layout: None where another rank's expert is
            held |= {i for i, expert in enumerate(experts) if expert is not None}
    if not held:
        return
    pattern = rf"(^|\.)experts\.(?!(?:{'|'.join(str(i) for i in sorted(held))})\.)\d+\."
    for owner in (type(model), model):
        patterns = owner._keys_to_ignore_on_load_unexpected
        if isinstance(patterns, set):
            owner._keys_to_ignore_on_load_unexpected = patterns | {pattern}
        elif pattern not in (patterns or []):
            owner._keys_to_ignore_on_load_unexpected = [*(patterns or []), pattern]


class Model:
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Load as PreTrainedModel.from_pretrained does, then fuse the routed experts. From an FP8 block-quantized
        checkpoint (DeepSeek-V3's, loaded by transformers' FP8 quantizer), the experts stay FP8 (frozen) and the other
        layers are dequantized (fp8_experts.py)."""
        wants_info = kwargs.get("output_loading_info", False)
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        config = _moe_rewrite_loading_config(cls, path, kwargs)
        if _moe_rewrite_fp8_checkpoint(config):
            # generated with: fp8-experts
            kwargs = _moe_rewrite_fp8_loading(config, kwargs)
            # generated without: fp8-experts
            if "quantization_config" not in kwargs:  # the user's own (e.g. dequantize=True) is theirs to choose
                raise ValueError(
                    "moe-rewrite: this checkpoint is FP8 block-quantized (its config's quantization_config), and this "
                    "file was rewritten without FP8 experts: rewrite it from the checkpoint's directory, or with "
                    "--fp8-experts (or pass a quantization_config that dequantizes it)"
                )
        model, info = super().from_pretrained(*args, **{**kwargs, "output_loading_info": True})
        unexpected = info.get("unexpected_keys", ())
        fused_keys = [k for k in unexpected if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        if fused_keys:
            # from_pretrained reads per-expert keys only: these experts would be left randomly initialised.
            raise RuntimeError(
                f"moe-rewrite: the checkpoint holds fused expert weights ({fused_keys[0]}, ...), which from_pretrained "
                "does not load; write it with save_pretrained, or convert its state dict with "
                "moe_rewrite.training.unfuse_state_dict(model, state_dict)"
            )
        _moe_rewrite_fuse_model(model)
        # an FP8 checkpoint: the layers other than the fused experts as real numbers (those that could not be fused
        # with their FP8 weights too, which then fuse as such)
        # generated with: fp8-experts
        if _moe_rewrite_fp8_checkpoint(model.config) and _moe_rewrite_dequantize_fp8_layers(model):
            _moe_rewrite_fuse_model(model)
        return (model, info) if wants_info else model

    def post_init(self):
        """PreTrainedModel.post_init; where transformers' from_pretrained itself merges the checkpoint's per-expert keys
        into gate_up_proj / down_proj (5.0 to 5.12 do for deepseek_v2/v3 remote code), the routed experts are fused
        here, before loading, so that those keys land in them."""
        super().post_init()
        _moe_rewrite_ignore_other_experts(self)
        if _moe_rewrite_loader_fuses_experts(self.config):
            _moe_rewrite_fuse_model(self, loading=True)

    @classmethod
    def _from_config(cls, config, **kwargs):
        """Build as PreTrainedModel._from_config does, then fuse the routed experts."""
        return _moe_rewrite_fuse_model(super()._from_config(config, **kwargs))
