"""Expert parallelism (config.ep_size = ep > 1): each rank of an expert-parallel group of ep ranks holds E / ep of every
MoE layer's routed experts, fused; a token's rows go to the ranks holding its experts and come back through
torch.distributed's all-to-all, with autograd. Generated with --expert-parallel (the "expert-parallel" feature), else
_moe_rewrite_no_expert_parallel's refusal in its place; always generated: _moe_rewrite_ep_rank (the MoE __init__'s
ep branch calls it, codemods/moe/expert_parallel.py) and the helpers at the end of this docstring.

Groups are blocks of ep consecutive ranks (rank r is expert-parallel rank r % ep and holds experts
[r % ep * E / ep, (r % ep + 1) * E / ep)): the inner dimension of a (world / ep, ep) DeviceMesh, which
Model.moe_rewrite_fully_shard builds. The ranks holding the same experts (r, r + ep, r + 2 ep, ...) are its
expert-data-parallel group: FSDP2 shards the experts over it, everything else over every rank.

Per layer and step: the per-expert row counts are exchanged (all-to-all of E integers) and copied to the host (the
split sizes: one sync), the rows sorted by expert (so by rank) go out, the local experts run them through the
grouped-GEMM core with unit weights (the fused experts' moe_rewrite_run, where FSDP2 gathers their shards), the
outputs come back, and the sending rank weights and sums them as the published moe_infer does: expert outputs in x's
dtype, weighted in the routing weights' dtype, summed, then cast. The router's gradient stays on the sending rank; a
rank that receives no row still runs both exchanges in backward.

Here too, as the core reads them on every step: the experts module under PEFT's ParamWrappers (_moe_rewrite_unwrap,
used by parameter_lora.py and the layouts above) and whether FSDP2 shards it as a unit of its own
(_moe_rewrite_fsdp2_unit).
"""

import torch

from ..kernels.dispatch import _moe_rewrite_triton
from .expert_output import _MoeRewriteCombine
from .grouped_linear import _MoeRewriteGather
from .route import _moe_rewrite_combine, _moe_rewrite_route, _moe_rewrite_unsort


def _moe_rewrite_ep_rank(config):
    """This rank's place in its expert-parallel group (rank % config.ep_size): the MoE layer's __init__ builds experts
    [ep_rank * E / ep, (ep_rank + 1) * E / ep) only. Needs torch.distributed initialized, ep dividing the world size
    and the number of routed experts."""
    dist = torch.distributed
    ep, experts = config.ep_size, config.n_routed_experts
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"moe-rewrite: ep_size={ep} needs torch.distributed initialized before the model is built "
            "(launch with torchrun and call torch.distributed.init_process_group first)"
        )
    world = dist.get_world_size()
    if world % ep or experts % ep:
        raise ValueError(
            f"moe-rewrite: ep_size={ep} must divide the world size ({world}) and n_routed_experts ({experts})"
        )
    return dist.get_rank() % ep


# generated with: expert-parallel
_moe_rewrite_ep_cache = {}  # ep_size -> (this rank's expert-parallel group, its expert-data-parallel group)


# generated with: expert-parallel
def _moe_rewrite_ep_groups(ep):
    """(expert-parallel group, expert-data-parallel group) of this rank in the default layout (module docstring),
    made on first use: every rank makes every group, in one order."""
    if ep not in _moe_rewrite_ep_cache:
        dist = torch.distributed
        world = dist.get_world_size()
        blocks = [list(range(start, start + ep)) for start in range(0, world, ep)]
        strides = [list(range(first, world, ep)) for first in range(ep)]
        ep_group, _ = dist.new_subgroups_by_enumeration(blocks)
        efsdp_group, _ = dist.new_subgroups_by_enumeration(strides)
        _moe_rewrite_ep_cache[ep] = (ep_group, efsdp_group)
    return _moe_rewrite_ep_cache[ep]


# generated with: expert-parallel
def _moe_rewrite_ep_group(moe):
    """The MoE layer's expert-parallel process group: the one Model.moe_rewrite_expert_parallel gave it, else the
    default layout's."""
    group = moe.__dict__.get("_moe_rewrite_ep_group")
    return group if group is not None else _moe_rewrite_ep_groups(moe.ep_size)[0]


# generated with: expert-parallel
class _MoeRewriteAllToAll(torch.autograd.Function):
    """torch.distributed.all_to_all_single with autograd: rows x, `in_splits` of them to each rank of `group`,
    `out_splits` received from each; backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        torch.distributed.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        torch.distributed.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _moe_rewrite_unwrap(experts):
    """(the module under PEFT's ParamWrappers, [the wrappers, outermost first]): `experts` and [] when not wrapped.

    PEFT nests one ParamWrapper per targeted parameter, each holding the next as base_layer; a wrapper is recognised by
    its base_layer submodule and its parameter_name (read from the module's own dicts: this runs on every step)."""
    wrappers = []
    while "base_layer" in experts._modules and isinstance(experts.__dict__.get("parameter_name"), str):
        wrappers.append(experts)
        experts = experts._modules["base_layer"]
    return experts, wrappers


def _moe_rewrite_fsdp2_unit(experts):
    """Whether FSDP2 shards the experts module as a unit of its own (moe_rewrite_fully_shard): fully_shard gives its
    class unshard(), and its parameters are gathered only around its forward or registered methods."""
    return callable(getattr(type(experts), "unshard", None))


def _moe_rewrite_run_experts(moe, x, topk_ids, topk_weight, out_dtype):
    """The fused experts' moe_rewrite_run with PEFT's wrappers of their parameters (if any): as FSDP2's registered
    forward method of the experts' unit where moe_rewrite_fully_shard made one (it gathers the shards), else
    directly."""
    outer = moe.experts
    experts, wrappers = _moe_rewrite_unwrap(outer)
    run = outer.__dict__.get("moe_rewrite_run") or experts.moe_rewrite_run
    return run(x, topk_ids, topk_weight, out_dtype, wrappers)


# generated without: expert-parallel
def _moe_rewrite_no_expert_parallel(*args, **kwargs):
    """Expert parallelism's entry points in a file rewritten without it: one line saying how to get it."""
    raise NotImplementedError(
        "moe-rewrite: this file was rewritten without expert parallelism (ep_size > 1, moe_rewrite_fully_shard, "
        "moe_rewrite_expert_parallel, moe_rewrite_all_reduce_gradients): rewrite it with --expert-parallel"
    )


# generated with: expert-parallel
def _moe_rewrite_expert_parallel(moe, x, topk_ids, topk_weight, out_dtype):
    """The routed experts' weighted outputs for this rank's tokens x (tokens, hidden), with topk_ids (global expert
    ids) and topk_weight (tokens, top_k), the experts spread over the layer's expert-parallel group (module
    docstring)."""
    outer = moe.experts
    held, _ = _moe_rewrite_unwrap(outer)
    if "first_expert" not in held.__dict__:  # per-expert layers
        raise NotImplementedError(
            "moe-rewrite: expert parallelism needs the routed experts fused (the default; not --no-fuse-experts or "
            "MOE_REWRITE_FUSE_EXPERTS=0)"
        )
    own_unit = _moe_rewrite_fsdp2_unit(outer)
    if (getattr(held, "_is_fsdp_managed_module", False) and not own_unit) or hasattr(held.gate_up_proj, "ds_id"):
        raise NotImplementedError(
            "moe-rewrite: under expert parallelism each rank holds other experts, which FSDP1, DeepSpeed ZeRO and "
            "FSDP2 units spanning them would mix: shard with model.moe_rewrite_fully_shard() (FSDP2), or train "
            "without sharding and call model.moe_rewrite_all_reduce_gradients() after backward"
        )
    ep, experts = moe.ep_size, moe.config.n_routed_experts
    local = experts // ep
    group = _moe_rewrite_ep_group(moe)
    top_k = topk_ids.shape[1]
    # the route sorts the rows by expert, so by destination rank (one Triton launch on CUDA), and counts them
    kernels = _moe_rewrite_triton(x.device, x.dtype)
    offsets, route = _moe_rewrite_route(topk_ids, experts, kernels is not None, kernels)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
    received = torch.empty_like(counts)  # (source rank, local expert)
    torch.distributed.all_to_all_single(received, counts, group=group)
    host = torch.stack([counts, received]).cpu()  # the split sizes: one sync per layer
    send = host[0].view(ep, local).sum(1).tolist()
    recv = host[1].view(ep, local).sum(1).tolist()
    rows = _MoeRewriteAllToAll.apply(_MoeRewriteGather.apply(x, route, top_k, kernels), recv, send, group)
    expert_ids = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received, output_size=sum(recv))
    ones = torch.ones(rows.shape[0], 1, dtype=topk_weight.dtype, device=x.device)
    # the grouped GEMMs on the held experts, each row's output rounded once to x's dtype as moe_infer's
    outputs = _moe_rewrite_run_experts(moe, rows, expert_ids.unsqueeze(1), ones, x.dtype)
    back = _MoeRewriteAllToAll.apply(outputs, send, recv, group)
    dtype = out_dtype or torch.promote_types(x.dtype, topk_weight.dtype)
    if kernels is not None:  # weighted sum in float32, rounded once, without a float32 copy of the rows
        return _MoeRewriteCombine.apply(back, topk_weight, route, dtype, kernels)
    return _moe_rewrite_combine(_moe_rewrite_unsort(back, route.order), topk_weight).to(dtype)
