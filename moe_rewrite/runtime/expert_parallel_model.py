"""The model's side of expert parallelism (expert_parallel.py has the layers'): which group each layer exchanges rows
in, FSDP2 on the two meshes, gradients without FSDP, and whole checkpoints written from the ranks' shares. Always
generated.

    torchrun --nproc-per-node 8 train.py, where train.py does
        torch.distributed.init_process_group()
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, ep_size=4)  # this rank's experts
        model.moe_rewrite_fully_shard()     # FSDP2: experts over the (world / ep) ranks holding them, the rest over all
        ... loss.backward(); optimizer.step() ...
        model.save_pretrained(out, is_main_process=rank == 0)   # on every rank: the checkpoint any ep_size loads
"""

import torch

from .expert_parallel import _moe_rewrite_ep_group, _moe_rewrite_ep_groups
from .parameter_lora import _moe_rewrite_unwrap


def _moe_rewrite_moe_layers(model):
    """The model's MoE layers (the modules moe-rewrite gave moe_train)."""
    return [module for module in model.modules() if callable(getattr(module, "moe_train", None))]


def _moe_rewrite_ep_layers(root):
    """{"<name>.experts.": layer} for the MoE layers under expert parallelism in `root` (the model, or a PeftModel
    around it): the state-dict prefix of each layer's experts."""
    layers = {}
    for name, module in root.named_modules():
        if getattr(module, "ep_size", 1) > 1 and callable(getattr(module, "moe_train", None)):
            layers[f"{name}.experts." if name else "experts."] = module
    return layers


def _moe_rewrite_ep_size(model):
    """The model's ep_size (1 without expert parallelism); every MoE layer has the same."""
    sizes = {getattr(layer, "ep_size", 1) for layer in _moe_rewrite_moe_layers(model)}
    if len(sizes) > 1:
        raise RuntimeError(f"moe-rewrite: the MoE layers have different ep_size values {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def _moe_rewrite_check_ep_group(group, ep):
    """`group` (the expert-parallel one) must hold this rank's block of ep consecutive ranks, in order: the layers
    were built and loaded for the experts of that block's rank % ep."""
    dist = torch.distributed
    ranks = dist.get_process_group_ranks(group)
    first = dist.get_rank() // ep * ep
    if ranks != list(range(first, first + ep)):
        raise ValueError(
            f"moe-rewrite: the expert-parallel group must hold ranks {first} to {first + ep - 1} in order (blocks of "
            f"ep_size consecutive ranks, the inner dimension of a (world // ep_size, ep_size) DeviceMesh), not {ranks}"
        )


def _moe_rewrite_fully_shard_api():
    """FSDP2's fully_shard and register_fsdp_forward_method (torch >= 2.6 exports them from torch.distributed.fsdp,
    2.4-2.5 from _composable)."""
    try:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard, register_fsdp_forward_method
    return fully_shard, register_fsdp_forward_method


def _moe_rewrite_divide_gradients(module, factor, gloo):
    """FSDP2 `module` divides its reduced gradients by `factor`. On gloo, which has no PREMUL_SUM or AVG, it sums then
    divides, except on a group of one rank (torch 2.13's FSDP2 would divide twice there)."""
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(float(factor))
    else:  # torch < 2.6
        module.set_reduce_scatter_divide_factor(float(factor))
    if gloo and hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)


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
    if raw.dtype == torch.float8_e4m3fn:  # FP8 codes travel as bytes (gloo has no float8)
        raw = raw.view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(layer.ep_size)]
    dist.all_gather(parts, raw, group=_moe_rewrite_ep_group(layer))
    if name.startswith("lora_B."):
        local = layer.config.n_routed_experts // layer.ep_size
        parts = [part.view(part.shape[0], -1, local) for part in parts]
        return torch.cat(parts, dim=2).flatten(1)
    return torch.cat(parts).view(value.dtype)


def _moe_rewrite_experts_shard_kwargs(unit, kwargs):
    """fully_shard's keyword arguments for an experts unit: FP8 experts keep their codes and scales as they are (a
    mixed-precision param_dtype would gather them cast to it: twice the bytes, scales rounded); their adapters then
    run in their own dtype."""
    import dataclasses

    experts, _ = _moe_rewrite_unwrap(unit)
    policy = kwargs.get("mp_policy")
    fp8 = getattr(experts, "moe_rewrite_fp8", lambda: False)()
    if not fp8 or policy is None or getattr(policy, "param_dtype", None) is None:
        return kwargs
    return {**kwargs, "mp_policy": dataclasses.replace(policy, param_dtype=None)}


def _moe_rewrite_gathered_state_dict(model, state_dict, writes):
    """For save_pretrained under expert parallelism or FSDP2, called on every rank: (the whole state dict (the
    model's own when None) on the writing rank, None on the others; True): each layer's fused experts gathered from
    the ranks of its expert-parallel group (global expert order), and the LoRA weights PEFT put on their views
    (experts.N.gate_proj.lora_A...), which differ by rank; DTensors (FSDP2 shards) made whole. Otherwise
    (state_dict, False). `model` is the root whose state dict it is (a PeftModel around the model too)."""
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    source = model.state_dict() if state_dict is None else state_dict
    ep_layers = _moe_rewrite_ep_layers(model)
    sharded = any(hasattr(value, "full_tensor") for value in source.values())
    if not distributed or not (ep_layers or sharded):
        return state_dict, False
    whole, views = {}, {prefix: {} for prefix in ep_layers}
    for key, value in source.items():  # one order on every rank: the collectives pair up
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        prefix = next((p for p in ep_layers if key.startswith(p)), None)
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
    for prefix, layer in ep_layers.items():
        shares = [None] * layer.ep_size
        dist.all_gather_object(shares, views[prefix], group=_moe_rewrite_ep_group(layer))
        if writes:
            for share in shares:
                whole.update(share)
    return (whole if writes else None), True


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
        import os

        adapter = kwargs.get("selected_adapters", [peft_model.active_adapter])[0]
        # gathered under expert parallelism or FSDP2 (PEFT would read the DTensors); else PEFT reads the model itself
        whole, gathered = _moe_rewrite_gathered_state_dict(peft_model, None, is_main_process)
        if gathered:
            kwargs["state_dict"] = whole if is_main_process else {}
        peft_model.save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if not is_main_process or _moe_rewrite_ep_size(self) <= 1:
            return
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

    def moe_rewrite_expert_parallel(self, group=None):
        """Exchange every MoE layer's rows in `group`, a torch.distributed ProcessGroup or a one-dimensional
        DeviceMesh (mesh["ep"]), instead of the default one the layers make on first use; it must hold this rank's
        block of ep_size consecutive ranks, in order (the experts were built for it). Returns the model."""
        ep = _moe_rewrite_ep_size(self)
        if ep <= 1:
            raise RuntimeError("moe-rewrite: this model was built without expert parallelism (ep_size=1)")
        if hasattr(group, "get_group"):  # a DeviceMesh
            group = group.get_group()
        _moe_rewrite_check_ep_group(group, ep)
        for layer in _moe_rewrite_moe_layers(self):
            layer.__dict__["_moe_rewrite_ep_group"] = group
        return self

    def moe_rewrite_fully_shard(self, mesh=None, **kwargs):
        """Shard the model with FSDP2 for expert parallelism (or without it, ep_size=1): each MoE layer's experts over
        the ranks holding the same experts (`mesh`'s first dimension), everything else over every rank, each decoder
        layer (the classes in _no_split_modules) a unit and the model the root. The experts' gradients are divided by
        the world size, not by their group's, as every token's loss counts once in the world's mean.

        `mesh`: a two-dimensional DeviceMesh (expert data parallel, expert parallel) of shape
        (world // ep_size, ep_size); by default one on the parameters' device type. `kwargs` go to every fully_shard
        call (mp_policy, reshard_after_forward, ...). Returns the model."""
        from torch.distributed.device_mesh import init_device_mesh

        dist = torch.distributed
        fully_shard, register_fsdp_forward_method = _moe_rewrite_fully_shard_api()
        world, ep = dist.get_world_size(), _moe_rewrite_ep_size(self)
        device = next(self.parameters()).device.type
        if mesh is None:
            mesh = init_device_mesh(device, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        if mesh.ndim != 2 or tuple(mesh.shape) != (world // ep, ep):
            raise ValueError(
                f"moe-rewrite: moe_rewrite_fully_shard needs a (world // ep_size, ep_size) = ({world // ep}, {ep}) "
                f"DeviceMesh, got shape {tuple(mesh.shape)}"
            )
        names = mesh.mesh_dim_names or ("efsdp", "ep")
        efsdp_mesh, ep_mesh = mesh[names[0]], mesh[names[1]]
        if ep > 1:
            self.moe_rewrite_expert_parallel(ep_mesh)
        gloo = dist.get_backend() == "gloo"
        for layer in _moe_rewrite_moe_layers(self):
            unit = layer.experts  # the fused experts, or PEFT's wrappers of their parameters around them
            fully_shard(unit, mesh=efsdp_mesh, **_moe_rewrite_experts_shard_kwargs(unit, kwargs))
            _moe_rewrite_divide_gradients(unit, world, gloo and world // ep > 1)
            # moe_train runs the experts through moe_rewrite_run (with the wrappers' adapters): FSDP2 gathers the
            # unit around it as around a forward
            experts, _ = _moe_rewrite_unwrap(unit)
            if experts is not unit:
                unit.moe_rewrite_run = experts.moe_rewrite_run
            register_fsdp_forward_method(unit, "moe_rewrite_run")
        dp_mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
        blocks = set(getattr(self, "_no_split_modules", None) or ())
        units = [module for module in self.modules() if type(module).__name__ in blocks] + [self]
        for unit in units:
            fully_shard(unit, mesh=dp_mesh, **kwargs)
            if gloo and world > 1:
                unit.set_force_sum_reduction_for_comms(True)
        return self

    def moe_rewrite_all_reduce_gradients(self):
        """Without FSDP (or DDP) under expert parallelism, after backward: every gradient averaged over the world, the
        experts' summed over the ranks holding the same experts and divided by the world size (their all-to-all
        backward already summed the expert-parallel group's tokens). Parameters without a gradient count as zeros."""
        dist = torch.distributed
        world, ep = dist.get_world_size(), _moe_rewrite_ep_size(self)
        expert_ids = {id(p) for layer in _moe_rewrite_moe_layers(self) for p in layer.experts.parameters()}
        trained = [p for p in self.parameters() if p.requires_grad]
        groups = {None: [p for p in trained if id(p) not in expert_ids]}
        if ep > 1:
            groups[_moe_rewrite_ep_groups(ep)[1]] = [p for p in trained if id(p) in expert_ids]
        else:
            groups[None] = trained
        for group, params in groups.items():
            for dtype in sorted({p.dtype for p in params}, key=str):  # one all-reduce per group and dtype
                same = [p for p in params if p.dtype == dtype]
                for p in same:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                flat = torch.cat([p.grad.reshape(-1) for p in same])
                dist.all_reduce(flat, group=group)
                flat.div_(world)
                for p, value in zip(same, flat.split([p.numel() for p in same])):
                    p.grad.copy_(value.view_as(p.grad))
