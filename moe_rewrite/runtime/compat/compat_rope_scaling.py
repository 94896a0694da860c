"""Module-level helper of the compat rewrite (moe_rewrite/codemods/compat.py), added to the moe-rewrite block: the
file's reads of `config.rope_scaling` go through it.
"""


def _moe_rewrite_rope_scaling(config):
    """config.rope_scaling as transformers 4.x gives it: None for plain RoPE. transformers 5 fills a missing
    rope_scaling in as {"rope_type": "default", "rope_theta": ...}, which the file would read as a scaling and fail
    on its "type" key; a real scaling keeps its "type" (5.x adds "rope_type" beside it), so it passes unchanged."""
    scaling = config.rope_scaling
    if isinstance(scaling, dict) and "type" not in scaling and scaling.get("rope_type") == "default":
        return None
    return scaling
