"""RoPE in Triton (codemods/rope.py): the published apply_rotary_pos_emb gathers the table rows of position_ids, copies
q and k into the de-interleaved lane order (even lanes, then odd: view, transpose, reshape) and computes
`y * cos + rotate_half(y) * sin` in four more passes. Here one kernel each way rotates q, then k, reading each table
row once for all of a tensor's heads, and writes new contiguous tensors of q's and k's shapes (the published function
returns new tensors too). The published roundings are kept: `y * cos` and `rotate_half(y) * sin` each rounded to the
activations' dtype, then their sum; backward, `g * cos` and `g * sin` rounded, then one rounded sum, as autograd
computes them. Where it does not apply (off CUDA, no Triton, MOE_REWRITE_TRITON=0 or MOE_REWRITE_FUSED_ROPE=0,
torch.compile, other shapes or dtypes) the published function runs.
"""

import torch

# _moe_rewrite_options marks this module as holding generated caches (tests/conftest.py empties them by that name)
from .dispatch import _moe_rewrite_options, _moe_rewrite_setting, _moe_rewrite_triton  # noqa: F401
from .triton_block import _moe_rewrite_triton_modules

# "kernels" -> {name: jitted kernel}; "checked" -> (position_ids, its version, table rows) last bounds-checked
_moe_rewrite_rope_cache = {}
MOE_REWRITE_ROPE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MOE_REWRITE_ROPE_POSITIONS = 16  # positions (table rows) one program rotates, for every head of q and k


def _moe_rewrite_rope_applies(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    """Whether _moe_rewrite_rope computes the file's apply_rotary_pos_emb(q, k, cos, sin, position_ids,
    unsqueeze_dim): on CUDA where the Triton kernels run (dispatch.py), not while torch.compile traces, with
    unsqueeze_dim 1, q and k of shape (batch, heads, seq, dim) with the same batch, seq and an even dim (their head
    counts may differ: MLA's k_pe has one), tables of shape (rows, dim) that need no gradient, position_ids of shape
    (batch or 1, seq) in int64, every tensor plain (not a subclass), q, k and the tables in one dtype of bf16, fp16,
    fp32 (the published products would promote mixed ones). MOE_REWRITE_FUSED_ROPE=0 keeps the published function."""
    tensors = (q, k, cos, sin, position_ids)
    if q.device.type != "cuda" or any(type(t) is not torch.Tensor or t.device != q.device for t in tensors):
        return False
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 2 or position_ids.dim() != 2:
        return False
    batch, _, seq, dim = q.shape
    if dim % 2 or not q.numel() or k.shape[0] != batch or k.shape[2:] != (seq, dim) or not k.numel():
        return False
    if cos.shape != sin.shape or cos.shape[1] != dim or position_ids.shape not in ((batch, seq), (1, seq)):
        return False
    if position_ids.dtype != torch.int64 or cos.requires_grad or sin.requires_grad:
        return False
    if q.dtype not in MOE_REWRITE_ROPE_DTYPES or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return False
    if _moe_rewrite_setting("MOE_REWRITE_FUSED_ROPE", "1") == "0":
        return False
    return _moe_rewrite_triton(q.device, q.dtype) is not None  # also False while torch.compile traces


def _moe_rewrite_rope(q, k, cos, sin, position_ids, interleaved=True):
    """The file's apply_rotary_pos_emb(q, k, cos, sin, position_ids) (unsqueeze_dim 1), with the gradients of q and
    k, through Triton; `interleaved=False` for a file whose function has no view/transpose lines (its lanes already
    in rotate_half's order). See _moe_rewrite_rope_applies for where it runs."""
    _moe_rewrite_rope_check_positions(position_ids, cos.shape[0])
    return _MoeRewriteRoPE.apply(q, k, cos, sin, position_ids, interleaved)


def _moe_rewrite_rope_check_positions(position_ids, rows):
    """The published `cos[position_ids]`'s bounds check: every id in [-rows, rows) (a negative one counts from the
    table's end). On CUDA as published, a device-side assert (torch._assert_async: no host sync; the error surfaces
    at the next synchronisation as "CUDA error: device-side assert triggered"); elsewhere the published IndexError,
    "index N is out of bounds for dimension 0 with size rows", N the first. Checked once for every layer's call
    with the same position_ids (the tensor, unchanged since, against a table as long; inference tensors every call)."""
    version = None if position_ids.is_inference() else position_ids._version  # inference tensors have none
    seen = _moe_rewrite_rope_cache.get("checked")
    if version is not None and seen is not None and seen[0] is position_ids and seen[1:] == (version, rows):
        return
    bad = (position_ids >= rows) | (position_ids < -rows)
    if position_ids.device.type == "cuda":
        torch._assert_async(~bad.any())
    elif bad.any():
        raise IndexError(f"index {position_ids[bad][0].item()} is out of bounds for dimension 0 with size {rows}")
    _moe_rewrite_rope_cache["checked"] = (position_ids, version, rows)


def _moe_rewrite_rope_kernels():
    """{"rope": the jitted kernel}, built on first use (triton must be installed)."""
    if "kernels" in _moe_rewrite_rope_cache:
        return _moe_rewrite_rope_cache["kernels"]
    triton, tl = _moe_rewrite_triton_modules()

    @triton.jit
    def rope(
        src,
        dst,
        cos,
        sin,
        position_ids,
        heads,
        sb,
        sh,
        ss,
        sd,
        cos_s0,
        cos_s1,
        sin_s0,
        sin_s1,
        pos_sb,
        pos_ss,
        table_rows,
        seq,
        dim,
        BACKWARD: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        POSITIONS: tl.constexpr,
        HALF: tl.constexpr,
    ):
        """Program (i, b): positions i * POSITIONS ... of batch row b, every head of one tensor (q or k); the table
        rows of those positions are read once for all heads (both halves: the table is not assumed to repeat). src is
        read in its own strides, dst written contiguous (batch, heads, seq, dim). Forward: src is the input, dst its
        rotation; backward: src is the rotation's gradient, dst the input's."""
        batch = tl.program_id(1).to(tl.int64)
        positions = tl.program_id(0).to(tl.int64) * POSITIONS + tl.arange(0, POSITIONS)
        lanes = tl.arange(0, HALF)
        half = dim // 2
        inside = positions < seq
        row = tl.load(position_ids + batch * pos_sb + positions * pos_ss, mask=inside, other=0)
        row = tl.where(row < 0, row + table_rows, row)  # cos[position_ids] counts negative indices from the end
        # a row outside the table (refused before the launch, as published) reads zeros, not another tensor's memory
        in_table = (row >= 0) & (row < table_rows)
        mask = inside[:, None] & (lanes < half)[None, :]
        table = mask & in_table[:, None]
        c = cos + row[:, None] * cos_s0 + lanes[None, :] * cos_s1
        s = sin + row[:, None] * sin_s0 + lanes[None, :] * sin_s1
        c1 = tl.load(c, mask=table, other=0.0).to(tl.float32)
        c2 = tl.load(c + half * cos_s1, mask=table, other=0.0).to(tl.float32)
        s1 = tl.load(s, mask=table, other=0.0).to(tl.float32)
        s2 = tl.load(s + half * sin_s1, mask=table, other=0.0).to(tl.float32)
        if INTERLEAVED:  # the published de-interleave: lane j of y is x's lane 2j, lane j + dim/2 is 2j + 1
            first, second = 2 * lanes, 2 * lanes + 1
        else:
            first, second = lanes, lanes + half
        dtype = dst.dtype.element_ty
        at = src + batch * sb + positions[:, None] * ss  # int64 offsets (batch and positions are int64)
        to = dst + (batch * heads * seq + positions[:, None]) * dim
        for _ in range(heads):
            if BACKWARD:
                g1 = tl.load(at + lanes[None, :] * sd, mask=mask, other=0.0).to(tl.float32)
                g2 = tl.load(at + (lanes[None, :] + half) * sd, mask=mask, other=0.0).to(tl.float32)
                # as autograd: grad_y = g * cos + rotate_half's transpose of g * sin, i.e. (g2 * s2, -g1 * s1), each
                # product rounded to the dtype, then one rounded sum; the de-interleave's transpose moves no value
                y1 = ((g1 * c1).to(dtype).to(tl.float32) + (g2 * s2).to(dtype).to(tl.float32)).to(dtype)
                y2 = ((g2 * c2).to(dtype).to(tl.float32) - (g1 * s1).to(dtype).to(tl.float32)).to(dtype)
                tl.store(to + first[None, :], y1, mask=mask)
                tl.store(to + second[None, :], y2, mask=mask)
            else:
                y1 = tl.load(at + first[None, :] * sd, mask=mask, other=0.0).to(tl.float32)
                y2 = tl.load(at + second[None, :] * sd, mask=mask, other=0.0).to(tl.float32)
                # as published: y * cos + rotate_half(y) * sin with rotate_half(y) = (-y2, y1), each product rounded
                # to the dtype, then the sum rounded
                o1 = ((y1 * c1).to(dtype).to(tl.float32) - (y2 * s1).to(dtype).to(tl.float32)).to(dtype)
                o2 = ((y2 * c2).to(dtype).to(tl.float32) + (y1 * s2).to(dtype).to(tl.float32)).to(dtype)
                tl.store(to + lanes[None, :], o1, mask=mask)
                tl.store(to + lanes[None, :] + half, o2, mask=mask)
            at += sh
            to += seq * dim

    _moe_rewrite_rope_cache["kernels"] = {"rope": rope}
    return _moe_rewrite_rope_cache["kernels"]


def _moe_rewrite_rope_launch(src, dst, cos, sin, position_ids, backward, interleaved):
    """One tensor (q or k), every head: forward, src is the input and dst its rotation; backward, src is the
    rotation's gradient and dst the input's. dst is contiguous, of src's shape."""
    batch, heads, seq, dim = src.shape
    pos_sb = 0 if position_ids.shape[0] == 1 else position_ids.stride(0)  # one row for every batch row
    _moe_rewrite_rope_kernels()["rope"][(-(-seq // MOE_REWRITE_ROPE_POSITIONS), batch)](
        src,
        dst,
        cos,
        sin,
        position_ids,
        heads,
        *src.stride(),
        *cos.stride(),
        *sin.stride(),
        pos_sb,
        position_ids.stride(1),
        cos.shape[0],
        seq,
        dim,
        BACKWARD=backward,
        INTERLEAVED=interleaved,
        POSITIONS=MOE_REWRITE_ROPE_POSITIONS,
        HALF=max(1 << (dim // 2 - 1).bit_length(), 2),
        enable_fp_fusion=False,  # no a * b + c as one fma: fp32 products rounded as torch rounds them
    )


class _MoeRewriteRoPE(torch.autograd.Function):
    """The published apply_rotary_pos_emb (see _moe_rewrite_rope) as one Triton kernel each way; nothing is saved
    for the backward but the tables and position_ids (the rotation is linear in q and k)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, interleaved):
        q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        k_out = torch.empty(k.shape, device=k.device, dtype=k.dtype)
        for x, out in ((q, q_out), (k, k_out)):
            _moe_rewrite_rope_launch(x, out, cos, sin, position_ids, False, interleaved)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.interleaved = interleaved
        return q_out, k_out

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: an error, not wrong gradients
    def backward(ctx, grad_q, grad_k):
        cos, sin, position_ids = ctx.saved_tensors
        grads = []
        for grad in (grad_q, grad_k):
            grads.append(torch.empty(grad.shape, device=grad.device, dtype=grad.dtype))
            _moe_rewrite_rope_launch(grad, grads[-1], cos, sin, position_ids, True, ctx.interleaved)
        return grads[0], grads[1], None, None, None, None
