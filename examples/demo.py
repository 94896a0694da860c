"""`make demo`: rewrite the bundled V3-form stand-in checkpoint and train the patched model a few steps on CPU.

1. Build a small checkpoint with the ORIGINAL stand-in code (random weights, saved with save_pretrained).
2. Show that it cannot train: the router asserts `not self.training`.
3. Run `moe-rewrite CHECKPOINT --out PATCHED` (weights are linked, not copied).
4. Load PATCHED with trust_remote_code and train a few AdamW steps on synthetic tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging

from moe_rewrite.training import unfuse_state_dict

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "deepseek_v3"


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def build_original() -> torch.nn.Module:
    """The stand-in model as its original code builds it, with seeded random weights. Like the published V3 file, that
    code creates the router's e_score_correction_bias with torch.empty and nothing initialises it (checkpoints fill
    it): zero it, as a fresh checkpoint has it and as the rewritten file's _init_weights does, or the routing and the
    losses below change from run to run."""
    config = AutoConfig.from_pretrained(FIXTURE, trust_remote_code=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    for module in model.modules():
        if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
            torch.nn.init.zeros_(module.e_score_correction_bias)
    return model


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # keep our lines in order with the CLI's stderr
    logging.set_verbosity_error()
    work = Path(os.environ.get("DEMO_DIR") or tempfile.mkdtemp(prefix="moe-rewrite-demo-"))
    shutil.rmtree(work, ignore_errors=True)
    original_dir, patched_dir = work / "original", work / "patched"
    os.environ.setdefault("HF_MODULES_CACHE", str(work / "hf_modules"))

    say(f"1. a DeepSeek-V3-form checkpoint written by the original code: {original_dir}")
    original = build_original()
    config = original.config
    original.register_for_auto_class("AutoModelForCausalLM")
    original.save_pretrained(original_dir)
    print("   files:", ", ".join(sorted(p.name for p in original_dir.iterdir())))

    batch = torch.randint(0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    say("2. training it as published")
    try:
        original.train()(input_ids=batch, labels=batch)
        print("   unexpectedly trained")
    except AssertionError:
        print("   AssertionError in MoEGate.forward (`assert not self.training`): the published code cannot train")

    say(f"3. moe-rewrite {original_dir} --out {patched_dir}")
    cli = [sys.executable, "-m", "moe_rewrite", str(original_dir), "--out", str(patched_dir)]
    subprocess.run(cli, check=True)
    diff = subprocess.run(
        [sys.executable, "-m", "moe_rewrite", str(original_dir), "--diff"], capture_output=True, text=True
    ).stdout
    added = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    print(f"   diff: +{len(added)} / -{len(removed)} lines; the edits to existing code:")
    for line in removed + [line for line in added if "self.moe_train(" in line and "def " not in line]:
        print("     ", line.rstrip())
    for p in sorted(patched_dir.iterdir()):
        kind = f"-> {os.readlink(p)}" if p.is_symlink() else "(written)"
        print(f"   {p.name} {kind}")

    say("4. training the patched checkpoint (AdamW, 5 steps, CPU)")
    model = AutoModelForCausalLM.from_pretrained(patched_dir, trust_remote_code=True).train()
    fused = [m for m in model.modules() if type(m).__name__ == "_MoeRewriteFusedExperts"]
    print(
        f"   routed experts loaded fused: {len(fused)} MoE layer(s), 2 parameters each instead of "
        f"{3 * len(fused[0]) if fused else 0}"
    )
    # What save_pretrained writes: the checkpoint's own per-expert keys.
    expected, loaded = original.state_dict(), unfuse_state_dict(model)
    same = loaded.keys() == expected.keys() and all(torch.equal(loaded[k], v) for k, v in expected.items())
    print(f"   weights identical to the original checkpoint (per-expert keys): {same}")
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(5):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        print(f"   step {step}: loss {loss.item():.4f}")
    moe = model.model.layers[1].mlp
    print(
        "   MoE kernel used on this machine: "
        f"{sys.modules[type(moe).__module__]._moe_rewrite_kernel(batch.device, torch.float32)}"
    )
    print(f"\nDone. Patched checkpoint: {patched_dir}")


if __name__ == "__main__":
    main()
