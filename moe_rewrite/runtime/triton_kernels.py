"""Triton kernels for the grouped-GEMM core's memory-bound steps on CUDA, each one pass over its rows in float32 with
one rounding at the end: SwiGLU (silu(gate) * up), its backward fused with the routing weights' gradient, the un-sort
plus weighted sum of each token's top-k expert rows, and that sum's backward; the gather of each token's row to its
top-k places in expert order (a copy); and the route (which rows go to which expert, in order) in one launch. Also
a grouped GEMM (forward and input-gradient products) that runs its tiles expert by expert, for few rows per expert on
sm90. The core uses them where `_moe_rewrite_triton(device, dtype)` (grouped_gemm.py) returns them, and runs the
same arithmetic as torch ops everywhere else.
"""

import torch

MOE_REWRITE_TRITON_BLOCK = 1024  # columns per program (pass): the rows are memory-bound, one block keeps it simple
MOE_REWRITE_ROUTE_BLOCK = 4096  # routed rows per pass of the route kernel
# The grouped GEMM's tile (rows, columns, depth), warps and pipeline stages: the best of bench/triton_gemm.py's at
# V3's sizes on an H200 (bench/NOTES.md, change 26)
MOE_REWRITE_GEMM_TILE = (128, 256, 64, 8, 3)


def _moe_rewrite_build_triton():
    """The kernels, {name: jitted function}, or None where triton is not installed. Called once per process."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

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

    return {
        "route": route,
        "grouped_mm": grouped_mm,
        "gather_rows": gather_rows,
        "swiglu": swiglu,
        "swiglu_backward": swiglu_backward,
        "sum_rows": sum_rows,
        "sum_rows_backward": sum_rows_backward,
    }


def _moe_rewrite_gemm_fits(n, k):
    """Whether the grouped GEMM's tile fits a product n wide and k deep: at least one tile wide, whole tiles deep."""
    _, bn, bk, _, _ = MOE_REWRITE_GEMM_TILE
    return n >= bn and k % bk == 0


def _moe_rewrite_grouped_mm(kernels, a, b, offsets, mode):
    """grouped_gemm._moe_rewrite_gmm's "fwd" (a @ b[e]^T, b (E, n, k)) or "dgrad" (a @ b[e], b (E, k, n)) product
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


def _moe_rewrite_blocks(columns):
    return -(-columns // MOE_REWRITE_TRITON_BLOCK)


def _moe_rewrite_route_rows(kernels, topk_ids, num_experts, padding=0):
    """(offsets, (order, tokens, positions)) for the routing topk_ids (tokens, top_k), as grouped_gemm's
    _moe_rewrite_route computes them with torch ops (a stable sort by expert and its inverse), `padding` zeros after
    the tokens included, in one launch: the host issues one kernel before the first GEMM instead of about ten."""
    ids = topk_ids.reshape(-1).contiguous()
    rows = ids.numel()
    order, positions = (torch.empty(rows, device=ids.device, dtype=torch.int64) for _ in range(2))
    tokens = torch.empty(rows + padding, device=ids.device, dtype=torch.int64)
    offsets = torch.empty(num_experts, device=ids.device, dtype=torch.int32)
    kernels["route"][(num_experts,)](
        ids, order, tokens, positions, offsets, rows, topk_ids.shape[1], padding, BLOCK=MOE_REWRITE_ROUTE_BLOCK
    )
    return offsets, (order, tokens, positions)


def _moe_rewrite_gather_rows(kernels, x, positions, rows, dtype, topk_weight=None):
    """The (rows, hidden) rows x[tokens] in expert order, in `dtype`, for the route whose inverse permutation is
    `positions` (token t's slot k at positions[t * top_k + k]); rows past the real ones (padding,
    _moe_rewrite_padding) get token 0's row, as x.index_select(0, tokens).to(dtype) gives for the padded tokens.
    With topk_weight (tokens, top_k): (rows, row_weight), each row's routing weight in the same pass (zero for
    padding rows), as grouped_gemm's _moe_rewrite_row_weights gives them."""
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
