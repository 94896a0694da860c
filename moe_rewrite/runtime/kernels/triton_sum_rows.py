"""The weighted un-sort in Triton: each token's top-k expert rows (in expert order) summed, times their routing weights,
in float32 with one rounding, and that sum's backward. CUDA with triton; triton is imported when the kernels are
built, never at import.
"""

import torch

from .triton_block import MOE_REWRITE_TRITON_BLOCK, _moe_rewrite_blocks, _moe_rewrite_triton_modules


def _moe_rewrite_sum_rows_kernels():
    """{"sum_rows", "sum_rows_backward": the jitted kernels}. triton must be installed (dispatch.py's
    _moe_rewrite_build_triton asks)."""
    triton, tl = _moe_rewrite_triton_modules()

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
