# Methods moe-rewrite adds to the model's PreTrainedModel subclass for `--fuse-experts`: every model class of the file
# (the base model, ForCausalLM, ...) loads and builds with fused routed experts. Written inside a placeholder class,
# as in moe_train_method.py.


class Model:
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Load as PreTrainedModel.from_pretrained does, then fuse the routed experts (moe-rewrite --fuse-experts)."""
        loaded = super().from_pretrained(*args, **kwargs)
        _moe_rewrite_fuse_model(loaded[0] if isinstance(loaded, tuple) else loaded)
        return loaded

    @classmethod
    def _from_config(cls, config, **kwargs):
        """Build as PreTrainedModel._from_config does, then fuse the routed experts (moe-rewrite --fuse-experts)."""
        return _moe_rewrite_fuse_model(super()._from_config(config, **kwargs))
