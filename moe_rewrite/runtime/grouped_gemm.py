"""The grouped-GEMM core: the routed experts' MLPs for every token at once, as two grouped GEMMs over rows sorted by
expert, with autograd; the per-expert loop as fallback. Always generated.

The core never asks how the expert weights are laid out: it gets them from the MoE layer's
`moe_rewrite_expert_weights()` (fused_experts.py, or per_expert.py with --no-fuse-experts) as weight sources, objects
with `tensors`, `shape` (E, out, in), `stacked(dtype)` and `grads(compute)`; `_MoeRewriteExpertWeight` below is the one
for an (E, out, in) tensor, expert_linears.py's the one for E nn.Linear weights (and PEFT's LoRA adapters on them).
"""

import torch

from .triton_kernels import (
    _moe_rewrite_build_triton,
    _moe_rewrite_gather_rows,
    _moe_rewrite_gemm_fits,
    _moe_rewrite_grouped_mm,
    _moe_rewrite_route_rows,
    _moe_rewrite_sum_rows,
    _moe_rewrite_sum_rows_backward,
    _moe_rewrite_swiglu,
    _moe_rewrite_swiglu_backward,
)

# moe-rewrite writes the rewrite's own options here (backend, stacking, version; see moe_rewrite/options.py).
_moe_rewrite_options = {"version": "template", "backend": "auto", "stacking": "stack"}
_moe_rewrite_kernels = {}  # (device, dtype) -> kernel name, "triton" -> the Triton kernels, ("sm90", device) -> bool
_moe_rewrite_settings = {}  # environment variable -> value, read once per process


def _moe_rewrite_setting(name, default):
    """The environment variable `name` (MOE_REWRITE_BACKEND, MOE_REWRITE_TRITON, MOE_REWRITE_TRITON_GEMM, ...), read on
    first use and kept for the process, so that no training step reads the environment."""
    if name not in _moe_rewrite_settings:
        import os

        _moe_rewrite_settings[name] = os.environ.get(name) or default
    return _moe_rewrite_settings[name]


def _moe_rewrite_compute_dtype(x):
    """The dtype the expert GEMMs run in: torch.autocast's when it is on for x's device (as nn.Linear would), else
    x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _moe_rewrite_kernel(device, dtype):
    """The grouped-GEMM kernel for activations on `device` computed in `dtype`: "torch", "sonicmoe" (the whole expert
    MLP where SonicMoE runs it, else "torch"), "grouped_gemm", "sorted" or "loop". Decided on first use per
    (device, dtype) and kept for the process."""
    key = (device, dtype)
    if key not in _moe_rewrite_kernels:
        _moe_rewrite_kernels[key] = _moe_rewrite_choose_kernel(device, dtype)
    return _moe_rewrite_kernels[key]


def _moe_rewrite_choose_kernel(device, dtype):
    """MOE_REWRITE_BACKEND, else the backend chosen at rewrite time, resolved for this device and dtype."""
    backend = _moe_rewrite_setting("MOE_REWRITE_BACKEND", _moe_rewrite_options["backend"])
    cuda_bf16 = device.type == "cuda" and dtype == torch.bfloat16
    if backend == "loop":
        return "loop"
    if backend == "grouped_gemm":
        if not cuda_bf16 or _moe_rewrite_grouped_gemm() is None:
            raise RuntimeError(
                "moe-rewrite: backend 'grouped_gemm' needs the grouped_gemm package, CUDA and bfloat16 activations"
            )
        return "grouped_gemm"
    if backend == "sonicmoe":  # SonicMoE's kernels are written for Hopper (sm90) and bf16
        if not (cuda_bf16 and _moe_rewrite_hopper(device)) or _moe_rewrite_sonicmoe() is None:
            raise RuntimeError(
                "moe-rewrite: backend 'sonicmoe' needs the sonic-moe package, an sm90 GPU (H100, H200) and bfloat16 "
                "activations"
            )
        return "sonicmoe"
    # torch's grouped matmul (torch._grouped_mm, torch's only grouped GEMM, private but the one transformers uses too)
    # has fast kernels for bf16 on sm90+ only; anywhere else the sorted per-expert pass is faster.
    torch_fast = cuda_bf16 and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] >= 9
    if backend == "torch":
        return "torch" if torch_fast else "sorted"
    if backend == "auto":  # never SonicMoE: its first call per token count autotunes for minutes (bench/NOTES.md)
        if torch_fast:
            return "torch"
        if cuda_bf16 and _moe_rewrite_grouped_gemm() is not None:
            return "grouped_gemm"
        return "sorted"
    raise ValueError(f"moe-rewrite: unknown backend {backend!r}; use auto, torch, sonicmoe, grouped_gemm or loop")


def _moe_rewrite_triton(device, dtype):
    """The Triton kernels of the memory-bound steps (triton_kernels.py) for rows on `device` in `dtype`, or None, and
    the same arithmetic runs as torch ops: off CUDA, in float64 (the kernels compute in float32), without triton, with
    MOE_REWRITE_TRITON=0, or under torch.compile (which fuses those steps itself). Built on first use and kept for the
    process."""
    if device.type != "cuda" or dtype == torch.float64 or torch.compiler.is_compiling():
        return None
    if "triton" not in _moe_rewrite_kernels:
        wanted = _moe_rewrite_setting("MOE_REWRITE_TRITON", "1") != "0"
        _moe_rewrite_kernels["triton"] = _moe_rewrite_build_triton() if wanted else None
    return _moe_rewrite_kernels["triton"]


def _moe_rewrite_grouped_gemm():
    """The grouped_gemm package's backend module, or None when it is not installed."""
    try:
        from grouped_gemm import backend
    except ImportError:
        return None
    return backend


def _moe_rewrite_sonicmoe():
    """The sonic-moe package (SonicMoE: the whole expert MLP in fused CuTe-DSL kernels for Hopper), or None when it is
    not installed."""
    try:
        import sonicmoe
    except ImportError:
        return None
    return sonicmoe


def _moe_rewrite_is_silu(act_fn):
    """Whether the experts' activation is SiLU (ACT2FN["silu"]: torch's nn.SiLU, or transformers' SiLUActivation)."""
    kind = type(act_fn)
    transformers_silu = kind.__name__ == "SiLUActivation" and kind.__module__ == "transformers.activations"
    return kind is torch.nn.SiLU or transformers_silu


def _moe_rewrite_sonicmoe_experts(x, topk_ids, topk_weight, weights, dtype):
    """The routed experts' weighted outputs through SonicMoE (kernel "sonicmoe"), or None when it cannot run them as
    the grouped GEMMs would: adapters, an activation other than SiLU, experts that are not fused parameters, sizes
    whose rows are not 16-byte aligned, or under torch.compile.

    SonicMoE gathers the rows inside its up-projection GEMM, applies SwiGLU in that GEMM's epilogue and scatters the
    weighted rows out of the down projection, with its own backward (gradients for x, both weights and the routing
    weights). It reads the fused parameters as they are: (E, 2I, H) as (2I, H, E), its layout, with concat_layout for
    the [gate; up] rows. Its first call per token count autotunes and compiles its kernels (minutes on an H200).
    """
    gate_up_w, down_w, act_fn, adapters = weights
    experts, double, hidden = gate_up_w.shape
    if (
        any(adapters.values())
        or not _moe_rewrite_is_silu(act_fn)
        or type(gate_up_w) is not _MoeRewriteExpertWeight
        or type(down_w) is not _MoeRewriteExpertWeight
        or hidden % 8
        or double % 16
        or torch.compiler.is_compiling()
    ):
        return None
    sonicmoe = _moe_rewrite_sonicmoe()
    tokens, top_k = topk_ids.shape
    out, _ = sonicmoe.moe_general_routing_inputs(
        x.to(dtype).contiguous(),
        topk_weight.reshape(-1).float(),
        torch.arange(tokens, device=x.device, dtype=torch.int32).repeat_interleave(top_k),  # sorted token ids
        topk_ids.reshape(-1).to(torch.int32),
        gate_up_w.stacked(dtype).permute(1, 2, 0),
        None,
        down_w.stacked(dtype).permute(1, 2, 0),
        None,
        experts,
        torch.cuda.current_stream(x.device).cuda_stream,
        sonicmoe.enums.ActivationType.SWIGLU,
        concat_layout=True,
    )
    return out.to(torch.promote_types(dtype, topk_weight.dtype))  # the dtype the grouped GEMMs return


def _moe_rewrite_gmm(kernel, a, b, offsets, mode):
    """One grouped GEMM over rows sorted by expert; `offsets` holds the cumulative row counts per expert (int32).

    mode "fwd":   a (rows, in),  b (E, out, in) -> (rows, out), each row times its expert's weight transposed
    mode "dgrad": a (rows, out), b (E, out, in) -> (rows, in)
    mode "wgrad": a (rows, out), b (rows, in)   -> (E, out, in), per expert a_e^T @ b_e (zero for empty experts)
    """
    if kernel == "torch":
        if mode != "wgrad" and b.stride(2) == 1:
            n, k = (b.shape[1], b.shape[2]) if mode == "fwd" else (b.shape[2], b.shape[1])
            kernels = _moe_rewrite_triton(a.device, a.dtype)
            if kernels is not None and _moe_rewrite_gemm_by_triton(a.device, a.shape[0], b.shape[0], n, k):
                return _moe_rewrite_grouped_mm(kernels, a, b, offsets, mode)
        if mode == "fwd":
            return torch._grouped_mm(a, b.transpose(1, 2), offs=offsets)
        if mode == "dgrad":
            return torch._grouped_mm(a, b, offs=offsets)
        return torch._grouped_mm(a.t(), b, offs=offsets)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).cpu()
    if kernel == "grouped_gemm":
        gg = _moe_rewrite_grouped_gemm()
        counts = counts.long()
        if mode == "fwd":
            return gg.gmm(a, b, counts, trans_b=True)
        if mode == "dgrad":
            return gg.gmm(a, b, counts)
        return gg.gmm(a, b, counts, trans_a=True)
    # "sorted": one pass over contiguous per-expert slices; portable to any device and dtype. Rows past the last
    # offset (padding, _moe_rewrite_padding) are in no group: zeros out, as the grouped kernels leave them unread.
    total = int(counts.sum())
    a_parts, padding = a[:total].split(counts.tolist()), a.shape[0] - total
    if mode == "fwd":
        return torch.cat([*(part @ w.t() for part, w in zip(a_parts, b)), a.new_zeros(padding, b.shape[1])])
    if mode == "dgrad":
        return torch.cat([*(part @ w for part, w in zip(a_parts, b)), a.new_zeros(padding, b.shape[2])])
    return torch.stack([part.t() @ rows for part, rows in zip(a_parts, b[:total].split(counts.tolist()))])


def _moe_rewrite_gemm_by_triton(device, rows, experts, n, k):
    """Whether the Triton grouped GEMM (triton_kernels.py) runs a forward or input-gradient product of `rows` rows
    over `experts` experts, n wide and k deep, instead of torch._grouped_mm, where the kernel is "torch" (bf16) and
    the Triton kernels run: on sm90 at no more than 160 rows per expert on average, where torch's CUTLASS tiles read
    an expert's weights once per row tile (bench/NOTES.md, change 26: 1.07-1.36x at V3's widths and 64-160 rows per
    expert, 0.87-1.01x at 256 and 768), for products at least one tile wide and a depth of whole tiles (not the
    adapters' rank-r ones).
    MOE_REWRITE_TRITON_GEMM=0 keeps torch's."""
    if rows > 160 * experts or not _moe_rewrite_gemm_fits(n, k) or not _moe_rewrite_hopper(device):
        return False
    return _moe_rewrite_setting("MOE_REWRITE_TRITON_GEMM", "1") != "0"


class _MoeRewriteExpertWeight:
    """The weight source of one (E, out, in) tensor (a fused experts parameter): autograd connects the tensor itself,
    the GEMMs read it cast to the compute dtype, and its gradient comes back in its own dtype (as nn.Linear's does)."""

    def __init__(self, weight):
        self.weight, self.shape = weight, weight.shape
        self.tensors = (weight,)

    def stacked(self, dtype):
        return self.weight.to(dtype)

    def grads(self, compute):
        return (compute().to(self.weight.dtype),)


def _moe_rewrite_kept(stacked, keep_stacked, tensors):
    """What an autograd node keeps of a stacked weight for backward: the weight when asked to (keep_stacked) or when it
    is one of the source's own tensors, which costs nothing to keep (autograd saves nn.Linear's weight the same way);
    else None, and backward rebuilds it."""
    return stacked if keep_stacked or any(stacked is t for t in tensors) else None


class _MoeRewriteGroupedLinear(torch.autograd.Function):
    """Rows sorted by expert times their expert's weight, for every expert in one grouped GEMM.

    `source` is a weight source (see the top of this block) and `tensors` its `source.tensors`, the inputs autograd
    connects this node to. With keep_stacked False, a stacked weight that is not one of those tensors is rebuilt in
    backward instead of being kept alive between forward and backward (lower peak memory). `gather` is None when x
    holds the rows, or (route, top_k, dtype, kernels) for the first GEMM (route: see _moe_rewrite_route): the rows
    are x[tokens] in `dtype`, gathered here and again in backward for the weight gradient, so that x (which the
    router keeps anyway) is kept instead of them (TK x hidden), and x's gradient sums each token's row gradients.
    """

    @staticmethod
    def forward(ctx, x, offsets, kernel, keep_stacked, gather, source, *tensors):
        route, ctx.top_k, ctx.dtype, ctx.kernels = gather or ((None, None, None), 1, x.dtype, None)
        stacked = source.stacked(ctx.dtype)
        ctx.kernel, ctx.source = kernel, source
        # the real and padded row counts when x's rows are gathered; backward through the Triton kernels reads only
        # the positions of the route, so order and tokens are not kept then (the step's peak is in this backward)
        ctx.rows = None if route[0] is None else (route[0].numel(), route[1].numel())
        kept = (None, None, route[2]) if ctx.kernels is not None and route[2] is not None else route
        ctx.save_for_backward(x, offsets, _moe_rewrite_kept(stacked, keep_stacked, tensors), *kept)
        return _moe_rewrite_gmm(kernel, _moe_rewrite_rows(ctx, x, route), stacked, offsets, "fwd")

    @staticmethod
    def backward(ctx, grad):
        x, offsets, stacked, *route = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            if stacked is None:
                stacked = ctx.source.stacked(ctx.dtype)
            grad_x = _moe_rewrite_gmm(ctx.kernel, grad, stacked, offsets, "dgrad")
            del stacked  # a rebuilt copy is freed before the weight gradients are allocated
            if ctx.rows is not None:
                grad_x = _moe_rewrite_token_sums(ctx.kernels, grad_x, route, ctx.top_k, x.dtype)
        tensor_grads = ctx.needs_input_grad[6:]  # after x, offsets, kernel, keep_stacked, gather, source
        grads = (None,) * len(tensor_grads)
        if any(tensor_grads):
            # The weight gradient reads no padding row (its offsets end at the real rows, and its tile does not
            # depend on them): x's rows are gathered without them, less memory at the step's peak.
            rows = _moe_rewrite_rows(ctx, x, route, padded=False)
            grad = grad[: rows.shape[0]]
            grads = ctx.source.grads(lambda: _moe_rewrite_gmm(ctx.kernel, grad, rows, offsets, "wgrad"))
        return (grad_x, None, None, None, None, None, *grads)


def _moe_rewrite_rows(ctx, x, route, padded=True):
    """The grouped linear's input rows: x itself, or the rows x[tokens] in the compute dtype (route: see
    _moe_rewrite_route; ctx.rows its real and padded row counts), with the Triton kernels in one pass that reads each
    token's row once; without the padding rows unless `padded`."""
    if ctx.rows is None:
        return x
    return _moe_rewrite_gather(ctx.kernels, x, route, ctx.dtype, count=ctx.rows[1] if padded else ctx.rows[0])


def _moe_rewrite_gather(kernels, x, route, dtype, topk_weight=None, count=None):
    """x[tokens] in `dtype` (route: see _moe_rewrite_route): the rows in expert order, padding rows included (or
    the first `count` of them), through the Triton kernels where they run (each token's row read once, written to
    its top_k places), else torch's index_select. With topk_weight: (rows, each row's routing weight), the weights in
    the same pass."""
    order, tokens, positions = route
    if kernels is not None and positions is not None:
        count = tokens.numel() if count is None else count
        return _moe_rewrite_gather_rows(kernels, x, positions, count, dtype, topk_weight)
    tokens = tokens if count is None else tokens[:count]
    rows = x.index_select(0, tokens).to(dtype)
    return rows if topk_weight is None else (rows, _moe_rewrite_row_weights(topk_weight, order, tokens))


def _moe_rewrite_linear(x, offsets, kernel, keep_stacked, source, gather=None):
    return _MoeRewriteGroupedLinear.apply(x, offsets, kernel, keep_stacked, gather, source, *source.tensors)


class _MoeRewriteGather(torch.autograd.Function):
    """rows[i] = x[tokens[i]]: each token once per selected expert, sorted by expert (for adapters on gate_up, which
    read the rows too; without them the first grouped linear gathers them itself).

    Backward sums each token's top_k row gradients (_moe_rewrite_token_sums).
    """

    @staticmethod
    def forward(ctx, x, route, top_k, kernels):
        ctx.save_for_backward(*route)
        ctx.top_k, ctx.kernels = top_k, kernels
        return _moe_rewrite_gather(kernels, x, route, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        route = ctx.saved_tensors
        return _moe_rewrite_token_sums(ctx.kernels, grad, route, ctx.top_k, grad.dtype), None, None, None


def _moe_rewrite_route(topk_ids, num_experts, with_positions, kernels=None, padding=0):
    """How the (token, slot) rows go to the experts, on the device (no host sync): (offsets, route), offsets the
    cumulative row counts per expert (int32), route = (order, tokens, positions): `order` sorts the rows by expert
    (stable: each expert's rows stay in token order, whatever the sort's tie-breaking), the i-th sorted row is token
    tokens[i], and row j (token j // top_k, slot j % top_k) is at positions[j] in expert order (the inverse
    permutation, which the Triton kernels read; computed `with_positions`, else None). `padding` more tokens (token
    0, rows in no expert's group: _moe_rewrite_padding) follow the sorted rows' ones. With `kernels` (the Triton
    kernels) the same tensors, positions and padding included, come from one launch instead of about ten: the host's
    time before the first GEMM (bench/NOTES.md, changes 24 and 26)."""
    if kernels is not None:
        return _moe_rewrite_route_rows(kernels, topk_ids, num_experts, padding)
    flat_ids = topk_ids.reshape(-1)
    # Sorted on the narrowest integer type that holds the expert ids: the radix sort makes one or two passes, not 8.
    key = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32
    sorted_ids, order = flat_ids.to(key).sort(stable=True)
    experts = torch.arange(num_experts, device=flat_ids.device, dtype=key)
    offsets = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    positions = _moe_rewrite_positions(order) if with_positions else None
    tokens = order // topk_ids.shape[1]
    if padding:
        tokens = torch.cat([tokens, tokens.new_zeros(padding)])
    return offsets, (order, tokens, positions)


def _moe_rewrite_padding(rows, num_experts):
    """How many padding rows (token 0, in no expert's group) after the last sorted one make torch._grouped_mm take
    its large tile for `rows` routed rows. On sm90 it picks its tile from the average rows per group: up to 128 a
    64 x 128 one, above 128 x 256 (SonicMoE's tuned choice at V3's sizes, whose routing at 4096 tokens has exactly 128
    rows per expert on average). Rows past the last offset are never read or written by the GEMMs, and the un-sort and
    token sums read rows by position, so the padding changes no number (LoRA dropout draws its masks over the padding
    rows too: other draws, the same distribution). Only where it adds at most an eighth of the rows, else 0
    (bench/NOTES.md, change 22)."""
    pad = 129 * num_experts - rows
    return pad if 0 < pad <= rows // 8 else 0


def _moe_rewrite_hopper(device):
    """Whether `device` is an sm90 GPU (H100, H200): SonicMoE's kernels, and torch._grouped_mm's tile choice above.
    Asked once per device and kept for the process (it is asked every step)."""
    key = ("sm90", device)
    if key not in _moe_rewrite_kernels:
        _moe_rewrite_kernels[key] = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    return _moe_rewrite_kernels[key]


def _moe_rewrite_token_sums(kernels, grad_rows, route, top_k, dtype):
    """Each token's top_k row gradients (rows in expert order) summed in `dtype` (accumulated in float32 for bf16 and
    fp16): un-sorted by a permutation and summed (no atomics, deterministic), in one pass with `kernels` (the Triton
    kernels, or None)."""
    order, _, positions = route
    if kernels is not None:
        return _moe_rewrite_sum_rows(kernels, grad_rows, positions, top_k, dtype=dtype)
    return _moe_rewrite_unsort(grad_rows, order, dtype).view(-1, top_k, grad_rows.shape[-1]).sum(dim=1)


def _moe_rewrite_unsort(rows, order, dtype=None):
    """Rows in expert order back to (token, slot) order, in `dtype` (rows' by default): a permutation, so no atomics
    and a deterministic result; padding rows past the real ones (_moe_rewrite_padding) are dropped."""
    rows = rows[: order.numel()]
    return torch.empty_like(rows, dtype=dtype).index_copy_(0, order, rows.to(dtype or rows.dtype))


def _moe_rewrite_positions(order):
    """Where each (token, slot) row is in expert order: the inverse of the permutation `order`."""
    return torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))


def _moe_rewrite_combine(y, topk_weight):
    """Weighted sum over each token's top-k expert outputs, in the promoted dtype (float32 for fp32 router weights).

    The multiply promotes y itself (bf16 -> fp32 is exact), so this is moe_infer's cast-then-multiply without a copy.
    """
    dtype = torch.promote_types(y.dtype, topk_weight.dtype)
    return (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1).to(dtype)).sum(dim=1)


class _MoeRewriteExpertOutput(torch.autograd.Function):
    """The experts' weighted outputs from their gate/up projections: act_fn(gate) * up through the down projection,
    back to token order, weighted by the routing weights and summed per token, keeping only gate_up for backward.

    Backward recomputes act_fn(gate) * up, runs the down projection's input-gradient GEMM on the unweighted row
    gradients, and takes each routing weight's gradient as that GEMM's output dotted with the recomputed row
    (<dy, h W^T> = <dy W, h>), so neither the activation, the product nor the expert outputs are kept: about
    TK * (2 * intermediate + hidden) elements less per layer than autograd over the composed ops.
    `gate_up` holds each row's gate then up projection in expert order (`route`: see _moe_rewrite_route); the result
    is in `out_dtype`, or the promoted dtype of the outputs and routing weights when it is None (the sum is
    accumulated in float32 either way and rounded once). For SiLU where the Triton kernels run, SwiGLU, the un-sort
    and weighted sum, and backward's elementwise work are one pass each.
    """

    @staticmethod
    def forward(ctx, gate_up, topk_weight, route, offsets, kernel, keep_stacked, act_fn, out_dtype, source, *tensors):
        stacked = source.stacked(gate_up.dtype)
        kernels = _moe_rewrite_triton(gate_up.device, gate_up.dtype) if _moe_rewrite_is_silu(act_fn) else None
        if kernels is not None:
            hidden = _moe_rewrite_swiglu(kernels, gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = act_fn(gate) * up
        out = _moe_rewrite_gmm(kernel, hidden, stacked, offsets, "fwd")
        ctx.kernel, ctx.source, ctx.act_fn, ctx.kernels = kernel, source, act_fn, kernels
        order, tokens, positions = route
        kept = _moe_rewrite_kept(stacked, keep_stacked, tensors)
        ctx.save_for_backward(gate_up, topk_weight, order, tokens, positions, offsets, kept)
        dtype = out_dtype or torch.promote_types(out.dtype, topk_weight.dtype)
        if kernels is not None:
            return _moe_rewrite_sum_rows(kernels, out, positions, topk_weight.shape[1], topk_weight, dtype)
        return _moe_rewrite_combine(_moe_rewrite_unsort(out, order), topk_weight).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        gate_up, topk_weight, order, tokens, positions, offsets, stacked = ctx.saved_tensors
        kernel, act_fn, kernels = ctx.kernel, ctx.act_fn, ctx.kernels
        # each row's token gradient, and its routing weight (in the weights' own precision), in expert order
        route = (order, tokens, positions)
        grad_rows, row_weight = _moe_rewrite_gather(kernels, grad, route, gate_up.dtype, topk_weight)
        tensor_grads = ctx.needs_input_grad[9:]  # after gate_up, ..., act_fn, out_dtype, source
        grads = (None,) * len(tensor_grads)
        if kernels is not None:
            # SiLU in Triton: the down dgrad, then one pass over the rows for the gate/up gradients, the routing
            # weights' dot products and the weighted rows (written over the dgrad's output), then the down wgrad
            if stacked is None:
                stacked = ctx.source.stacked(gate_up.dtype)
            grad_hidden = _moe_rewrite_gmm(kernel, grad_rows, stacked, offsets, "dgrad")  # unweighted
            stacked = None  # a rebuilt copy is freed before the gradients below are allocated
            grad_gate_up, per_row = _moe_rewrite_swiglu_backward(
                kernels, gate_up, grad_hidden, row_weight, weighted=any(tensor_grads)
            )
            if any(tensor_grads):
                grads = ctx.source.grads(lambda: _moe_rewrite_gmm(kernel, grad_rows, grad_hidden, offsets, "wgrad"))
            return (grad_gate_up, _moe_rewrite_row_weight_grad(ctx, per_row, order, topk_weight), *(None,) * 7, *grads)
        # any activation as torch ops: recompute act_fn(gate) * up, the down wgrad, dgrad, then gate/up's gradients
        row_weight = row_weight.unsqueeze(-1)
        gate, up = gate_up.chunk(2, dim=-1)
        silu = _moe_rewrite_is_silu(act_fn)
        # the activation's own backward through autograd, unless it is SiLU (aten.silu_backward below)
        gate_in = gate.detach().requires_grad_(ctx.needs_input_grad[0] and not silu)
        with torch.enable_grad():
            act_graph = act_fn(gate_in)
        act = act_graph.detach()
        hidden = act * up
        if any(tensor_grads):
            weighted = torch.mul(hidden, row_weight, out=torch.empty_like(hidden))  # one rounding, from fp32
            grads = ctx.source.grads(lambda: _moe_rewrite_gmm(kernel, grad_rows, weighted, offsets, "wgrad"))
            weighted = None
        if stacked is None:
            stacked = ctx.source.stacked(gate_up.dtype)
        grad_hidden = _moe_rewrite_gmm(kernel, grad_rows, stacked, offsets, "dgrad")  # unweighted
        stacked = grad_rows = None  # freed before the gradients below are allocated
        per_row = (grad_hidden * hidden).sum(dim=-1, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_weight = _moe_rewrite_row_weight_grad(ctx, per_row, order, topk_weight)
        hidden = per_row = None
        if not ctx.needs_input_grad[0]:
            return (None, grad_weight, *(None,) * 7, *grads)
        grad_hidden = torch.mul(grad_hidden, row_weight, out=grad_hidden)
        # the gate and up gradients written into one buffer (no concatenation)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(grad_hidden, act, out=grad_up)
        if silu:
            torch.ops.aten.silu_backward.grad_input(grad_hidden * up, gate, grad_input=grad_gate)
        else:
            grad_gate.copy_(torch.autograd.grad(act_graph, gate_in, grad_hidden * up)[0])
        return (grad_gate_up, grad_weight, *(None,) * 7, *grads)


class _MoeRewriteSwiGLU(torch.autograd.Function):
    """silu(gate) * up for rows of gate_up = [gate; up] through the Triton kernels, keeping only gate_up: the product
    for adapters on the down projection, which read it (without them _MoeRewriteExpertOutput does this itself)."""

    @staticmethod
    def forward(ctx, gate_up, kernels):
        ctx.save_for_backward(gate_up)
        ctx.kernels = kernels
        return _moe_rewrite_swiglu(kernels, gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        unweighted = torch.ones(gate_up.shape[0], device=gate_up.device)
        grad_gate_up, _ = _moe_rewrite_swiglu_backward(ctx.kernels, gate_up, grad.contiguous(), unweighted, False)
        return grad_gate_up, None


class _MoeRewriteCombine(torch.autograd.Function):
    """The un-sort and weighted sum of each token's expert rows (in expert order) through the Triton kernels: for
    adapters on the down projection (without them _MoeRewriteExpertOutput does this itself). The sum accumulates in
    float32 and is written in `out_dtype`, or the promoted dtype of rows and weights when it is None; backward is one
    pass over the rows (each row's gradient, and its routing weight's <dy, row>: the rows are kept only when the
    routing weights need a gradient)."""

    @staticmethod
    def forward(ctx, rows, topk_weight, route, out_dtype, kernels):
        order, tokens, positions = route
        ctx.save_for_backward(rows if ctx.needs_input_grad[1] else None, topk_weight, order, tokens)
        ctx.kernels, ctx.dtype = kernels, rows.dtype
        dtype = out_dtype or torch.promote_types(rows.dtype, topk_weight.dtype)
        return _moe_rewrite_sum_rows(kernels, rows, positions, topk_weight.shape[1], topk_weight, dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, topk_weight, order, tokens = ctx.saved_tensors
        row_weight = _moe_rewrite_row_weights(topk_weight, order, tokens)
        grad_rows, per_row = _moe_rewrite_sum_rows_backward(ctx.kernels, grad, rows, tokens, row_weight, ctx.dtype)
        return grad_rows, _moe_rewrite_row_weight_grad(ctx, per_row, order, topk_weight), None, None, None


def _moe_rewrite_row_weights(topk_weight, order, tokens):
    """Each sorted row's routing weight, in the weights' own precision; zero for padding rows (_moe_rewrite_padding:
    a weight for the kernels to read, whose products reach no expert and no token)."""
    row_weight = topk_weight.reshape(-1)[order]
    if tokens.numel() > order.numel():
        row_weight = torch.cat([row_weight, row_weight.new_zeros(tokens.numel() - order.numel())])
    return row_weight


def _moe_rewrite_row_weight_grad(ctx, per_row, order, topk_weight):
    """The routing weights' gradient from each row's <dy W, h> in expert order (float32), or None when not needed."""
    if not ctx.needs_input_grad[1]:
        return None
    return _moe_rewrite_unsort(per_row, order).view(topk_weight.shape).to(topk_weight.dtype)


def _moe_rewrite_grouped_experts(x, topk_ids, topk_weight, weights, num_experts, kernel, dtype, out_dtype):
    """The routed experts' weighted outputs for tokens x: `weights` is (gate_up, down, act_fn, adapters), two weight
    sources (gate and up concatenated along the output dim, so one GEMM runs both), the activation, and the LoRA
    adapters: {name: ((A, B, scaling, dropout), ...)} on gate_up_proj and down_proj as a whole (parameter_lora.py) or
    on the gate_proj, up_proj and down_proj of every expert (expert_linears.py)."""
    if kernel == "sonicmoe":
        out = _moe_rewrite_sonicmoe_experts(x, topk_ids, topk_weight, weights, dtype)
        if out is not None:
            return out.to(out_dtype or out.dtype)
        kernel = "torch"
    gate_up_w, down_w, act_fn, adapters = weights
    top_k = topk_ids.shape[1]
    # The kernels for the rows (in the compute dtype: every step but x's gradient) and for x's gradient (in x's dtype:
    # there only where the rows' are too, so the route holds the positions whenever either reads them).
    kernels, x_kernels = _moe_rewrite_triton(x.device, dtype), _moe_rewrite_triton(x.device, x.dtype)
    # Padding rows for torch's GEMMs on sm90, not for the Triton one (the first GEMM's shapes decide where it runs);
    # not under anomaly detection (the padding rows' gradients are left unwritten, and it checks every row for NaN).
    _, double, hidden = gate_up_w.shape
    padded = kernels is not None and kernel == "torch" and _moe_rewrite_hopper(x.device)
    padded = padded and not _moe_rewrite_gemm_by_triton(x.device, topk_ids.numel(), num_experts, double, hidden)
    padding = _moe_rewrite_padding(topk_ids.numel(), num_experts) if padded and not torch.is_anomaly_enabled() else 0
    offsets, route = _moe_rewrite_route(topk_ids, num_experts, kernels is not None, kernels, padding)
    # "stack" keeps stacked weights from forward to backward (fastest), except under torch.distributed, where the
    # weights are usually sharded (FSDP, ZeRO) and a kept copy per layer would undo the sharding.
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    keep = _moe_rewrite_options["stacking"] == "stack" and not distributed
    if not (adapters.get("gate_up_proj") or adapters.get("gate_proj") or adapters.get("up_proj")):
        gate_up = _moe_rewrite_linear(x, offsets, kernel, keep, gate_up_w, gather=(route, top_k, dtype, x_kernels))
    else:  # the adapters read the gathered rows too
        rows = _MoeRewriteGather.apply(x, route, top_k, x_kernels).to(dtype)
        gate_up = _moe_rewrite_linear(rows, offsets, kernel, keep, gate_up_w)
        gate_up = _moe_rewrite_add_lora(gate_up, rows, offsets, kernel, keep, adapters.get("gate_up_proj", ()))
    if adapters.get("gate_proj") or adapters.get("up_proj"):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = _moe_rewrite_add_lora(gate, rows, offsets, kernel, keep, adapters.get("gate_proj", ()))
        up = _moe_rewrite_add_lora(up, rows, offsets, kernel, keep, adapters.get("up_proj", ()))
        gate_up = torch.cat([gate, up], dim=-1)
    if not adapters.get("down_proj"):
        return _MoeRewriteExpertOutput.apply(
            gate_up, topk_weight, route, offsets, kernel, keep, act_fn, out_dtype, down_w, *down_w.tensors
        )
    if kernels is not None and _moe_rewrite_is_silu(act_fn):
        hidden = _MoeRewriteSwiGLU.apply(gate_up, kernels)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = act_fn(gate) * up
    out = _moe_rewrite_linear(hidden, offsets, kernel, keep, down_w)
    out = _moe_rewrite_add_lora(out, hidden, offsets, kernel, keep, adapters.get("down_proj", ()))
    if kernels is not None:
        return _MoeRewriteCombine.apply(out, topk_weight, route, out_dtype, kernels)
    out = _moe_rewrite_combine(_moe_rewrite_unsort(out, route[0]), topk_weight)
    return out.to(out_dtype or out.dtype)


def _moe_rewrite_add_lora(y, x, offsets, kernel, keep_stacked, loras):
    """y + B(A(dropout(x))) * scaling for each (A, B, scaling, dropout) of `loras`, each row through its expert's
    adapter (PEFT's LoRA forward), as two grouped GEMMs of the adapter's rank: W + BA is never formed. In the compute
    dtype, as the base GEMM."""
    for a, b, scaling, dropout in loras:
        rank = a.shape[1]
        # torch._grouped_mm needs 16-byte aligned strides
        rank_kernel = "sorted" if kernel == "torch" and (rank * x.element_size()) % 16 else kernel
        low = _moe_rewrite_linear(dropout(x), offsets, rank_kernel, keep_stacked, a)
        y = y + _moe_rewrite_linear(low, offsets, rank_kernel, keep_stacked, b) * scaling
    return y


def _moe_rewrite_loop(experts, x, topk_ids, topk_weight):
    """The naive per-expert loop (the published V2 training path): backend "loop", and experts whose weights the core
    cannot read (quantized projections, adapters it cannot reproduce, DeepSpeed ZeRO-3 partitions)."""
    flat_ids = topk_ids.view(-1)
    x = x.repeat_interleave(topk_ids.shape[1], dim=0)
    y = torch.empty_like(x)
    for i, expert in enumerate(experts):
        y[flat_ids == i] = expert(x[flat_ids == i])
    return _moe_rewrite_combine(y, topk_weight)


class MoE:
    def moe_train(self, x, topk_ids, topk_weight, out_dtype=None):
        """Routed experts in training mode (helpers: the moe-rewrite block above this class).

        x: (tokens, hidden); topk_ids, topk_weight: (tokens, top_k). Returns the weighted sum of each token's expert
        outputs, exactly what a loop over the experts computes, with autograd: in the promoted dtype of x and
        topk_weight, or cast to `out_dtype` (the V3 form's training branch asks for x's dtype, as moe_infer returns
        it; the grouped path then writes that dtype straight from its float32 sums, with the same one rounding).
        The expert MLPs run as grouped GEMMs over tokens sorted by expert: gate and up fused in one, down in another.
        """
        if self.ep_size > 1:
            raise NotImplementedError("moe-rewrite: moe_train does not support expert parallelism (ep_size > 1) yet")
        dtype = _moe_rewrite_compute_dtype(x)
        kernel = _moe_rewrite_kernel(x.device, dtype)
        weights = None if kernel == "loop" else self.moe_rewrite_expert_weights()
        if weights is not None:
            experts = weights[0].shape[0]
            return _moe_rewrite_grouped_experts(x, topk_ids, topk_weight, weights, experts, kernel, dtype, out_dtype)
        if isinstance(self.experts, torch.nn.ModuleList):
            y = _moe_rewrite_loop(self.experts, x, topk_ids, topk_weight)
        else:  # fused experts, or PEFT's wrappers around them: their own forward (a loop over the experts)
            y = self.experts(x, topk_ids, topk_weight)
        return y.to(out_dtype or y.dtype)
