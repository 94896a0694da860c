"""bench/e2e/native.py's --checkpointing modes at tiny sizes on the CPU: every decoder layer checkpointed (the
default), none, and selective (torch's selective activation checkpointing keeping the products' and attention's
outputs) train the rewritten V3 stand-in along the same losses, since recomputing a layer (or keeping what it would
recompute) changes no number; each row names its mode."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import native_row, rewritten_v3  # noqa: E402


@pytest.mark.slow
def test_the_checkpointing_modes_train_along_the_same_losses(tmp_path):
    code = rewritten_v3(tmp_path / "code")
    rows = {}
    for mode in ("layers", "none", "selective"):
        args = f"--impl moe-rewrite --ckpt {code} --tiny --batch 2 --seq 32 --steps 3 --warmup 1 --checkpointing {mode}"
        rows[mode] = native_row(args, tmp_path / f"{mode}.json")
    assert {mode: row["checkpointing"] for mode, row in rows.items()} == {m: m for m in rows}
    labels = {mode: row["impl"] for mode, row in rows.items()}
    assert labels == {"layers": "moe-rewrite", "none": "moe-rewrite no-ckpt", "selective": "moe-rewrite selective-ckpt"}
    want = rows["layers"]["losses"]
    assert len(want) == 3 and want[0] != want[2]  # the steps train
    for mode in ("none", "selective"):
        assert rows[mode]["losses"] == pytest.approx(want, rel=1e-5), mode
