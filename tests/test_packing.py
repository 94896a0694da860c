"""Packed batches (runtime/model/packing.py, codemods/model/packing.py): DataCollatorWithFlattening's rows give each
document the outputs, losses and gradients it has alone, through the CLI-rewritten stand-ins (V3 and V2 forms);
the opt-outs keep the published attention across documents; num_items_in_batch; generation unchanged; the flex
path's block mask on CPU."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import FORM_DIRS, build_model, runtime_env  # noqa: E402

from moe_rewrite import RewriteOptions, rewrite_source  # noqa: E402
from moe_rewrite.runtime.model import packed_attention, packing  # noqa: E402

LENGTHS = (5, 9, 3, 7)


def _documents(vocab, lengths=LENGTHS):
    return [torch.randint(2, vocab, (n,)) for n in lengths]


def _collate(docs, flash_kwargs=False):
    """DataCollatorWithFlattening's batch (its flash keyword arguments built as transformers >= 4.53 builds them where
    the installed release has no `return_flash_attn_kwargs`)."""
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": d.tolist()} for d in docs]
    try:
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)
    except TypeError:
        batch = DataCollatorWithFlattening()(features)
        if flash_kwargs:
            cu = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()], dtype=torch.int32)
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(map(len, docs)))
            batch["max_length_k"] = batch["max_length_q"]
    assert "attention_mask" not in batch and batch["labels"][0, 0] == -100
    return batch


def _model(path, **overrides):
    return build_model(path, seed=3, aux_loss_alpha=0.0, **overrides)  # the aux loss spans the batch: not per document


def _alone(model, docs):
    """Each document on its own: logits (eval), and the summed token losses with their gradients (train)."""
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    model.train()
    model.zero_grad()
    total = sum(model(input_ids=d[None], labels=d[None]).loss * (len(d) - 1) for d in docs)
    count = sum(len(d) - 1 for d in docs)
    (total / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, total.detach() / count, grads


def _packed(model, batch):
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    model.train()
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got, want, tol=2e-5):
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize(
    "flash_kwargs",
    [pytest.param(False, marks=pytest.mark.slow, id="position-ids"), pytest.param(True, id="cu-seq-lens")],
)  # one case in `make test-fast` (over 10 s each on CI's 2 cores); the compiled path's tests are slow
def test_a_packed_batch_is_each_document_alone(patched, form, flash_kwargs):
    model = _model(patched)
    docs = _documents(model.config.vocab_size)
    batch = _collate(docs, flash_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _packed(model, batch)
    want = _alone(model, docs)
    _assert_close(got[0], want[0])
    _assert_close(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        _assert_close(got[2][name], want[2][name], tol=1e-4)


def test_a_packed_batch_under_eager_and_gradient_checkpointing(patched, form):
    model = _model(patched, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    docs = _documents(model.config.vocab_size, (4, 6, 5))
    want = _alone(model, docs)
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _packed(model, _collate(docs))
    _assert_close(got[1], want[1])
    for name in want[2]:
        _assert_close(got[2][name], want[2][name], tol=1e-4)


def test_restarting_positions_warn_once_and_the_opt_outs_keep_the_published_attention(patched, form, monkeypatch):
    model = _model(patched).eval()
    original = build_model(FORM_DIRS[form], seed=3, aux_loss_alpha=0.0).eval()
    original.load_state_dict(model.state_dict(), strict=False)
    docs = _documents(model.config.vocab_size)
    batch = _collate(docs)
    inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    with torch.no_grad():
        published = original(**inputs).logits
        with pytest.warns(UserWarning, match="packed"):
            packed = model(**inputs).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            assert torch.equal(model(**inputs).logits, packed)
        assert (packed - published).abs().max() > 1e-3  # the documents after the first see only themselves
        model.config.moe_rewrite_packed = False
        _assert_close(model(**inputs).logits, published)
        model.config.moe_rewrite_packed = True
        runtime_env(monkeypatch, "MOE_REWRITE_PACKED", "0")
        _assert_close(model(**inputs).logits, published)


def test_an_unpacked_batch_and_generation_are_unchanged(patched, form):
    model = _model(patched).eval()
    original = build_model(FORM_DIRS[form], seed=3, aux_loss_alpha=0.0).eval()
    original.load_state_dict(model.state_dict(), strict=False)
    ids = torch.randint(2, model.config.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        _assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits)
        positions = torch.arange(9)[None].expand(2, -1)
        _assert_close(model(input_ids=ids, position_ids=positions).logits, original(input_ids=ids).logits)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        want = ids
        for _ in range(4):  # the published file, greedy, without a cache, positions as generate() gives them
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            logits = original(input_ids=want, attention_mask=mask, position_ids=positions, use_cache=False).logits
            want = torch.cat([want, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    assert torch.equal(got, want)


def test_only_position_ids_the_caller_passes_are_searched_for_documents(patched, form, monkeypatch):
    """Finding documents costs a host sync (and a graph break under torch.compile(model)): a batch without an
    attention mask and without position ids (the forward makes them: never packed) skips it, one with position ids
    still gets it, and the two give the same logits."""
    import sys

    model = _model(patched).eval()
    module = sys.modules[type(model).__module__]
    searched = []
    untraced = module._moe_rewrite_documents_untraced
    monkeypatch.setattr(module, "_moe_rewrite_documents_untraced", lambda *a: searched.append(a) or untraced(*a))
    ids = torch.randint(2, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        assert searched == []
        given = model(input_ids=ids, position_ids=torch.arange(9)[None].expand(2, -1)).logits
    assert len(searched) == 1
    assert torch.equal(plain, given)


def test_num_items_in_batch_makes_the_loss_independent_of_the_micro_batches(patched, form):
    model = _model(patched).train()
    docs = _documents(model.config.vocab_size, (6, 3, 8, 5, 4))
    whole = _collate(docs)
    items = int((whole["labels"] != -100).sum())
    model.zero_grad()
    model(**whole).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0.0
    for part in (docs[:1], docs[1:]):  # micro-batches of 5 and 20 items
        loss = model(**_collate(part), num_items_in_batch=torch.tensor(items)).loss
        loss.backward()
        total += loss.item()
    _assert_close(torch.tensor(total), model(**whole).loss.detach())
    for name, grad in want.items():
        _assert_close(dict(model.named_parameters())[name].grad, grad, tol=1e-4)


def test_forwards_without_kwargs_get_them_and_every_edit_is_taken_back():
    source = (FORM_DIRS["v3"] / "modeling_deepseek.py").read_text()
    plain = source.replace(
        "        return_dict: Optional[bool] = None,\n        **kwargs,\n",
        "        return_dict: Optional[bool] = None,\n",
    )
    assert plain.count("**kwargs") == source.count("**kwargs") - 2  # the Model's and the ForCausalLM's
    out = rewrite_source(plain, RewriteOptions()).text
    assert out.count("**moe_rewrite_kwargs") == 3  # two signatures, the self.model(...) call
    assert "packed=moe_rewrite_kwargs" in out and "_moe_rewrite_items_loss(loss, labels, moe_rewrite_kwargs)" in out
    assert rewrite_source(out, RewriteOptions()).text == out
    assert (
        rewrite_source(out, RewriteOptions(sdpa=False)).text == rewrite_source(plain, RewriteOptions(sdpa=False)).text
    )


def test_position_ids_rebound_after_the_mask_leave_the_model_as_published():
    source = (FORM_DIRS["v3"] / "modeling_deepseek.py").read_text()
    anchor = "        hidden_states = inputs_embeds\n        all_hidden_states"
    assert source.count(anchor) == 1
    edited = source.replace(anchor, "        position_ids = position_ids + 0\n" + anchor)
    result = rewrite_source(edited, RewriteOptions())
    assert "packed=kwargs" not in result.text
    assert any("packing" in str(n) and "rebound" in str(n) for n in result.notes)


def test_a_forward_that_already_names_our_flag_is_left_as_published():
    source = (FORM_DIRS["v3"] / "modeling_deepseek.py").read_text()
    anchor = "        hidden_states = inputs_embeds\n        all_hidden_states"
    edited = source.replace(anchor, "        moe_rewrite_positions_given = False\n" + anchor)
    result = rewrite_source(edited, RewriteOptions())
    assert "packed=kwargs" not in result.text
    assert any("packing" in str(n) and "moe_rewrite_positions_given" in str(n) for n in result.notes)


@pytest.mark.parametrize(
    "old, new",
    [
        ("loss_fct = CrossEntropyLoss()", 'loss_fct = CrossEntropyLoss(reduction="sum")'),
        ("loss = loss_fct(shift_logits, shift_labels)", "loss = loss_fct(shift_logits, shift_labels) / 2"),
    ],
    ids=["sum", "scaled"],
)
def test_a_loss_not_the_published_mean_gets_no_num_items_in_batch(old, new):
    """num_items_in_batch turns the published mean into a sum over the Trainer's count: a loss of another form (a
    sum, a scaled mean, transformers' loss_function that divides by it already) would be divided twice, so the
    ForCausalLM is left as published with a line saying why, and the Model still takes packed batches."""
    source = (FORM_DIRS["v3"] / "modeling_deepseek.py").read_text()
    assert source.count(old) == 1
    result = rewrite_source(source.replace(old, new), RewriteOptions())
    assert "= _moe_rewrite_items_loss(" not in result.text and "position_ids=position_ids" in result.text
    assert any("ForCausalLM" in str(n) and "num_items_in_batch not taken" in str(n) for n in result.notes)


def _reference(q, k, v, ids):
    """Per document causal attention in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = ids.numel()
    allowed = (ids[:, None] == ids[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize("lengths", [(130, 126, 1, 200), (300,), (5, 5, 5)])
def test_the_document_block_mask_and_flex_path_on_cpu(lengths, monkeypatch):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    documents = packing._MoeRewriteDocuments(starts, ids[None])
    tokens = ids.numel()
    padded = -(-tokens // 128) * 128
    built = packed_attention._moe_rewrite_document_block_mask(documents, padded, torch.device("cpu"))
    full_ids = torch.cat([ids, ids.new_full((padded - tokens,), len(lengths))])
    want = create_block_mask(
        lambda b, h, q, kv: (q >= kv) & (full_ids[q] == full_ids[kv]), 1, 1, padded, padded, device="cpu"
    )
    assert torch.equal(built.to_dense(), want.to_dense())
    monkeypatch.setitem(packed_attention._moe_rewrite_packed_attention_cache, "flex", flex_attention)  # eager on CPU
    q, k = (torch.randn(tokens, 3, 24) for _ in range(2))
    v = torch.randn(tokens, 3, 16)  # FlexAttention has no backward on CPU: tests/test_cuda_packing.py
    out = packing._moe_rewrite_flex(q, k, v, documents, None)
    want = _reference(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), ids).transpose(0, 1)
    assert (out.double() - want).abs().max() < 1e-5


def test_per_document_sdpa_over_several_rows():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 4, 5, 5]])
    documents = packing._MoeRewriteDocuments([0, 2, 5, 6, 9, 10, 12], ids)
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    got = packing._moe_rewrite_attention_per_document(
        q, k, v, documents, lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)
    )
    for row in range(2):
        want = _reference(q[row], k[row], v[row], ids[row])
        assert (got[row].double() - want).abs().max() < 1e-5


def test_the_document_causal_mask_over_several_rows():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 4, 5, 5]])
    got = packing._moe_rewrite_document_causal_mask(ids)
    assert got.shape == (2, 1, 6, 6) and got.dtype == torch.bool
    for row in range(2):
        for q in range(6):
            for k in range(6):
                assert bool(got[row, 0, q, k]) == (k <= q and bool(ids[row, q] == ids[row, k]))


def test_a_compiled_layer_takes_varlen_where_it_runs_else_the_mask_with_one_warning_on_cuda(monkeypatch):
    """The kernel a compiled layer runs packed documents on, decided at tracing (packing.py): the CPU and a CUDA
    batch varlen_attn does not take (float32, dropout, the probe failing) get the mask, CUDA with one warning."""
    monkeypatch.setattr(packing, "_moe_rewrite_packing_cache", {})  # no decision or warning from an earlier test
    choose = packing._moe_rewrite_compiled_packed_backend
    cuda = torch.device("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose(torch.device("cpu"), torch.bfloat16, 192, 128, 0.0) == "mask"
    probed = []
    monkeypatch.setattr(packing, "_moe_rewrite_packed_runs", lambda *a: probed.append(a) or True)
    assert choose(cuda, torch.bfloat16, 192, 128, 0.0) == "varlen"
    assert probed == [("varlen", cuda, torch.bfloat16, 192, 128)]
    assert choose(cuda, torch.bfloat16, 192, 128, 0.0) == "varlen"  # the cached decision: no second probe
    with pytest.warns(UserWarning, match="document-causal mask .*float32"):
        assert choose(cuda, torch.float32, 192, 128, 0.0) == "mask"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert choose(cuda, torch.bfloat16, 192, 128, 0.1) == "mask"
    monkeypatch.setattr(packing, "_moe_rewrite_packed_runs", lambda *a: False)
    assert choose(cuda, torch.float16, 192, 128, 0.0) == "mask"
    assert len(probed) == 1  # decided once per device, dtype and head dims
