"""Model-level fixes outside the MoE layers: packed documents, attention through SDPA, the chunked causal-LM loss,
decoder-layer checkpointing, the RoPE tables outside torch.compile, _init_weights guards. Imports kernels/
(dispatch's settings, the cross-entropy kernel).

Sections (moe_rewrite/runtime/__init__.py SECTION_LIST, in its order):

    packed_attention: packed documents' kernels: SDPA per document, varlen_attn, FlexAttention with a block mask
    packing: packed documents (restarting position ids, cu_seq_lens_*) each attending to itself; num_items_in_batch
    attention: the attention core through torch's scaled_dot_product_attention, its backend chosen once per shape
    lm_loss: the causal-LM loss in chunks, without float32 logits over the vocabulary, in training with labels
    checkpoint_layer: gradient_checkpointing_enable() checkpoints the decoder layers
    rope_tables: the RoPE modules' table rebuilds kept out of torch.compile's graphs
    init_guards: _init_weights keeps loaded weights and rebuilds non-persistent buffers on transformers 5.x
"""
