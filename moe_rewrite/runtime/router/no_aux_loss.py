"""The published `AddAuxiliaryLoss.apply(y, aux_loss)` of the V2-form MoE forward, where aux_loss_alpha = 0 in
training: the gate then returns no aux loss (None), and the published call fails on it (`assert loss.numel() == 1`).
Here it says why, or, with config.moe_rewrite_train_without_aux_loss = True, trains without the aux loss (what
alpha = 0 means). Wherever the gate returns a loss, the published call runs as it is.
"""


def _moe_rewrite_add_aux_loss(add_aux_loss, y, aux_loss, config):
    """add_aux_loss.apply(y, aux_loss) as published; for aux_loss None, y (opted in) or a clear error."""
    if aux_loss is not None:
        return add_aux_loss.apply(y, aux_loss)
    if getattr(config, "moe_rewrite_train_without_aux_loss", False):
        return y
    raise ValueError(
        f"the MoE gate returned no aux loss in training (config.aux_loss_alpha = "
        f"{getattr(config, 'aux_loss_alpha', None)}), and the published AddAuxiliaryLoss.apply(y, aux_loss) cannot "
        "take None; to train without the aux loss, set config.moe_rewrite_train_without_aux_loss = True (on "
        "model.config, or in config.json), or give aux_loss_alpha a positive value"
    )
