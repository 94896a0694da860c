"""transformers compatibility: helpers for APIs that later releases removed (in the block) and stand-ins for removed
imports (import fallbacks: compat.py puts them in the `except ImportError:` of the file's own import). Imports
nothing.

Sections (moe_rewrite/runtime/__init__.py SECTION_LIST, in its order):

    compat_cache: Cache methods that later transformers releases removed
    compat_rope_scaling: config.rope_scaling as the file expects it on transformers 5.x
    compat_generation: generation position ids sliced as transformers 4.x passed them
    compat_fx_available: is_torch_fx_available, which transformers 5.0 removed
    compat_causal_mask: _prepare_4d_causal_attention_mask, which transformers 5.x removed
    compat_attn_mask_converter: AttentionMaskConverter, which transformers 5.x removed with its module
    compat_attention_mask: _prepare_4d_attention_mask, which transformers 5.x removed with its module
    compat_sdpa_causal_mask: _prepare_4d_causal_attention_mask_for_sdpa, which transformers 5.x removed with its module
    compat_llama_attention: LlamaAttention and LlamaFlashAttention2 as transformers 4.46/4.47 had them
"""
