"""The sequence-wise balance loss for `--aux-loss` (V3 form), attached to the MoE output for backward."""

import torch


class _MoeRewriteAddAuxLoss(torch.autograd.Function):
    """Returns y unchanged; backward feeds a gradient of 1 to `loss`. The balance loss trains the router without
    changing the model's loss value, the way the V2-form files train theirs (AddAuxiliaryLoss)."""

    @staticmethod
    def forward(ctx, y, loss):
        ctx.loss_dtype, ctx.loss_needs_grad = loss.dtype, loss.requires_grad
        return y

    @staticmethod
    def backward(ctx, grad):
        grad_loss = torch.ones((), dtype=ctx.loss_dtype, device=grad.device) if ctx.loss_needs_grad else None
        return grad, grad_loss


def _moe_rewrite_balance_loss(moe, x, topk_ids, batch_size):
    """Complementary sequence-wise balance loss (DeepSeek-V3 report, section 2.1.2), times config.aux_loss_alpha.

    Per sequence of T tokens: sum over experts i of f_i * P_i, f_i = E / (k * T) * (the sequence's tokens routed to i),
    P_i = the mean over the sequence of the router's sigmoid scores normalised to sum 1 per token; then the mean over
    sequences. x: (batch_size * T, hidden), topk_ids: (batch_size * T, k).
    """
    num_experts, top_k = moe.gate.weight.shape[0], topk_ids.shape[1]
    scores = torch.sigmoid(torch.nn.functional.linear(x.float(), moe.gate.weight.float()))
    scores = (scores / scores.sum(dim=-1, keepdim=True)).view(batch_size, -1, num_experts)
    seq_len = scores.shape[1]
    routed = torch.zeros(batch_size, num_experts, dtype=scores.dtype, device=scores.device)
    routed.scatter_add_(
        1, topk_ids.view(batch_size, -1), torch.ones_like(topk_ids, dtype=scores.dtype).view(batch_size, -1)
    )
    f = routed * (num_experts / (top_k * seq_len))
    return moe.config.aux_loss_alpha * (f * scores.mean(dim=1)).sum(dim=1).mean()


def _moe_rewrite_with_balance_loss(moe, y, x, topk_ids):
    """y, with the balance loss attached for backward (nothing when aux_loss_alpha is 0). y: (batch, T, hidden)."""
    if not moe.config.aux_loss_alpha > 0:
        return y
    return _MoeRewriteAddAuxLoss.apply(y, _moe_rewrite_balance_loss(moe, x, topk_ids, y.shape[0]))
