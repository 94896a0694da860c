"""The wheel users install carries the runtime sections, and the installed package rewrites without the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT, V3_DIR


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, ROOT],
        check=True,
    )
    (path,) = out.glob("moe_rewrite-*.whl")
    return path


def test_wheel_ships_the_runtime_and_entry_point(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    from moe_rewrite.runtime import PACKAGES, SECTION_LIST

    assert {f"moe_rewrite/runtime/{entry.package}/{entry.name}.py" for entry in SECTION_LIST} <= set(names)
    assert {f"moe_rewrite/runtime/{package}/__init__.py" for package in PACKAGES} <= set(names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "moe-rewrite = moe_rewrite.cli:run" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_installed_wheel_rewrites_outside_the_source_tree(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "moe_rewrite", V3_DIR, "--out", out],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    where = subprocess.run(
        [sys.executable, "-c", "import moe_rewrite.render as r; print(r.RUNTIME_DIR)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(target))
    assert "def moe_train(" in (out / "modeling_deepseek.py").read_text()
