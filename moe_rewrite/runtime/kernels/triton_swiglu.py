"""SwiGLU in Triton: silu(gate) * up for rows of [gate; up], and its backward fused with the routing weights'
gradient, each one pass over the rows in float32 with one rounding. CUDA with triton; triton is imported when the
kernels are built, never at import.
"""

import torch

from .triton_block import MOE_REWRITE_TRITON_BLOCK, _moe_rewrite_blocks, _moe_rewrite_triton_modules


def _moe_rewrite_swiglu_kernels():
    """{"swiglu", "swiglu_backward": the jitted kernels}. triton must be installed (dispatch.py's
    _moe_rewrite_build_triton asks)."""
    triton, tl = _moe_rewrite_triton_modules()

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
