"""The compat codemod on its own: a second run changes nothing, --no-compat takes every edit back, a used name without
a stand-in is refused, and the mask stand-in equals transformers' own function bit for bit."""

from __future__ import annotations

import pytest
from conftest import V3_DIR, assert_one_line_error, run_cli

from moe_rewrite import RewriteOptions, rewrite_source

SOURCE = (V3_DIR / "modeling_deepseek.py").read_text()


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_second_run_changes_nothing_and_no_compat_takes_it_back():
    once = rewrite_source(SOURCE).text
    assert "_moe_rewrite_cache_usable_length(past_key_value, kv_seq_len, self.layer_idx)" in once
    assert "class DeepseekV3ForCausalLM(DeepseekV3PreTrainedModel, GenerationMixin):" in once
    assert 'scaling_type = _moe_rewrite_rope_scaling(self.config)["type"]' in once
    rope_classes = "".join(
        f"\n    DeepseekV3{kind}RotaryEmbedding," for kind in ("", "LinearScaling", "DynamicNTKScaling", "Yarn")
    )
    assert f"_moe_rewrite_records_init({rope_classes}\n)" in once
    assert rewrite_source(once).changed is False
    off = RewriteOptions(compat=False)
    taken_back, never = rewrite_source(once, off).text, rewrite_source(SOURCE, off).text
    assert taken_back == never
    assert "GenerationMixin" not in never
    assert "get_usable_length(" in taken_back
    assert "_moe_rewrite_rope_scaling" not in taken_back
    assert "_moe_rewrite_records_init" not in taken_back


@pytest.mark.parametrize("form", ["v3", "v2"])
def test_rope_tables_come_back_after_meta_init(form, tmp_path):
    """transformers 5.x (and FSDP2-style meta init) builds the model on the meta device and gives non-persistent buffers
    uninitialised memory; `_init_weights` of the rewritten file recomputes them. Simulated here on any release: build on
    meta, to_empty (memory filled with NaN, as garbage would be), _init_weights: the RoPE tables equal a fresh model's
    and the logits too."""
    torch = pytest.importorskip("torch")
    from conftest import FORM_DIRS, build_model, model_module

    out = tmp_path / "out"
    assert run_cli(FORM_DIRS[form], "--out", out)[0] == 0
    reference = build_model(out, seed=3).eval()
    with torch.device("meta"):
        model = build_model(out, seed=3)
    model = model_module(model)._moe_rewrite_fuse_model(model.to_empty(device="cpu"))  # fused once materialised
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.fill_(float("nan"))
        model.load_state_dict(reference.state_dict())
    rope = [n for n, _ in model.named_buffers() if "rotary_emb" in n]
    assert rope and all(torch.isnan(dict(model.named_buffers())[n]).all() for n in rope)
    model.apply(model._init_weights)  # what 5.x runs on each module it did not load
    model.load_state_dict(reference.state_dict())  # _init_weights redraws the weights; the buffers stay
    fresh = dict(reference.named_buffers())
    for name in rope:
        assert torch.equal(dict(model.named_buffers())[name], fresh[name]), name
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


def test_a_removed_name_the_file_uses_without_a_stand_in_is_refused(tmp_path):
    text = SOURCE.replace(
        "from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask",
        "from transformers.modeling_attn_mask_utils import _create_4d_causal_attention_mask, "
        "_prepare_4d_causal_attention_mask",
    ).replace(
        "logger = logging.get_logger(__name__)",
        "CREATE = _create_4d_causal_attention_mask\nlogger = logging.get_logger(__name__)",
    )
    path = tmp_path / "modeling_deepseek.py"
    path.write_text(text)
    assert_one_line_error(run_cli(path, "--check"), "_create_4d_causal_attention_mask", "--no-compat")
    assert path.read_text() == text
    assert run_cli(path, "--check", "--no-compat")[0] == 1  # would rewrite, coupling left as it is


def test_mask_stand_in_equals_transformers_bit_for_bit():
    torch = pytest.importorskip("torch")
    reference = pytest.importorskip("transformers.modeling_attn_mask_utils")._prepare_4d_causal_attention_mask
    from moe_rewrite.runtime.compat.compat_causal_mask import _prepare_4d_causal_attention_mask as ours

    gen = torch.Generator().manual_seed(0)
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for batch, query, past in [(1, 1, 0), (2, 1, 5), (2, 7, 0), (3, 4, 6)]:
            embeds = torch.zeros(batch, query, 8, dtype=dtype)
            masks = [
                None,
                (torch.rand(batch, query + past, generator=gen) > 0.3).long(),
                torch.ones(batch, query + past),
            ]
            masks.append((torch.rand(batch, 1, query, query + past, generator=gen) > 0.5).to(dtype))
            for mask in masks:
                expected = reference(mask, (batch, query), embeds, past)
                got = ours(mask, (batch, query), embeds, past)
                assert (expected is None) == (got is None)
                if expected is not None:
                    assert got.dtype == expected.dtype and torch.equal(got, expected), (dtype, batch, query, past)
                checked += 1
    assert checked == 48


def test_names_still_in_transformers_are_imported_again_beside_the_stand_ins():
    text = SOURCE.replace(
        "from transformers.utils.import_utils import is_torch_fx_available",
        "from transformers.utils.import_utils import is_torch_fx_available, is_torch_available as torch_there",
    )
    out = rewrite_source(text).text
    assert "    from transformers.utils.import_utils import is_torch_available as torch_there\n" in out
    assert "    def is_torch_fx_available():" in out
    namespace: dict = {}
    guarded = out[out.index("try:\n    from transformers.utils.import_utils") :]
    exec(
        guarded[: guarded.index("from transformers.generation")], namespace
    )  # the guarded import runs (its try branch, here)
    assert namespace["is_torch_fx_available"]() is True and callable(namespace["torch_there"])
