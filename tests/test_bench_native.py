"""bench/e2e/native.py's --checkpointing modes at tiny sizes on the CPU: every decoder layer checkpointed (the
default), none, and selective (torch's selective activation checkpointing keeping the products' and attention's
outputs) train the rewritten V3 stand-in along the same losses, since recomputing a layer (or keeping what it would
recompute) changes no number; each row names its mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_checkpointing_modes_train_along_the_same_losses(tmp_path):
    code = tmp_path / "code"
    rewrite = [sys.executable, "-m", "moe_rewrite", str(ROOT / "fixtures" / "deepseek_v3"), "--out", str(code)]
    subprocess.run(rewrite, check=True, cwd=ROOT, capture_output=True)
    rows = {}
    for mode in ("layers", "none", "selective"):
        out = tmp_path / f"{mode}.json"
        args = f"--impl moe-rewrite --ckpt {code} --tiny --batch 2 --seq 32 --steps 3 --warmup 1"
        args += f" --checkpointing {mode} --out {out}"
        run = subprocess.run(
            [sys.executable, "bench/e2e/native.py", *args.split()], cwd=ROOT, capture_output=True, text=True
        )
        rows[mode] = json.loads(out.read_text())
        assert "error" not in rows[mode], run.stderr[-3000:]
    assert {mode: row["checkpointing"] for mode, row in rows.items()} == {m: m for m in rows}
    labels = {mode: row["impl"] for mode, row in rows.items()}
    assert labels == {"layers": "moe-rewrite", "none": "moe-rewrite no-ckpt", "selective": "moe-rewrite selective-ckpt"}
    want = rows["layers"]["losses"]
    assert len(want) == 3 and want[0] != want[2]  # the steps train
    for mode in ("none", "selective"):
        assert rows[mode]["losses"] == pytest.approx(want, rel=1e-5), mode
