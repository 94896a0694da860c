"""The route: which (token, slot) rows go to which expert, in expert order, and the steps that move rows along it
(gather, un-sort, weighted combine, token sums) as torch ops or through the Triton kernels. Always generated.
"""

import torch

from ..kernels.triton_gather import _moe_rewrite_gather_rows
from ..kernels.triton_route import _moe_rewrite_route_rows
from ..kernels.triton_sum_rows import _moe_rewrite_sum_rows

# torch._grouped_mm on sm90 takes its large tile (128 x 256) above 128 rows per expert on average, its small one
# (64 x 128) up to 128: padding lifts the average to this many rows (_moe_rewrite_padding).
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
