"""Only the code a model can use is generated: FP8 experts' code where the checkpoint's config asks for FP8 (or
--fp8-experts), expert parallelism's exchange and sharding where asked (--expert-parallel, with fused experts only;
elsewhere their entry points refuse in one line naming it); the choice is said in the summary and recorded in the
banner, and a second run changes nothing."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import V3_DIR, build_model, patched_checkpoint, run_cli

from moe_rewrite import RewriteError, RewriteOptions, rewrite_source

# what each feature defines (docstrings elsewhere may name it)
FP8_NAMES = ("class _MoeRewriteFP8", "def _moe_rewrite_dequantize(", "def _moe_rewrite_fp8_loading(", "dequantized_")
EP_NAMES = ("def _moe_rewrite_expert_parallel(", "class _MoeRewriteAllToAll", "def _moe_rewrite_fully_shard_api(")
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


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
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


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
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


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_expert_parallel_code_only_where_asked_and_refused_in_one_line_elsewhere():
    text = (V3_DIR / "modeling_deepseek.py").read_text()
    plain = rewrite_source(text)
    assert plain.options.expert_parallel is False and "expert-parallel" not in _banner(plain.text)
    assert [name for name in EP_NAMES if name in plain.text] == [] and "expert_parallel_model" not in plain.sections
    # what is left says how to get it, where a model would reach it: moe_train at ep_size > 1 and the model's methods
    assert plain.text.count("_moe_rewrite_no_expert_parallel()") == 4
    assert "rewrite it with --expert-parallel" in plain.text
    ep = rewrite_source(text, RewriteOptions(expert_parallel=True))
    assert [name for name in EP_NAMES if name not in ep.text] == [] and "expert-parallel" in _banner(ep.text)
    assert "_moe_rewrite_no_expert_parallel" not in ep.text and "expert_parallel_model" in ep.sections
    per_expert = rewrite_source(text, RewriteOptions(fuse_experts=False))
    assert [name for name in EP_NAMES if name in per_expert.text] == []
    assert per_expert.text.count("_moe_rewrite_no_expert_parallel()") == 4
    with pytest.raises(RewriteError, match="^--expert-parallel needs fused experts: drop --no-fuse-experts$"):
        rewrite_source(text, RewriteOptions(expert_parallel=True, fuse_experts=False))
    # a second run keeps what the banner records, and says so; --no-expert-parallel drops it
    again = rewrite_source(ep.text)
    assert not again.changed and again.options.expert_parallel is True
    assert again.chosen == (
        "expert parallelism: kept, as the earlier rewrite's banner records it (--no-expert-parallel drops it)",
    )
    assert rewrite_source(ep.text, RewriteOptions(expert_parallel=False)).text == plain.text
    assert not rewrite_source(plain.text).changed


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_expert_parallel_through_the_cli(tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(V3_DIR, "--out", out, "--expert-parallel", "--no-fuse-experts")
    expected = "moe-rewrite: error: --expert-parallel needs fused experts: drop --no-fuse-experts"
    assert (code, err.strip().splitlines()) == (2, [expected])
    assert not out.exists()
    code, _, err = run_cli(V3_DIR, "--out", out, "--expert-parallel")
    assert code == 0, err
    assert "expert-parallel" in err.splitlines()[0]  # the options the file was rewritten with
    written = (out / "modeling_deepseek.py").read_text()
    assert "expert-parallel" in _banner(written) and [name for name in EP_NAMES if name not in written] == []
    vendored = tmp_path / "vendor" / "modeling_deepseek.py"
    vendored.parent.mkdir()
    vendored.write_text(written)
    code, _, err = run_cli(vendored, "--check")
    assert code == 0, err
    code, _, err = run_cli(vendored, "--in-place", "--no-expert-parallel")
    assert code == 1, err
    assert [name for name in EP_NAMES if name in vendored.read_text()] == []


def test_a_file_without_expert_parallelism_refuses_it_naming_the_option(tmp_path_factory):
    import torch

    model = build_model(patched_checkpoint(tmp_path_factory, "v3"))
    for call in (model.moe_rewrite_fully_shard, model.moe_rewrite_expert_parallel):
        with pytest.raises(NotImplementedError, match="rewrite it with --expert-parallel$"):
            call()
    with pytest.raises(NotImplementedError, match="rewrite it with --expert-parallel$"):
        model.moe_rewrite_all_reduce_gradients()
    moe = next(m for m in model.modules() if callable(getattr(m, "moe_train", None)))
    moe.ep_size = 2  # what a config with ep_size = 2 gives the layer
    x, ids = torch.randn(3, model.config.hidden_size), torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="rewrite it with --expert-parallel$"):
        moe.moe_train(x, ids, torch.ones(3, 1))


def test_the_generated_copy_names_each_sections_module_and_keeps_first_sentences():
    """Each section of the block sits under a comment naming its runtime module; the copy's docstrings keep their
    first sentence (the module keeps the whole text)."""
    import ast
    import re

    from moe_rewrite import render

    source = (V3_DIR / "modeling_deepseek.py").read_text()
    out = rewrite_source(source).text
    named = re.findall(r"^# moe_rewrite/(runtime/\w+/\w+\.py)$", out, flags=re.M)
    assert named and len(named) == len(set(named))
    assert all(render.section_file(path.split("/")[-1][:-3]).is_file() for path in named)
    copied = {
        node.name: ast.get_docstring(node, clean=False)
        for node in ast.walk(ast.parse(out))
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith(("_moe_rewrite", "_MoeRewrite"))
    }
    whole = {}
    for path in named:
        tree = ast.parse(render.section_file(path.split("/")[-1][:-3]).read_text())
        whole |= {
            node.name: ast.get_docstring(node, clean=False)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        }
    cut = [name for name, doc in copied.items() if doc and whole.get(name) and doc != whole[name]]
    assert cut  # some were cut, and each to a prefix of the whole text ending a sentence
    for name in cut:
        assert whole[name].startswith(copied[name]) and copied[name].endswith(".")
    assert render.first_sentence('"""One. Two."""') == '"""One."""'
    assert render.first_sentence('"""Say e.g. this. Then (that)."""') == '"""Say e.g. this."""'
    assert render.first_sentence('"""Only one sentence, no period"""') == '"""Only one sentence, no period"""'
