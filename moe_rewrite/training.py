"""Training-loop helpers for files rewritten with `--bias-update` (aux-loss-free balancing).

Each rewritten MoE layer counts its routed tokens during training; once per optimizer step its
`moe_rewrite_update_bias()` moves `e_score_correction_bias` by RATE * sign(mean load - load), with the counts summed
over data-parallel ranks. Call it yourself, or let one of these do it:

    from moe_rewrite.training import register_bias_update
    register_bias_update(model, optimizer)            # after every optimizer.step()

    from moe_rewrite.training import BiasUpdateCallback
    Trainer(..., callbacks=[BiasUpdateCallback()])    # transformers' Trainer

Every rewritten MoE layer can hold its routed experts in two fused parameters instead of 3 * E nn.Linear weights
(faster, most of all under FSDP). Models of files rewritten with the defaults load fused; for files rewritten with
--no-fuse-experts, fuse after loading and before wrapping the model:

    from moe_rewrite.training import fuse_experts
    fuse_experts(model)                               # then FSDP / DDP / Trainer, optimizer

Needs only torch at run time (and transformers for the callback), not the rewriter's own dependencies.
"""

from __future__ import annotations

import sys
from typing import Any


def _layers_with(model: Any, method: str, missing: str) -> list:
    """The model's modules that have the generated `method`; ValueError(missing) when none has."""
    layers = [m for m in model.modules() if callable(getattr(m, method, None))]
    if not layers:
        raise ValueError(missing)
    return layers


FUSE_MISSING = "no MoE layer of this model has moe_rewrite_fuse_experts: rewrite its modeling file again"


def fuse_experts(model: Any) -> int:
    """Fuse the routed experts of every rewritten MoE layer (moe_rewrite_fuse_experts); returns how many layers."""
    layers = _layers_with(model, "moe_rewrite_fuse_experts", FUSE_MISSING)
    for layer in layers:
        layer.moe_rewrite_fuse_experts()
    return len(layers)


def unfuse_state_dict(model: Any, state_dict: dict | None = None) -> dict:
    """`state_dict` (default: the model's own) with fused experts written as the checkpoint's per-expert keys, what the
    model's save_pretrained writes. For checkpoints saved another way (torch.save, accelerate's save_model), whose fused
    names from_pretrained does not load; `model` is any model built from the patched file (the meta device will do)."""
    layer = _layers_with(model, "moe_rewrite_fuse_experts", FUSE_MISSING)[0]
    unfused = sys.modules[type(layer).__module__]._moe_rewrite_unfuse_state_dict(state_dict, model)
    return dict(model.state_dict()) if unfused is None else unfused


def bias_update_layers(model: Any) -> list:
    """The model's MoE layers that were rewritten with --bias-update."""
    return _layers_with(model, "moe_rewrite_update_bias", "no MoE layer of this model was rewritten with --bias-update")


def update_biases(model: Any) -> None:
    """Apply one bias update to every rewritten MoE layer (once per optimizer step)."""
    for layer in bias_update_layers(model):
        layer.moe_rewrite_update_bias()


def register_bias_update(model: Any, optimizer: Any):
    """Update the biases after every `optimizer.step()`. Returns the hook handle (`.remove()` undoes it)."""
    layers = bias_update_layers(model)

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        for layer in layers:
            layer.moe_rewrite_update_bias()

    return optimizer.register_step_post_hook(after_step)


def __getattr__(name: str) -> Any:
    # The callback subclasses transformers.TrainerCallback: build it only when asked, so importing this module
    # does not need transformers.
    if name == "BiasUpdateCallback":
        from transformers import TrainerCallback

        class BiasUpdateCallback(TrainerCallback):
            """transformers Trainer callback: one bias update per optimizer step."""

            def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
                update_biases(model)

        globals()["BiasUpdateCallback"] = BiasUpdateCallback
        return BiasUpdateCallback
    raise AttributeError(name)
