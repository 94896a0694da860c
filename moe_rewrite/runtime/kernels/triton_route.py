"""The route in one Triton launch: which rows go to which expert, in order (route.py's _moe_rewrite_route computes the
same with about ten torch ops). CUDA with triton; triton is imported when the kernels are built, never at import.
"""

import torch

from .triton_block import _moe_rewrite_triton_modules

MOE_REWRITE_ROUTE_BLOCK = 4096  # routed rows per pass of the route kernel


def _moe_rewrite_route_kernels():
    """{"route": the jitted kernel}. triton must be installed (dispatch.py's _moe_rewrite_build_triton asks)."""
    triton, tl = _moe_rewrite_triton_modules()

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
