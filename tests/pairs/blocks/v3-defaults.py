

# ---- moe-rewrite 0.3.0 (backend=auto, stacking=stack): training path for DeepseekV3MoE ----
# Generated code: edit moe_rewrite/runtime/ in moe-rewrite, not this block; a new run regenerates it.
_moe_rewrite_options = {"version": "0.3.0", "backend": "auto", "stacking": "stack"}
_moe_rewrite_settings_cache = {}  # environment variable -> value
_moe_rewrite_kernel_cache = {}  # (device, dtype) -> the grouped-GEMM kernel's name
_moe_rewrite_triton_cache = {}  # "kernels" -> the Triton kernels ({name: jitted function}) or None
_moe_rewrite_hopper_cache = {}  # device -> whether it is an sm90 GPU


def _moe_rewrite_setting(name, default):
    """The environment variable `name` (MOE_REWRITE_BACKEND, MOE_REWRITE_TRITON, MOE_REWRITE_TRITON_GEMM, ...), read on
    first use and kept for the process, so that no training step reads the environment."""
    if name not in _moe_rewrite_settings_cache:
        import os

        _moe_rewrite_settings_cache[name] = os.environ.get(name) or default
    return _moe_rewrite_settings_cache[name]


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
    if key not in _moe_rewrite_kernel_cache:
        _moe_rewrite_kernel_cache[key] = _moe_rewrite_choose_kernel(device, dtype)
    return _moe_rewrite_kernel_cache[key]


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
    # has fast kernels for bf16 on sm90+ only; anywhere else the sorted kernel is faster.
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


def _moe_rewrite_hopper(device):
    """Whether `device` is an sm90 GPU (H100, H200): SonicMoE's kernels, and torch._grouped_mm's tile choice
    (_moe_rewrite_padding). Asked once per device and kept for the process (it is asked every step)."""
    if device not in _moe_rewrite_hopper_cache:
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
        _moe_rewrite_hopper_cache[device] = hopper
    return _moe_rewrite_hopper_cache[device]


def _moe_rewrite_triton(device, dtype):
    """The Triton kernels of the memory-bound steps (the triton_*.py sections) for rows on `device` in `dtype`, or
    None, and the same arithmetic runs as torch ops: off CUDA, in float64 (the kernels compute in float32), without
    triton, with MOE_REWRITE_TRITON=0, or under torch.compile (which fuses those steps itself). Built on first use and
    kept for the process."""
    if device.type != "cuda" or dtype == torch.float64 or torch.compiler.is_compiling():
        return None
    if "kernels" not in _moe_rewrite_triton_cache:
        wanted = _moe_rewrite_setting("MOE_REWRITE_TRITON", "1") != "0"
        _moe_rewrite_triton_cache["kernels"] = _moe_rewrite_build_triton() if wanted else None
    return _moe_rewrite_triton_cache["kernels"]


def _moe_rewrite_build_triton():
    """Every Triton kernel, {name: jitted function}, or None where triton is not installed. Called once per process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return {
        **_moe_rewrite_route_kernels(),
        **_moe_rewrite_gather_kernels(),
        **_moe_rewrite_swiglu_kernels(),
        **_moe_rewrite_sum_rows_kernels(),
        **_moe_rewrite_gemm_kernels(),
    }


def _moe_rewrite_gemm_by_triton(device, rows, experts, n, k):
    """Whether the Triton grouped GEMM (triton_gemm.py) runs a forward or input-gradient product of `rows` rows
    over `experts` experts, n wide and k deep, instead of torch._grouped_mm, where the kernel is "torch" (bf16) and
    the Triton kernels run: on sm90 at no more than 160 rows per expert on average, where torch's CUTLASS tiles read
    an expert's weights once per row tile (bench/NOTES.md, change 26: 1.07-1.36x at V3's widths and 64-160 rows per
    expert, 0.87-1.01x at 256 and 768), for products at least one tile wide and a depth of whole tiles (not the
    adapters' rank-r ones).
    MOE_REWRITE_TRITON_GEMM=0 keeps torch's."""
    if rows > 160 * experts or not _moe_rewrite_gemm_fits(n, k) or not _moe_rewrite_hopper(device):
        return False
    return _moe_rewrite_setting("MOE_REWRITE_TRITON_GEMM", "1") != "0"


MOE_REWRITE_LARGE_TILE_ROWS = 129


class _MoeRewriteRoute:
    """The route of _moe_rewrite_route: `order` sorts the (token, slot) rows by expert, the i-th sorted row is token
    `tokens[i]` (padding rows after the sorted ones: token 0), and row j is at `positions[j]` in expert order (the
    inverse of `order`, which the Triton kernels read; None where nothing reads it). Autograd nodes save the tensors
    with ctx.save_for_backward and rebuild the route in backward."""

    __slots__ = ("order", "tokens", "positions")

    def __init__(self, order, tokens, positions):
        self.order, self.tokens, self.positions = order, tokens, positions


def _moe_rewrite_route(topk_ids, num_experts, with_positions, kernels=None, padding=0):
    """How the (token, slot) rows go to the experts, on the device (no host sync): (offsets, route), offsets the
    cumulative row counts per expert (int32) and route a _MoeRewriteRoute: `order` sorts the rows by expert (stable:
    each expert's rows stay in token order, whatever the sort's tie-breaking), positions are computed
    `with_positions`. `padding` more tokens (token 0, rows in no expert's group: _moe_rewrite_padding) follow the
    sorted rows' ones. With `kernels` (the Triton kernels) the same tensors, positions and padding included, come from
    one launch instead of about ten: the host's time before the first GEMM (bench/NOTES.md, changes 24 and 26)."""
    if kernels is not None:
        offsets, order, tokens, positions = _moe_rewrite_route_rows(kernels, topk_ids, num_experts, padding)
        return offsets, _MoeRewriteRoute(order, tokens, positions)
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
    return offsets, _MoeRewriteRoute(order, tokens, positions)


def _moe_rewrite_padding(rows, num_experts):
    """How many padding rows (token 0, in no expert's group) after the last sorted one make torch._grouped_mm take
    its large tile for `rows` routed rows: MOE_REWRITE_LARGE_TILE_ROWS per expert (SonicMoE's tuned choice at V3's
    sizes, whose routing at 4096 tokens has exactly 128 rows per expert on average). Rows past the last offset are
    never read or written by the GEMMs, and the un-sort and token sums read rows by position, so the padding changes
    no number (LoRA dropout draws its masks over the padding rows too: other draws, the same distribution). Only where
    it adds at most an eighth of the rows, else 0 (bench/NOTES.md, change 22)."""
    pad = MOE_REWRITE_LARGE_TILE_ROWS * num_experts - rows
    return pad if 0 < pad <= rows // 8 else 0


def _moe_rewrite_positions(order):
    """Where each (token, slot) row is in expert order: the inverse of the permutation `order`."""
    return torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))


def _moe_rewrite_gather(kernels, x, route, dtype, topk_weight=None, count=None):
    """x[route.tokens] in `dtype`: the rows in expert order, padding rows included (or the first `count` of them),
    through the Triton kernels where they run (each token's row read once, written to its top_k places), else torch's
    index_select. With topk_weight: (rows, each row's routing weight), the weights in the same pass."""
    if kernels is not None and route.positions is not None:
        count = route.tokens.numel() if count is None else count
        return _moe_rewrite_gather_rows(kernels, x, route.positions, count, dtype, topk_weight)
    tokens = route.tokens if count is None else route.tokens[:count]
    rows = x.index_select(0, tokens).to(dtype)
    return rows if topk_weight is None else (rows, _moe_rewrite_row_weights(topk_weight, route.order, tokens))


def _moe_rewrite_row_weights(topk_weight, order, tokens):
    """Each sorted row's routing weight, in the weights' own precision; zero for padding rows (_moe_rewrite_padding:
    a weight for the kernels to read, whose products reach no expert and no token)."""
    row_weight = topk_weight.reshape(-1)[order]
    if tokens.numel() > order.numel():
        row_weight = torch.cat([row_weight, row_weight.new_zeros(tokens.numel() - order.numel())])
    return row_weight


def _moe_rewrite_token_sums(kernels, grad_rows, route, top_k, dtype):
    """Each token's top_k row gradients (rows in expert order) summed in `dtype` (accumulated in float32 for bf16 and
    fp16): un-sorted by a permutation and summed (no atomics, deterministic), in one pass with `kernels` (the Triton
    kernels, or None)."""
    if kernels is not None:
        return _moe_rewrite_sum_rows(kernels, grad_rows, route.positions, top_k, dtype=dtype)
    return _moe_rewrite_unsort(grad_rows, route.order, dtype).view(-1, top_k, grad_rows.shape[-1]).sum(dim=1)


def _moe_rewrite_unsort(rows, order, dtype=None):
    """Rows in expert order back to (token, slot) order, in `dtype` (rows' by default): a permutation, so no atomics
    and a deterministic result; padding rows past the real ones (_moe_rewrite_padding) are dropped."""
    rows = rows[: order.numel()]
    return torch.empty_like(rows, dtype=dtype).index_copy_(0, order, rows.to(dtype or rows.dtype))


def _moe_rewrite_combine(y, topk_weight):
    """Weighted sum over each token's top-k expert outputs, in the promoted dtype (float32 for fp32 router weights).

    The multiply promotes y itself (bf16 -> fp32 is exact), so this is moe_infer's cast-then-multiply without a copy.
    """
    dtype = torch.promote_types(y.dtype, topk_weight.dtype)
    return (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1).to(dtype)).sum(dim=1)


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


class _MoeRewriteExpertMLP:
    """What the core reads of the routed experts (moe_rewrite_expert_weights()): `gate_up` and `down`, two weight
    sources (gate and up concatenated along the output dim, so one GEMM runs both), the activation `act_fn`, and
    `adapters`, the LoRA adapters: {name: (lora, ...)} on gate_up_proj and down_proj as a whole (parameter_lora.py)
    or on the gate_proj, up_proj and down_proj of every expert (expert_linears.py), each lora
    (A, B, scaling, dropout) with A and B weight sources."""

    __slots__ = ("gate_up", "down", "act_fn", "adapters")

    def __init__(self, gate_up, down, act_fn, adapters):
        self.gate_up, self.down, self.act_fn, self.adapters = gate_up, down, act_fn, adapters


def _moe_rewrite_kept(stacked, keep_stacked, tensors):
    """What an autograd node keeps of a stacked weight for backward: the weight when asked to (keep_stacked) or when it
    is one of the source's own tensors, which costs nothing to keep (autograd saves nn.Linear's weight the same way);
    else None, and backward rebuilds it."""
    return stacked if keep_stacked or any(stacked is t for t in tensors) else None


class _MoeRewriteGatherPlan:
    """How the first GEMM gathers its rows from x: along `route` (a _MoeRewriteRoute), each token's row `top_k`
    times, in `dtype` (the compute dtype), through `kernels` (the Triton kernels for x's dtype, or None)."""

    __slots__ = ("route", "top_k", "dtype", "kernels")

    def __init__(self, route, top_k, dtype, kernels):
        self.route, self.top_k, self.dtype, self.kernels = route, top_k, dtype, kernels


class _MoeRewriteGroupedLinear(torch.autograd.Function):
    """Rows sorted by expert times their expert's weight, for every expert in one grouped GEMM.

    `source` is a weight source (see the top of this section) and `tensors` its `source.tensors`, the inputs autograd
    connects this node to. With keep_stacked False, a stacked weight that is not one of those tensors is rebuilt in
    backward instead of being kept alive between forward and backward (lower peak memory). `gather` is None when x
    holds the rows, or a _MoeRewriteGatherPlan for the first GEMM: the rows are x[route.tokens] in its dtype,
    gathered here and again in backward for the weight gradient, so that x (which the router keeps anyway) is kept
    instead of them (TK x hidden), and x's gradient sums each token's row gradients.
    """

    @staticmethod
    def forward(ctx, x, offsets, kernel, keep_stacked, gather, source, *tensors):
        if gather is None:
            route, ctx.top_k, ctx.dtype, ctx.kernels = None, 1, x.dtype, None
        else:
            route, ctx.top_k, ctx.dtype, ctx.kernels = gather.route, gather.top_k, gather.dtype, gather.kernels
        stacked = source.stacked(ctx.dtype)
        ctx.kernel, ctx.source = kernel, source
        # the real and padded row counts when x's rows are gathered; backward through the Triton kernels reads only
        # the positions of the route, so order and tokens are not kept then (the step's peak is in this backward)
        ctx.rows = None if route is None else (route.order.numel(), route.tokens.numel())
        if route is None:
            kept = (None, None, None)
        elif ctx.kernels is not None and route.positions is not None:
            kept = (None, None, route.positions)
        else:
            kept = (route.order, route.tokens, route.positions)
        ctx.save_for_backward(x, offsets, _moe_rewrite_kept(stacked, keep_stacked, tensors), *kept)
        return _moe_rewrite_gmm(kernel, _moe_rewrite_rows(ctx, x, route), stacked, offsets, "fwd")

    @staticmethod
    def backward(ctx, grad):
        x, offsets, stacked, order, tokens, positions = ctx.saved_tensors
        route = _MoeRewriteRoute(order, tokens, positions)
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
    """The grouped linear's input rows: x itself, or the rows x[route.tokens] in the compute dtype (ctx.rows their
    real and padded counts), with the Triton kernels in one pass that reads each token's row once; without the
    padding rows unless `padded`."""
    if ctx.rows is None:
        return x
    return _moe_rewrite_gather(ctx.kernels, x, route, ctx.dtype, count=ctx.rows[1] if padded else ctx.rows[0])


def _moe_rewrite_linear(x, offsets, kernel, keep_stacked, source, gather=None):
    return _MoeRewriteGroupedLinear.apply(x, offsets, kernel, keep_stacked, gather, source, *source.tensors)


class _MoeRewriteGather(torch.autograd.Function):
    """rows[i] = x[route.tokens[i]]: each token once per selected expert, sorted by expert (for adapters on gate_up,
    which read the rows too; without them the first grouped linear gathers them itself).

    Backward sums each token's top_k row gradients (_moe_rewrite_token_sums).
    """

    @staticmethod
    def forward(ctx, x, route, top_k, kernels):
        ctx.save_for_backward(route.order, route.tokens, route.positions)
        ctx.top_k, ctx.kernels = top_k, kernels
        return _moe_rewrite_gather(kernels, x, route, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        route = _MoeRewriteRoute(*ctx.saved_tensors)
        return _moe_rewrite_token_sums(ctx.kernels, grad, route, ctx.top_k, grad.dtype), None, None, None


def _moe_rewrite_is_silu(act_fn):
    """Whether the experts' activation is SiLU (ACT2FN["silu"]: torch's nn.SiLU, or transformers' SiLUActivation)."""
    kind = type(act_fn)
    transformers_silu = kind.__name__ == "SiLUActivation" and kind.__module__ == "transformers.activations"
    return kind is torch.nn.SiLU or transformers_silu


class _MoeRewriteExpertOutput(torch.autograd.Function):
    """The experts' weighted outputs from their gate/up projections: act_fn(gate) * up through the down projection,
    back to token order, weighted by the routing weights and summed per token, keeping only gate_up for backward.

    Backward recomputes act_fn(gate) * up, runs the down projection's input-gradient GEMM on the unweighted row
    gradients, and takes each routing weight's gradient as that GEMM's output dotted with the recomputed row
    (<dy, h W^T> = <dy W, h>), so neither the activation, the product nor the expert outputs are kept: about
    TK * (2 * intermediate + hidden) elements less per layer than autograd over the composed ops.
    `gate_up` holds each row's gate then up projection in expert order (`route`: a _MoeRewriteRoute); the result
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
        kept = _moe_rewrite_kept(stacked, keep_stacked, tensors)
        ctx.save_for_backward(gate_up, topk_weight, route.order, route.tokens, route.positions, offsets, kept)
        dtype = out_dtype or torch.promote_types(out.dtype, topk_weight.dtype)
        if kernels is not None:
            return _moe_rewrite_sum_rows(kernels, out, route.positions, topk_weight.shape[1], topk_weight, dtype)
        return _moe_rewrite_combine(_moe_rewrite_unsort(out, route.order), topk_weight).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        gate_up, topk_weight, order, tokens, positions, offsets, stacked = ctx.saved_tensors
        kernel, act_fn, kernels = ctx.kernel, ctx.act_fn, ctx.kernels
        # each row's token gradient, and its routing weight (in the weights' own precision), in expert order
        route = _MoeRewriteRoute(order, tokens, positions)
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
        ctx.save_for_backward(rows if ctx.needs_input_grad[1] else None, topk_weight, route.order, route.tokens)
        ctx.kernels, ctx.dtype = kernels, rows.dtype
        dtype = out_dtype or torch.promote_types(rows.dtype, topk_weight.dtype)
        return _moe_rewrite_sum_rows(kernels, rows, route.positions, topk_weight.shape[1], topk_weight, dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, topk_weight, order, tokens = ctx.saved_tensors
        row_weight = _moe_rewrite_row_weights(topk_weight, order, tokens)
        grad_rows, per_row = _moe_rewrite_sum_rows_backward(ctx.kernels, grad, rows, tokens, row_weight, ctx.dtype)
        return grad_rows, _moe_rewrite_row_weight_grad(ctx, per_row, order, topk_weight), None, None, None


def _moe_rewrite_row_weight_grad(ctx, per_row, order, topk_weight):
    """The routing weights' gradient from each row's <dy W, h> in expert order (float32), or None when not needed."""
    if not ctx.needs_input_grad[1]:
        return None
    return _moe_rewrite_unsort(per_row, order).view(topk_weight.shape).to(topk_weight.dtype)


def _moe_rewrite_sonicmoe_experts(x, topk_ids, topk_weight, weights, dtype):
    """The routed experts' weighted outputs through SonicMoE (kernel "sonicmoe"), or None when it cannot run them as
    the grouped GEMMs would: adapters, an activation other than SiLU, experts that are not fused parameters, sizes
    whose rows are not 16-byte aligned, or under torch.compile.

    SonicMoE gathers the rows inside its up-projection GEMM, applies SwiGLU in that GEMM's epilogue and scatters the
    weighted rows out of the down projection, with its own backward (gradients for x, both weights and the routing
    weights). It reads the fused parameters as they are: (E, 2I, H) as (2I, H, E), its layout, with concat_layout for
    the [gate; up] rows. Its first call per token count autotunes and compiles its kernels (minutes on an H200).
    """
    gate_up_w, down_w = weights.gate_up, weights.down
    experts, double, hidden = gate_up_w.shape
    if (
        any(weights.adapters.values())
        or not _moe_rewrite_is_silu(weights.act_fn)
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


def _moe_rewrite_loop(experts, x, topk_ids, topk_weight):
    """The naive per-expert loop (the published V2 training path): backend "loop", and experts whose weights the core
    cannot read (quantized projections, adapters it cannot reproduce, DeepSpeed ZeRO-3 partitions)."""
    flat_ids = topk_ids.view(-1)
    x = x.repeat_interleave(topk_ids.shape[1], dim=0)
    y = torch.empty_like(x)
    for i, expert in enumerate(experts):
        y[flat_ids == i] = expert(x[flat_ids == i])
    return _moe_rewrite_combine(y, topk_weight)


def _moe_rewrite_grouped_experts(x, topk_ids, topk_weight, weights, num_experts, kernel, dtype, out_dtype):
    """The routed experts' weighted outputs for tokens x, `weights` a _MoeRewriteExpertMLP (the weight sources, the
    activation and the LoRA adapters), through the grouped GEMMs on `kernel`, or through SonicMoE where it is chosen
    and can run them."""
    if kernel == "sonicmoe":
        out = _moe_rewrite_sonicmoe_experts(x, topk_ids, topk_weight, weights, dtype)
        if out is not None:
            return out.to(out_dtype or out.dtype)
        kernel = "torch"
    gate_up_w, down_w, act_fn, adapters = weights.gate_up, weights.down, weights.act_fn, weights.adapters
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
        gather = _MoeRewriteGatherPlan(route, top_k, dtype, x_kernels)
        gate_up = _moe_rewrite_linear(x, offsets, kernel, keep, gate_up_w, gather=gather)
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
    out = _moe_rewrite_combine(_moe_rewrite_unsort(out, route.order), topk_weight)
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


MOE_REWRITE_TRITON_BLOCK = 1024  # columns per program (pass): the rows are memory-bound, one block keeps it simple


def _moe_rewrite_blocks(columns):
    """How many column blocks cover `columns` columns."""
    return -(-columns // MOE_REWRITE_TRITON_BLOCK)


MOE_REWRITE_ROUTE_BLOCK = 4096  # routed rows per pass of the route kernel


def _moe_rewrite_route_kernels():
    """{"route": the jitted kernel}. triton must be installed (dispatch.py's _moe_rewrite_build_triton asks)."""
    import triton
    import triton.language as tl

    @triton.jit
    def route(ids, order, tokens, positions, offsets, rows, top_k, padding, BLOCK: tl.constexpr):
        """Program e places the rows routed to expert e (row j: token j // top_k, slot j % top_k, expert ids[j])
        after every row of a lower expert, in row order (a stable sort by expert): at each of its places i,
        order[i] = j and tokens[i] = j // top_k, and positions[j] = i; offsets[e] = the rows of experts <= e. Each
        program reads all the ids twice (they are few: no atomics, no sort, one launch). The `padding` entries of
        tokens after the rows' get token 0, a share of them from each program."""
        expert = tl.program_id(0)
        for start in range(expert * BLOCK, padding, tl.num_programs(0) * BLOCK):
            pad = start + tl.arange(0, BLOCK)
            tl.store(tokens + rows + pad, tl.zeros([BLOCK], dtype=tl.int64), mask=pad < padding)
        lower = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, rows, BLOCK):
            j = start + tl.arange(0, BLOCK)
            ids_j = tl.load(ids + j, mask=j < rows, other=expert)  # masked-off: counted as neither lower nor hit
            lower += (ids_j < expert).to(tl.int32)
        place = tl.sum(lower, axis=0)
        for start in range(0, rows, BLOCK):
            j = start + tl.arange(0, BLOCK)
            hit = tl.load(ids + j, mask=j < rows, other=-1) == expert
            at = place + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(order + at, j.to(tl.int64), mask=hit)
            tl.store(tokens + at, (j // top_k).to(tl.int64), mask=hit)
            tl.store(positions + j, at.to(tl.int64), mask=hit)
            place += tl.sum(hit.to(tl.int32), axis=0)
        tl.store(offsets + expert, place)

    return {"route": route}


def _moe_rewrite_route_rows(kernels, topk_ids, num_experts, padding=0):
    """(offsets, order, tokens, positions) for the routing topk_ids (tokens, top_k), as route.py's _moe_rewrite_route
    computes them with torch ops (a stable sort by expert and its inverse), `padding` zeros after the tokens included,
    in one launch: the host issues one kernel before the first GEMM instead of about ten."""
    ids = topk_ids.reshape(-1).contiguous()
    rows = ids.numel()
    order, positions = (torch.empty(rows, device=ids.device, dtype=torch.int64) for _ in range(2))
    tokens = torch.empty(rows + padding, device=ids.device, dtype=torch.int64)
    offsets = torch.empty(num_experts, device=ids.device, dtype=torch.int32)
    kernels["route"][(num_experts,)](
        ids, order, tokens, positions, offsets, rows, topk_ids.shape[1], padding, BLOCK=MOE_REWRITE_ROUTE_BLOCK
    )
    return offsets, order, tokens, positions


def _moe_rewrite_gather_kernels():
    """{"gather_rows": the jitted kernel}. triton must be installed (dispatch.py's _moe_rewrite_build_triton asks)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows(
        x,
        positions,
        out,
        weight,
        row_weight,
        tokens,
        top_k,
        real_rows,
        hidden,
        WEIGHTS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """out[positions[t * top_k + k]] = x[t] for token t < tokens and each slot k: each token's row read once and
        written to its top_k places (in token order, not row by row: x's rows are not read top_k times over), and,
        WEIGHTS, row_weight[positions[t * top_k + k]] = weight[t * top_k + k]. A program t >= tokens writes padding
        row real_rows + t - tokens with token 0's row (and a zero weight)."""
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        first = tl.program_id(1) == 0  # the column block that writes the weights
        if token < tokens:
            value = tl.load(x + token * hidden + cols, mask=mask).to(out.dtype.element_ty)
            for k in range(top_k):
                row = tl.load(positions + token * top_k + k).to(tl.int64)
                tl.store(out + row * hidden + cols, value, mask=mask)
                if WEIGHTS and first:
                    tl.store(row_weight + row, tl.load(weight + token * top_k + k))
        else:
            row = real_rows + token - tokens
            tl.store(out + row * hidden + cols, tl.load(x + cols, mask=mask).to(out.dtype.element_ty), mask=mask)
            if WEIGHTS and first:
                tl.store(row_weight + row, tl.zeros([], dtype=row_weight.dtype.element_ty))

    return {"gather_rows": gather_rows}


def _moe_rewrite_gather_rows(kernels, x, positions, rows, dtype, topk_weight=None):
    """The (rows, hidden) rows x[tokens] in expert order, in `dtype`, for the route whose inverse permutation is
    `positions` (token t's slot k at positions[t * top_k + k]); rows past the real ones (padding,
    _moe_rewrite_padding) get token 0's row, as x.index_select(0, tokens).to(dtype) gives for the padded tokens.
    With topk_weight (tokens, top_k): (rows, row_weight), each row's routing weight in the same pass (zero for
    padding rows), as route.py's _moe_rewrite_row_weights gives them."""
    x = x.contiguous()
    tokens, hidden = x.shape
    out = x.new_empty(rows, hidden, dtype=dtype)
    weight = None if topk_weight is None else topk_weight.reshape(-1).contiguous()
    row_weight = None if weight is None else weight.new_empty(rows)
    if rows:
        real = positions.numel()
        grid = (tokens + rows - real, _moe_rewrite_blocks(hidden))
        kernels["gather_rows"][grid](
            x,
            positions,
            out,
            out if weight is None else weight,
            out if weight is None else row_weight,
            tokens,
            real // tokens,
            real,
            hidden,
            WEIGHTS=weight is not None,
            BLOCK=MOE_REWRITE_TRITON_BLOCK,
        )
    return out if weight is None else (out, row_weight)


def _moe_rewrite_swiglu_kernels():
    """{"swiglu", "swiglu_backward": the jitted kernels}. triton must be installed (dispatch.py's
    _moe_rewrite_build_triton asks)."""
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu(gate_up, out, inter, BLOCK: tl.constexpr):
        """out[row] = silu(gate) * up, for a row of gate_up holding [gate; up] (inter columns each)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gate_up + row * 2 * inter + cols, mask=mask).to(tl.float32)
        up = tl.load(gate_up + row * 2 * inter + inter + cols, mask=mask).to(tl.float32)
        tl.store(out + row * inter + cols, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_backward(
        gate_up, grad_h, row_weight, grad_gate_up, per_row, inter, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr
    ):
        """For one row, from its [gate; up], the gradient grad_h of h = silu(gate) * up (before the routing weight w)
        and w: the gradients of gate and up (of w * h), per_row = <grad_h, h> (w's gradient), and, WEIGHTED, w * h
        written over grad_h (the down projection's weight gradient input). One program a row: no atomics."""
        row = tl.program_id(0).to(tl.int64)
        weight = tl.load(row_weight + row).to(tl.float32)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, inter, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < inter
            # masked-off columns load zeros: they enter the dot product
            gate = tl.load(gate_up + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gate_up + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.load(grad_h + row * inter + cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            act = gate * sig
            dot += grad * act * up
            grad = grad * weight
            grad_gate = grad * up * sig * (1 + gate * (1 - sig))  # d silu(g) / dg = sig * (1 + g * (1 - sig))
            tl.store(grad_gate_up + row * 2 * inter + cols, grad_gate.to(grad_gate_up.dtype.element_ty), mask=mask)
            tl.store(
                grad_gate_up + row * 2 * inter + inter + cols, (grad * act).to(grad_gate_up.dtype.element_ty), mask=mask
            )
            if WEIGHTED:
                tl.store(grad_h + row * inter + cols, (act * up * weight).to(grad_h.dtype.element_ty), mask=mask)
        tl.store(per_row + row, tl.sum(dot, axis=0))

    return {"swiglu": swiglu, "swiglu_backward": swiglu_backward}


def _moe_rewrite_swiglu(kernels, gate_up):
    """silu(gate) * up for rows of gate_up = [gate; up] (rows, 2 * inter) -> (rows, inter)."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    if rows:
        grid = (rows, _moe_rewrite_blocks(inter))
        kernels["swiglu"][grid](gate_up, out, inter, BLOCK=MOE_REWRITE_TRITON_BLOCK)
    return out


def _moe_rewrite_swiglu_backward(kernels, gate_up, grad_h, row_weight, weighted):
    """(grad_gate_up, per_row) for rows of gate_up = [gate; up], the gradient grad_h of silu(gate) * up before each
    row's routing weight, and the weights (rows,): the gradient of row_weight * silu(gate) * up with respect to
    gate_up, and per_row = <grad_h, silu(gate) * up> in float32. With `weighted`, grad_h (contiguous, not needed
    afterwards) is overwritten with row_weight * silu(gate) * up."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    grad_gate_up = torch.empty_like(gate_up)
    per_row = torch.empty(rows, device=gate_up.device, dtype=torch.float32)
    if rows:
        kernels["swiglu_backward"][(rows,)](
            gate_up,
            grad_h,
            row_weight.contiguous(),
            grad_gate_up,
            per_row,
            inter,
            WEIGHTED=weighted,
            BLOCK=MOE_REWRITE_TRITON_BLOCK,
        )
    return grad_gate_up, per_row


def _moe_rewrite_sum_rows_kernels():
    """{"sum_rows", "sum_rows_backward": the jitted kernels}. triton must be installed (dispatch.py's
    _moe_rewrite_build_triton asks)."""
    import triton
    import triton.language as tl

    @triton.jit
    def sum_rows(rows, position, weight, out, top_k, hidden, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
        """out[t] = sum over k of rows[position[t * top_k + k]] (times weight[t, k] when WEIGHTED), k in order."""
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(top_k):
            row = tl.load(position + token * top_k + k).to(tl.int64)
            value = tl.load(rows + row * hidden + cols, mask=mask).to(tl.float32)
            if WEIGHTED:
                value = value * tl.load(weight + token * top_k + k).to(tl.float32)
            total += value
        tl.store(out + token * hidden + cols, total.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def sum_rows_backward(
        grad, rows, tokens, row_weight, grad_rows, per_row, hidden, DOT: tl.constexpr, BLOCK: tl.constexpr
    ):
        """For the i-th row in expert order, of token tokens[i] with routing weight w: grad_rows[i] = w * grad[token]
        and, with DOT, per_row[i] = <grad[token], rows[i]> (w's gradient). One program a row: no atomics."""
        row = tl.program_id(0).to(tl.int64)
        token = tl.load(tokens + row).to(tl.int64)
        weight = tl.load(row_weight + row).to(tl.float32)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < hidden
            token_grad = tl.load(grad + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            if DOT:
                dot += token_grad * tl.load(rows + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_rows + row * hidden + cols, (token_grad * weight).to(grad_rows.dtype.element_ty), mask=mask)
        if DOT:
            tl.store(per_row + row, tl.sum(dot, axis=0))

    return {"sum_rows": sum_rows, "sum_rows_backward": sum_rows_backward}


def _moe_rewrite_sum_rows(kernels, rows, position, top_k, weight=None, dtype=None):
    """(tokens, hidden) from rows in expert order: token t's rows position[t * top_k : (t + 1) * top_k], summed in
    float32 (each times weight[t, k] when weight is given) and written in `dtype` (rows' dtype by default)."""
    rows = rows.contiguous()
    tokens, hidden = position.shape[0] // top_k, rows.shape[1]
    out = rows.new_empty(tokens, hidden, dtype=dtype or rows.dtype)
    if tokens:
        grid = (tokens, _moe_rewrite_blocks(hidden))
        kernels["sum_rows"][grid](
            rows,
            position,
            rows if weight is None else weight.contiguous(),
            out,
            top_k,
            hidden,
            WEIGHTED=weight is not None,
            BLOCK=MOE_REWRITE_TRITON_BLOCK,
        )
    return out


def _moe_rewrite_sum_rows_backward(kernels, grad, rows, tokens, row_weight, dtype):
    """The backward of the weighted sum over each token's rows (_moe_rewrite_sum_rows with weights) for rows in expert
    order, the i-th of token tokens[i] with weight row_weight[i]: (grad_rows, per_row), grad_rows[i] =
    row_weight[i] * grad[tokens[i]] in `dtype`, and per_row[i] = <grad[tokens[i]], rows[i]> in float32 (None when rows
    is None: the weights need no gradient)."""
    grad = grad.contiguous()
    grad_rows = grad.new_empty(tokens.shape[0], grad.shape[1], dtype=dtype)
    per_row = None if rows is None else torch.empty(tokens.shape[0], device=grad.device, dtype=torch.float32)
    if tokens.shape[0]:
        kernels["sum_rows_backward"][(tokens.shape[0],)](
            grad,
            grad if rows is None else rows.contiguous(),
            tokens,
            row_weight.contiguous(),
            grad_rows,
            grad_rows if per_row is None else per_row,
            grad.shape[1],
            DOT=rows is not None,
            BLOCK=MOE_REWRITE_TRITON_BLOCK,
        )
    return grad_rows, per_row


MOE_REWRITE_GEMM_TILE = (128, 256, 64, 8, 3)


def _moe_rewrite_gemm_kernels():
    """{"grouped_mm": the jitted kernel}. triton must be installed (dispatch.py's _moe_rewrite_build_triton asks)."""
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_mm(
        a,
        b,
        out,
        offsets,
        experts,
        n,
        k,
        b_expert_stride,
        b_n_stride,
        b_k_stride,
        EXPERTS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """out[r] = a[r] @ b[e]^T for the rows r of expert e (offsets: the cumulative rows per expert), b[e] read as
        (n, k) through its strides; a (rows, k) and out (rows, n) contiguous, k a multiple of BK. Program p takes the
        p-th (BM x BN) tile in the order (expert, column strip, row tile), counted from the offsets here (no host
        work): an expert's row tiles of one weight strip run side by side and read it from HBM once (bench/NOTES.md,
        change 26). Programs past the last tile return; rows past the last offset are neither read nor written."""
        pid = tl.program_id(0)
        e_all = tl.arange(0, EXPERTS)
        ends = tl.load(offsets + e_all, mask=e_all < experts, other=0)
        starts = tl.load(offsets + e_all - 1, mask=(e_all > 0) & (e_all < experts), other=0)
        row_tiles = (ends - starts + BM - 1) // BM
        tiles = row_tiles * tl.cdiv(n, BN)
        last = tl.cumsum(tiles, 0)
        if pid < tl.sum(tiles, 0):
            e = tl.sum((last <= pid).to(tl.int32), 0)  # the first expert whose tiles end after p
            mine = e_all == e
            local = pid - tl.sum(tl.where(mine, last - tiles, 0), 0)
            its_row_tiles = tl.sum(tl.where(mine, row_tiles, 0), 0)
            rows = tl.sum(tl.where(mine, starts, 0), 0) + (local % its_row_tiles) * BM + tl.arange(0, BM)
            in_rows = rows < tl.sum(tl.where(mine, ends, 0), 0)
            cols = (local // its_row_tiles) * BN + tl.arange(0, BN)
            in_cols = cols[None, :] < n
            ks = tl.arange(0, BK)
            a_at = a + tl.where(in_rows, rows, 0).to(tl.int64)[:, None] * k + ks[None, :]
            b_at = b + e.to(tl.int64) * b_expert_stride + cols[None, :] * b_n_stride + ks[:, None] * b_k_stride
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for _ in range(0, k, BK):
                a_tile = tl.load(a_at, mask=in_rows[:, None], other=0.0)
                b_tile = tl.load(b_at, mask=in_cols, other=0.0)
                acc = tl.dot(a_tile, b_tile, acc)
                a_at += BK
                b_at += BK * b_k_stride
            at = out + rows.to(tl.int64)[:, None] * n + cols[None, :]
            tl.store(at, acc.to(out.dtype.element_ty), mask=in_rows[:, None] & in_cols)

    return {"grouped_mm": grouped_mm}


def _moe_rewrite_gemm_fits(n, k):
    """Whether the grouped GEMM's tile fits a product n wide and k deep: at least one tile wide, whole tiles deep."""
    _, bn, bk, _, _ = MOE_REWRITE_GEMM_TILE
    return n >= bn and k % bk == 0


def _moe_rewrite_grouped_mm(kernels, a, b, offsets, mode):
    """grouped_linear.py's _moe_rewrite_gmm's "fwd" (a @ b[e]^T, b (E, n, k)) or "dgrad" (a @ b[e], b (E, k, n)) product
    for rows `a` sorted by expert, `offsets` their cumulative counts per expert (int32): the same rows as
    torch._grouped_mm gives, those past the last offset left unwritten as there."""
    bm, bn, bk, warps, stages = MOE_REWRITE_GEMM_TILE
    a = a.contiguous()
    experts = b.shape[0]
    if mode == "fwd":
        n, b_n_stride, b_k_stride = b.shape[1], b.stride(1), b.stride(2)
    else:
        n, b_n_stride, b_k_stride = b.shape[2], b.stride(2), b.stride(1)
    out = a.new_empty(a.shape[0], n)
    tiles = (-(-a.shape[0] // bm) + experts) * -(-n // bn)  # at least every expert's tiles
    if a.shape[0] and tiles:
        kernels["grouped_mm"][(tiles,)](
            a,
            b,
            out,
            offsets,
            experts,
            n,
            a.shape[1],
            b.stride(0),
            b_n_stride,
            b_k_stride,
            EXPERTS=1 << max(experts - 1, 0).bit_length(),
            BM=bm,
            BN=bn,
            BK=bk,
            num_warps=warps,
            num_stages=stages,
        )
    return out


MOE_REWRITE_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _moe_rewrite_linear_weights(experts, adapted=False):
    """The per-expert layers' gate, up and down weights as three lists; None when an expert must be called as a module:
    projections that are not plain nn.Linear layers (quantized layers; LoRA adapters unless `adapted`, when the
    adapted layers' base weights count), or weights that are not there in full (DeepSpeed ZeRO-3 gathers them in the
    module's own forward hook).
    """
    # nn.Module's own dicts (_modules, _parameters), not getattr: nn.Module.__getattr__ costs about a microsecond per
    # lookup, 6 * E lookups per layer and step. FSDP without use_orig_params sets the weight as a plain attribute.
    modules = _moe_rewrite_projections(experts)
    if adapted:  # PEFT's LoRA layers hold the original layer as base_layer
        modules = [[m._modules.get("base_layer", m) if m is not None else None for m in part] for part in modules]
    if any(type(m) is not torch.nn.Linear for part in modules for m in part):
        return None
    weights = tuple(
        [m._parameters["weight"] if "weight" in m._parameters else m.weight for m in part] for part in modules
    )
    first, last = modules[0][0], modules[2][-1]
    if weights[0][0].shape != (first.out_features, first.in_features):
        return None
    if weights[2][-1].shape != (last.out_features, last.in_features):
        return None
    return weights


class _MoeRewriteExpertLinears:
    """The weight source of E experts' nn.Linear weights for one projection, or `parts` of them concatenated along the
    output dim (gate and up: parts=2); `weights` lists part 0 of every expert, then part 1.

    stacked(dtype) is one (E, parts * out, in) tensor: a view when the weights already lie at a fixed stride in one
    buffer (an FSDP flat parameter) in that dtype, else a copy. With direct gradients (see
    _moe_rewrite_direct_grads) autograd connects one weight only and grads() writes every expert's .grad itself.
    """

    def __init__(self, weights, parts):
        self.weights, self.parts = tuple(weights), parts
        rows, cols = self.weights[0].shape
        self.shape = (len(self.weights) // parts, parts * rows, cols)
        self.direct = _moe_rewrite_direct_grads(self.weights)
        trainable = [w for w in self.weights if w.requires_grad]
        self.tensors = tuple(trainable[:1] if self.direct else self.weights)

    def stacked(self, dtype):
        weights, parts = self.weights, self.parts
        experts = len(weights) // parts
        first = weights[0]
        rows, cols = first.shape
        base = first.storage_offset()
        stride = weights[1].storage_offset() - base if experts > 1 else 0
        if (
            stride >= parts * rows * cols
            and (stride * first.element_size()) % 16 == 0
            and all(
                w.is_contiguous()
                and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and w.storage_offset() == base + (i % experts) * stride + (i // experts) * rows * cols
                for i, w in enumerate(weights)
            )
        ):
            return first.as_strided((experts, parts * rows, cols), (stride, cols, 1), base).to(dtype)
        # Interleaved as (expert, part), one stack lays them out exactly as (E, parts * out, in).
        interleaved = [weights[p * experts + e] for e in range(experts) for p in range(parts)]
        return torch.stack(interleaved).view(experts, parts * rows, cols).to(dtype)

    def grads(self, compute):
        if self.direct:
            # Only when this backward accumulates into parameters (not autograd.grad, not backward(inputs=...)).
            # torch._C._will_engine_execute_node is private; torch has no public way to ask
            # (tests/test_private_apis.py checks the behaviour relied on).
            node = torch.autograd.graph.get_gradient_edge(self.tensors[0]).node
            if torch._C._will_engine_execute_node(node):
                _moe_rewrite_accumulate(self.weights, self.per_weight(compute()))
            return (None,) * len(self.tensors)
        return tuple(self.per_weight(compute()))

    def per_weight(self, grad_w):
        """Each weight's gradient, in the weights' own dtype (fp32 weights under autocast get fp32 gradients)."""
        grad_w = grad_w.to(self.weights[0].dtype)
        per_part = grad_w.view(len(self.weights) // self.parts, self.parts, -1, grad_w.shape[-1]).unbind(1)
        return [g for part in per_part for g in part.unbind(0)]


def _moe_rewrite_direct_grads(weights):
    """Whether backward may write the experts' weight gradients itself rather than hand them to autograd.

    Each autograd leaf costs several microseconds of host time per step (one engine node per expert weight: 384 for
    128 experts, about 2.5 ms on an H200 host, more than the layer's GPU time; see moe-rewrite's bench/NOTES.md).
    Only for plain leaf tensors without hooks and outside torch.distributed, whose wrappers (DDP, FSDP, DeepSpeed)
    hook gradient accumulation. Tensor hooks are read from the tensors' own `_backward_hooks` and
    `_post_accumulate_grad_hooks` (private; torch has no public query). torch.autograd.grad asking for an expert weight
    needs MOE_REWRITE_DIRECT_GRADS=0. As with any .grad, gradients accumulate.
    """
    if _moe_rewrite_setting("MOE_REWRITE_DIRECT_GRADS", "1") == "0":
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    return all(
        w.is_leaf and not w._backward_hooks and getattr(w, "_post_accumulate_grad_hooks", None) is None for w in weights
    )


def _moe_rewrite_accumulate(weights, grads):
    """w.grad = g, or w.grad += g (one multi-tensor add, torch._foreach_add_ as torch's optimizers use it) where a
    gradient is already there."""
    existing, added = [], []
    for w, g in zip(weights, grads):
        if not w.requires_grad:
            continue
        if w.grad is None:
            w.grad = g
        else:
            existing.append(w.grad)
            added.append(g)
    if existing:
        torch._foreach_add_(existing, added)


def _moe_rewrite_lora(projections):
    """The LoRA adapters PEFT put on one projection of every expert (`projections`: E modules), as the core reads them:
    a tuple of (A, B, scaling, dropout), A and B weight sources over the experts' lora_A / lora_B weights; () when no
    adapter adds anything (no expert's projection is adapted, or the adapters are disabled or merged: PEFT's forward
    runs the base layer alone, which holds W + BA once merged). None when the grouped GEMMs cannot reproduce the
    modules' own forward, and the per-expert loop runs them: adapters other than LoRA, some experts adapted and others
    not, several active adapters, DoRA and other variants, LoRA biases, different scalings or dropouts, layers in
    different states, adapters disabled and merged at once (PEFT's forward unmerges them then).
    """
    # Submodules through nn.Module's own _modules dict (PEFT's lora_A / lora_B / lora_dropout ModuleDicts): this runs
    # for 3 * E layers per MoE layer and step, and nn.Module.__getattr__ costs about a microsecond per lookup.
    wrapped = ["base_layer" in p._modules for p in projections]
    if not any(wrapped):
        return ()
    if not all(wrapped) or not all("lora_A" in p._modules for p in projections):  # other tuners: their own forward
        return None
    first = projections[0]
    state = (first.disable_adapters, first.merged)
    if any((p.disable_adapters, p.merged) != state for p in projections) or all(state):
        return None
    if any(state):
        return ()
    adapters = list(first.active_adapters)
    if len(adapters) != 1 or adapters[0] not in first._modules["lora_A"]._modules:
        return None
    name = adapters[0]
    scaling, dropout = first.scaling[name], first._modules["lora_dropout"]._modules[name]
    rate = dropout.__dict__.get("p")  # nn.Dropout's rate; nn.Identity (no dropout) has none
    a_weights, b_weights = [], []
    for p in projections:
        modules = p._modules
        a = modules["lora_A"]._modules.get(name)
        b = modules["lora_B"]._modules.get(name)
        drop = modules["lora_dropout"]._modules.get(name)
        if a is None or list(p.active_adapters) != adapters:
            return None
        if name in p.__dict__.get("lora_variant", ()) or p.use_dora.get(name) or b._parameters.get("bias") is not None:
            return None
        if p.scaling[name] != scaling or type(drop) is not type(dropout) or drop.__dict__.get("p") != rate:
            return None
        a_weights.append(a._parameters["weight"])
        b_weights.append(b._parameters["weight"])
    return ((_MoeRewriteExpertLinears(a_weights, 1), _MoeRewriteExpertLinears(b_weights, 1), scaling, dropout),)


def _moe_rewrite_projections(experts):
    """The experts' gate, up and down projection modules: three lists of E (nn.Module's own dict, see above)."""
    return [[e._modules.get(name) for e in experts] for name in MOE_REWRITE_PROJECTIONS]


def _moe_rewrite_adapters(projections):
    """{projection name: _moe_rewrite_lora(...)} for the adapted ones of `projections` (_moe_rewrite_projections;
    {} when none is), or None when the loop must run them."""
    adapters = {}
    for name, column in zip(MOE_REWRITE_PROJECTIONS, projections):
        loras = _moe_rewrite_lora(column)
        if loras is None:
            return None
        if loras:
            adapters[name] = loras
    return adapters


def _moe_rewrite_unwrap(experts):
    """(the module under PEFT's ParamWrappers, [the wrappers, outermost first]): `experts` and [] when not wrapped.

    PEFT nests one ParamWrapper per targeted parameter, each holding the next as base_layer; a wrapper is recognised by
    its base_layer submodule and its parameter_name (read from the module's own dicts: this runs on every step)."""
    wrappers = []
    while "base_layer" in experts._modules and isinstance(experts.__dict__.get("parameter_name"), str):
        wrappers.append(experts)
        experts = experts._modules["base_layer"]
    return experts, wrappers


def _moe_rewrite_parameter_lora(wrapper):
    """One ParamWrapper's LoRA adapters as the core reads them (as expert_linears.py's _moe_rewrite_lora): a tuple of
    (A, B, scaling, dropout), A and B weight sources over
    (E, r, in) and (E, out, r) views of PEFT's lora_A (r * E, in) and lora_B (out, r * E) weights, taken from PEFT's
    own get_delta_factors (whose product, times scaling, is the delta PEFT adds to the parameter in its forward), so
    the core adds exactly that delta's contribution without forming it. () when the wrapper adds nothing (adapters
    disabled, or merged into the parameter); None when the grouped GEMMs cannot reproduce its forward (several active
    adapters, disabled adapters that are merged: PEFT unmerges them in its forward; a PEFT without get_delta_factors).
    """
    merged, disabled = wrapper.merged, wrapper.disable_adapters
    if disabled or merged:
        return None if disabled and merged else ()
    lora_a = wrapper._modules["lora_A"]._modules
    names = [name for name in wrapper.active_adapters if name in lora_a]
    if not names:
        return ()
    dropout = wrapper._modules["lora_dropout"]._modules.get(names[0])
    if len(names) != 1 or not hasattr(wrapper, "get_delta_factors") or type(dropout) is not torch.nn.Identity:
        return None
    lhs, rhs, scaling = wrapper.get_delta_factors(names[0])  # delta = scaling * lhs @ rhs: (E, out, r) @ (E, r, in)
    # torch._grouped_mm reads each expert's matrix with unit stride in one of its dims; PEFT's lora_B view has the
    # expert as its fastest dim, so it is copied (out * r * E elements, with autograd).
    return ((_MoeRewriteExpertWeight(rhs.contiguous()), _MoeRewriteExpertWeight(lhs.contiguous()), scaling, dropout),)


def _moe_rewrite_parameter_adapters(wrappers):
    """{parameter name: _moe_rewrite_parameter_lora(...)} for the adapters of `wrappers` (_moe_rewrite_unwrap's; {}
    when none adds anything), or None when the loop must run them through PEFT's forward (a parameter wrapped twice
    included)."""
    adapters = {}
    names = [wrapper.__dict__["parameter_name"] for wrapper in wrappers]
    if len(set(names)) != len(names) or not set(names) <= {"gate_up_proj", "down_proj"}:
        return None
    for name, wrapper in zip(names, wrappers):
        loras = _moe_rewrite_parameter_lora(wrapper)
        if loras is None:
            return None
        if loras:
            adapters[name] = loras
    return adapters


def _moe_rewrite_load_expert_lora(moe, state_dict, prefix, *args):
    """load_state_dict pre-hook of the MoE layer (moe_rewrite_fuse_experts registers it): LoRA weights in the standard
    per-expert format (experts.{i}.gate_proj.lora_A.{adapter}.weight, what PEFT writes for the original file) that
    arrive where PEFT wrapped the fused parameters instead become the wrappers' weights, as peft converts them for
    transformers' own models (not for remote code, whose expert adapters would silently not load): down_proj's A and
    B stacked over the experts, gate_up_proj's rank-2r adapter holding gate_proj's and up_proj's (A stacked, B
    block-diagonal). What the wrappers cannot hold is an error, never a partial load."""
    head = prefix + "experts."
    keys = [k for k in state_dict if k.startswith(head) and ".lora_" in k and k[len(head) :].split(".")[0].isdigit()]
    experts, wrappers = _moe_rewrite_unwrap(moe._modules["experts"])
    if not keys or not wrappers or "lora_A" in experts[0]._modules["down_proj"]._modules:
        return  # nothing per-expert, or the expert views hold LoRA layers of their own that take these keys
    # PEFT names the adapter in the keys it finds modules for; the others keep the file's name, without one: they
    # belong to the adapter being loaded, the one PEFT added last.
    newest = list(wrappers[0]._modules["lora_A"]._modules)[-1:] or [""]
    parts = {}  # adapter -> {(expert, projection, "lora_A" | "lora_B"): tensor}
    for key in keys:
        fields = key[len(head) :].split(".")
        if len(fields) == 4:
            fields.insert(3, newest[0])
        index, projection, lora, adapter, weight = (fields + [""] * 5)[:5]
        if weight != "weight" or lora not in ("lora_A", "lora_B") or projection not in MOE_REWRITE_PROJECTIONS:
            raise RuntimeError(f"moe-rewrite: cannot load {key} onto the fused experts PEFT wrapped")
        parts.setdefault(adapter, {})[int(index), projection, lora] = state_dict.pop(key)
    count = len(experts)
    for depth, wrapper in enumerate(wrappers):
        name, target = wrapper.__dict__["parameter_name"], head + "base_layer." * depth
        projections = ("gate_proj", "up_proj") if name == "gate_up_proj" else ("down_proj",)
        for adapter, found in parts.items():
            a = [found.pop((i, p, "lora_A"), None) for i in range(count) for p in projections]
            b = [found.pop((i, p, "lora_B"), None) for i in range(count) for p in projections]
            if any(t is None for t in a + b):
                raise RuntimeError(
                    f"moe-rewrite: the {adapter!r} adapter lacks some experts' {' or '.join(projections)}"
                )
            merged = {
                "lora_A": torch.cat(a),  # (len(projections) * r * E, in): expert e's rows together
                # (len(projections) * out, len(projections) * r * E): expert e's columns are e, e + E, ...
                "lora_B": torch.stack(
                    [torch.block_diag(*b[i : i + len(projections)]) for i in range(0, len(b), len(projections))], -1
                ).flatten(1),
            }
            for lora, value in merged.items():
                layer = wrapper._modules[lora]._modules.get(adapter)
                if layer is None or layer.weight.shape != value.shape:
                    expected = "no such adapter" if layer is None else f"expected {tuple(layer.weight.shape)}"
                    raise RuntimeError(
                        f"moe-rewrite: the per-expert {adapter!r} adapter does not fit PEFT's adapter on {name} "
                        f"({lora} {tuple(value.shape)}, {expected})"
                    )
                state_dict[f"{target}{lora}.{adapter}.weight"] = value
    left = [key for found in parts.values() for key in found]
    if left:
        raise RuntimeError(f"moe-rewrite: per-expert LoRA weights {left[0]} ... have no PEFT adapter to load into")


class _MoeRewriteFusedExperts(torch.nn.Module):
    """The routed experts as two parameters, made by the MoE layer's moe_rewrite_fuse_experts():
    gate_up_proj (E, 2 * intermediate, hidden) holds every expert's gate_proj then up_proj weight, down_proj
    (E, hidden, intermediate) every expert's down_proj weight.

    The grouped GEMMs read them as they are (no stacking copy per step), and a layer has 2 expert parameters instead of
    3 * E: FSDP, DDP and the optimizer handle each parameter separately, at a host cost per parameter and step.
    experts[i] is expert i as a module whose gate_proj, up_proj and down_proj are nn.Linear views of the parameters
    (no parameters of their own): moe_infer calls them one by one in eval mode, and PEFT's target_modules find and
    adapt them under the checkpoint's names (experts.{i}.gate_proj). PEFT's target_parameters wrap this module itself
    (parameter_lora.py). state_dict() uses the parameters' own names, as FSDP and torch.distributed.checkpoint expect;
    load_state_dict also takes the checkpoint's per-expert keys (experts.{i}.gate_proj.weight, ...), and the model's
    save_pretrained writes them.
    """

    def __init__(self, act_fn, gate_w, up_w, down_w):
        super().__init__()
        self.act_fn = act_fn
        gate_up, down = _moe_rewrite_stack_experts(gate_w, up_w, down_w)
        self.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=gate_w[0].requires_grad)
        self.down_proj = torch.nn.Parameter(down, requires_grad=gate_w[0].requires_grad)
        for i in range(len(gate_w)):
            self.add_module(str(i), _MoeRewriteFusedExpert(self, i))
        # The views and their projections as made, for _moe_rewrite_own_projections (a plain attribute, not a module)
        self._moe_rewrite_made = _MoeRewriteMadeViews(self, len(gate_w))
        self.register_load_state_dict_pre_hook(_moe_rewrite_merge_experts)

    def __len__(self):
        return self.gate_up_proj.shape[0]

    def __getitem__(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"expert {index} out of range for {len(self)} experts")
        return self._modules[str(index % len(self))]

    def __iter__(self):
        return (self._modules[str(i)] for i in range(len(self)))

    def __repr__(self):  # one line, not one per expert view
        return f"{type(self).__name__}({self.extra_repr()})"

    def extra_repr(self):
        experts, double_inter, hidden = self.gate_up_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={double_inter // 2}"

    def forward(self, x, topk_ids, topk_weight):
        """The experts' weighted outputs, expert by expert through the views (what PEFT's wrappers call, with their
        adapters applied to the parameters, when the grouped-GEMM core cannot reproduce them)."""
        return _moe_rewrite_loop(self, x, topk_ids, topk_weight)

    def moe_rewrite_weights(self, wrappers=()):
        """The _MoeRewriteExpertMLP the grouped-GEMM core reads: the two parameters as weight sources, and the LoRA
        adapters on the expert views (expert_linears._moe_rewrite_adapters) and in PEFT's `wrappers` of the
        parameters (parameter_lora.py); None when the loop must run them."""
        if self._moe_rewrite_own_projections():
            adapters = {}
        else:
            projections = _moe_rewrite_projections(self)
            # A projection replaced by another module (not this module's view, under PEFT's layer if adapted) must
            # run as that module, through the loop.
            intact = all(
                p is not None and type(p._modules.get("base_layer", p)) is _MoeRewriteExpertProjection
                for column in projections
                for p in column
            )
            adapters = _moe_rewrite_adapters(projections) if intact else None
        fused_adapters = _moe_rewrite_parameter_adapters(wrappers) if adapters is not None else None
        if fused_adapters is None:
            return None
        for name, loras in fused_adapters.items():
            adapters[name] = adapters.get(name, ()) + loras
        gate_up, down = _MoeRewriteExpertWeight(self.gate_up_proj), _MoeRewriteExpertWeight(self.down_proj)
        return _MoeRewriteExpertMLP(gate_up, down, self.act_fn, adapters)

    def _moe_rewrite_own_projections(self):
        """Whether every expert view is in place and holds the projections it was made with, of their own type and
        with no submodule (PEFT's target_modules put its layer in their place): the usual case, where no expert
        projection has an adapter. Checked in C loops (map) over the 3 * E modules, not in Python: this runs for every
        layer and step, and on an H200's host at E = 256 the full check in moe_rewrite_weights took 0.5 ms, this one
        0.1 (bench/NOTES.md, change 23)."""
        import operator

        made = self.__dict__.get("_moe_rewrite_made")
        if made is None:
            return False
        if list(map(self._modules.get, made.keys)) != made.views:
            return False
        try:
            held = list(map(operator.itemgetter(*MOE_REWRITE_PROJECTIONS), made.view_modules))
        except KeyError:  # a projection deleted
            return False
        types = [_MoeRewriteExpertProjection] * len(made.flat)
        return held == made.own and list(map(type, made.flat)) == types and not any(map(len, made.flat_modules))


class _MoeRewriteMadeViews:
    """Fused experts' views and their projections as made (_moe_rewrite_own_projections compares them with what the
    module holds now): the views' `keys` and the `views`, their `view_modules` dicts, `own` (each view's gate, up and
    down projections), `flat` (those projections in one list) and their `flat_modules` dicts."""

    __slots__ = ("keys", "views", "view_modules", "own", "flat", "flat_modules")

    def __init__(self, experts, count):
        self.keys = tuple(str(i) for i in range(count))
        self.views = [experts._modules[key] for key in self.keys]
        self.view_modules = [view._modules for view in self.views]
        self.own = [tuple(view._modules[name] for name in MOE_REWRITE_PROJECTIONS) for view in self.views]
        self.flat = [p for column in self.own for p in column]
        self.flat_modules = [p._modules for p in self.flat]


class _MoeRewriteFusedExpert(torch.nn.Module):
    """Expert `index` of fused experts, called like the expert MLP it replaced: down(act(gate(x)) * up(x))."""

    def __init__(self, experts, index):
        super().__init__()
        inter = experts.down_proj.shape[2]
        for name, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)), ("down_proj", None)):
            self.add_module(name, _MoeRewriteExpertProjection(experts, index, name, rows))
        object.__setattr__(self, "_moe_rewrite_experts", experts)  # not a submodule: the experts hold this view

    def forward(self, x):
        act_fn = self._moe_rewrite_experts.act_fn
        return self.down_proj(act_fn(self.gate_proj(x)) * self.up_proj(x))


class _MoeRewriteExpertProjection(torch.nn.Linear):
    """One projection of one fused expert as an nn.Linear (what PEFT adapts): its weight is a view of the fused
    parameter, read on every use, so it has no parameter or state-dict key of its own and follows .to() and FSDP."""

    def __init__(self, experts, index, name, rows):
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "_moe_rewrite_experts", experts)  # not a submodule (experts holds this)
        self.index, self.name, self.rows = index, name, rows
        out_features, in_features = self.weight.shape
        self.in_features, self.out_features, self.bias = in_features, out_features, None

    @property
    def weight(self):
        experts = self._moe_rewrite_experts
        if self.rows is None:
            return experts.down_proj[self.index]
        return experts.gate_up_proj[self.index, self.rows]


def _moe_rewrite_warn_unfused():
    """Experts that could be fused but are not run through the per-expert loop: say so, once per process."""
    import warnings

    warnings.warn(
        "moe-rewrite: these routed experts are not fused, so they train through the slow per-expert loop; fuse them "
        "with moe_rewrite.training.fuse_experts(model), or rewrite with --no-fuse-experts to train them as they are",
        stacklevel=4,
    )


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
    some are reported missing."""
    projections = ("gate_proj", "up_proj", "down_proj")
    keys = [(i, proj, f"{prefix}{i}.{proj}.weight") for i in range(len(module)) for proj in projections]
    found = [key for key in keys if key[2] in state_dict]
    if not found:
        return
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.is_meta or type(gate_up) is not torch.nn.Parameter:
        # Meta (load_state_dict(assign=True)) or sharded (FSDP2 DTensor) parameters: whole tensors, loaded as usual.
        if len(found) == len(keys):
            tensors = [state_dict.pop(key) for _, _, key in keys]
            gate_up, down = _moe_rewrite_stack_experts(tensors[0::3], tensors[1::3], tensors[2::3])
            for name, value in (("gate_up_proj", gate_up), ("down_proj", down)):
                param = getattr(module, name)
                if hasattr(param, "device_mesh"):  # every rank holds the full tensor: keep this rank's shard
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
                state_dict[prefix + name] = value
        return
    inter = down.shape[2]
    with torch.no_grad():
        for i, proj, key in found:
            value = state_dict.pop(key)
            target = (
                down[i] if proj == "down_proj" else gate_up[i, :inter] if proj == "gate_proj" else gate_up[i, inter:]
            )
            if value.shape != target.shape:
                raise RuntimeError(f"moe-rewrite: {key} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
            target.copy_(value)
    loaded = {key for _, _, key in found}
    missing_keys.extend(key for _, _, key in keys if key not in loaded)
    # What was copied counts as loaded, the fused names are not reported missing.
    state_dict.setdefault(prefix + "gate_up_proj", gate_up.detach())
    state_dict.setdefault(prefix + "down_proj", down.detach())


def _moe_rewrite_unfuse_state_dict(state_dict, model):
    """For save_pretrained: the state dict (the model's own when None) with every fused experts' gate_up_proj /
    down_proj pair written as the checkpoint's per-expert keys, as CPU copies; None when the model's own state dict
    holds no fused experts (save_pretrained then writes it as usual)."""
    own = state_dict is None
    if own:
        state_dict = model.state_dict()
    fused = [key[: -len("gate_up_proj")] for key in state_dict if key.endswith("experts.gate_up_proj")]
    fused = {prefix for prefix in fused if prefix + "down_proj" in state_dict}
    if own and not fused:
        return None
    unfused = {}
    for key, value in state_dict.items():
        prefix, _, name = key.rpartition(".")
        prefix += "."
        if prefix in fused and name == "down_proj":
            continue  # written with its gate_up_proj
        if prefix not in fused or name != "gate_up_proj":
            unfused[key] = value
        else:
            down = state_dict[prefix + "down_proj"].detach()
            value, inter = value.detach(), down.shape[2]
            for i in range(value.shape[0]):  # copies: slices of one buffer would be taken for tied weights
                unfused[f"{prefix}{i}.gate_proj.weight"] = value[i, :inter].to("cpu", copy=True)
                unfused[f"{prefix}{i}.up_proj.weight"] = value[i, inter:].to("cpu", copy=True)
                unfused[f"{prefix}{i}.down_proj.weight"] = down[i].to("cpu", copy=True)
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


def _moe_rewrite_loader_fuses_experts(config):
    """Whether this transformers' from_pretrained may merge per-expert checkpoint keys into fused ones for this remote
    code: 5.0 to 5.12 apply their deepseek_v2/v3 conversion to models of that model_type (5.0.0 always, 5.12 when the
    model has fused parameters); 5.13 skips remote code."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return major == 5 and minor < 13 and getattr(config, "model_type", None) in ("deepseek_v2", "deepseek_v3")


def _moe_rewrite_checkpoint_layer(checkpoint, layer, *args, **kwargs):
    """Run one decoder layer under transformers' gradient-checkpointing function.

    Positional arguments (the hidden states) go through the checkpoint; keyword arguments are bound first, because
    reentrant checkpointing, transformers' default, takes no keyword arguments.
    """
    import functools

    return checkpoint(functools.partial(layer.__call__, **kwargs), *args)


def _moe_rewrite_cache_max_length(cache):
    """Cache.get_max_length() as of transformers 4.46: the most tokens the cache holds, None when it grows without
    limit (4.48 renamed it get_max_cache_shape; 4.56+ and 5.x answer -1 for no limit)."""
    if not getattr(cache, "layers", True):  # 5.x: a DynamicCache builds its layers lazily and has no limit
        return None
    getter = getattr(cache, "get_max_length", None) or cache.get_max_cache_shape
    length = getter()
    return None if length is None or length < 0 else length


def _moe_rewrite_cache_usable_length(cache, new_seq_length, layer_idx=0):
    """Cache.get_usable_length (removed in 4.56): how many cached tokens of layer_idx the new tokens attend to."""
    if hasattr(cache, "get_usable_length"):
        return cache.get_usable_length(new_seq_length, layer_idx)
    max_length = _moe_rewrite_cache_max_length(cache)
    previous = cache.get_seq_length(layer_idx)
    if max_length is not None and previous + new_seq_length > max_length:
        return max_length - new_seq_length
    return previous


def _moe_rewrite_cache_seen_tokens(cache):
    """Cache.seen_tokens (removed in 4.56): the tokens the cache has seen, its length for a DynamicCache."""
    seen = getattr(cache, "seen_tokens", None)
    return cache.get_seq_length() if seen is None else seen


def _moe_rewrite_cache_from_legacy(cache_class, past_key_values):
    """cache_class.from_legacy_cache (removed in 5.0): a cache holding legacy ((key, value), ...) tuples."""
    if hasattr(cache_class, "from_legacy_cache"):
        return cache_class.from_legacy_cache(past_key_values)
    cache = cache_class()
    for layer_idx, (key, value) in enumerate(past_key_values or ()):
        cache.update(key, value, layer_idx)
    return cache


def _moe_rewrite_cache_to_legacy(cache):
    """Cache.to_legacy_cache (removed in 5.0): the cache as ((key, value), ...) tuples, one per layer."""
    if hasattr(cache, "to_legacy_cache"):
        return cache.to_legacy_cache()
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def _moe_rewrite_rope_scaling(config):
    """config.rope_scaling as transformers 4.x gives it: None for plain RoPE. transformers 5 fills a missing
    rope_scaling in as {"rope_type": "default", "rope_theta": ...}, which the file would read as a scaling and fail
    on its "type" key; a real scaling keeps its "type" (5.x adds "rope_type" beside it), so it passes unchanged."""
    scaling = config.rope_scaling
    if isinstance(scaling, dict) and "type" not in scaling and scaling.get("rope_type") == "default":
        return None
    return scaling


def _moe_rewrite_generation_position_ids(position_ids, input_ids):
    """The position ids of the tokens in `input_ids`. transformers 5.12 and 5.13 (measured; not 5.0 or 5.24) pass
    generate()'s position ids for the whole sequence so far, where earlier releases passed none and the file computed
    them; the file slices only the ones it computes, so after the first step they would not match the uncached
    tokens."""
    if position_ids is not None and position_ids.shape[-1] > input_ids.shape[-1]:
        return position_ids[..., -input_ids.shape[-1] :]
    return position_ids


def _moe_rewrite_loaded(module):
    """Whether transformers loaded every parameter of `module` itself (not its children) from the checkpoint: 5.x
    marks loaded parameters `_is_hf_initialized`, and 4.x marks none, so there _init_weights runs as before. Fused
    experts' projection views count as loaded: their weight is a view of the fused parameters, which hold their own
    values (an nn.Linear re-init through the view would overwrite the loaded experts)."""
    if "_moe_rewrite_experts" in module.__dict__:
        return True
    params = list(module.parameters(recurse=False))
    return bool(params) and all(getattr(p, "_is_hf_initialized", False) for p in params)


def _moe_rewrite_records_init(*classes):
    """Make each instance of these classes (the file's modules with non-persistent buffers: the RoPE tables) keep the
    arguments it was built with, so _moe_rewrite_restore_buffers can build a fresh copy. The outermost __init__
    records, so a subclass keeps its own arguments, not those it passes to super().__init__."""
    import functools

    def recording(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            self.__dict__.setdefault("_moe_rewrite_init_args", (args, kwargs))
            init(self, *args, **kwargs)

        return __init__

    for cls in classes:
        cls.__init__ = recording(cls.__init__)


def _moe_rewrite_restore_buffers(module):
    """Recompute the non-persistent buffers of a module of a class given to _moe_rewrite_records_init, from a fresh copy
    built on the CPU. transformers 5 builds the model on the meta device and then fills non-persistent buffers with
    uninitialised memory (torch.empty_like), since no checkpoint holds them (huggingface/transformers#48892); the
    RoPE tables would hold garbage. On 4.x the fresh copy has the values the module already holds."""
    recorded = module.__dict__.get("_moe_rewrite_init_args")
    # nn.Module's own record of its non-persistent buffers (private; nn.Module has no public accessor for it).
    names = [name for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None]
    if recorded is None or not names:
        return
    args, kwargs = recorded
    with torch.device("cpu"):
        fresh = type(module)(*args, **kwargs)
    with torch.no_grad():
        for name in names:
            old, new = module._buffers[name], fresh._buffers[name]
            if old.shape == new.shape:
                old.copy_(new)
            else:  # the module grew the table since: start again from the fresh one's size
                module._buffers[name] = new.to(device=old.device, dtype=old.dtype)
                module.__dict__.update({k: v for k, v in fresh.__dict__.items() if type(v) in (int, float)})

# ---- in class _MoeRewriteFusedExperts:

def moe_rewrite_weights(self, wrappers=()):
    """The _MoeRewriteExpertMLP the grouped-GEMM core reads: the two parameters as weight sources, and the LoRA
        adapters on the expert views (expert_linears._moe_rewrite_adapters) and in PEFT's `wrappers` of the
        parameters (parameter_lora.py); None when the loop must run them."""
    if self._moe_rewrite_own_projections():
        adapters = {}
    else:
        projections = _moe_rewrite_projections(self)
        # A projection replaced by another module (not this module's view, under PEFT's layer if adapted) must
        # run as that module, through the loop.
        intact = all(
            p is not None and type(p._modules.get("base_layer", p)) is _MoeRewriteExpertProjection
            for column in projections
            for p in column
        )
        adapters = _moe_rewrite_adapters(projections) if intact else None
    fused_adapters = _moe_rewrite_parameter_adapters(wrappers) if adapters is not None else None
    if fused_adapters is None:
        return None
    for name, loras in fused_adapters.items():
        adapters[name] = adapters.get(name, ()) + loras
    gate_up, down = _MoeRewriteExpertWeight(self.gate_up_proj), _MoeRewriteExpertWeight(self.down_proj)
    return _MoeRewriteExpertMLP(gate_up, down, self.act_fn, adapters)

# ---- in class DeepseekV3MoE:

# moe-rewrite: generated method, regenerated on every run
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
        experts = weights.gate_up.shape[0]
        return _moe_rewrite_grouped_experts(x, topk_ids, topk_weight, weights, experts, kernel, dtype, out_dtype)
    if isinstance(self.experts, torch.nn.ModuleList):
        y = _moe_rewrite_loop(self.experts, x, topk_ids, topk_weight)
    else:  # fused experts, or PEFT's wrappers around them: their own forward (a loop over the experts)
        y = self.experts(x, topk_ids, topk_weight)
    return y.to(out_dtype or y.dtype)

# ---- in class DeepseekV3MoE:

# moe-rewrite: generated method, regenerated on every run
def moe_rewrite_infer(self, x, topk_ids, topk_weight):
    """Eval mode's routed experts: the file's own moe_infer, expert by expert, unless the experts cannot be indexed
        as moe_infer does (PEFT's wrappers around the fused experts, see _moe_rewrite_unwrap); then moe_train runs
        them with their adapters, without gradients as moe_infer, and returns x's dtype as moe_infer does."""
    if hasattr(type(self.experts), "__getitem__"):
        return self.moe_infer(x, topk_ids, topk_weight)
    with torch.no_grad():
        return self.moe_train(x, topk_ids, topk_weight, out_dtype=x.dtype)

# ---- in class DeepseekV3MoE:

# moe-rewrite: generated method, regenerated on every run
def moe_rewrite_expert_weights(self):
    """The experts' weights for the grouped-GEMM core, a _MoeRewriteExpertMLP, or None: the per-expert
        loop runs (experts that are not fused: quantized, or loaded with MOE_REWRITE_FUSE_EXPERTS=0)."""
    experts, wrappers = _moe_rewrite_unwrap(self.experts)
    if isinstance(experts, _MoeRewriteFusedExperts):
        return experts.moe_rewrite_weights(wrappers)
    if isinstance(experts, torch.nn.ModuleList) and _moe_rewrite_linear_weights(experts) is not None:
        _moe_rewrite_warn_unfused()
    return None

# ---- in class DeepseekV3MoE:

# moe-rewrite: generated method, regenerated on every run
def moe_rewrite_fuse_experts(self, allow_meta=False):
    """Hold the routed experts' weights in two parameters instead of 3 * E nn.Linear weights (see
        _MoeRewriteFusedExperts): faster training, most of all under FSDP.

        Call it once the weights are loaded and before the model is wrapped (FSDP, DDP, DeepSpeed) or handed to an
        optimizer; moe_rewrite.training.fuse_experts(model) does it for every layer. Returns the fused experts; calling
        it again does nothing. Outputs and gradients stay the same; save_pretrained still writes per-expert keys.
        `allow_meta`: fuse meta-device weights too, for a loader that fills the fused parameters.
        """
    experts = self.experts
    if isinstance(experts, _MoeRewriteFusedExperts):
        return experts
    if self.ep_size > 1:
        raise NotImplementedError("moe-rewrite: fused experts do not support expert parallelism (ep_size > 1) yet")
    weights = _moe_rewrite_linear_weights(experts)
    if weights is None:
        raise RuntimeError(
            "moe-rewrite: only experts made of plain, whole nn.Linear layers can be fused (not LoRA adapters, "
            "quantized layers or DeepSpeed ZeRO-3 partitions)"
        )
    flat = [w for part in weights for w in part]
    if getattr(self, "_is_fsdp_managed_module", False) or any(type(w) is not torch.nn.Parameter for w in flat):
        raise RuntimeError("moe-rewrite: fuse the experts before wrapping the model (FSDP, DDP, DeepSpeed)")
    # accelerate's dispatch (device_map) marks the modules it moves or offloads with `_hf_hook` (its own,
    # undocumented attribute: accelerate has no public "is this module dispatched" query).
    if any(hasattr(m, "_hf_hook") for m in experts.modules()):
        raise RuntimeError("moe-rewrite: experts dispatched or offloaded by accelerate (device_map) are not fused")
    if not allow_meta and any(w.is_meta for w in flat):
        raise RuntimeError("moe-rewrite: the expert weights are on the meta device; fuse them once they are loaded")
    if len({(w.dtype, w.device, w.requires_grad) for w in flat}) != 1:
        raise RuntimeError("moe-rewrite: fusing needs every expert weight in one dtype, device and requires_grad")
    self.experts = _MoeRewriteFusedExperts(experts[0].act_fn, *weights)
    self.register_load_state_dict_pre_hook(_moe_rewrite_load_expert_lora)
    return self.experts

# ---- in class DeepseekV3PreTrainedModel:

# moe-rewrite: generated method, regenerated on every run
def save_pretrained(self, save_directory, *args, **kwargs):
    """Save as PreTrainedModel.save_pretrained does, fused routed experts written as per-expert keys (moe-rewrite);
        a `state_dict` passed in (a full state dict gathered from FSDP, say) is converted the same way; the patched
        modeling file and the files it imports are written beside the weights."""
    writes = args[0] if args else kwargs.get("is_main_process", True)
    if not writes:
        pass  # this process writes nothing
    elif len(args) > 1:  # state_dict passed by position, after is_main_process
        args = (args[0], _moe_rewrite_unfuse_state_dict(args[1], self), *args[2:])
    else:
        kwargs["state_dict"] = _moe_rewrite_unfuse_state_dict(kwargs.get("state_dict"), self)
    result = super().save_pretrained(save_directory, *args, **kwargs)
    if writes:
        _moe_rewrite_save_code(self, save_directory)
    return result

# ---- in class DeepseekV3PreTrainedModel:

# moe-rewrite: generated method, regenerated on every run
@classmethod
def from_pretrained(cls, *args, **kwargs):
    """Load as PreTrainedModel.from_pretrained does, then fuse the routed experts."""
    wants_info = kwargs.get("output_loading_info", False)
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
    return (model, info) if wants_info else model

# ---- in class DeepseekV3PreTrainedModel:

# moe-rewrite: generated method, regenerated on every run
def post_init(self):
    """PreTrainedModel.post_init; where transformers' from_pretrained itself merges the checkpoint's per-expert keys
        into gate_up_proj / down_proj (5.0 to 5.12 do for deepseek_v2/v3 remote code), the routed experts are fused
        here, before loading, so that those keys land in them."""
    super().post_init()
    if _moe_rewrite_loader_fuses_experts(self.config):
        _moe_rewrite_fuse_model(self, loading=True)

# ---- in class DeepseekV3PreTrainedModel:

# moe-rewrite: generated method, regenerated on every run
@classmethod
def _from_config(cls, config, **kwargs):
    """Build as PreTrainedModel._from_config does, then fuse the routed experts."""
    return _moe_rewrite_fuse_model(super()._from_config(config, **kwargs))
