# Module-level helper of the _init_weights guard (moe_rewrite/codemods/init_weights.py), added to the moe-rewrite block.


def _moe_rewrite_loaded(module):
    """Whether transformers loaded every parameter of `module` itself (not its children) from the checkpoint: 5.x
    marks loaded parameters `_is_hf_initialized`, and 4.x marks none, so there _init_weights runs as before."""
    params = list(module.parameters(recurse=False))
    return bool(params) and all(getattr(p, "_is_hf_initialized", False) for p in params)
