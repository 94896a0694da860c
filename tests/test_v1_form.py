"""The V1 form (DeepSeekMoE 16B, fixtures/deepseek_moe): rewritten, one fp32 training step equals the file's own
per-expert loop (loss and every gradient, padded batch), eval equals its moe_infer, and the mask stand-ins of the
compat rewrite equal transformers' own, bit for bit."""

from __future__ import annotations

import pytest
from conftest import FIXTURES, build_model, run_cli

torch = pytest.importorskip("torch")
V1_DIR = FIXTURES / "deepseek_moe"


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    out = tmp_path_factory.mktemp("v1") / "patched_v1"
    code, _, err = run_cli(V1_DIR, "--out", out, "--no-fuse-experts")
    assert code == 0, err
    text = (out / "modeling_deepseek.py").read_text()
    assert "y = self.moe_train(hidden_states, topk_idx, topk_weight)" in text
    assert "self.moe_rewrite_infer(hidden_states, flat_topk_idx, topk_weight.view(-1, 1))" in text
    return out


def test_a_training_step_equals_the_published_loop_and_eval_its_moe_infer(rewritten):
    original, patched = build_model(V1_DIR, seed=1), build_model(rewritten, seed=1)
    assert not hasattr(patched.model.layers[1].mlp, "ep_size")
    patched.load_state_dict(original.state_dict())
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    losses, grads = [], []
    for model in (original.train(), patched.train()):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        expected = original.eval()(input_ids=ids, attention_mask=mask).logits
        got = patched.eval()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_v1_model_without_ep_size_trains_with_fused_experts(tmp_path):
    out = tmp_path / "patched_v1_fused"
    assert run_cli(V1_DIR, "--out", out)[0] == 0
    model = build_model(out, seed=3).train()
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    assert type(model.model.layers[1].mlp.experts).__name__ == "_MoeRewriteFusedExperts"


def test_mask_stand_ins_equal_transformers_bit_for_bit():
    utils = pytest.importorskip("transformers.modeling_attn_mask_utils")
    from moe_rewrite.runtime.compat.compat_attention_mask import _prepare_4d_attention_mask
    from moe_rewrite.runtime.compat.compat_attn_mask_converter import AttentionMaskConverter
    from moe_rewrite.runtime.compat.compat_sdpa_causal_mask import _prepare_4d_causal_attention_mask_for_sdpa

    theirs = utils.AttentionMaskConverter
    gen = torch.Generator().manual_seed(0)

    def same(a, b):
        return (a is None and b is None) or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))

    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for batch, query, past in [(1, 1, 0), (2, 1, 5), (2, 7, 0), (3, 4, 6)]:
            keys = query + past
            embeds = torch.zeros(batch, query, 8, dtype=dtype)
            padded = (torch.rand(batch, keys, generator=gen) > 0.3).long()
            for window in (None, 3):
                a, b = AttentionMaskConverter(True, window), theirs(True, window)
                assert same(a.to_causal_4d(batch, query, keys, dtype), b.to_causal_4d(batch, query, keys, dtype))
                assert same(a.to_4d(padded, query, dtype, keys), b.to_4d(padded, query, dtype, keys))
                for mask in (None, padded):
                    assert a._ignore_causal_mask_sdpa(mask, embeds, past, window) == b._ignore_causal_mask_sdpa(
                        mask, embeds, past, window
                    )
            made = theirs._make_causal_mask((batch, query), dtype, "cpu", past)
            assert same(AttentionMaskConverter._make_causal_mask((batch, query), dtype, "cpu", past), made)
            expanded = theirs._expand_mask(padded, dtype, query)
            assert same(AttentionMaskConverter._expand_mask(padded, dtype, query), expanded)
            assert same(
                _prepare_4d_attention_mask(padded, dtype, query), utils._prepare_4d_attention_mask(padded, dtype, query)
            )
            minimum = torch.finfo(dtype).min
            assert same(
                AttentionMaskConverter._unmask_unattended(expanded, minimum),
                theirs._unmask_unattended(expanded, minimum),
            )
            four_d = (torch.rand(batch, 1, query, keys, generator=gen) > 0.5).to(dtype)
            for mask in (None, padded, torch.ones(batch, keys), four_d):
                expected = utils._prepare_4d_causal_attention_mask_for_sdpa(mask, (batch, query), embeds, past)
                assert same(_prepare_4d_causal_attention_mask_for_sdpa(mask, (batch, query), embeds, past), expected)
                checked += 1
    assert checked == 32
