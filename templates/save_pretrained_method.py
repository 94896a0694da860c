# The method moe-rewrite adds to the model's PreTrainedModel subclass in every rewrite: save_pretrained writes fused
# experts (moe_rewrite_fuse_experts) as the checkpoint's own per-expert keys, so saved checkpoints load anywhere, and
# the patched code files beside them, so the directory reloads with trust_remote_code as it is.
# Written inside a placeholder class, as in moe_train_method.py.


class Model:
    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as PreTrainedModel.save_pretrained does, fused routed experts written as per-expert keys (moe-rewrite);
        a `state_dict` passed in (a full state dict gathered from FSDP, say) is converted the same way; the patched
        modeling file and the files it imports are written beside the weights."""
        writes = args[0] if args else kwargs.get("is_main_process", True)
        if not writes:
            pass  # this process writes nothing
        elif len(args) > 1:  # state_dict passed by position, after is_main_process
            args = (args[0], _moe_rewrite_unfuse_state_dict(args[1], self), *args[2:])
        else:
            kwargs["state_dict"] = _moe_rewrite_unfuse_state_dict(kwargs.get("state_dict"), self)
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if writes:
            _moe_rewrite_save_code(self, save_directory)
        return result
