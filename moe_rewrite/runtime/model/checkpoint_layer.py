"""Module-level helper for `--gradient-checkpointing` (V3 form), added to the moe-rewrite block."""


def _moe_rewrite_checkpoint_layer(checkpoint, layer, *args, **kwargs):
    """Run one decoder layer under transformers' gradient-checkpointing function.

    Positional arguments (the hidden states) go through the checkpoint; keyword arguments are bound first, because
    reentrant checkpointing, transformers' default, takes no keyword arguments.
    """
    import functools

    return checkpoint(functools.partial(layer.__call__, **kwargs), *args)
