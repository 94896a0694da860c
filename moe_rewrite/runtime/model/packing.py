"""Packed documents (codemods/packing.py): several documents in one row, each attending only to itself, as
transformers' DataCollatorWithFlattening packs them: position ids restarting at 0 for each document, no attention
mask, and with `return_flash_attn_kwargs=True` the `cu_seq_lens_q/k` and `max_length_q/k` keyword arguments. The
Model's mask call (_moe_rewrite_sdpa_mask) finds the documents once per forward, outside any compiled graph
(_moe_rewrite_documents_untraced), and hands every layer one _MoeRewriteDocuments in place of the mask;
_moe_rewrite_attention runs each document causal on its own. Eager: FlexAttention with a document block mask,
torch's varlen_attn, or SDPA per document (CPU: the math kernel per document, the published arithmetic). Inside a
compiled layer only the documents' tensors and their longest length are read: varlen_attn on CUDA in float16/bfloat16,
else SDPA with a document-causal mask, so a new mix of lengths is new inputs, not a new graph. The loss needs nothing:
the collator's labels are -100 at each document's first token. config.moe_rewrite_packed = False or
MOE_REWRITE_PACKED=0 keeps the published attention across documents.
"""

import torch

# _moe_rewrite_options marks this module as holding generated caches (tests/conftest.py empties them by that name)
from ..kernels.dispatch import _moe_rewrite_options, _moe_rewrite_setting  # noqa: F401
from .packed_attention import (
    _moe_rewrite_attention_per_document,
    _moe_rewrite_flex,
    _moe_rewrite_varlen,
)

# "warned" / "warned_mask" -> the ambiguous-batch / compiled-mask warning was given; (device, dtype, q/k dim, v dim,
# forced) -> the eager packed backend ("flex", "varlen" or "sdpa"); ("compiled", device, dtype, q/k dim, v dim,
# dropout > 0, forced) -> a compiled layer's ("varlen" or "mask")
_moe_rewrite_packing_cache = {}
# Where the longest document holds at least this share of the tokens, SDPA per document (cuDNN's causal kernel over
# it) beats the variable-length kernels over the whole row (bench/packing_probe.py on an H100, 8192 tokens, forward +
# backward: one document, 2.7 ms per document against 5.8 varlen; one of 6144 and eight of 256, 5.1 against 4.0
# varlen; 18 log-normal documents, 7.0 against 1.9; bench/NOTES.md change 41)
MOE_REWRITE_LONG_DOCUMENT_SHARE = 0.9


class _MoeRewriteDocuments:
    """The documents of a packed batch, in place of the attention mask, built once per forward and shared by every
    layer (and by a checkpointed layer's recomputed forward). Rows are never shared: every row starts a document.
    What a compiled layer reads, so that new lengths are new inputs of one graph: `cu_seqlens`, int32 on the
    device, where each document begins in the batch's tokens flattened to one row, its last entry the number of
    tokens; `ids` (rows, tokens), the document of each token, on the device; `max_length`, the longest document (an
    int that torch.compile makes dynamic once it changes). The eager paths also read `starts`, the same boundaries
    as host ints."""

    def __init__(self, starts, ids):
        self.starts, self.ids = starts, ids
        self.cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=ids.device)
        self.max_length = max(b - a for a, b in zip(starts[:-1], starts[1:]))
        self._cache = {}


def _moe_rewrite_packing_enabled(config):
    """Whether packed batches run per document: config.moe_rewrite_packed (default True) and MOE_REWRITE_PACKED."""
    return getattr(config, "moe_rewrite_packed", True) and _moe_rewrite_setting("MOE_REWRITE_PACKED", "1") != "0"


def _moe_rewrite_documents(config, mask, position_ids, packed, shape, past_length, device):
    """The batch's documents where it is packed, else None: the collator's `cu_seq_lens_q` (with `cu_seq_lens_k`
    equal), or position ids restarting inside a row (a position not one more than the one before it), as
    transformers finds packed rows for its own models: only with no attention mask and no cache, and not when
    opted out. Those tests need no tensor's values; the documents are found by _moe_rewrite_documents_untraced."""
    packed = packed or {}
    cu = packed.get("cu_seq_lens_q")
    if mask is not None or past_length != 0 or shape[-1] < 2 or not _moe_rewrite_packing_enabled(config):
        return None
    if cu is None and position_ids is None:
        return None
    return _moe_rewrite_documents_untraced(position_ids, cu, packed.get("cu_seq_lens_k"), shape, device)


# host logic: one graph break of a compiled Model's forward and one host sync, per forward given position ids (those
# the Model makes itself reach _moe_rewrite_documents as None: codemods/model/packing.py)
@torch.compiler.disable
def _moe_rewrite_documents_untraced(position_ids, cu, cu_k, shape, device):
    """_moe_rewrite_documents' documents from `cu` (the collator's cu_seq_lens_q) or the position ids, or None where
    every row is one document (the causal mask is the published one). Runs eagerly, also under torch.compile: its
    host sync (the boundaries) and its Python over the documents stay out of the graphs, which get the tensors."""
    rows, length = shape
    if cu is not None:
        if cu_k is not None and not torch.equal(torch.as_tensor(cu_k).cpu(), torch.as_tensor(cu).cpu()):
            raise ValueError("moe-rewrite: packed documents need cu_seq_lens_k equal to cu_seq_lens_q (no cache)")
        starts = [int(s) for s in torch.as_tensor(cu).reshape(-1).tolist()]
        if starts[0] != 0 or starts[-1] != rows * length or any(b <= a for a, b in zip(starts[:-1], starts[1:])):
            raise ValueError(f"moe-rewrite: cu_seq_lens_q {starts} does not split the batch's {rows * length} tokens")
        bounds = torch.zeros(rows * length, dtype=torch.bool)
        bounds[starts[:-1]] = True
        bounds = bounds.view(rows, length)
        if rows > 1 and not bool(bounds[:, 0].all()):
            raise ValueError("moe-rewrite: cu_seq_lens_q has a document across two rows")
        ids = torch.cumsum(bounds.reshape(-1), 0).view(rows, length) - 1
        return _MoeRewriteDocuments(starts, ids.to(device))
    positions = position_ids.expand(rows, -1) if position_ids.shape[0] != rows else position_ids
    step = torch.diff(positions, dim=-1) != 1
    bounds = torch.cat([torch.ones_like(step[:, :1]), step], dim=-1)
    flat = bounds.reshape(-1)
    found = torch.nonzero(flat).reshape(-1).tolist()  # the host sync
    if len(found) == rows:
        return None  # one document per row: the causal mask is the published one
    if "warned" not in _moe_rewrite_packing_cache:
        _moe_rewrite_packing_cache["warned"] = True
        import warnings

        warnings.warn(
            "moe-rewrite: position_ids restart inside a row and there is no attention_mask: the row is read as packed "
            "documents (DataCollatorWithFlattening), each attending only to itself, as transformers does; "
            "config.moe_rewrite_packed = False or MOE_REWRITE_PACKED=0 keeps the published attention across them",
            stacklevel=5,
        )
    ids = torch.cumsum(flat, 0).view(rows, length) - 1  # not a view: a compiled graph guards on what a view is of
    return _MoeRewriteDocuments(found + [rows * length], ids.to(device))


def _moe_rewrite_documents_mask(mask, documents):
    """The file's additive 4-D mask with every key of another document blocked (eager attention, attention weights
    asked for): the published core then computes each document alone."""
    ids = documents.ids.to(mask.device)
    other = ids[:, None, :, None] != ids[:, None, None, :]
    return mask.masked_fill(other, torch.finfo(mask.dtype).min)


def _moe_rewrite_packed_attention(query, key, value, documents, scale, dropout_p, core):
    """Attention of (batch, heads, tokens, dim) queries, keys and values where `documents` packs the tokens: each
    document causal on its own, as `core(q, k, v)` (the SDPA core, causal without a mask) would compute it alone.
    Under torch.compile from the documents' tensors only: varlen_attn, or `core(q, k, v, mask)` with the boolean
    document-causal mask."""
    rows, heads, length, _ = query.shape
    if torch.compiler.is_compiling():
        backend = _moe_rewrite_compiled_packed_backend(
            query.device, query.dtype, query.shape[-1], value.shape[-1], dropout_p
        )
    else:
        backend = _moe_rewrite_packed_backend(query, value, documents, dropout_p)
    if backend == "mask":
        return core(query, key, value, _moe_rewrite_document_causal_mask(documents.ids.to(query.device)))
    if backend == "sdpa":
        return _moe_rewrite_attention_per_document(query, key, value, documents, core)
    flat = [t.transpose(1, 2).reshape(rows * length, heads, t.shape[-1]) for t in (query, key, value)]
    if backend == "varlen":
        out = _moe_rewrite_varlen(*flat, documents, scale)
    else:
        out = _moe_rewrite_flex(*flat, documents, scale)
    return out.reshape(rows, length, heads, -1).transpose(1, 2)


def _moe_rewrite_document_causal_mask(ids):
    """The (rows, 1, tokens, tokens) boolean mask of `key <= query and same document` from the documents of the
    tokens, (rows, tokens): tensor ops only, so a compiled graph holds it for any lengths."""
    positions = torch.arange(ids.shape[-1], device=ids.device)
    causal = positions[None, :] <= positions[:, None]
    return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


@torch.compiler.assume_constant_result  # run at tracing, not traced: a constant of the compiled graph
def _moe_rewrite_compiled_packed_backend(device, dtype, qk_dim, v_dim, dropout_p):
    """The packed backend of a compiled layer: "varlen" on CUDA in float16/bfloat16 without dropout where the eager
    choice's probe runs varlen_attn at these dims (MOE_REWRITE_PACKED_ATTENTION=auto or varlen), else "mask" (SDPA
    with the document-causal mask: (tokens x tokens) booleans per row), with a warning once on CUDA. Decided once
    per device, dtype and head dims; the per-document and FlexAttention paths need the documents on the host."""
    forced = _moe_rewrite_setting("MOE_REWRITE_PACKED_ATTENTION", "auto")
    key = ("compiled", device, dtype, qk_dim, v_dim, dropout_p > 0, forced)
    if key not in _moe_rewrite_packing_cache:
        half = dtype in (torch.float16, torch.bfloat16)
        wanted = device.type == "cuda" and half and dropout_p == 0 and forced in ("auto", "varlen")
        varlen = wanted and _moe_rewrite_packed_runs("varlen", device, dtype, qk_dim, v_dim)
        if device.type == "cuda" and not varlen and "warned_mask" not in _moe_rewrite_packing_cache:
            _moe_rewrite_packing_cache["warned_mask"] = True
            import warnings

            why = (
                "it does not run here"
                if wanted
                else f"{dtype}, dropout {dropout_p}, MOE_REWRITE_PACKED_ATTENTION={forced}"
            )
            warnings.warn(
                f"moe-rewrite: packed documents in a compiled layer run SDPA with a document-causal mask (memory "
                f"quadratic in the tokens), not varlen_attn ({why})",
                stacklevel=2,
            )
        _moe_rewrite_packing_cache[key] = "varlen" if varlen else "mask"
    return _moe_rewrite_packing_cache[key]


def _moe_rewrite_packed_backend(query, value, documents, dropout_p):
    """The packed backend: "sdpa" (per document) off CUDA, with dropout, under MOE_REWRITE_PACKED_ATTENTION=sdpa,
    or where one document holds most tokens; else the kernel chosen once per device, dtype and head dims:
    MOE_REWRITE_PACKED_ATTENTION (flex, varlen), else varlen_attn where a small case runs and matches SDPA per
    document, else flex where it runs. A function of the documents and the shapes only, so a checkpointed layer's
    recomputed forward takes the same path."""
    forced = _moe_rewrite_setting("MOE_REWRITE_PACKED_ATTENTION", "auto")
    if query.device.type != "cuda" or dropout_p > 0 or forced == "sdpa":
        return "sdpa"
    longest = documents.max_length / documents.starts[-1]
    if forced == "auto" and longest >= MOE_REWRITE_LONG_DOCUMENT_SHARE:
        return "sdpa"
    key = (query.device, query.dtype, query.shape[-1], value.shape[-1], forced)
    if key not in _moe_rewrite_packing_cache:
        order = [forced] if forced in ("flex", "varlen") else ["varlen", "flex"]
        choice = next((name for name in order if _moe_rewrite_packed_runs(name, *key[:4])), "sdpa")
        _moe_rewrite_packing_cache[key] = choice
    return _moe_rewrite_packing_cache[key]


def _moe_rewrite_packed_runs(backend, device, dtype, qk_dim, v_dim):
    """Whether `backend` runs three documents (forward and backward) at these dims and matches SDPA per document
    within the dtype's tolerance; under hooks of its own, as attention.py's probe (gradient checkpointing)."""
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        shape = (1, 2, 300, qk_dim)
        q, k = (torch.randn(shape, device=device, dtype=dtype, generator=generator) for _ in range(2))
        v = torch.randn(1, 2, 300, v_dim, device=device, dtype=dtype, generator=generator)
        ids = torch.tensor([0] * 40 + [1] * 200 + [2] * 60, device=device).view(1, 300)
        documents = _MoeRewriteDocuments([0, 40, 240, 300], ids)
        flat = [t.transpose(1, 2).reshape(300, 2, t.shape[-1]).requires_grad_() for t in (q, k, v)]
        own_hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with own_hooks, torch.enable_grad():
            run = _moe_rewrite_varlen if backend == "varlen" else _moe_rewrite_flex
            out = run(*flat, documents, None)
            out.float().sum().backward()
        want = _moe_rewrite_attention_per_document(
            q.float(),
            k.float(),
            v.float(),
            documents,
            lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True),
        )
        got = out.reshape(1, 300, 2, v_dim).transpose(1, 2).float()
        return bool(torch.allclose(got, want, atol=2e-2, rtol=2e-2)) and bool(flat[0].grad.isfinite().all())
    except Exception:  # noqa: BLE001 (any failure of an optional kernel: it is not chosen)
        return False


def _moe_rewrite_items_loss(loss, labels, kwargs):
    """The loss under transformers' gradient-accumulation convention: where the Trainer passes
    `num_items_in_batch` (the labels counted over all micro-batches of a step), the sum of the token losses divided
    by it, not their mean, so that the step's loss does not depend on how the documents fall into micro-batches;
    else the loss as computed."""
    items = kwargs.get("num_items_in_batch") if kwargs else None
    if loss is None or labels is None or items is None:
        return loss
    counted = (labels[..., 1:] != -100).sum().to(loss.device)
    total = torch.where(counted > 0, loss, torch.zeros_like(loss)) * counted
    return total / torch.as_tensor(items, device=loss.device).to(loss.dtype)
