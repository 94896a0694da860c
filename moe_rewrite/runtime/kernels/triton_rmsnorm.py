"""RMSNorm in Triton (codemods/rmsnorm.py): the published norm computes, per row of x,
`weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)` in four passes over the row, each with its own
fp32 tensor; here one pass forward (one read, one write, 1/rms kept per row) and one backward. The published roundings
are kept: normalised in fp32, rounded to x's dtype, multiplied by the weight in the promoted dtype (an fp32 weight
with bf16 x gives fp32, as published); backward, the gradient through `.to(x.dtype)` rounded to x's dtype first.
Where it does not apply (off CUDA, no Triton, MOE_REWRITE_TRITON=0 or MOE_REWRITE_FUSED_NORM=0, torch.compile,
other dtypes, a DTensor weight) the published norm runs.
"""

import torch

# _moe_rewrite_options marks this module as holding generated caches (tests/conftest.py empties them by that name)
from .dispatch import _moe_rewrite_options, _moe_rewrite_setting, _moe_rewrite_triton  # noqa: F401
from .triton_block import _moe_rewrite_triton_modules

MOE_REWRITE_RMSNORM_WIDTH = 8192  # the widest row one program holds (DeepSeek-V3's hidden size is 7168)
_moe_rewrite_rmsnorm_cache = {}  # "kernels" -> {name: jitted kernel}; device -> programs of the backward
MOE_REWRITE_RMSNORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _moe_rewrite_rmsnorm_applies(x, weight):
    """Whether _moe_rewrite_rmsnorm computes the file's RMSNorm of x with this weight: on CUDA where the Triton
    kernels run (dispatch.py), not while torch.compile traces (it fuses the published norm itself), for plain tensors
    (an FSDP2 weight is a plain tensor inside forward, a DTensor is not) in bf16, fp16 or fp32, rows at most
    MOE_REWRITE_RMSNORM_WIDTH wide and contiguous, a 1-D weight as wide. MOE_REWRITE_FUSED_NORM=0 keeps the published
    norm."""
    if x.device.type != "cuda" or type(x) is not torch.Tensor or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if x.dtype not in MOE_REWRITE_RMSNORM_DTYPES or weight.dtype not in MOE_REWRITE_RMSNORM_DTYPES:
        return False
    width = x.shape[-1] if x.dim() else 0
    if not (0 < width <= MOE_REWRITE_RMSNORM_WIDTH and x.stride(-1) == 1 and x.numel()):
        return False
    if weight.shape != (width,) or weight.device != x.device:
        return False
    if _moe_rewrite_setting("MOE_REWRITE_FUSED_NORM", "1") == "0":
        return False
    return _moe_rewrite_triton(x.device, x.dtype) is not None  # also False while torch.compile traces


def _moe_rewrite_rmsnorm(x, weight, eps):
    """weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype), as the published RMSNorm computes it,
    with its gradients (of x and of the weight) through Triton. See _moe_rewrite_rmsnorm_applies for where it runs."""
    return _MoeRewriteRMSNorm.apply(x, weight, float(eps))


def _moe_rewrite_rmsnorm_kernels():
    """{"rmsnorm", "rmsnorm_backward": the jitted kernels}, built on first use (triton must be installed)."""
    if "kernels" in _moe_rewrite_rmsnorm_cache:
        return _moe_rewrite_rmsnorm_cache["kernels"]
    triton, tl = _moe_rewrite_triton_modules()

    @triton.jit
    def rmsnorm(x, weight, out, rstd, stride, width, inv_width, eps, BLOCK: tl.constexpr):
        """One row: rstd = 1/sqrt(mean(x²) + eps) in fp32; out = weight * (x * rstd rounded to x's dtype), the product
        in fp32 rounded to out's dtype (the promoted one)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        xs = tl.load(x + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        # torch's mean multiplies the sum by 1/width (rounded to fp32); rsqrt as torch.rsqrt
        r = tl.rsqrt(tl.sum(xs * xs, axis=0) * inv_width + eps)
        normed = (xs * r).to(x.dtype.element_ty).to(tl.float32)
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + row * width + cols, (w * normed).to(out.dtype.element_ty), mask=mask)
        tl.store(rstd + row, r)

    @triton.jit
    def rmsnorm_backward(
        x,
        weight,
        grad_out,
        rstd,
        grad_x,
        partial_w,
        rows,
        stride,
        width,
        WEIGHT_GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Rows pid, pid + programs, ...: grad_x of each, and this program's fp32 sum of the weight's gradient over
        them (one row of partial_w; the rows of partial_w are summed afterwards). As published: the gradient of the
        normalised row is grad_out * weight rounded to out's dtype, then to x's (`.to(x.dtype)`'s backward), and
        each term of the weight's gradient, grad_out * normed, is rounded to out's dtype before it is summed."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for at in range(pid.to(tl.int64), rows, programs):  # int64 offsets: rows * width can pass 2**31
            xs = tl.load(x + at * stride + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(grad_out + at * width + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(rstd + at)
            normed = xs * r
            if WEIGHT_GRAD:
                rounded = normed.to(x.dtype.element_ty).to(tl.float32)
                acc += (g * rounded).to(grad_out.dtype.element_ty).to(tl.float32)
            gn = (g * w).to(grad_out.dtype.element_ty).to(x.dtype.element_ty).to(tl.float32)
            # d/dx of x * rstd(x): rstd * (gn - normed * mean(gn * normed))
            dot = tl.sum(gn * normed, axis=0) / width
            tl.store(grad_x + at * width + cols, (r * (gn - normed * dot)).to(grad_x.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            tl.store(partial_w + pid * width + cols, acc, mask=mask)

    _moe_rewrite_rmsnorm_cache["kernels"] = {"rmsnorm": rmsnorm, "rmsnorm_backward": rmsnorm_backward}
    return _moe_rewrite_rmsnorm_cache["kernels"]


def _moe_rewrite_rmsnorm_launch(width):
    """(BLOCK, num_warps) for rows `width` wide: the whole row in one block; more warps for wider rows, so that each
    thread holds at most 16 fp32 values of a row."""
    block = 1 << (width - 1).bit_length()
    return block, min(max(block // 512, 4), 16)


def _moe_rewrite_rmsnorm_programs(device, rows):
    """How many programs the backward runs: a few per SM (each loops over its share of the rows and writes one row of
    fp32 partial sums of the weight's gradient), at most one per row."""
    if device not in _moe_rewrite_rmsnorm_cache:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        _moe_rewrite_rmsnorm_cache[device] = 2 * sms
    return min(rows, _moe_rewrite_rmsnorm_cache[device])


class _MoeRewriteRMSNorm(torch.autograd.Function):
    """The published RMSNorm (see _moe_rewrite_rmsnorm) as one Triton kernel each way; 1/rms is kept per row (fp32)
    for the backward instead of the published norm's fp32 copies of x."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        width = x.shape[-1]
        rows = x.reshape(-1, width)  # a view where x's rows have one stride (the usual case)
        kernels = _moe_rewrite_rmsnorm_kernels()
        out = torch.empty(rows.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
        rstd = torch.empty(rows.shape[0], device=x.device, dtype=torch.float32)
        block, warps = _moe_rewrite_rmsnorm_launch(width)
        kernels["rmsnorm"][(rows.shape[0],)](
            rows, weight, out, rstd, rows.stride(0), width, 1.0 / width, eps, BLOCK=block, num_warps=warps
        )
        ctx.save_for_backward(rows, weight, rstd)
        ctx.x_shape = x.shape
        return out.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: an error, not wrong gradients
    def backward(ctx, grad):
        rows, weight, rstd = ctx.saved_tensors
        width = rows.shape[1]
        grad = grad.reshape(-1, width).contiguous()
        grad_x = torch.empty(rows.shape, device=rows.device, dtype=rows.dtype)
        weight_grad = ctx.needs_input_grad[1]
        programs = _moe_rewrite_rmsnorm_programs(rows.device, rows.shape[0])
        partial = torch.empty(programs if weight_grad else 1, width, device=rows.device, dtype=torch.float32)
        block, warps = _moe_rewrite_rmsnorm_launch(width)
        _moe_rewrite_rmsnorm_kernels()["rmsnorm_backward"][(programs,)](
            rows,
            weight,
            grad,
            rstd,
            grad_x,
            partial,
            rows.shape[0],
            rows.stride(0),
            width,
            WEIGHT_GRAD=weight_grad,
            BLOCK=block,
            num_warps=warps,
        )
        grad_weight = partial.sum(0).to(weight.dtype) if weight_grad else None
        return grad_x.view(ctx.x_shape), grad_weight, None
