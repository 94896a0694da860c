"""The compat rewrite's stand-ins for LlamaAttention and LlamaFlashAttention2 from
transformers.models.llama.modeling_llama as transformers 4.46/4.47 had them. 4.48 removed LlamaFlashAttention2 and
changed LlamaAttention: it takes RoPE's (cos, sin) from the caller (`position_embeddings`) and returns two values, not
three. DeepSeek-VL2's and DeepSeek-OCR's language models build these classes for `use_mla: false` (ATTENTION_CLASSES'
"mha_eager" and "mha_flash_attention_2") with `(config=config, layer_idx=layer_idx)`, call them with `position_ids`
and unpack three values. They go in the `except ImportError:` branch of the file's import, so 4.46/4.47 use their own.
tests/test_compat_codemod.py checks the eager class against 4.46.3's, float32, forward and gradients.

What 4.46 offered beyond those files' use is refused where it is built (NotImplementedError naming it): a
`rope_scaling` (the files pass theirs to their own MLA RoPE) and `pretraining_tp` > 1.
"""

import torch


class LlamaAttention(torch.nn.Module):
    """Multi-head (grouped-query) attention with RoPE from position_ids, computed as transformers 4.46 did (eager)."""

    def __init__(self, config, layer_idx=None):
        super().__init__()
        scaling = getattr(config, "rope_scaling", None) or {}  # 5.x may fill in {"rope_type": "default", ...}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise NotImplementedError("moe-rewrite's stand-in for LlamaAttention has the default RoPE only")
        if getattr(config, "pretraining_tp", 1) > 1:
            raise NotImplementedError("moe-rewrite's stand-in for LlamaAttention has no pretraining_tp > 1")
        self.config = config
        self.layer_idx = layer_idx
        self.attention_dropout = config.attention_dropout
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", self.hidden_size // self.num_heads)
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = torch.nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=bias)
        # Not a buffer: transformers 5 leaves non-persistent buffers uninitialised when it loads on the meta device.
        # Computed on the CPU in float32, as 4.46 built its buffer, and kept per device.
        self._moe_rewrite_inv_freq = {}

    def _rope(self, x, position_ids):
        """(cos, sin) for position_ids in x's dtype: 4.46's LlamaRotaryEmbedding with the default rope type."""
        inv_freq = self._moe_rewrite_inv_freq.get(x.device)
        if inv_freq is None:
            head_dim = getattr(self.config, "head_dim", None) or self.hidden_size // self.num_heads
            dim = int(head_dim * getattr(self.config, "partial_rotary_factor", 1.0))
            exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
            inv_freq = self._moe_rewrite_inv_freq[x.device] = (1.0 / (self.rope_theta**exponents)).to(x.device)
        inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        device_type = x.device.type if x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)

    def _project(self, hidden_states, position_ids, past_key_value, cache_position, position_embeddings):
        """q, k, v as (batch, heads, query, head_dim) with RoPE applied and the cache updated."""
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        key_states, value_states = key_states.transpose(1, 2), value_states.transpose(1, 2)
        if position_embeddings is None:
            cos, sin = self._rope(value_states, position_ids)
        else:
            cos, sin = position_embeddings
        half = self.head_dim // 2
        q1, q2 = query_states[..., :half], query_states[..., half:]
        k1, k2 = key_states[..., :half], key_states[..., half:]
        query_states = (query_states * cos.unsqueeze(1)) + (torch.cat((-q2, q1), dim=-1) * sin.unsqueeze(1))
        key_states = (key_states * cos.unsqueeze(1)) + (torch.cat((-k2, k1), dim=-1) * sin.unsqueeze(1))
        if past_key_value is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, cache_kwargs)
        return query_states, key_states, value_states

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_value=None,
        output_attentions=False,
        use_cache=False,
        cache_position=None,
        position_embeddings=None,
        **kwargs,
    ):
        import math

        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._project(
            hidden_states, position_ids, past_key_value, cache_position, position_embeddings
        )
        if self.num_key_value_groups > 1:  # repeat_kv
            b, kv_heads, length, dim = key_states.shape
            shape = (b, kv_heads, self.num_key_value_groups, length, dim)
            key_states = key_states[:, :, None].expand(shape).reshape(b, -1, length, dim)
            value_states = value_states[:, :, None].expand(shape).reshape(b, -1, length, dim)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = torch.nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights if output_attentions else None, past_key_value


class LlamaFlashAttention2(LlamaAttention):
    """The same projections and RoPE, attention through flash-attn with a 2-D padding mask, as 4.46 did."""

    def __init__(self, *args, **kwargs):
        from transformers.utils import is_flash_attn_greater_or_equal_2_10

        super().__init__(*args, **kwargs)
        self._flash_attn_uses_top_left_mask = not is_flash_attn_greater_or_equal_2_10()

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_value=None,
        output_attentions=False,
        use_cache=False,
        cache_position=None,
        position_embeddings=None,
        **kwargs,
    ):
        from transformers.modeling_flash_attention_utils import _flash_attention_forward

        bsz, q_len, _ = hidden_states.size()
        query_states, key_states, value_states = self._project(
            hidden_states, position_ids, past_key_value, cache_position, position_embeddings
        )
        # flash-attn takes (batch, query, heads, head_dim)
        query_states, key_states, value_states = (t.transpose(1, 2) for t in (query_states, key_states, value_states))
        if query_states.dtype == torch.float32:  # float32 activations (upcast norms): back to the weights' dtype
            if torch.is_autocast_enabled():
                target_dtype = torch.get_autocast_dtype("cuda")
            elif hasattr(self.config, "_pre_quantization_dtype"):
                target_dtype = self.config._pre_quantization_dtype
            else:
                target_dtype = self.q_proj.weight.dtype
            query_states, key_states, value_states = (
                t.to(target_dtype) for t in (query_states, key_states, value_states)
            )
        attn_output = _flash_attention_forward(
            query_states,
            key_states,
            value_states,
            attention_mask,
            q_len,
            position_ids=position_ids,
            dropout=self.attention_dropout if self.training else 0.0,
            sliding_window=getattr(self, "sliding_window", None),
            use_top_left_mask=self._flash_attn_uses_top_left_mask,
            is_causal=self.is_causal,
        )
        attn_output = self.o_proj(attn_output.reshape(bsz, q_len, -1).contiguous())
        return attn_output, None, past_key_value
