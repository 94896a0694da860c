"""The compat rewrite's stand-in for transformers.modeling_attn_mask_utils.AttentionMaskConverter, which transformers
5.x removed with its module (DeepSeekMoE 16B's file imports it; training forks call its static helpers). It goes in
the `except ImportError:` branch of the file's own import, so releases that still have the module use theirs.
tests/test_compat_codemod.py checks it gives transformers 4.46's masks, bit for bit.
"""

import torch


class AttentionMaskConverter:
    """transformers 4.x's additive-mask builder (moe-rewrite's copy of its behaviour): 0 where a query attends, the
    dtype's minimum elsewhere."""

    def __init__(self, is_causal, sliding_window=None):
        self.is_causal = is_causal
        self.sliding_window = sliding_window
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"`sliding_window` must be a strictly positive integer, not `{sliding_window}`")

    def to_causal_4d(self, batch_size, query_length, key_value_length, dtype, device="cpu"):
        """The causal (batch, 1, query, key) mask; None for a single query without a sliding window."""
        if not self.is_causal:
            raise ValueError(f"Please use `to_causal_4d` only if {self.__class__} has `is_causal` set to True.")
        if query_length == 1 and self.sliding_window is None:
            return None
        past = key_value_length - query_length
        return self._make_causal_mask((batch_size, query_length), dtype, device, past, self.sliding_window)

    def to_4d(self, attention_mask_2d, query_length, dtype, key_value_length=None):
        """A 2-D padding mask (1 keep, 0 drop) as the (batch, 1, query, key) additive mask, causal if it is."""
        shape = (attention_mask_2d.shape[0], query_length)
        causal = None
        if (query_length > 1 or self.sliding_window is not None) and self.is_causal:
            if key_value_length is None:
                raise ValueError("This attention mask converter is causal: pass `key_value_length`.")
            past = key_value_length - query_length
            causal = self._make_causal_mask(shape, dtype, attention_mask_2d.device, past, self.sliding_window)
        elif self.sliding_window is not None:
            raise NotImplementedError("Sliding window is currently only implemented for causal masking")
        padding = self._expand_mask(attention_mask_2d, dtype, tgt_len=query_length).to(attention_mask_2d.device)
        if causal is None:
            return padding
        return causal.masked_fill(padding.bool(), torch.finfo(dtype).min)

    @staticmethod
    def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0, sliding_window=None):
        """Query i sees keys up to past + i (and, with a sliding window, none more than `sliding_window` back);
        an expanded (batch, 1, query, past + query) view."""
        batch, query = input_ids_shape
        keys = query + past_key_values_length
        blocked = torch.ones(query, keys, dtype=torch.bool, device=device).triu(past_key_values_length + 1)
        if sliding_window is not None:
            blocked |= torch.ones_like(blocked).tril(past_key_values_length - sliding_window - 1)
        mask = torch.zeros(query, keys, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)
        return mask[None, None, :, :].expand(batch, 1, query, keys)

    @staticmethod
    def _expand_mask(mask, dtype, tgt_len=None):
        """(batch, key) of 1 keep / 0 drop -> (batch, 1, tgt_len, key): 0 where kept, the dtype's minimum where not
        (1 - value, so a value other than 0 and 1 gives what 4.x gave)."""
        batch, keys = mask.size()
        query = keys if tgt_len is None else tgt_len
        inverted = 1.0 - mask[:, None, None, :].expand(batch, 1, query, keys).to(dtype)
        return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)

    @staticmethod
    def _unmask_unattended(expanded_mask, min_dtype):
        """Rows that mask every key attend to every key instead (SDPA's memory-efficient path gives NaN for them)."""
        if expanded_mask.dtype == torch.bool:
            raise ValueError(
                "AttentionMaskConverter._unmask_unattended expects a float `expanded_mask`, got a BoolTensor."
            )
        return expanded_mask.mul(~torch.all(expanded_mask == min_dtype, dim=-1, keepdim=True))

    @staticmethod
    def _ignore_causal_mask_sdpa(
        attention_mask, inputs_embeds, past_key_values_length, sliding_window=None, is_training=False
    ):
        """Whether SDPA's own is_causal can stand for the mask (no padding, a square or single-query causal mask)."""
        query = inputs_embeds.shape[1]
        keys = query + past_key_values_length
        tracing = torch.jit.is_tracing() or isinstance(inputs_embeds, torch.fx.Proxy) or torch.compiler.is_compiling()
        square = query == 1 or keys == query
        window_fits = sliding_window is None or keys < sliding_window
        if attention_mask is None:
            return bool((is_training or not tracing) and square and window_fits)
        if not window_fits or len(attention_mask.shape) == 4:
            return False
        return bool(not tracing and torch.all(attention_mask == 1) and square)
