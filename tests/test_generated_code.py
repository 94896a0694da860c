"""Only the code a model can use is generated: FP8 experts' code where the checkpoint's config asks for FP8 (or
--fp8-experts), expert parallelism's exchange and sharding where they can run (not with --no-fuse-experts, where they
are refused); the choice is said in the summary and recorded in the banner, and a second run changes nothing."""

from __future__ import annotations

import json
import shutil

from conftest import V3_DIR, run_cli

from moe_rewrite import RewriteOptions, rewrite_source

# what each feature defines (docstrings elsewhere may name it)
FP8_NAMES = ("class _MoeRewriteFP8", "def _moe_rewrite_dequantize(", "def _moe_rewrite_fp8_loading(", "dequantized_")
EP_NAMES = ("def _moe_rewrite_expert_parallel(", "class _MoeRewriteAllToAll", "def moe_rewrite_fully_shard(")
FP8_SECTIONS = {"fp8_experts"}
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _fp8_checkpoint(tmp_path):
    """The V3 stand-in's code with a config.json that asks for FP8, as DeepSeek-V3's does."""
    source = tmp_path / "fp8_src"
    shutil.copytree(V3_DIR, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"quantization_config": QUANTIZATION}, indent=2))
    return source


def _banner(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("# ---- moe-rewrite"))


def test_fp8_code_only_where_the_config_asks():
    text = (V3_DIR / "modeling_deepseek.py").read_text()
    plain = rewrite_source(text)
    assert not FP8_SECTIONS & set(plain.sections) and plain.options.fp8_experts is False
    assert [name for name in FP8_NAMES if name in plain.text] == []
    assert "fp8-experts" not in _banner(plain.text)
    fp8 = rewrite_source(text, config={"quantization_config": QUANTIZATION})
    assert FP8_SECTIONS <= set(fp8.sections) and "fp8-experts" in _banner(fp8.text)
    assert [name for name in FP8_NAMES if name not in fp8.text] == []
    assert fp8.chosen == ("FP8 experts: generated, as config.json's quantization_config asks (quant_method fp8)",)
    # the caller's choice stands over the config
    assert rewrite_source(text, RewriteOptions(fp8_experts=False), {"quantization_config": QUANTIZATION}).text == (
        plain.text
    )
    assert rewrite_source(text, RewriteOptions(fp8_experts=True)).text == fp8.text


def test_fp8_choice_through_the_cli_is_said_and_a_second_run_changes_nothing(tmp_path):
    source = _fp8_checkpoint(tmp_path)
    code, _, err = run_cli(source, "--out", tmp_path / "out")
    assert code == 0, err
    assert "FP8 experts: generated, as config.json's quantization_config asks" in err
    written = (tmp_path / "out" / "modeling_deepseek.py").read_text()
    assert "fp8-experts" in _banner(written) and [name for name in FP8_NAMES if name not in written] == []
    assert run_cli(tmp_path / "out", "--check")[0] == 0  # the output's own config asks for FP8 too
    # a vendored file without its config: the banner keeps the choice, --no-fp8-experts drops it
    vendored = tmp_path / "vendor" / "modeling_deepseek.py"
    vendored.parent.mkdir()
    vendored.write_text(written)
    code, _, err = run_cli(vendored, "--check")
    assert code == 0, err
    code, _, err = run_cli(vendored, "--in-place", "--no-fp8-experts")
    assert code == 1, err
    dropped = vendored.read_text()
    assert "fp8-experts" not in _banner(dropped) and [name for name in FP8_NAMES if name in dropped] == []
    assert run_cli(vendored, "--check")[0] == 0
    assert run_cli(source, "--out", tmp_path / "no_fp8", "--no-fp8-experts")[0] == 0
    assert (tmp_path / "no_fp8" / "modeling_deepseek.py").read_text() == dropped


def test_expert_parallel_code_not_where_it_is_refused():
    text = (V3_DIR / "modeling_deepseek.py").read_text()
    fused = rewrite_source(text)
    assert [name for name in EP_NAMES if name not in fused.text] == []
    per_expert = rewrite_source(text, RewriteOptions(fuse_experts=False))
    assert [name for name in EP_NAMES if name in per_expert.text] == []
    # what is left says why, where a model would reach it
    assert "expert parallelism needs the routed experts fused (rewrite without --no-fuse-experts)" in per_expert.text
