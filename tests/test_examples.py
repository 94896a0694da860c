"""examples/finetune.py, as a user runs it, on the V3-form stand-in at its tiny size: LoRA with the Trainer, and full
fine-tuning in a plain loop with gradient checkpointing and the bias update; each saves, reloads and must reload the
model it trained. And examples/demo.py's checkpoint, the same on every run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from conftest import ROOT, build_model, patched_checkpoint  # noqa: E402

SCRIPT = ROOT / "examples" / "finetune.py"


def checkpoint_with_weights(tmp_path_factory, *options: str):
    """The stand-in rewritten with `options`, saved with random weights as a complete checkpoint."""
    model = build_model(patched_checkpoint(tmp_path_factory, "v3", *options), seed=0)
    path = tmp_path_factory.mktemp("weights") / "checkpoint"
    model.save_pretrained(path)
    return path


def finetune(checkpoint, out, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(checkpoint), "--out", str(out), "--steps", "3", "--seq-len", "16", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"reloaded: max \|logits - trained model's\| = (\S+)", proc.stdout)
    assert found, proc.stdout
    assert float(found.group(1)) < 1e-5, proc.stdout  # the reloaded model is the trained one
    return proc.stdout + proc.stderr


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_lora_with_the_trainer(tmp_path_factory, tmp_path):
    output = finetune(checkpoint_with_weights(tmp_path_factory), tmp_path / "lora", "--lora", "--lora-rank", "4")
    assert "trainable params" in output and "'loss'" in output
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert any(".mlp.experts.0.gate_proj.lora_B" in k for k in adapter)  # the routed experts were adapted


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_full_fine_tuning_in_a_loop_with_checkpointing_and_the_bias_update(tmp_path_factory, tmp_path):
    checkpoint = checkpoint_with_weights(tmp_path_factory, "--bias-update", "0.01")
    output = finetune(checkpoint, tmp_path / "full", "--loop", "--gradient-checkpointing", "--lr", "1e-3")
    losses = [float(x) for x in re.findall(r"step \d+: loss (\S+)", output)]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    from safetensors.torch import load_file

    before, after = load_file(checkpoint / "model.safetensors"), load_file(tmp_path / "full" / "model.safetensors")
    assert after.keys() == before.keys() and "model.layers.1.mlp.experts.0.gate_proj.weight" in after
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.count_nonzero(after[bias]) > 0 and torch.equal(before[bias], torch.zeros_like(before[bias]))
    assert not torch.equal(
        after["model.layers.1.mlp.experts.0.down_proj.weight"], before["model.layers.1.mlp.experts.0.down_proj.weight"]
    )


def test_the_demo_checkpoint_is_the_same_whatever_memory_torch_empty_returns(monkeypatch):
    """`make demo` builds its checkpoint with the original stand-in code, whose router bias comes from torch.empty
    (as in the published V3 file): built over NaN-filled memory and over memory holding 1e30, every tensor it saves
    is finite and the same, the bias zero; so its losses do not change from run to run."""
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    empty = torch.empty

    def built_over(value: float) -> dict:
        def filled(*args, **kwargs):
            tensor = empty(*args, **kwargs)
            return tensor.fill_(value) if tensor.is_floating_point() else tensor

        monkeypatch.setattr(torch, "empty", filled)
        try:
            return demo.build_original().state_dict()
        finally:
            monkeypatch.setattr(torch, "empty", empty)

    nan, huge = built_over(float("nan")), built_over(1e30)

    assert nan.keys() == huge.keys()
    for name, tensor in nan.items():
        assert bool(torch.isfinite(tensor).all()) and torch.equal(tensor, huge[name]), name
    bias = nan["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, torch.zeros_like(bias))
