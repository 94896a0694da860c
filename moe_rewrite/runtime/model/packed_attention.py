"""The kernels packed documents run on (packing.py chooses among them, once per device, dtype and head dims): SDPA per
document through the caller's causal core, torch's varlen_attn over the flattened tokens, and FlexAttention with a
document-causal block mask built from the documents with tensor ops. A compiled layer runs varlen_attn or the
caller's core with packing.py's document-causal mask.
"""

import torch

# _moe_rewrite_options marks this module as holding generated caches (tests/conftest.py empties them by that name)
from ..kernels.dispatch import _moe_rewrite_options  # noqa: F401

_moe_rewrite_packed_attention_cache = {}  # "flex" -> flex_attention, compiled once per process
MOE_REWRITE_FLEX_BLOCK = 128  # FlexAttention's block: the flattened tokens are padded to a multiple of it


def _moe_rewrite_attention_per_document(query, key, value, documents, causal_core):
    """Each document's slice through `causal_core`, concatenated: exactly each document alone (one launch per
    document: the fallback, and the fastest where documents are few and long)."""
    rows, heads, length, _ = query.shape
    starts = documents.starts
    outs = []
    for start, end in zip(starts[:-1], starts[1:]):
        row = start // length  # a document never crosses rows
        a, b = start - row * length, end - row * length
        outs.append(causal_core(query[row : row + 1, :, a:b], key[row : row + 1, :, a:b], value[row : row + 1, :, a:b]))
    out = torch.cat(outs, dim=2)  # (1, heads, rows * length, v_dim): the rows one after the other
    return out[0].view(heads, rows, length, -1).transpose(0, 1) if rows > 1 else out


def _moe_rewrite_varlen(query, key, value, documents, scale):
    """torch.nn.attention.varlen.varlen_attn (torch >= 2.10) over (tokens, heads, dim), causal within each
    document (window (-1, 0)); value padded to the query's head dim where the kernel needs one dim. Reads the
    documents' tensors and longest length only (a compiled layer runs it too: varlen_attn is a custom operator)."""
    from torch.nn.attention.varlen import varlen_attn

    cu = documents.cu_seqlens.to(query.device)
    v_dim = value.shape[-1]
    if v_dim != query.shape[-1]:
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - v_dim))
    longest = documents.max_length
    out = varlen_attn(query, key, value, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))
    return out[..., :v_dim]


def _moe_rewrite_flex(query, key, value, documents, scale):
    """FlexAttention (compiled once per process) over (tokens, heads, dim) with a document-causal block mask built
    from the documents (cached on them: one per forward, shared by the layers); tokens padded to a multiple of its
    block, the padding a document of its own."""
    tokens, block = query.shape[0], MOE_REWRITE_FLEX_BLOCK
    padded = -(-tokens // block) * block
    block_mask = documents._cache.get("block_mask")
    if block_mask is None:
        block_mask = documents._cache["block_mask"] = _moe_rewrite_document_block_mask(documents, padded, query.device)
    q, k, v = (
        torch.nn.functional.pad(t, (0, 0, 0, 0, 0, padded - tokens)).transpose(0, 1)[None] for t in (query, key, value)
    )
    out = _moe_rewrite_flex_attention()(q, k, v, block_mask=block_mask, scale=scale)
    return out[0].transpose(0, 1)[:tokens]


def _moe_rewrite_flex_attention():
    """flex_attention, compiled once per process (its eager form materialises the scores; off CUDA it stays eager)."""
    if "flex" not in _moe_rewrite_packed_attention_cache:
        from torch.nn.attention.flex_attention import flex_attention

        _moe_rewrite_packed_attention_cache["flex"] = torch.compile(flex_attention)
    return _moe_rewrite_packed_attention_cache["flex"]


def _moe_rewrite_document_block_mask(documents, padded, device):
    """The BlockMask of `q >= kv and same document` over `padded` tokens (the padding one more document), built with
    tensor ops from the documents (create_block_mask evaluates the mask on every pair: 10-20 ms a call): a block
    pair is visited where the key block's last document reaches the query block's first and the key block is not
    after it; full (no mask_mod) where both blocks lie in one document and the key block is before the query
    block."""
    from torch.nn.attention.flex_attention import BlockMask

    block = MOE_REWRITE_FLEX_BLOCK
    ids = documents.ids.reshape(-1).to(device)
    ids = torch.cat([ids, ids.new_full((padded - ids.numel(),), int(ids[-1]) + 1)]) if padded > ids.numel() else ids
    blocks = ids.view(-1, block)
    first, last = blocks[:, 0], blocks[:, -1]  # documents are in order: a block's smallest and largest
    n = blocks.shape[0]
    q_index = torch.arange(n, device=device)[:, None]
    kv_index = torch.arange(n, device=device)[None, :]
    visited = (kv_index <= q_index) & (last[None, :] >= first[:, None])
    one = first == last
    full = visited & (kv_index < q_index) & one[:, None] & one[None, :] & (first[:, None] == first[None, :])
    partial = visited & ~full

    def indices(pattern):
        counts = pattern.sum(-1, dtype=torch.int32)
        order = torch.argsort((~pattern).to(torch.int8), dim=-1, stable=True).to(
            torch.int32
        )  # the set blocks first, in order
        return counts[None, None], order[None, None]

    def document_causal(b, h, q, kv):
        return (q >= kv) & (ids[q] == ids[kv])

    kv_num, kv_indices = indices(partial)
    full_num, full_indices = indices(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=block, mask_mod=document_causal
    )
