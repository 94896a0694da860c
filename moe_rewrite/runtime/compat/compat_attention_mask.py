"""The compat rewrite's stand-in for transformers.modeling_attn_mask_utils._prepare_4d_attention_mask, which
transformers 5.x removed with its module; it goes in the `except ImportError:` branch of the file's own import.
tests/test_compat_codemod.py checks it gives transformers 4.46's masks, bit for bit.
"""

import torch


def _prepare_4d_attention_mask(mask, dtype, tgt_len=None):
    """(batch, key) of 1 keep / 0 drop -> the (batch, 1, tgt_len, key) additive mask of transformers 4.x (moe-rewrite's
    copy of its behaviour): 0 where kept, the dtype's minimum where not."""
    batch, keys = mask.size()
    query = keys if tgt_len is None else tgt_len
    inverted = 1.0 - mask[:, None, None, :].expand(batch, 1, query, keys).to(dtype)
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)
