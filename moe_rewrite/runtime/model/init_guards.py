"""The helpers of the _init_weights edits (moe_rewrite/codemods/init_weights.py): keep what transformers 5.x loaded,
rebuild the non-persistent buffers it leaves unset."""

import torch


def _moe_rewrite_loaded(module):
    """Whether transformers loaded every parameter of `module` itself (not its children) from the checkpoint: 5.x
    marks loaded parameters `_is_hf_initialized`, and 4.x marks none, so there _init_weights runs as before. Fused
    experts' projection views count as loaded: their weight is a view of the fused parameters, which hold their own
    values (an nn.Linear re-init through the view would overwrite the loaded experts)."""
    if "_moe_rewrite_experts" in module.__dict__:
        return True
    params = list(module.parameters(recurse=False))
    return bool(params) and all(getattr(p, "_is_hf_initialized", False) for p in params)


def _moe_rewrite_records_init(*classes):
    """Make each instance of these classes (the file's modules with non-persistent buffers: the RoPE tables) keep the
    arguments it was built with, so _moe_rewrite_restore_buffers can build a fresh copy. The outermost __init__
    records, so a subclass keeps its own arguments, not those it passes to super().__init__."""
    import functools

    def recording(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            self.__dict__.setdefault("_moe_rewrite_init_args", (args, kwargs))
            init(self, *args, **kwargs)

        return __init__

    for cls in classes:
        cls.__init__ = recording(cls.__init__)


def _moe_rewrite_restore_buffers(module):
    """Recompute the non-persistent buffers of a module of a class given to _moe_rewrite_records_init, from a fresh copy
    built on the CPU. transformers 5 builds the model on the meta device and then fills non-persistent buffers with
    uninitialised memory (torch.empty_like), since no checkpoint holds them (huggingface/transformers#48892); the
    RoPE tables would hold garbage. On 4.x the fresh copy has the values the module already holds."""
    recorded = module.__dict__.get("_moe_rewrite_init_args")
    # nn.Module's own record of its non-persistent buffers (private; nn.Module has no public accessor for it).
    names = [name for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None]
    if recorded is None or not names:
        return
    args, kwargs = recorded
    with torch.device("cpu"):
        fresh = type(module)(*args, **kwargs)
    with torch.no_grad():
        for name in names:
            old, new = module._buffers[name], fresh._buffers[name]
            if old.shape == new.shape:
                old.copy_(new)
            else:  # the module grew the table since: start again from the fresh one's size
                module._buffers[name] = new.to(device=old.device, dtype=old.dtype)
                module.__dict__.update({k: v for k, v in fresh.__dict__.items() if type(v) in (int, float)})
