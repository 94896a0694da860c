"""Module-level helper of the compat rewrite (moe_rewrite/codemods/compat.py), added to the moe-rewrite block: the
`kwargs.get("position_ids", None)` of prepare_inputs_for_generation goes through it.
"""


def _moe_rewrite_generation_position_ids(position_ids, input_ids):
    """The position ids of the tokens in `input_ids`. transformers 5.12 and 5.13 (measured; not 5.0 or 5.24) pass
    generate()'s position ids for the whole sequence so far, where earlier releases passed none and the file computed
    them; the file slices only the ones it computes, so after the first step they would not match the uncached
    tokens."""
    if position_ids is not None and position_ids.shape[-1] > input_ids.shape[-1]:
        return position_ids[..., -input_ids.shape[-1] :]
    return position_ids
