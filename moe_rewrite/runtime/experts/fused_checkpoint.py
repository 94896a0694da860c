"""Checkpoint keys of fused experts, both ways: the checkpoint's per-expert keys (experts.{i}.gate_proj.weight, ...)
load into the fused parameters, and save_pretrained writes them back as per-expert keys, beside the patched code.
Always generated.
"""

import torch

from ..moe.grouped_mm import _moe_rewrite_dequantize
from ..parallel.expert_parallel_checkpoint import _moe_rewrite_gathered_state_dict
from .expert_linears import MOE_REWRITE_PROJECTIONS
from .fp8_experts import _moe_rewrite_model_dtype


def _moe_rewrite_stack_experts(gate_w, up_w, down_w):
    """The (E, 2 * intermediate, hidden) gate_up and (E, hidden, intermediate) down tensors holding the experts'
    weights, in the first weight's dtype and device (filled in place: no per-expert temporaries)."""
    experts, (inter, hidden) = len(gate_w), gate_w[0].shape
    first = gate_w[0]
    with torch.no_grad():
        gate_up = torch.empty(experts, 2 * inter, hidden, dtype=first.dtype, device=first.device)
        down = torch.empty(experts, hidden, inter, dtype=first.dtype, device=first.device)
        for i in range(experts):
            gate_up[i, :inter].copy_(gate_w[i])
            gate_up[i, inter:].copy_(up_w[i])
            down[i].copy_(down_w[i])
    return gate_up, down


def _moe_rewrite_merge_experts(module, state_dict, prefix, local_metadata, strict, missing_keys, *args):
    """load_state_dict pre-hook of fused experts: the checkpoint's per-expert keys load into the fused parameters, also
    a few at a time (one shard of a sharded checkpoint after another); per-expert keys absent from a call that brings
    some are reported missing. FP8 experts take the checkpoint's FP8 codes (weight) and block scales
    (weight_scale_inv) of each projection."""
    fields = [("weight", ("gate_up_proj", "down_proj"))]  # (the checkpoint key's last name, the fused parameters)
    # generated with: fp8-experts
    if module.moe_rewrite_fp8():
        fields.append(("weight_scale_inv", ("gate_up_proj_scale_inv", "down_proj_scale_inv")))
    for key_suffix, names in fields:
        _moe_rewrite_merge_field(module, state_dict, prefix, missing_keys, key_suffix, names)


def _moe_rewrite_merge_field(module, state_dict, prefix, missing_keys, key_suffix, names):
    """_moe_rewrite_merge_experts for one field: the per-expert `{i}.{projection}.{key_suffix}` keys into the fused
    parameters `names` (gate and up into the first, down into the second)."""
    projections = list(enumerate(MOE_REWRITE_PROJECTIONS))  # (role, name): role 0 gate, 1 up, 2 down
    first = module.first_expert  # the keys number the layer's experts; a rank under expert parallelism holds some
    keys = [
        (i, role, f"{prefix}{first + i}.{name}.{key_suffix}") for i in range(len(module)) for role, name in projections
    ]
    found = [key for key in keys if key[2] in state_dict]
    if not found:
        return
    gate_up, down = (module._parameters[name] for name in names)
    if key_suffix == "weight":
        # FP8 codes load only into FP8 experts, with their scales; real numbers only into experts that are not FP8
        dtypes = {state_dict[key].dtype for _, _, key in found}
        scaled = any(f"{key}_scale_inv" in state_dict for _, _, key in found)  # {i}.{projection}.weight_scale_inv
        codes = torch.float8_e4m3fn in dtypes or scaled
        # generated with: fp8-experts
        if module.moe_rewrite_fp8() and dtypes != {gate_up.dtype}:
            raise RuntimeError(
                f"moe-rewrite: {found[0][2]} is {dtypes.pop()}, and these experts hold FP8 block-quantized codes: "
                "call model.moe_rewrite_dequantize_experts() first to load real numbers into them"
            )
        if codes and not module.moe_rewrite_fp8():
            raise RuntimeError(
                f"moe-rewrite: {found[0][2]} holds FP8 block-quantized codes (with weight_scale_inv), and these "
                "experts are not FP8: load the FP8 checkpoint with from_pretrained, which keeps its experts FP8"
            )
    if gate_up.is_meta or type(gate_up) is not torch.nn.Parameter:
        # Meta (load_state_dict(assign=True)) or sharded (FSDP2 DTensor) parameters: whole tensors, loaded as usual.
        if len(found) == len(keys):
            tensors = [state_dict.pop(key) for _, _, key in keys]
            stacked = _moe_rewrite_stack_experts(tensors[0::3], tensors[1::3], tensors[2::3])
            for name, value in zip(names, stacked):
                param = module._parameters[name]
                if hasattr(param, "device_mesh"):  # every rank holds the full tensor: keep this rank's shard
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
                state_dict[prefix + name] = value
        return
    inter = down.shape[2]
    with torch.no_grad():
        for i, role, key in found:  # role 0 gate, 1 up, 2 down
            value = state_dict.pop(key)
            target = (gate_up[i, :inter], gate_up[i, inter:], down[i])[role]
            if value.shape != target.shape:
                raise RuntimeError(f"moe-rewrite: {key} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
            target.copy_(value)
    loaded = {key for _, _, key in found}
    missing_keys.extend(key for _, _, key in keys if key not in loaded)
    # What was copied counts as loaded, the fused names are not reported missing.
    state_dict.setdefault(prefix + names[0], gate_up.detach())
    state_dict.setdefault(prefix + names[1], down.detach())


def _moe_rewrite_unfuse_state_dict(state_dict, model):
    """For save_pretrained: the state dict (the model's own when None) with every fused experts' gate_up_proj /
    down_proj pair written as the checkpoint's per-expert keys, as CPU copies; None when the model's own state dict
    holds no fused experts (save_pretrained then writes it as usual). FP8 experts are written dequantized, in the
    model's dtype (with a warning): the rest of the model is (fp8_experts.py), and a merged adapter needs it."""
    own = state_dict is None
    if own:
        state_dict = model.state_dict()
    fused = [key[: -len("gate_up_proj")] for key in state_dict if key.endswith("experts.gate_up_proj")]
    fused = {prefix for prefix in fused if prefix + "down_proj" in state_dict}
    if own and not fused:
        return None
    # generated with: fp8-experts
    fp8 = {prefix for prefix in fused if prefix + "gate_up_proj_scale_inv" in state_dict}
    # generated with: fp8-experts
    if fp8:
        import warnings

        warnings.warn(
            "moe-rewrite: the FP8 experts are saved dequantized, in the model's dtype (twice the size of the FP8 "
            "checkpoint), as the rest of the model is",
            stacklevel=3,
        )
        dtype = _moe_rewrite_model_dtype(model)
    unfused = {}
    for key, value in state_dict.items():
        prefix, _, name = key.rpartition(".")
        prefix += "."
        if prefix in fused and name in ("down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
            continue  # written with its gate_up_proj
        if prefix not in fused or name != "gate_up_proj":
            unfused[key] = value
            continue
        down = state_dict[prefix + "down_proj"].detach()
        value, inter = value.detach(), down.shape[2]
        for i in range(value.shape[0]):  # copies: slices of one buffer would be taken for tied weights
            gate_up_i, down_i = value[i], down[i]
            # generated with: fp8-experts
            if prefix in fp8:
                gate_up_i = _moe_rewrite_dequantize(gate_up_i, state_dict[prefix + "gate_up_proj_scale_inv"][i], dtype)
                down_i = _moe_rewrite_dequantize(down_i, state_dict[prefix + "down_proj_scale_inv"][i], dtype)
            gate, up, down_name = MOE_REWRITE_PROJECTIONS
            unfused[f"{prefix}{i}.{gate}.weight"] = gate_up_i[:inter].to("cpu", copy=True)
            unfused[f"{prefix}{i}.{up}.weight"] = gate_up_i[inter:].to("cpu", copy=True)
            unfused[f"{prefix}{i}.{down_name}.weight"] = down_i.to("cpu", copy=True)
    return unfused


def _moe_rewrite_save_code(model, directory):
    """Copy the modeling file `model` runs (this patched file) and its configuration file beside the weights that
    save_pretrained wrote: transformers writes only the configuration file of remote code, so Trainer checkpoints and
    merged adapters would not reload with trust_remote_code."""
    import os
    import shutil
    import sys

    for cls in (type(model), type(model.config)):
        source = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if source is None:
            continue
        target = os.path.join(directory, os.path.basename(source))
        if not (os.path.exists(target) and os.path.samefile(source, target)):
            shutil.copyfile(source, target)


class Model:
    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as PreTrainedModel.save_pretrained does, fused routed experts written as per-expert keys (moe-rewrite);
        a `state_dict` passed in (a full state dict gathered from FSDP, say) is converted the same way; the patched
        modeling file and the files it imports are written beside the weights. Under expert parallelism or FSDP2,
        call it on every rank (is_main_process=rank == 0): they gather the whole checkpoint, which loads with any
        ep_size."""
        writes = args[0] if args else kwargs.get("is_main_process", True)
        # under expert parallelism or FSDP2 every rank takes part in gathering the whole state dict
        given = args[1] if len(args) > 1 else kwargs.get("state_dict")
        whole, gathered = _moe_rewrite_gathered_state_dict(self, given, writes)
        if not writes:
            if gathered:  # for the writing rank, which writes every file
                return None
        elif len(args) > 1:  # state_dict passed by position, after is_main_process
            args = (args[0], _moe_rewrite_unfuse_state_dict(whole, self), *args[2:])
        else:
            kwargs["state_dict"] = _moe_rewrite_unfuse_state_dict(whole, self)
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if writes:
            _moe_rewrite_save_code(self, save_directory)
        return result
