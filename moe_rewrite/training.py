"""Training-loop helpers for files rewritten with `--bias-update` (aux-loss-free balancing).

Each rewritten MoE layer counts its routed tokens during training; once per optimizer step its
`moe_rewrite_update_bias()` moves `e_score_correction_bias` by RATE * sign(mean load - load), with the counts summed
over data-parallel ranks. Call it yourself, or let one of these do it:

    from moe_rewrite.training import register_bias_update
    register_bias_update(model, optimizer)            # after every optimizer.step()

    from moe_rewrite.training import BiasUpdateCallback
    Trainer(..., callbacks=[BiasUpdateCallback()])    # transformers' Trainer

Every rewritten MoE layer can also hold its routed experts in two fused parameters instead of 3 * E nn.Linear
weights (faster, most of all under FSDP); do it after loading and before wrapping the model:

    from moe_rewrite.training import fuse_experts
    fuse_experts(model)                               # then FSDP / DDP / Trainer, optimizer

Needs only torch at run time (and transformers for the callback), not the rewriter's own dependencies.
"""

from __future__ import annotations

from typing import Any


def fuse_experts(model: Any) -> int:
    """Fuse the routed experts of every rewritten MoE layer (moe_rewrite_fuse_experts); returns how many layers."""
    layers = [m for m in model.modules() if callable(getattr(m, "moe_rewrite_fuse_experts", None))]
    if not layers:
        raise ValueError("no MoE layer of this model has moe_rewrite_fuse_experts: rewrite its modeling file again")
    for layer in layers:
        layer.moe_rewrite_fuse_experts()
    return len(layers)


def unfuse_state_dict(state_dict: dict) -> dict:
    """The same state dict with every fused experts' `...experts.gate_up_proj` / `...experts.down_proj` pair written as
    the original per-expert keys (`...experts.{i}.gate_proj.weight`, ...), in place of the pair.

    For full state dicts gathered from a wrapped model (FSDP1 FULL_STATE_DICT, torch.distributed.checkpoint's
    get_model_state_dict(full_state_dict=True)), which keep the parameters' own names: pass the result to
    save_pretrained(state_dict=...) to write a checkpoint in the model's original layout.
    """
    out: dict = {}
    for key, value in state_dict.items():
        if key.endswith("experts.down_proj") and key[: -len("down_proj")] + "gate_up_proj" in state_dict:
            continue  # written with its gate_up_proj
        if not key.endswith("experts.gate_up_proj") or key[: -len("gate_up_proj")] + "down_proj" not in state_dict:
            out[key] = value
            continue
        prefix = key[: -len("gate_up_proj")]
        down = state_dict[prefix + "down_proj"]
        inter = down.shape[2]
        for i in range(value.shape[0]):
            out[f"{prefix}{i}.gate_proj.weight"] = value[i, :inter].clone()
            out[f"{prefix}{i}.up_proj.weight"] = value[i, inter:].clone()
            out[f"{prefix}{i}.down_proj.weight"] = down[i].clone()
    return out


def bias_update_layers(model: Any) -> list:
    """The model's MoE layers that were rewritten with --bias-update."""
    layers = [m for m in model.modules() if callable(getattr(m, "moe_rewrite_update_bias", None))]
    if not layers:
        raise ValueError("no MoE layer of this model was rewritten with --bias-update")
    return layers


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
