"""The compat rewrite's stand-in for transformers.modeling_attn_mask_utils._prepare_4d_causal_attention_mask_for_sdpa,
which transformers 5.x removed with its module; it goes in the `except ImportError:` branch of the file's own import,
and needs nothing else from the file. tests/test_compat_codemod.py checks it gives transformers 4.46's masks, bit
for bit.
"""

import torch


def _prepare_4d_causal_attention_mask_for_sdpa(
    attention_mask, input_shape, inputs_embeds, past_key_values_length, sliding_window=None
):
    """The mask transformers 4.x gave SDPA (moe-rewrite's copy of its behaviour): None where SDPA's is_causal stands
    for it (no padding, a square or single-query causal mask, not tracing), a 4-D mask passed through as it is,
    otherwise the additive causal (batch, 1, query, key) mask, with fully masked rows attending everywhere on CUDA."""
    if sliding_window is not None:
        raise NotImplementedError("moe-rewrite's fallback for the SDPA causal mask has no sliding window")
    dtype, device = inputs_embeds.dtype, inputs_embeds.device
    batch, query = input_shape[0], input_shape[-1]
    keys = query + past_key_values_length
    tracing = torch.jit.is_tracing() or isinstance(inputs_embeds, torch.fx.Proxy) or torch.compiler.is_compiling()
    square = query == 1 or keys == query
    if attention_mask is None:
        if not tracing and square:
            return None
    elif attention_mask.dim() == 4:
        return _moe_rewrite_unmask_unattended(attention_mask, tracing)
    elif not tracing and square and torch.all(attention_mask == 1):
        return None
    blocked = None
    if query > 1:  # query i sees keys up to past_key_values_length + i
        device = device if attention_mask is None else attention_mask.device
        blocked = torch.ones(query, keys, dtype=torch.bool, device=device).triu(past_key_values_length + 1)
    if attention_mask is not None:
        padding = (1.0 - attention_mask[:, None, None, :].expand(batch, 1, query, keys).to(dtype)).to(torch.bool)
        blocked = padding if blocked is None else padding | blocked
        device = attention_mask.device
    if blocked is None:
        return None
    mask = torch.zeros(batch, 1, query, keys, dtype=dtype, device=device)
    mask = mask.masked_fill(blocked.expand(batch, 1, query, keys), torch.finfo(dtype).min)
    return mask if attention_mask is None else _moe_rewrite_unmask_unattended(mask, tracing)


def _moe_rewrite_unmask_unattended(mask, tracing):
    """On CUDA, rows that mask every key attend to every key instead (SDPA's memory-efficient path gives NaN)."""
    if tracing or mask.device.type != "cuda":
        return mask
    return mask.mul(~torch.all(mask == torch.finfo(mask.dtype).min, dim=-1, keepdim=True))
