"""The published `AddAuxiliaryLoss.apply(y, aux_loss)` of the V2-form MoE forward, where aux_loss_alpha = 0 in
training: the gate then returns no aux loss (None), and the published call fails on it (`assert loss.numel() == 1`).
Alpha 0 means the aux loss weighs nothing: here the layer trains without it, as the published loop would with the
loss skipped, and says so once per process (a warning). Wherever the gate returns a loss, the published call runs as
it is. config.moe_rewrite_train_without_aux_loss = True, once the opt-in, is still accepted, silently.
"""

import torch

_moe_rewrite_no_aux_loss_said = []  # the warning below, once per process


def _moe_rewrite_add_aux_loss(add_aux_loss, y, aux_loss, config):
    """add_aux_loss.apply(y, aux_loss) as published; for aux_loss None, y (alpha 0: said once) or a clear error."""
    if aux_loss is not None:
        return add_aux_loss.apply(y, aux_loss)
    if getattr(config, "moe_rewrite_train_without_aux_loss", False):
        return y
    alpha = getattr(config, "aux_loss_alpha", None)
    if isinstance(alpha, (int, float)) and alpha == 0:
        if not _moe_rewrite_no_aux_loss_said and not torch.compiler.is_compiling():
            import warnings

            _moe_rewrite_no_aux_loss_said.append(True)
            warnings.warn(
                "moe-rewrite: config.aux_loss_alpha = 0, so the MoE gate returns no aux loss and the layers train "
                "without it (it would weigh nothing); the published AddAuxiliaryLoss.apply(y, None) would fail here",
                stacklevel=2,
            )
        return y
    raise ValueError(
        f"the MoE gate returned no aux loss in training (config.aux_loss_alpha = {alpha}), and the published "
        "AddAuxiliaryLoss.apply(y, aux_loss) cannot take None; give aux_loss_alpha a positive value, or 0 to train "
        "without the aux loss"
    )
