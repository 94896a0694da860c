"""No 4-D mask where SDPA's causal kernel computes the same: the runtime wrapper's decision, and the codemod that puts
it around the Model's `_prepare_4d_causal_attention_mask` call (what it proves, the line where it leaves the call,
idempotence, --no-sdpa). The whole model against the published file: tests/test_training.py."""

from __future__ import annotations

import pytest
import torch
from conftest import V3_DIR, runtime_env

from moe_rewrite import RewriteOptions, rewrite_source
from moe_rewrite.runtime.compat.compat_causal_mask import _prepare_4d_causal_attention_mask as build_4d
from moe_rewrite.runtime.model import attention


class _Config:
    def __init__(self, implementation: str = "sdpa") -> None:
        self._attn_implementation = implementation


def _decide(mask, q_len=5, past=0, implementation="sdpa", output_attentions=False, batch=2):
    """What the wrapper returns, and whether it called the file's function (with the same arguments)."""
    calls = []
    embeds = torch.zeros(batch, q_len, 4)

    def build(*args):
        calls.append(args)
        return build_4d(*args)

    got = attention._moe_rewrite_sdpa_mask(
        build, _Config(implementation), output_attentions, mask, (batch, q_len), embeds, past
    )
    if calls:
        assert len(calls) == 1 and calls[0][0] is mask and calls[0][1:] == ((batch, q_len), embeds, past)
    return got, bool(calls)


def _ones(keys=5, batch=2, dtype=torch.long):
    return torch.ones(batch, keys, dtype=dtype)


def _padded(side: str, keys=5):
    mask = _ones(keys)
    mask[0, slice(0, 2) if side == "left" else slice(-2, None)] = 0
    return mask


NONE_CASES = {
    "no mask": dict(mask=None),
    "all ones": dict(mask=_ones()),
    "all ones, bool": dict(mask=_ones(dtype=torch.bool)),
    "all ones, float": dict(mask=_ones(dtype=torch.float32)),
    "one query, no cache": dict(mask=None, q_len=1),
    "one query after a cache": dict(mask=_ones(keys=8), q_len=1, past=7),
    "one query after a cache, no mask": dict(mask=None, q_len=1, past=7),
}
BUILT_CASES = {
    "right padding": dict(mask=_padded("right")),
    "left padding": dict(mask=_padded("left")),
    "a value other than 1": dict(mask=_ones() * 2),
    "output_attentions": dict(mask=None, output_attentions=True),
    "a cache and several queries": dict(mask=None, q_len=3, past=4),
    "a cache and several queries, all ones": dict(mask=_ones(keys=7), q_len=3, past=4),
    "one padded query after a cache": dict(mask=_padded("left", keys=8), q_len=1, past=7),
    "eager": dict(mask=None, implementation="eager"),
    "flash_attention_2": dict(mask=None, implementation="flash_attention_2"),
    "a 4-D mask": dict(mask=torch.ones(2, 1, 5, 5)),
    "a 2-D mask of the wrong length": dict(mask=_ones(keys=4)),
}


@pytest.mark.parametrize("case", NONE_CASES, ids=list(NONE_CASES))
def test_no_mask_where_sdpa_runs_causal_only(case):
    assert _decide(**NONE_CASES[case]) == (None, False)


@pytest.mark.parametrize("case", BUILT_CASES, ids=list(BUILT_CASES))
def test_the_files_own_mask_everywhere_else(case):
    args = BUILT_CASES[case]
    if case == "a 2-D mask of the wrong length":  # the file's function refuses it, as published
        with pytest.raises(RuntimeError):
            _decide(**args)
        return
    got, built = _decide(**args)
    assert built
    if args["mask"] is not None or args.get("q_len", 5) > 1:
        assert got is not None and got.dim() == 4


def test_moe_rewrite_sdpa_0_keeps_the_files_mask(monkeypatch):
    runtime_env(monkeypatch, "MOE_REWRITE_SDPA", "0")
    got, built = _decide(None)
    assert built and got.shape == (2, 1, 5, 5)


def test_under_torch_compile_the_files_mask(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _decide(None)[1]


# ---- the codemod ----

FIXTURE = (V3_DIR / "modeling_deepseek.py").read_text()
CALL = """\
            attention_mask = _prepare_4d_causal_attention_mask(
                attention_mask,
                (batch_size, seq_length),
                inputs_embeds,
                past_length,
            )
"""
WRAPPED = """\
            # moe-rewrite: no mask where SDPA runs causal-only; the file's own mask otherwise
            attention_mask = _moe_rewrite_sdpa_mask(
                _prepare_4d_causal_attention_mask,
                self.config,
                output_attentions,
                attention_mask,
                (batch_size, seq_length),
                inputs_embeds,
                past_length,
                position_ids=position_ids if moe_rewrite_positions_given else None,
                packed=kwargs,
            )
"""
DONE = "attention mask: DeepseekV3Model passes none where SDPA runs causal-only (no padding, no cache)"


@pytest.fixture(scope="module")
def rewritten() -> str:
    return rewrite_source(FIXTURE).text


def test_the_mask_call_is_wrapped_and_a_second_run_changes_nothing(rewritten):
    assert FIXTURE.count(CALL) == 1
    assert WRAPPED in rewritten and CALL not in rewritten
    assert "def _moe_rewrite_sdpa_mask(" in rewritten
    again = rewrite_source(rewritten)
    assert not again.changed and DONE in again.attention


def test_no_sdpa_gives_the_published_call_back(rewritten):
    plain = rewrite_source(rewritten, RewriteOptions(sdpa=False))
    assert CALL in plain.text and "_moe_rewrite_sdpa_mask" not in plain.text
    assert plain.text == rewrite_source(FIXTURE, RewriteOptions(sdpa=False)).text
    assert plain.attention == ()


def _left(old: str, new: str, reason: str, *more: tuple[str, str]) -> None:
    text = FIXTURE
    for a, b in [(old, new), *more]:
        assert text.count(a) == 1, a
        text = text.replace(a, b)
    result = rewrite_source(text)
    lines = [
        line for line in result.attention if line.startswith("attention mask: DeepseekV3Model left as published: ")
    ]
    assert len(lines) == 1 and reason in lines[0], result.attention
    assert "= _moe_rewrite_sdpa_mask(" not in result.text and "= _prepare_4d_causal_attention_mask(" in result.text


DECODER = "        attn_in = self.input_layernorm(hidden_states)\n"
CORE = "        attn_weights = (\n            torch.matmul(query_states, key_states.transpose(2, 3))"
ATTENTION_CALL = "            hidden_states=attn_in,\n            attention_mask=attention_mask,\n"
MODEL_CALL = (
    "            layer_outputs = decoder_layer(\n"
    "                hidden_states,\n"
    "                attention_mask=attention_mask,\n"
)
LEFT = {
    "the attention left as published": (
        "attn_weights, dim=-1, dtype=torch.float32\n",
        "attn_weights, dim=-1, dtype=torch.float16\n",
        "an attention class runs the published core, which needs the 4-D mask",
    ),
    "the attention class chosen without a dict": (
        'ATTENTION_CLASSES = {\n    "eager": DeepseekV3Attention,\n'
        '    "flash_attention_2": DeepseekV3FlashAttention2,\n}\n',
        "",
        "the SDPA attention is not chosen through an ATTENTION_CLASSES-like dict",
        (
            "        self.self_attn = ATTENTION_CLASSES[config._attn_implementation](",
            "        self.self_attn = DeepseekV3Attention(",
        ),
    ),
    "keyword arguments": (
        "                past_length,\n            )",
        "                past_key_values_length=past_length,\n            )",
        "does not pass four positional arguments",
    ),
    "another mask built from": (
        "                attention_mask,\n                (batch_size, seq_length),",
        "                attention_mask * 1,\n                (batch_size, seq_length),",
        "does not build it from `attention_mask` itself",
    ),
    "the mask read after": (
        "        hidden_states = inputs_embeds\n        all_hidden_states",
        "        hidden_states = inputs_embeds * attention_mask.shape[0]\n        all_hidden_states",
        "`attention_mask` is used after `attention_mask = _prepare_4d_causal_attention_mask(...)` other than passed on",
    ),
    "the file's own function": (
        "\nclass DeepseekV3RMSNorm(",
        "\ndef _prepare_4d_causal_attention_mask(*args):\n    return None\n\n\nclass DeepseekV3RMSNorm(",
        "the file defines `_prepare_4d_causal_attention_mask` itself",
    ),
    "another import": (
        "from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask\n",
        "from my_masks import _prepare_4d_causal_attention_mask\n",
        "`_prepare_4d_causal_attention_mask` comes from `from my_masks import _prepare_4d_causal_attention_mask`",
    ),
    # the mask followed from the Model to the attention core (issue 47): any use on the way but passing it on
    "(a) a window on the mask in the decoder layer, under a None guard": (
        DECODER,
        "        if attention_mask is not None:\n"
        "            attention_mask = attention_mask + torch.full_like(attention_mask, -1e4).tril(-4)\n" + DECODER,
        "DeepseekV3DecoderLayer.forward uses the mask: `if attention_mask is not None:`",
    ),
    "(b) arithmetic on the mask in the decoder layer": (
        DECODER,
        "        attention_mask = attention_mask * 1.0\n" + DECODER,
        "DeepseekV3DecoderLayer.forward uses the mask: `attention_mask = attention_mask * 1.0`",
    ),
    "(b) a method changing it in place in the decoder layer": (
        DECODER,
        "        attention_mask.clamp_(min=-1e4)\n" + DECODER,
        "DeepseekV3DecoderLayer.forward uses the mask: `attention_mask.clamp_(min=-10000.0)`",
    ),
    "(c) a subscript store into it in the attention forward": (
        CORE,
        "        attention_mask[..., 0] = 0\n" + CORE,
        "DeepseekV3Attention.forward uses the mask outside its core: `attention_mask[..., 0] = 0`",
    ),
    "(c) kept by the attention forward after its core": (
        "        attn_output = attn_output.transpose(1, 2).contiguous()\n",
        "        attn_output = attn_output.transpose(1, 2).contiguous()\n        self.last_mask = attention_mask\n",
        "DeepseekV3Attention.forward uses the mask outside its core: `self.last_mask = attention_mask`",
    ),
    "(d) the decoder layer raises without it": (
        DECODER,
        "        if attention_mask is None:\n            raise ValueError('no mask')\n" + DECODER,
        "DeepseekV3DecoderLayer.forward uses the mask: `if attention_mask is None:`",
    ),
    "(d) the attention forward raises without it": (
        CORE,
        "        if attention_mask is None:\n            raise ValueError('no mask')\n" + CORE,
        "DeepseekV3Attention.forward uses the mask outside its core: `if attention_mask is None:`",
    ),
    "(d) built only where a 2-D mask is given": (
        "            attention_mask = _prepare_4d_causal_attention_mask(\n",
        "            if attention_mask is not None:\n"
        "                attention_mask = _prepare_4d_causal_attention_mask(\n",
        "DeepseekV3Model.forward builds the mask only under `attention_mask is not None`: None would reach the layers",
    ),
    "passed to another function by the decoder layer": (
        DECODER,
        "        torch._assert(torch.isfinite(attention_mask).any(), 'mask')\n" + DECODER,
        "DeepseekV3DecoderLayer.forward passes the mask to `torch.isfinite(...)`, not to its attention",
    ),
    "passed to another function by the Model": (
        "        hidden_states = inputs_embeds\n        all_hidden_states",
        "        self.check(attention_mask)\n        hidden_states = inputs_embeds\n        all_hidden_states",
        "the mask is passed to `self.check(...)`, not to a decoder layer",
    ),
    "reaching the decoder layer's **kwargs": (
        MODEL_CALL,
        MODEL_CALL.replace("attention_mask=attention_mask,", "mask=attention_mask,"),
        "the mask reaches DeepseekV3DecoderLayer.forward's `*args` or `**kwargs`",
    ),
    "landing on another parameter of the attention": (
        ATTENTION_CALL + "            position_ids=position_ids,\n",
        ATTENTION_CALL + "            position_ids=attention_mask,\n",
        "the mask reaches DeepseekV3Attention.forward other than as `attention_mask`",
    ),
}


@pytest.mark.parametrize("case", LEFT, ids=list(LEFT))
def test_a_call_it_cannot_prove_is_left_as_published_with_a_line(case):
    _left(*LEFT[case])


def test_the_attention_left_as_published_keeps_the_mask_in_the_cli(tmp_path):
    from conftest import run_cli

    path = tmp_path / "modeling_deepseek.py"
    path.write_text(
        FIXTURE.replace("attn_weights, dim=-1, dtype=torch.float32", "attn_weights, dim=-1, dtype=torch.float16")
    )
    code, _, err = run_cli(path, "--check")
    assert code == 1
    assert "\n  attention mask: DeepseekV3Model left as published: an attention class runs the published core" in err


def test_a_flash_only_file_keeps_its_mask_call_and_says_nothing():
    """No eager attention core (the file runs flash-attn only): neither codemod has anything to do or to say."""
    start = FIXTURE.index(
        "        attn_weights = (\n            torch.matmul(query_states, key_states.transpose(2, 3))"
    )
    end = FIXTURE.index("        attn_output = attn_output.transpose(1, 2).contiguous()\n")
    text = FIXTURE[:start] + '        raise NotImplementedError("this file runs flash-attn only")\n' + FIXTURE[end:]
    result = rewrite_source(text)
    assert result.changed and result.attention == ()
    assert "= _moe_rewrite_sdpa_mask(" not in result.text and "= _prepare_4d_causal_attention_mask(" in result.text


def test_the_mask_passed_by_position_to_the_decoder_layer_is_wrapped():
    """A pass-through by position lands on the decoder forward's parameter of that place: still the proven chain."""
    text = FIXTURE.replace(MODEL_CALL, MODEL_CALL.replace("attention_mask=attention_mask,", "attention_mask,"))
    assert text != FIXTURE
    result = rewrite_source(text)
    assert DONE in result.attention and "= _moe_rewrite_sdpa_mask(" in result.text
    assert not rewrite_source(result.text).changed


def test_a_mask_built_only_with_a_2d_one_leaves_the_attention_as_published_too():
    """(d) The published Model hands the layers None without a 2-D mask: its core refuses it (the assert) or runs
    unmasked, where the SDPA branch would run it causal. The attention stays as published as well, saying why."""
    text = FIXTURE.replace(
        "            attention_mask = _prepare_4d_causal_attention_mask(\n",
        "            if attention_mask is not None:\n"
        "                attention_mask = _prepare_4d_causal_attention_mask(\n",
    )
    result = rewrite_source(text)
    assert result.attention[0].startswith(
        "attention: DeepseekV3Attention left as published: the Model can hand it no mask (DeepseekV3Model.forward "
        "builds the mask only under `attention_mask is not None`)"
    ), result.attention
    assert "_moe_rewrite_attention" not in result.text and "_moe_rewrite_sdpa_mask" not in result.text
    assert "_supports_sdpa" not in result.text
    assert not rewrite_source(result.text).changed
    plain = rewrite_source(text, RewriteOptions(sdpa=False)).text  # the same, but for the banner's options
    assert plain == result.text.replace("stacking=stack)", "stacking=stack, no-sdpa)", 1)
