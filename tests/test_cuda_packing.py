"""Packed attention's GPU kernels (runtime/model/packing.py) against a per-document float32 reference at MLA's head
dims (q/k 192, v 128), forward and backward: FlexAttention with the document block mask, varlen_attn where it runs,
SDPA per document; the backend chosen once and kept, the same under gradient checkpointing's recomputation. CI's CPU
machine skips this file (no GPU).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import runtime_env  # noqa: E402

from moe_rewrite.runtime.model import attention, packing  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HEADS, QK, V = 4, 192, 128
LENGTHS = (130, 7, 400, 1, 250)


def _documents(lengths=LENGTHS):
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].cuda()
    return packing._MoeRewriteDocuments(starts, ids)


def _inputs(tokens):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, HEADS, tokens, QK, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(1, HEADS, tokens, V, device="cuda", generator=g)
    return q, k, v, torch.randn(1, HEADS, tokens, V, device="cuda", generator=g)


def _reference(q, k, v, grad, documents):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    causal = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        out = packing._moe_rewrite_attention_per_document(*leaves, documents, causal)
    out.backward(grad)
    return out, [t.grad for t in leaves]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("backend", ["flex", "varlen", "sdpa"])
def test_each_packed_backend_matches_each_document_alone(backend, monkeypatch):
    runtime_env(monkeypatch, "MOE_REWRITE_PACKED_ATTENTION", backend)
    documents = _documents()
    q, k, v, grad = _inputs(documents.starts[-1])
    want, want_grads = _reference(q, k, v, grad, documents)
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    chosen = packing._moe_rewrite_packed_backend(leaves[0], leaves[2], documents, 0.0)
    if backend == "varlen" and chosen != "varlen":
        pytest.skip("varlen_attn does not run these head dims here")
    assert chosen == backend
    out = attention._moe_rewrite_attention(*leaves, documents, QK**-0.5, 0.0)
    out.backward(grad.bfloat16())
    assert _rel(out, want) < 1e-2
    for got, ref in zip(leaves, want_grads):
        assert _rel(got.grad, ref) < 2e-2


def test_the_choice_is_kept_and_recomputation_takes_the_same_path(monkeypatch):
    documents = _documents((300, 200, 100, 400))
    q, k, v, grad = _inputs(1000)
    want, want_grads = _reference(q, k, v, grad, documents)
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    packing._moe_rewrite_packed_backend(leaves[0], leaves[2], documents, 0.0)  # chosen (its probe runs) and kept
    calls = []
    for name in ("_moe_rewrite_flex", "_moe_rewrite_varlen", "_moe_rewrite_attention_per_document"):
        original = getattr(packing, name)
        monkeypatch.setattr(packing, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))

    def layer(a, b, c):
        return attention._moe_rewrite_attention(a, b, c, documents, QK**-0.5, 0.0)

    out = torch.utils.checkpoint.checkpoint(layer, *leaves, use_reentrant=False)
    out.backward(grad.bfloat16())
    assert len(calls) >= 2 and len(set(calls)) == 1, calls  # the forward and its recomputation
    assert _rel(out, want) < 1e-2
    for got, ref in zip(leaves, want_grads):
        assert _rel(got.grad, ref) < 2e-2


def test_a_compiled_layer_runs_varlen_over_new_lengths_with_two_traces():
    """torch.compile (inductor) of a layer's attention over four mixes of document lengths, counts and tokens:
    varlen_attn from the documents' tensors, the same numbers as each document alone, no warning, traced twice."""
    import warnings

    if packing._moe_rewrite_compiled_packed_backend(torch.device("cuda"), torch.bfloat16, QK, V, 0.0) != "varlen":
        pytest.skip("varlen_attn does not run these head dims here")
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c, d: attention._moe_rewrite_attention(a, b, c, d, QK**-0.5, 0.0))
    traced = []
    for lengths in (LENGTHS, (300, 20, 100), (64, 64, 500, 3, 9), (900, 1)):
        documents = _documents(lengths)
        q, k, v, grad = _inputs(documents.starts[-1])
        want, want_grads = _reference(q, k, v, grad, documents)
        leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = compiled(*leaves, documents)
        out.backward(grad.bfloat16())
        traced.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        assert _rel(out, want) < 1e-2
        for got, ref in zip(leaves, want_grads):
            assert _rel(got.grad, ref) < 2e-2
    assert traced[0] > 0 and traced[1] > 0 and traced[2:] == [0, 0], traced
