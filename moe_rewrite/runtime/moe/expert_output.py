"""The expert output: act_fn(gate) * up through the down projection, back to token order, weighted by the routing
weights and summed per token, as one autograd node that keeps only the gate/up rows (and, for adapters on the down
projection, the same steps as nodes of their own: SwiGLU and the weighted combine through the Triton kernels). Always
generated.
"""

import torch

from ..kernels.dispatch import _moe_rewrite_triton
from ..kernels.triton_sum_rows import _moe_rewrite_sum_rows, _moe_rewrite_sum_rows_backward
from ..kernels.triton_swiglu import _moe_rewrite_swiglu, _moe_rewrite_swiglu_backward
from .grouped_linear import _moe_rewrite_kept
from .grouped_mm import _moe_rewrite_gmm
from .route import (
    _moe_rewrite_combine,
    _moe_rewrite_gather,
    _moe_rewrite_row_weights,
    _moe_rewrite_unsort,
    _MoeRewriteRoute,
)


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
        out = _moe_rewrite_gmm(kernel, hidden, stacked, offsets, "fwd", source.scale)
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
            # unweighted
            grad_hidden = _moe_rewrite_gmm(kernel, grad_rows, stacked, offsets, "dgrad", ctx.source.scale)
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
        grad_hidden = _moe_rewrite_gmm(kernel, grad_rows, stacked, offsets, "dgrad", ctx.source.scale)  # unweighted
        stacked = grad_rows = None  # freed before the gradients below are allocated
        per_row = (grad_hidden * hidden).sum(dim=-1, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_weight = _moe_rewrite_row_weight_grad(ctx, per_row, order, topk_weight)
        hidden = per_row = None
        if not ctx.needs_input_grad[0]:
            return (None, grad_weight, *(None,) * 7, *grads)
        grad_hidden = torch.mul(grad_hidden, row_weight, out=grad_hidden)
        if silu and torch.compiler.is_compiling():  # out= into halves of a buffer breaks the graph; it fuses these
            grad_gate = torch.ops.aten.silu_backward(grad_hidden * up, gate)
            return (torch.cat([grad_gate, grad_hidden * act], dim=-1), grad_weight, *(None,) * 7, *grads)
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
