"""The model's side of expert parallelism (expert_parallel.py has the layers'): which group each layer exchanges rows
in, FSDP2 on the two meshes, gradients without FSDP (whole checkpoints from the ranks' shares:
expert_parallel_checkpoint.py). Generated with --expert-parallel (the "expert-parallel" feature); without it,
expert_parallel_checkpoint.py's stand-ins for the entry points refuse.

    torchrun --nproc-per-node 8 train.py, where train.py does
        torch.distributed.init_process_group()
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, ep_size=4)  # this rank's experts
        model.moe_rewrite_fully_shard()     # FSDP2: experts over the (world / ep) ranks holding them, the rest over all
        ... loss.backward(); optimizer.step() ...
        model.save_pretrained(out, is_main_process=rank == 0)   # on every rank: the checkpoint any ep_size loads
"""

import torch

from ..moe.expert_parallel import _moe_rewrite_ep_groups, _moe_rewrite_unwrap


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


# generated with: expert-parallel
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


# generated with: expert-parallel
def _moe_rewrite_fully_shard_api():
    """FSDP2's fully_shard and register_fsdp_forward_method (torch >= 2.6 exports them from torch.distributed.fsdp,
    2.4-2.5 from _composable)."""
    try:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard, register_fsdp_forward_method
    return fully_shard, register_fsdp_forward_method


# generated with: expert-parallel
def _moe_rewrite_divide_gradients(module, factor, gloo):
    """FSDP2 `module` divides its reduced gradients by `factor`. On gloo, which has no PREMUL_SUM or AVG, it sums then
    divides, except on a group of one rank (torch 2.13's FSDP2 would divide twice there)."""
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(float(factor))
    else:  # torch < 2.6
        module.set_reduce_scatter_divide_factor(float(factor))
    if gloo and hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)


# generated with: expert-parallel
def _moe_rewrite_experts_shard_kwargs(unit, kwargs):
    """fully_shard's keyword arguments for an experts unit: FP8 experts keep their codes and scales as they are (a
    mixed-precision param_dtype would gather them cast to it: twice the bytes, scales rounded); their adapters then
    run in their own dtype."""
    experts, _ = _moe_rewrite_unwrap(unit)
    policy = kwargs.get("mp_policy")
    # generated with: fp8-experts
    if getattr(experts, "moe_rewrite_fp8", lambda: False)() and getattr(policy, "param_dtype", None) is not None:
        import dataclasses

        return {**kwargs, "mp_policy": dataclasses.replace(policy, param_dtype=None)}
    return kwargs


class Model:
    # generated with: expert-parallel
    @property
    def _ddp_params_and_buffers_to_ignore(self):
        """Refuses DistributedDataParallel under expert parallelism, in its constructor, before it broadcasts rank 0's
        parameters: DDP's __init__ reads this attribute through hasattr(), which lets any error but AttributeError
        through (torch 2.5 to 2.13; tests/test_private_apis.py). Without expert parallelism it is the plain attribute
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model sets (absent until then)."""
        ep = _moe_rewrite_ep_size(self)
        if ep > 1:
            raise NotImplementedError(
                f"moe-rewrite: DistributedDataParallel cannot wrap a model under expert parallelism (ep_size={ep}): "
                "its constructor would broadcast rank 0's experts over every other rank's, and it would average "
                "different experts' gradients; shard with model.moe_rewrite_fully_shard() (FSDP2), or train without "
                "a wrapper and call model.moe_rewrite_all_reduce_gradients() after backward"
            )
        if "_moe_rewrite_ddp_ignored" not in self.__dict__:
            raise AttributeError("_ddp_params_and_buffers_to_ignore")
        return self.__dict__["_moe_rewrite_ddp_ignored"]

    # generated with: expert-parallel
    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, value):
        self.__dict__["_moe_rewrite_ddp_ignored"] = value

    # generated with: expert-parallel
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

    # generated with: expert-parallel
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
        """Without FSDP under expert parallelism (DistributedDataParallel is refused), after backward: every gradient
        averaged over the world, the experts' summed over the ranks holding the same experts and divided by the world
        size (their all-to-all backward already summed the expert-parallel group's tokens). A parameter no rank has a
        gradient for (the V3 router's e_score_correction_bias) keeps none, as in one process and under FSDP2, so that
        weight decay leaves it as it is; one that only some ranks have a gradient for counts as zeros on the others."""
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
            if not params:
                continue
            # which parameters any rank of the group has a gradient for (the ranks list the same parameters in order)
            has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
            dist.all_reduce(has_grad, group=group)
            params = [p for p, count in zip(params, has_grad.tolist()) if count]
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
