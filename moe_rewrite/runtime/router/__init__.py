"""Router training, each section generated only with its option: the sequence-wise aux loss, aux-loss-free bias
updates, AddAuxiliaryLoss without an aux loss. Imports kernels/ (dispatch's options).

Sections (moe_rewrite/runtime/__init__.py SECTION_LIST, in its order):

    aux_loss: the sequence-wise balance loss (--aux-loss)
    bias_update: aux-loss-free balancing, bias += RATE * sign(mean load - load) (--bias-update)
    no_aux_loss: AddAuxiliaryLoss where aux_loss_alpha = 0 gives no aux loss: trained without it, said once
"""
