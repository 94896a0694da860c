"""The cross-entropy rows of the fused loss (lm_loss.py) in Triton: for each row of a chunk of logits, the float32
logsumexp over the vocabulary, the row's loss, and its gradient written in place over the logits. CUDA with triton;
triton is imported when the kernel is built, never at import.
"""

import torch

from .triton_block import MOE_REWRITE_TRITON_BLOCK, _moe_rewrite_triton_modules


def _moe_rewrite_cross_entropy_kernels():
    """{"cross_entropy_rows": the jitted kernel}. triton must be installed."""
    triton, tl = _moe_rewrite_triton_modules()

    @triton.jit
    def cross_entropy_rows(logits, target, scale, row_loss, vocab, BLOCK: tl.constexpr):
        """For one row z of logits (vocab columns) and its target t (-100: ignored): row_loss = logsumexp(z) - z[t]
        (0 when ignored), and z overwritten with (softmax(z) - onehot(t)) * scale[0] rounded once to z's dtype (0 when
        ignored), all in float32. One program a row; two passes over it (an online max and sum, then the gradient)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * vocab
        t = tl.load(target + row)
        valid = t != -100
        m = float("-inf")
        s = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), axis=0)
            m = new_m
        lse = m + tl.log(s)
        picked = tl.load(base + tl.where(valid, t, 0)).to(tl.float32)
        tl.store(row_loss + row, tl.where(valid, lse - picked, 0.0))
        inv = tl.load(scale)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = (tl.exp(z - lse) - tl.where(cols == t, 1.0, 0.0)) * inv
            tl.store(base + cols, tl.where(valid, grad, 0.0).to(logits.dtype.element_ty), mask=mask)

    return {"cross_entropy_rows": cross_entropy_rows}


def _moe_rewrite_cross_entropy_rows(kernels, logits, target, scale):
    """Per-row losses (rows,) in float32 of contiguous `logits` (rows, vocab) against `target` (rows,), -100
    ignored; `logits` is overwritten with the gradient (softmax - onehot) * scale (scale: a one-element float32
    tensor, 1/n), zero on ignored rows."""
    rows, vocab = logits.shape
    row_loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows:
        kernels["cross_entropy_rows"][(rows,)](logits, target, scale, row_loss, vocab, BLOCK=MOE_REWRITE_TRITON_BLOCK)
    return row_loss
