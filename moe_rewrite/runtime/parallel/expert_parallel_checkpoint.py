"""Whole checkpoints under expert parallelism or FSDP2, from the ranks' shares: the state dict gathered on the writing
rank (save_pretrained's, fused_checkpoint.py), Model.moe_rewrite_gathered_state_dict and
Model.moe_rewrite_save_adapters. Always generated: without --expert-parallel (the "expert-parallel" feature) its FSDP2
part only, and stand-ins that refuse expert parallelism's entry points (expert_parallel_model.py's methods).
"""

import torch

from ..moe.expert_parallel import _moe_rewrite_ep_group, _moe_rewrite_no_expert_parallel
from .expert_parallel_model import _moe_rewrite_ep_layers, _moe_rewrite_ep_size


def _moe_rewrite_gathered_state_dict(model, state_dict, writes):
    """For save_pretrained under expert parallelism or FSDP2, called on every rank: (the whole state dict (the
    model's own when None) on the writing rank, None on the others; True): each layer's fused experts gathered from
    the ranks of its expert-parallel group (global expert order), and the LoRA weights PEFT put on their views
    (experts.N.gate_proj.lora_A...), which differ by rank; DTensors (FSDP2 shards) made whole. Otherwise
    (state_dict, False). `model` is the root whose state dict it is (a PeftModel around the model too)."""
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    source = model.state_dict() if state_dict is None else state_dict
    # generated without: expert-parallel
    ep_layers = {}
    # generated with: expert-parallel
    ep_layers = _moe_rewrite_ep_layers(model)
    sharded = any(hasattr(value, "full_tensor") for value in source.values())
    if not distributed or not (ep_layers or sharded):
        return state_dict, False
    whole = {}
    # generated with: expert-parallel
    views = {prefix: {} for prefix in ep_layers}
    for key, value in source.items():  # one order on every rank: the collectives pair up
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        # generated with: expert-parallel
        prefix = next((p for p in ep_layers if key.startswith(p)), None)
        # generated with: expert-parallel
        if prefix is not None:
            rest = key[len(prefix) :]
            while rest.startswith("base_layer."):  # under PEFT's wrappers of the fused parameters
                rest = rest[len("base_layer.") :]
            if rest[:1].isdigit():  # an expert view's adapter (target_modules): this rank's experts only
                views[prefix][key] = value.detach().to("cpu", copy=True)
                continue
            value = _moe_rewrite_gather_experts(value, rest, ep_layers[prefix])
        if writes:
            whole[key] = value.detach().to("cpu", copy=True)
    # generated with: expert-parallel
    for prefix, layer in ep_layers.items():
        shares = [None] * layer.ep_size
        dist.all_gather_object(shares, views[prefix], group=_moe_rewrite_ep_group(layer))
        if writes:
            for share in shares:
                whole.update(share)
    return (whole if writes else None), True


# generated with: expert-parallel
def _moe_rewrite_gather_experts(value, name, layer):
    """A layer's expert tensor `name` (relative to its experts) whole over the layer's expert-parallel group, in
    global expert order: the fused parameters (expert first; FP8 experts' codes and block scales too), and the LoRA
    weights of PEFT's wrappers of them, lora_A (E * r, in) expert-major and lora_B (out, r * E) expert-minor (PEFT's
    ParamWrapper layout)."""
    dist = torch.distributed
    fused = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")
    if name not in fused and not name.startswith(("lora_A.", "lora_B.")):
        raise RuntimeError(f"moe-rewrite: cannot gather the experts' {name} from the expert-parallel ranks")
    raw = value.detach().contiguous()
    # generated with: fp8-experts
    if raw.dtype == torch.float8_e4m3fn:  # FP8 codes travel as bytes (gloo has no float8)
        raw = raw.view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(layer.ep_size)]
    dist.all_gather(parts, raw, group=_moe_rewrite_ep_group(layer))
    if name.startswith("lora_B."):
        local = layer.config.n_routed_experts // layer.ep_size
        parts = [part.view(part.shape[0], -1, local) for part in parts]
        return torch.cat(parts, dim=2).flatten(1)
    return torch.cat(parts).view(value.dtype)


# generated with: expert-parallel
def _moe_rewrite_add_expert_adapters(peft_model, save_directory, adapter, whole):
    """moe_rewrite_save_adapters under expert parallelism, on the writing rank: every rank's experts' adapters from the
    gathered state dict `whole` added to the adapter file PEFT wrote (it holds this rank's experts' only)."""
    import os

    from safetensors.torch import load_file, save_file

    directory = save_directory if adapter == "default" else os.path.join(save_directory, adapter)
    path = os.path.join(directory, "adapter_model.safetensors")
    saved = load_file(path)
    marker = f".{adapter}."
    prefixes = tuple(_moe_rewrite_ep_layers(peft_model))
    for key, value in whole.items():  # the experts' adapters, every rank's (the fused parameters have no marker)
        if key.startswith(prefixes) and marker in key:
            saved[key.replace(marker, ".", 1)] = value.contiguous()
    save_file(saved, path, metadata={"format": "pt"})


class Model:
    def moe_rewrite_gathered_state_dict(self, root=None, is_main_process=True):
        """The whole state dict of `root` (this model by default, or the PeftModel around it), call it on every rank
        under expert parallelism or FSDP2: every rank's experts and their LoRA weights, FSDP2 shards made whole, as
        CPU tensors on the rank where is_main_process is true (None on the others). save_pretrained and
        moe_rewrite_save_adapters gather by themselves."""
        root = self if root is None else root
        whole, gathered = _moe_rewrite_gathered_state_dict(root, None, is_main_process)
        if gathered:
            return whole
        return {key: value.detach().to("cpu", copy=True) for key, value in root.state_dict().items()}

    def moe_rewrite_save_adapters(self, peft_model, save_directory, is_main_process=True, **kwargs):
        """peft_model.save_pretrained(save_directory, **kwargs) under expert parallelism, on every rank: PEFT saves
        the adapters of the modules its rank holds, so the writing rank's file gets every other rank's experts'
        adapters added (PEFT's key names: the adapter's name taken out), and loads without expert parallelism as a
        usual PEFT adapter. The active adapter, in a safetensors file (PEFT's default)."""
        # gathered under expert parallelism or FSDP2 (PEFT would read the DTensors); else PEFT reads the model itself
        whole, gathered = _moe_rewrite_gathered_state_dict(peft_model, None, is_main_process)
        if gathered:
            kwargs["state_dict"] = whole if is_main_process else {}
        peft_model.save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        # generated with: expert-parallel
        if is_main_process and _moe_rewrite_ep_size(self) > 1:
            adapter = kwargs.get("selected_adapters", [peft_model.active_adapter])[0]
            _moe_rewrite_add_expert_adapters(peft_model, save_directory, adapter, whole)

    # generated without: expert-parallel
    def moe_rewrite_fully_shard(self, *args, **kwargs):
        _moe_rewrite_no_expert_parallel()

    # generated without: expert-parallel
    def moe_rewrite_expert_parallel(self, *args, **kwargs):
        _moe_rewrite_no_expert_parallel()

    # generated without: expert-parallel
    def moe_rewrite_all_reduce_gradients(self, *args, **kwargs):
        _moe_rewrite_no_expert_parallel()
