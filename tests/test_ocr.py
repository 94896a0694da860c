"""DeepSeek-OCR / DeepSeek-VL2-style checkpoints (tests/ocr_checkpoint.py): the MoE file that config.json's auto_map
module imports relatively is the one rewritten, and nothing else is; a V2-form router's `noaux_tc` branch trains,
choosing as in eval; the Llama attention stand-in equals transformers 4.46's class."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import assert_one_line_error, build_model, run_cli, snapshot
from ocr_checkpoint import WRAPPER, language_model, write_checkpoint

from moe_rewrite import rewrite_source
from moe_rewrite.codemods.kit import MARK

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = ROOT / "moe_rewrite" / "runtime" / "compat" / "compat_llama_attention.py"


def test_the_module_the_wrapper_imports_is_rewritten_and_nothing_else(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ocr")
    before = snapshot(ckpt)
    code, _, err = run_cli(ckpt, "--out", tmp_path / "out")
    assert code == 0, err
    assert "modeling_deepseekocr.py (config.json's auto_map) imports the MoE classes from modeling_deepseekv2.py" in err
    assert snapshot(ckpt) == before
    after = snapshot(tmp_path / "out")
    assert sorted(after) == sorted([*before, ".moe-rewrite.json"])
    assert MARK in after["modeling_deepseekv2.py"].decode()
    assert {n: after[n] for n in before if n != "modeling_deepseekv2.py"} == {
        n: b for n, b in before.items() if n != "modeling_deepseekv2.py"
    }
    code, _, err = run_cli(ckpt, "--in-place")
    assert code == 1, err
    in_place = snapshot(ckpt)
    assert in_place["modeling_deepseekv2.py"] == after["modeling_deepseekv2.py"]
    assert {n: b for n, b in in_place.items() if n != "modeling_deepseekv2.py"} == {
        n: b for n, b in before.items() if n != "modeling_deepseekv2.py"
    }


@pytest.mark.parametrize(
    ("wrapper", "extra", "says"),
    [
        ("from .configuration_deepseek import DeepseekV2Config\n", {}, "not a DeepSeek-family MoE file"),
        (WRAPPER + "from .modeling_other import X\n", {"modeling_other.py": None}, "several MoE files"),
        (WRAPPER + "from ..shared import X\n", {}, "outside the checkpoint's top level"),
        (WRAPPER + "from .absent import X\n", {}, "the checkpoint has no absent.py"),
    ],
    ids=["no-moe-file", "two-moe-files", "outside", "missing"],
)
def test_imports_leading_nowhere_or_to_several_moe_files_are_refused(tmp_path, wrapper, extra, says):
    ckpt = write_checkpoint(tmp_path / "ocr", wrapper=wrapper)
    for name in extra:
        (ckpt / name).write_text(language_model())
    before = snapshot(ckpt)
    assert_one_line_error(run_cli(ckpt, "--out", tmp_path / "out"), says)
    assert_one_line_error(run_cli(ckpt, "--in-place"), says)
    assert snapshot(ckpt) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "guard",
    [
        "            assert self.training is False, 'eval only'\n",
        "            if self.training:\n                raise NotImplementedError('eval only')\n",
    ],
)
def test_training_guard_spellings_in_a_v2_router_are_removed(guard):
    text = rewrite_source(language_model(guard=guard)).text
    gate = text[text.index("class MoEGate") : text.index("class AddAuxiliaryLoss")]
    assert "self.training is False" not in gate and "raise NotImplementedError('eval only')" not in gate
    assert 'elif self.topk_method == "noaux_tc":\n            n_tokens = scores.shape[0]\n' in gate


@pytest.mark.parametrize(
    "guard",
    [
        "            assert self.training == 0\n",
        "            if self.training and n_tokens:\n                raise ValueError\n",
    ],
)
def test_an_unusual_guard_in_a_v2_router_is_refused(guard):
    from moe_rewrite.errors import RewriteError

    with pytest.raises(RewriteError, match="MoEGate.forward: cannot tell whether the check on `self.training"):
        rewrite_source(language_model(guard=guard))


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    base = tmp_path_factory.mktemp("ocr")
    ckpt = write_checkpoint(base / "ocr_source")
    out = base / "ocr_rewritten"
    assert run_cli(ckpt, "--out", out, "--no-fuse-experts")[0] == 0
    return out


def test_noaux_tc_v2_router_trains_choosing_as_in_eval(rewritten):
    """One training step of the rewritten MoE layer, fp32: the router's training-mode choice equals its eval-mode
    choice, and output and gradients equal the per-expert loop on that choice (with the aux loss's gradient)."""
    import torch
    from helpers import assert_matches_reference, expert_params, moe_layer, reference_moe

    model = build_model(rewritten, seed=1).train()
    moe = moe_layer(model)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.1)  # a bias that changes the choice
    x = torch.randn(2, 9, 64, requires_grad=True)
    trained = moe.gate(x)
    moe.gate.eval()
    chosen = moe.gate(x)
    moe.gate.train()
    assert torch.equal(trained[0], chosen[0]) and torch.equal(trained[1], chosen[1])
    reference = reference_moe(moe, x)
    y = moe(x)
    assert_matches_reference(y, x, reference, lambda: {n: p.grad for n, p in expert_params(moe).items()})
    assert moe.gate.e_score_correction_bias.grad is None  # chosen with it, weighted without it


def _llama_check(python: str, model_dir: Path) -> str:
    script = f"""
import sys, importlib.util, torch, transformers
from transformers import AutoModelForCausalLM, AutoConfig
config = AutoConfig.from_pretrained({str(model_dir)!r}, trust_remote_code=True, use_mla=False)
config._attn_implementation = "eager"
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, torch_dtype=torch.float32).train()
ids = torch.arange(24).view(2, 12) % 256
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
print("loss", repr(loss.item()), repr(model.model.layers[0].self_attn.q_proj.weight.grad.sum().item()))
if transformers.__version__ == "4.46.3":  # the stand-in against the class it stands for
    from transformers.models.llama.modeling_llama import LlamaAttention
    spec = importlib.util.spec_from_file_location("stand_in", {str(STAND_IN)!r})
    stand_in = importlib.util.module_from_spec(spec); spec.loader.exec_module(stand_in)
    for kv in (4, 2):
        config.num_key_value_heads = kv
        old = LlamaAttention(config, layer_idx=0); new = stand_in.LlamaAttention(config, layer_idx=0)
        new.load_state_dict(old.state_dict())
        x = torch.randn(2, 7, 64, requires_grad=True)
        mask = torch.full((7, 7), torch.finfo(torch.float32).min).triu(1).expand(2, 1, 7, 7).clone()
        mask[0, :, :, :2] = torch.finfo(torch.float32).min
        got = []
        for module in (old, new):
            x.grad = None
            out = module(x, attention_mask=mask, position_ids=torch.arange(3, 10).expand(2, 7), output_attentions=True)
            out[0].sum().backward()
            got.append([out[0], out[1], x.grad, *(p.grad for p in module.parameters())])
        print("stand-in", kv, all(torch.equal(a, b) for a, b in zip(*got)))
"""
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, cwd=model_dir.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


RELEASES = os.environ.get("MOE_REWRITE_COMPAT_RELEASES", "4.46.3 5.24.0").split()


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_use_mla_false_trains_alike_on_every_release(rewritten):
    """The Llama attention path (`use_mla: false`): on 4.46.3 with transformers' classes, elsewhere with the stand-ins,
    the same training loss and gradients; on 4.46.3 the stand-in equals LlamaAttention bit for bit (forward, weights'
    and input gradients, MHA and GQA)."""
    import torch

    config_model = build_model(rewritten, seed=0, use_mla=False)  # this environment's transformers, in-process
    model = config_model.train()
    ids = torch.arange(24).view(2, 12) % 256
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    here = f"loss {loss.item()!r} {model.model.layers[0].self_attn.q_proj.weight.grad.sum().item()!r}"
    results = {}
    for release in RELEASES:
        python = ROOT / ".venv-tf" / release / "bin" / "python"
        if not python.exists():
            pytest.fail(f"no compat environment for transformers {release} ({python})")
        results[release] = _llama_check(str(python), rewritten)
    losses = {"here": here, **{release: out.splitlines()[0] for release, out in results.items()}}
    assert len(set(losses.values())) == 1, losses
    if "4.46.3" in results:
        assert results["4.46.3"].count("stand-in") == 2 and "False" not in results["4.46.3"], results["4.46.3"]
