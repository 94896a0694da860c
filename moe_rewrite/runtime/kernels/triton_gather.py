"""The gather in Triton: each token's row copied to its top_k places in expert order (with each row's routing weight,
when asked), x's rows read once. CUDA with triton; triton is imported when the kernels are built, never at import.
"""

from .triton_block import MOE_REWRITE_TRITON_BLOCK, _moe_rewrite_blocks, _moe_rewrite_triton_modules


def _moe_rewrite_gather_kernels():
    """{"gather_rows": the jitted kernel}. triton must be installed (dispatch.py's _moe_rewrite_build_triton asks)."""
    triton, tl = _moe_rewrite_triton_modules()

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
