"""Hub repo ids as SOURCE, through the real huggingface_hub client and no network: a Hub cache laid out as
huggingface_hub lays it out (refs/, snapshots/ of links into blobs/), read with HF_HUB_OFFLINE=1.

The command runs in another process, never in the pytest one: huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE
when it is imported, and in a full test run another test module imports it (through transformers) while pytest
collects, before conftest points them at the temp cache. A process started here sees exactly the environment given.
Most runs go to one long-lived worker process (`cli` fixture) that calls moe_rewrite.cli.main, as the
in-process `run_cli` does, to pay for the imports once; a few run `python -m moe_rewrite` itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    MODELING,
    ROOT,
    V2_DIR,
    V3_DIR,
    add_snapshot,
    assert_one_line_error,
    cache_state,
    set_ref,
    snapshot,
    written_entries,
)

CODE_FILES = ("config.json", "configuration_deepseek.py", MODELING)
REPO = "deepseek-ai/DeepSeek-V3-standin"
NO_CODE_REPO = "deepseek-ai/config-only"
MAIN_COMMIT = hashlib.sha1(b"main").hexdigest()
V2_COMMIT = hashlib.sha1(b"v2").hexdigest()


def repo_dir_of(repo_id: str) -> Path:
    return Path(os.environ["HF_HUB_CACHE"]) / ("models--" + repo_id.replace("/", "--"))


def files_of(form_dir: Path) -> dict[str, bytes]:
    data = {name: (form_dir / name).read_bytes() for name in CODE_FILES}
    data["model.safetensors.index.json"] = b'{"metadata": {"total_size": 4294967296}, "weight_map": {}}\n'
    return data


@pytest.fixture(scope="module")
def hub_cache():
    """The cache under conftest's HF_HUB_CACHE: REPO at main (V3) and at branch v2 (V2); NO_CODE_REPO has no code."""
    repo = repo_dir_of(REPO)
    add_snapshot(repo, MAIN_COMMIT, files_of(V3_DIR))
    add_snapshot(repo, V2_COMMIT, files_of(V2_DIR))
    set_ref(repo, "main", MAIN_COMMIT)
    set_ref(repo, "v2", V2_COMMIT)
    no_code = repo_dir_of(NO_CODE_REPO)
    add_snapshot(no_code, MAIN_COMMIT, {"config.json": b'{"model_type": "deepseek_v3"}\n'}, weight=False)
    set_ref(no_code, "main", MAIN_COMMIT)
    return Path(os.environ["HF_HUB_CACHE"])


def hub_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": os.environ["HF_HUB_CACHE"], "HF_HUB_OFFLINE": "1"}


def run_module(*args) -> tuple[int, str, str]:
    """`python -m moe_rewrite ARGS` in a fresh process: (exit code, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rewrite", *map(str, args)],
        cwd=ROOT,
        env=hub_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


WORKER = r"""
import io, json, sys, traceback
from contextlib import redirect_stderr, redirect_stdout
from moe_rewrite.cli import main
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(json.loads(line))
        except BaseException:
            code = -1
            traceback.print_exc()
    print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


@pytest.fixture(scope="module")
def cli(hub_cache):
    """run(*args) -> (exit code, stdout, stderr) of the command, in one worker process with the Hub environment."""
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER],
        cwd=ROOT,
        env=hub_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def run(*args) -> tuple[int, str, str]:
        worker.stdin.write(json.dumps([str(a) for a in args]) + "\n")
        worker.stdin.flush()
        reply = worker.stdout.readline()
        assert reply, f"the worker process died (exit code {worker.poll()})"
        return tuple(json.loads(reply))

    yield run
    worker.stdin.close()
    worker.wait(timeout=30)


def assert_code_only_checkpoint(out: Path, form_dir: Path) -> str:
    """out holds the patched modeling file and copies (not links into the cache) of the code/config files only."""
    assert sorted(p.name for p in written_entries(out)) == sorted(CODE_FILES)
    for p in written_entries(out):
        assert p.is_file() and not p.is_symlink(), p
    for name in ("config.json", "configuration_deepseek.py"):
        assert (out / name).read_bytes() == (form_dir / name).read_bytes(), name
    return (out / MODELING).read_text()


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_out_from_hub_repo(tmp_path, hub_cache):
    """The real command, in its own process."""
    before = cache_state(hub_cache)
    out = tmp_path / "out"

    code, stdout, err = run_module(REPO, "--out", out)

    assert code == 0, err
    assert stdout == ""
    assert "Traceback" not in err
    # named by repo id and the commit of the snapshot refs/main points at, not by the cache path
    assert f"Rewrote {REPO}@{MAIN_COMMIT[:12]}/{MODELING} -> " in err and "snapshots" not in err
    text = assert_code_only_checkpoint(out, V3_DIR)
    assert "class DeepseekV3MoE" in text and "def moe_train(" in text
    assert not (out / "model.safetensors").exists() and not (out / "model.safetensors").is_symlink()
    assert cache_state(hub_cache) == before  # the cached files (shared blobs) are left as they were


def test_out_again_gives_the_same_files(tmp_path, cli):
    out = tmp_path / "out"
    assert cli(REPO, "--out", out)[0] == 0
    first = snapshot(out)

    code, stdout, err = cli(REPO, "--out", out)

    assert code == 0, err
    assert stdout == ""
    assert snapshot(out) == first


def test_revision_branch(tmp_path, hub_cache, cli):
    before = cache_state(hub_cache)
    out = tmp_path / "out"

    code, _, err = cli(REPO, "--revision", "v2", "--out", out)

    assert code == 0, err
    assert f"Rewrote {REPO}@v2/{MODELING} -> " in err
    assert "V2 form" in err
    text = assert_code_only_checkpoint(out, V2_DIR)
    assert "class DeepseekV2MoE" in text and "def moe_train(" in text
    assert "class DeepseekV3MoE" not in text
    assert cache_state(hub_cache) == before


def test_revision_commit_hash(cli):
    code, _, err = cli(REPO, "--revision", V2_COMMIT, "--check")
    assert code == 1, err
    assert f"would rewrite {REPO}@{V2_COMMIT}/{MODELING} (V2 form" in err


def test_check_on_hub_repo(hub_cache, cli):
    before = cache_state(hub_cache)

    code, stdout, err = cli(REPO, "--check")

    assert code == 1, err
    assert stdout == ""
    assert err.startswith(f"would rewrite {REPO}@{MAIN_COMMIT[:12]}/{MODELING} (V3 form")
    assert err.endswith("\n1 file would be rewritten\n") and err.count("\n") == 2
    assert cache_state(hub_cache) == before


def test_error_in_its_own_process(tmp_path, hub_cache):
    """What a user sees on the terminal: one line, whatever huggingface_hub logs or warns on the way."""
    assert_one_line_error(run_module(REPO, "--revision", "no-such-branch", "--out", tmp_path / "out"), REPO)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, mentions",
    [
        (["nobody/nothing", "--out", "OUT"], ["nobody/nothing", "cache", "offline"]),
        ([REPO, "--revision", "no-such-branch", "--out", "OUT"], [f"{REPO}@no-such-branch", "cache", "offline"]),
        ([REPO, "--revision", "f" * 40, "--out", "OUT"], [f"{REPO}@{'f' * 40}", "cache", "offline"]),
        ([NO_CODE_REPO, "--out", "OUT"], [NO_CODE_REPO, MODELING, "repository"]),
        ([REPO, "--in-place"], [REPO, "in place"]),
    ],
    ids=["repo-not-cached", "branch-not-cached", "commit-not-cached", "no-modeling-file", "in-place"],
)
def test_hub_errors(tmp_path, hub_cache, cli, args, mentions):
    before = cache_state(hub_cache)
    out = tmp_path / "out"

    result = cli(*(out if a == "OUT" else a for a in args))

    assert_one_line_error(result, *mentions)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
    assert cache_state(hub_cache) == before


@pytest.mark.parametrize(
    "url, where",
    [
        (f"https://huggingface.co/{REPO}", f"{REPO}@{MAIN_COMMIT[:12]}"),
        (f"https://huggingface.co/{REPO}/tree/v2", f"{REPO}@v2"),
        (f"hf.co/{REPO}/blob/main/config.json", f"{REPO}@main"),
    ],
)
def test_a_hub_url_pasted_as_source_is_the_repo(cli, url, where):
    """A model page's address (with /tree/REVISION) names the repo and revision, as `org/name --revision` would."""
    code, _, err = cli(url, "--check")
    assert code == 1 and err.startswith(f"would rewrite {where}/{MODELING} ("), err


@pytest.mark.parametrize(
    "args, mentions",
    [
        ((f"https://huggingface.co/datasets/{REPO}", "--check"), "not a Hub model repository"),
        ((f"https://huggingface.co/{REPO}/tree/v2", "--revision", "main", "--check"), "--revision says main"),
        ((f"https://huggingface.co/{REPO}", "--in-place"), "cannot be rewritten in place"),
    ],
)
def test_hub_url_errors(cli, args, mentions):
    code, stdout, err = cli(*args)
    assert code == 2 and stdout == "" and err.count("\n") == 1 and mentions in err, err


@pytest.fixture
def silent_hub():
    """A Hub endpoint that accepts connections (the kernel completes them from the listen backlog) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def run_against(endpoint: str, *args) -> tuple[int, str, str, float]:
    env = {**hub_env(), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": endpoint, "MOE_REWRITE_HUB_TIMEOUT": "3"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rewrite", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_a_hub_that_never_answers_falls_back_to_the_cache_and_says_so(hub_cache, silent_hub):
    code, _, err, took = run_against(silent_hub, REPO, "--check")
    lines = err.splitlines()
    assert code == 1 and took < 30, err
    assert lines[0] == f"moe-rewrite: contacting the Hub for {REPO} ..."
    assert lines[1] == (
        f"moe-rewrite: the Hub did not answer within 3 s; using the cached snapshot of {REPO} ({MAIN_COMMIT[:12]})"
    )
    assert lines[2].startswith(f"would rewrite {REPO}@{MAIN_COMMIT[:12]}/{MODELING} (V3 form")


@pytest.mark.parametrize("weights", [[], ["--include-weights"]], ids=["code", "weights"])
def test_a_hub_that_never_answers_fails_in_one_line_without_a_cache(hub_cache, silent_hub, tmp_path, weights):
    code, stdout, err, took = run_against(silent_hub, "nobody/nothing", "--out", tmp_path / "out", *weights)
    lines = err.splitlines()
    assert code == 2 and stdout == "" and took < 30 and "Traceback" not in err, err
    assert lines == [lines[0], lines[1]] and lines[0] == "moe-rewrite: contacting the Hub for nobody/nothing ..."
    assert lines[1].startswith("moe-rewrite: error: nobody/nothing: the Hub did not answer within 3 s")
    assert "HF_HUB_OFFLINE=1" in lines[1] and not (tmp_path / "out").exists()
