"""The attention core through torch.nn.functional.scaled_dot_product_attention (codemods/attention.py): the published
eager core computes softmax(Q·Kᵀ·scale + mask)·V with an fp32 softmax and an O(S²) score tensor; SDPA computes the
same without it. The backend is chosen once per device, dtype and head dims; MOE_REWRITE_SDPA=0 runs the published
core instead.
"""

import torch

# _moe_rewrite_options marks this module as holding generated caches (tests/conftest.py empties them by that name)
from ..kernels.dispatch import _moe_rewrite_options, _moe_rewrite_setting  # noqa: F401
from .packing import (
    _moe_rewrite_documents,
    _moe_rewrite_documents_mask,
    _moe_rewrite_packed_attention,
    _MoeRewriteDocuments,
)

# (device, dtype, q/k head dim, v head dim) -> "math", "cudnn", "flash_padded" or "sdpa"
_moe_rewrite_attention_cache = {}


def _moe_rewrite_sdpa_enabled():
    """Whether the attention runs through SDPA where the config asks for "sdpa": MOE_REWRITE_SDPA=0 keeps the published
    eager core (read once per process)."""
    return _moe_rewrite_setting("MOE_REWRITE_SDPA", "1") != "0"


def _moe_rewrite_attention(query, key, value, mask, scale, dropout_p):
    """softmax(query·keyᵀ·scale + mask)·value, with dropout p on the probabilities, as the published core computes it.
    `mask` is the file's additive mask (0 where a key is seen, the dtype's lowest value where not) or None: None is the
    causal mask for a query as long as the keys, and no mask for a single query (a decoding step), or packed
    documents (packing.py), each causal on its own (in a compiled layer through a boolean mask: True where seen)."""
    if isinstance(mask, _MoeRewriteDocuments):
        return _moe_rewrite_packed_attention(
            query,
            key,
            value,
            mask,
            scale,
            dropout_p,
            lambda q, k, v, within=None: _moe_rewrite_attention(q, k, v, within, scale, dropout_p),
        )
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if mask is None and q_len > 1 and q_len != kv_len:  # SDPA's is_causal is top-left aligned: wrong with a cache
        raise ValueError(f"moe-rewrite: attention over {kv_len} keys for {q_len} queries needs a mask")
    if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
        # SDPA takes the mask in the query's dtype; .to() alone would turn float32's lowest value into -inf in
        # bfloat16, and a fully masked row (left padding) into NaN, where the published core averages it.
        mask = mask.clamp(min=torch.finfo(query.dtype).min).to(query.dtype)
    causal = mask is None and q_len > 1
    backend = _moe_rewrite_attention_backend(query.device, query.dtype, query.shape[-1], value.shape[-1])
    if backend == "sdpa" or (backend == "flash_padded" and mask is not None):  # flash takes no mask
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale
        )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "math":
        with sdpa_kernel([SDPBackend.MATH]):
            return torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale
            )
    if backend == "cudnn":  # torch's own order would pick the memory-efficient kernel, no faster than eager here
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        if mask is not None and dropout_p > 0:  # see _moe_rewrite_fully_masked_rows: no dropout in its rows
            order = [SDPBackend.EFFICIENT_ATTENTION]
        with sdpa_kernel(order + [SDPBackend.MATH], set_priority=True):
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale
            )
        if mask is not None and dropout_p == 0 and mask.dtype != torch.bool:
            out = _moe_rewrite_fully_masked_rows(out, query, key, value, mask, scale)
        return out
    # flash needs one head dim for q, k and v: v padded with zeros to q/k's, the output's padding sliced off
    v_dim = value.shape[-1]
    padded = torch.nn.functional.pad(value, (0, query.shape[-1] - v_dim))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, padded, dropout_p=dropout_p, is_causal=causal, scale=scale
        )
    return out[..., :v_dim]


def _moe_rewrite_fully_masked_rows(out, query, key, value, mask, scale):
    """`out` with each fully masked row (a query whose every mask entry is the dtype's lowest value: left padding)
    replaced by what the published core computes there, where cuDNN returns zeros. The published scores of such a row
    are all equal (q·k·scale is lost in the lowest value's rounding), so its softmax is uniform: the row is the mean
    of the values, and its backward is the softmax's at the uniform point, s = q·k·scale:
    ds_j = (g·v_j - g·mean(v)) / n. Written as mean(v) plus terms that are zero in value and carry exactly that
    gradient to q and k (e = q·k - q̂·k̂ = (q - q̂)·k̂ + q̂·(k - k̂), hats detached): mean_j(e_j·v_j) - mean(e)·mean(v),
    times scale. A few small GEMMs ((keys x q/k dim)ᵀ·(keys x v dim) per head) and one pass over the mask; no sync."""
    full = (mask == torch.finfo(mask.dtype).min).all(dim=-1, keepdim=True)
    n = key.shape[-2]
    q_hat, k_hat, v_hat = query.detach(), key.detach(), value.detach()
    mean_v = value.mean(dim=-2, keepdim=True)
    e_v = (query - q_hat) @ (k_hat.transpose(-1, -2) @ v_hat) + q_hat @ ((key - k_hat).transpose(-1, -2) @ v_hat)
    mean_e = (query - q_hat) @ k_hat.mean(dim=-2, keepdim=True).transpose(-1, -2)
    mean_e = mean_e + q_hat @ (key - k_hat).mean(dim=-2, keepdim=True).transpose(-1, -2)
    uniform = mean_v + scale * (e_v / n - mean_e * mean_v.detach())
    return torch.where(full, uniform.to(out.dtype), out)


def _moe_rewrite_attention_backend(device, dtype, qk_dim, v_dim):
    """The SDPA backend for these head dims on `device` in `dtype`. Off CUDA "math", the published arithmetic: torch's
    CPU flash kernel (equal head dims) loses log(keys) in the logsumexp of a fully masked row (left padding), where
    the scores are the lowest float, so its backward scales that row's gradient by the number of keys. On CUDA
    "cudnn" where cuDNN's attention runs the dims (q/k 192 with v 128 as MLA has them: the fastest measured,
    bench/e2e/PLAN.md), else "flash_padded" where the dims differ and fit flash, else "sdpa" (torch's own choice:
    float32, equal dims). Decided on first use and kept."""
    if torch.compiler.is_compiling():  # no probe inside a traced graph; torch.compile picks its own kernel
        return "sdpa"
    key = (device, dtype, qk_dim, v_dim)
    if key not in _moe_rewrite_attention_cache:
        backend = "math" if device.type != "cuda" else "sdpa"
        if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
            if _moe_rewrite_cudnn_attention_runs(device, dtype, qk_dim, v_dim):
                backend = "cudnn"
            elif qk_dim != v_dim and qk_dim <= 256 and qk_dim % 8 == 0:
                backend = "flash_padded"
        _moe_rewrite_attention_cache[key] = backend
    return _moe_rewrite_attention_cache[key]


def _moe_rewrite_cudnn_attention_runs(device, dtype, qk_dim, v_dim):
    """Whether cuDNN's SDPA kernel runs a small causal forward and backward at these dims (torch >= 2.5, a GPU and a
    cuDNN that has it); asked once per key of _moe_rewrite_attention_backend. The first call comes inside the first
    layer's forward, often under gradient checkpointing, which records what that forward runs: its saved-tensor hooks
    the tensors saved, selective checkpointing's dispatch mode the outputs its policy keeps, handed back in order to
    the recomputed forward. That forward no longer probes, so anything the probe left there would shift them and
    backward would fail. The probe runs in a thread of its own, which sees none of the caller's thread-local hooks
    and modes (nor its autocast)."""
    import threading

    runs = []

    def probe():
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q = torch.zeros(1, 1, 64, qk_dim, device=device, dtype=dtype, requires_grad=True)
            v = torch.zeros(1, 1, 64, v_dim, device=device, dtype=dtype)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, q, v, is_causal=True).sum().backward()
            runs.append(True)
        except (ImportError, AttributeError, RuntimeError):
            pass

    thread = threading.Thread(target=probe, name="moe-rewrite-cudnn-probe")
    thread.start()
    thread.join()
    return bool(runs)


def _moe_rewrite_sdpa_mask(
    build, config, output_attentions, mask, shape, embeds, past_length, position_ids=None, packed=None
):
    """The mask the Model hands every layer: `build(mask, shape, embeds, past_length)`, the file's own 4-D additive
    mask, except None where every layer runs SDPA (config "sdpa", MOE_REWRITE_SDPA on, no attention weights asked
    for) and that mask would only be causal: no 2-D mask or one of all ones, and no cache (the queries are all the
    keys) or a single query. _moe_rewrite_attention then runs SDPA's causal kernel instead of a masked one (cuDNN:
    1.5 ms against 5.3 at 2 x 4096, bench/e2e/PLAN.md). Padding keeps the 4-D mask: padded rows still feed the
    router. One host sync for the all-ones test, as transformers' own SDPA check has; under torch.fx or torch.jit
    tracing the file's mask, under torch.compile the file's mask unless the batch is packed. A packed batch
    (`position_ids`, and `packed` the forward's keyword arguments: packing.py) gets its documents in place of None,
    or in the file's mask where that is built (eager, attention weights asked for): each document then attends only
    to itself. Under torch.compile a forward given position ids (or cu_seq_lens_*) without an attention mask breaks
    the graph once where the documents are found (one host sync)."""
    q_len = shape[-1]
    traced = torch.jit.is_tracing() or isinstance(embeds, torch.fx.Proxy) or isinstance(mask, torch.fx.Proxy)
    documents = None
    if not traced:  # under torch.compile too: the documents are found outside the graph (packing.py)
        documents = _moe_rewrite_documents(config, mask, position_ids, packed, shape, past_length, embeds.device)
    if (
        getattr(config, "_attn_implementation", None) != "sdpa"
        or output_attentions
        or not _moe_rewrite_sdpa_enabled()
        or (past_length != 0 and q_len != 1)
        or traced
        or (documents is None and torch.compiler.is_compiling())
    ):
        built = build(mask, shape, embeds, past_length)
        return built if documents is None else _moe_rewrite_documents_mask(built, documents)
    if mask is not None:
        # the file's function blocks every key whose value is not exactly 1
        if tuple(mask.shape) != (shape[0], past_length + q_len) or not bool((mask == 1).all()):
            return build(mask, shape, embeds, past_length)
    return documents
