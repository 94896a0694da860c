"""The compat rewrite's stand-in for transformers.modeling_attn_mask_utils._prepare_4d_causal_attention_mask, which
transformers 5.x removed. It goes in the `except ImportError:` branch of the file's own import, so releases that still
have the module use theirs. tests/test_compat_codemod.py checks it gives the same masks, bit for bit.
"""

import torch


def _prepare_4d_causal_attention_mask(
    attention_mask, input_shape, inputs_embeds, past_key_values_length, sliding_window=None
):
    """The additive (batch, 1, query, key) mask of transformers 4.x (moe-rewrite's copy of its behaviour): 0 where a
    query attends, the dtype's minimum for future keys and for keys whose 2-D mask value is not 1; None for a single
    query without a mask. A 4-D mask of 1s and 0s is inverted the same way."""
    if sliding_window is not None:
        raise NotImplementedError("moe-rewrite's fallback for _prepare_4d_causal_attention_mask has no sliding window")
    dtype = inputs_embeds.dtype
    batch, query = input_shape[0], input_shape[-1]
    key = query + past_key_values_length
    if attention_mask is not None and attention_mask.dim() == 4:
        if tuple(attention_mask.shape) != (batch, 1, query, key):
            raise ValueError(
                f"Incorrect 4D attention_mask shape: {tuple(attention_mask.shape)}; expected: {(batch, 1, query, key)}."
            )
        inverted = 1.0 - attention_mask
        return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)
    device = inputs_embeds.device if attention_mask is None else attention_mask.device
    blocked = None
    if query > 1:  # query i sees keys up to past_key_values_length + i
        blocked = torch.ones(query, key, dtype=torch.bool, device=device).triu(past_key_values_length + 1)
    if attention_mask is not None:
        padding = (1.0 - attention_mask[:, None, None, :].to(dtype)).to(torch.bool)
        blocked = padding if blocked is None else padding | blocked
    if blocked is None:
        return None
    mask = torch.zeros(batch, 1, query, key, dtype=dtype, device=device)
    return mask.masked_fill(blocked.expand(batch, 1, query, key), torch.finfo(dtype).min)
