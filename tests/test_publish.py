"""Publishing the rewrite where users load it: `--push-to-hub` (one commit or pull request, code and config only),
`--include-weights` (a complete checkpoint linked from the Hub cache), config.json auto_map entries that take code from
another repo made local, and the round trip save_pretrained -> moe-rewrite --out -> from_pretrained -> train.

No network: pushes go to a recording double of HfApi (tests/hfapi_double.py) put in place of moe_rewrite.publish.HfApi;
Hub sources come from a Hub-layout cache of this module's own, read with HF_HUB_OFFLINE=1 by a worker process (see
test_hub.py for why the command reads the Hub cache in another process).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import hfapi_double
import pytest
from conftest import (
    MODELING,
    ROOT,
    V3_DIR,
    add_snapshot,
    assert_one_line_error,
    cache_state,
    model_module,
    run_cli,
    same_bits,
    set_ref,
    snapshot,
    written_entries,
)
from hfapi_double import TOKEN, RecordingHfApi

from moe_rewrite import RewriteOptions, __version__, rewrite_source

CONFIG = "configuration_deepseek.py"
ELSEWHERE = "deepseek-ai/DeepSeek-V3"  # where a fine-tune's auto_map takes the code from
LINKED = ("model.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")
LOOP = RewriteOptions(backend="loop")


@lru_cache(maxsize=None)
def patched_text(source: Path = V3_DIR / MODELING) -> str:
    return rewrite_source(source.read_text()).text


def hub_json(obj, ensure_ascii: bool = True) -> bytes:
    """JSON as the Hub's files are written."""
    return (json.dumps(obj, indent=2, ensure_ascii=ensure_ascii) + "\n").encode("utf-8")


def config_from(repo: str | None, **extra) -> dict:
    """The V3 stand-in's config.json, its auto_map taking the code from `repo` ("org/name--module.Class")."""
    config = json.loads((V3_DIR / "config.json").read_bytes())
    if repo:
        config["auto_map"] = {key: f"{repo}--{ref}" for key, ref in config["auto_map"].items()}
    return {**config, **extra}


def local_checkpoint(tmp_path: Path, config: bytes | None = None, name: str = "src") -> Path:
    """A copy of the V3 stand-in plus fake weights, weight index, tokenizer files and a generation config."""
    src = tmp_path / name
    shutil.copytree(V3_DIR, src)
    if config is not None:
        (src / "config.json").write_bytes(config)
    (src / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    (src / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}\n')
    (src / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (src / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    (src / "generation_config.json").write_text('{"bos_token_id": 0, "eos_token_id": 1}\n')
    return src


@pytest.fixture
def hub_api(monkeypatch):
    """The recording HfApi, in place of the one moe_rewrite.publish uses; its `calls` as the command made them."""
    hfapi_double.reset()
    monkeypatch.setattr("moe_rewrite.publish.HfApi", RecordingHfApi)
    return RecordingHfApi


def calls_named(calls: list, name: str) -> list[dict]:
    return [arguments for called, arguments in calls if called == name]


def assert_no_token(*texts: str) -> None:
    for text in texts:
        assert TOKEN not in text


def assert_no_token_in_files(path: Path) -> None:
    for name, data in snapshot(path).items():
        assert TOKEN.encode() not in data, name


# ---------------------------------------------------------------------------------------------------- --push-to-hub


def test_push_alone_uploads_code_and_config_in_one_commit(tmp_path, hub_api):
    src = local_checkpoint(tmp_path)
    before = snapshot(tmp_path)

    code, stdout, err = run_cli(src, "--push-to-hub", "me/DeepSeek-V3-train", "--token", TOKEN)

    assert code == 0, err
    assert stdout == ""
    assert "Traceback" not in err
    assert [name for name, _ in hub_api.calls] == ["HfApi", "create_repo", "create_commit"]
    assert calls_named(hub_api.calls, "HfApi") == [{"token": TOKEN}]
    assert calls_named(hub_api.calls, "create_repo") == [
        {"repo_id": "me/DeepSeek-V3-train", "repo_type": "model", "private": None, "exist_ok": True}
    ]
    (commit,) = calls_named(hub_api.calls, "create_commit")
    assert commit["repo_id"] == "me/DeepSeek-V3-train"
    assert [path for path, _ in commit["operations"]] == [MODELING, "config.json", CONFIG, "generation_config.json"]
    uploaded = dict(commit["operations"])
    assert uploaded.pop(MODELING) == patched_text()
    for name, text in uploaded.items():
        assert text == (src / name).read_text(), name  # no auto_map to change: as they were
    assert commit["create_pr"] is False
    assert commit["revision"] is None
    assert commit["repo_type"] == "model"
    message = commit["commit_message"]
    assert f"moe-rewrite {__version__}" in message and "backend=auto" in message and "stacking=stack" in message
    assert "https://huggingface.co/me/DeepSeek-V3-train/commit/" in err
    assert_no_token(stdout, err, message)
    assert snapshot(tmp_path) == before  # nothing written: no --out, no staging left behind


def test_push_create_pr_proposes_to_an_existing_repo(tmp_path, hub_api):
    src = local_checkpoint(tmp_path)

    code, stdout, err = run_cli(
        src,
        "--push-to-hub",
        "deepseek-ai/DeepSeek-V3",
        "--create-pr",
        "--commit-message",
        "Make the MoE layers train",
        "--push-revision",
        "dev",
        "--backend",
        "loop",
    )

    assert code == 0, err
    assert stdout == ""
    assert [name for name, _ in hub_api.calls] == ["HfApi", "create_commit"]  # never creates the model's repo
    assert calls_named(hub_api.calls, "HfApi") == [{"token": None}]  # the saved login
    (commit,) = calls_named(hub_api.calls, "create_commit")
    assert commit["create_pr"] is True
    assert commit["revision"] == "dev"
    assert commit["commit_message"] == "Make the MoE layers train"
    assert dict(commit["operations"])[MODELING] == rewrite_source((src / MODELING).read_text(), LOOP).text
    assert "pull request" in err and "https://huggingface.co/deepseek-ai/DeepSeek-V3/discussions/7" in err


def test_push_private_creates_a_private_repo(tmp_path, hub_api):
    src = local_checkpoint(tmp_path)

    code, _, err = run_cli(src, "--push-to-hub", "me/private-train", "--private", "--token", TOKEN)

    assert code == 0, err
    (create,) = calls_named(hub_api.calls, "create_repo")
    assert create["private"] is True and create["exist_ok"] is True
    assert_no_token(err)


def test_push_with_out_uploads_exactly_the_files_out_writes(tmp_path, hub_api):
    src = local_checkpoint(tmp_path)
    out = tmp_path / "out"

    code, stdout, err = run_cli(src, "--out", out, "--push-to-hub", "me/x", "--token", TOKEN)

    assert code == 0, err
    assert stdout == ""
    (commit,) = calls_named(hub_api.calls, "create_commit")
    written = {p.name: p.read_text() for p in written_entries(out) if not p.is_symlink()}
    assert dict(commit["operations"]) == written
    assert sorted(p.name for p in written_entries(out) if p.is_symlink()) == sorted(LINKED)  # linked, never uploaded
    assert_no_token(stdout, err)
    assert_no_token_in_files(out)


@pytest.mark.parametrize(
    "method, error, options, mentions",
    [
        ("create_repo", "unauthorized", [], ["me/x", "not authenticated", "--token"]),
        ("create_commit", "unauthorized", [], ["me/x", "not authenticated"]),
        ("create_commit", "forbidden", [], ["me/x", "permission denied", "--create-pr"]),
        ("create_commit", "forbidden", ["--create-pr"], ["me/x", "permission denied"]),
        ("create_commit", "not_found", ["--create-pr"], ["me/x", "not found"]),
        ("create_commit", "gated", ["--create-pr"], ["me/x", "gated"]),
        ("create_commit", "revision_not_found", ["--push-revision", "dev"], ["me/x", "branch dev not found"]),
        ("create_commit", "server_echoes_token", [], ["me/x", "push failed", "***"]),
        ("create_repo", "refused", [], ["me/x", "cannot reach the Hub (Connection refused)", "nothing was pushed"]),
        ("create_commit", "timeout", [], ["me/x", "cannot reach the Hub (timed out)"]),
    ],
    ids=[
        "401-create-repo",
        "401-commit",
        "403",
        "403-pr",
        "repo-not-found",
        "gated",
        "branch-not-found",
        "token-redacted",
        "connection-refused",
        "timeout",
    ],
)
def test_push_errors_are_one_line_and_write_nothing(tmp_path, hub_api, method, error, options, mentions):
    src = local_checkpoint(tmp_path)
    before = snapshot(tmp_path)
    hub_api.fail = {method: error}
    out = tmp_path / "out"

    result = run_cli(src, "--out", out, "--push-to-hub", "me/x", "--token", TOKEN, *options)

    assert_one_line_error(result, *mentions)
    assert_no_token(*result[1:])
    assert "urllib3" not in result[2] and "0x7f" not in result[2]
    assert method in [name for name, _ in hub_api.calls]
    if error == "forbidden" and options:
        assert "--create-pr" not in result[2]
    assert not out.exists()  # pushed first: a failed push leaves nothing written
    assert snapshot(tmp_path) == before


def _file_source(t: Path) -> Path:
    shutil.copyfile(V3_DIR / MODELING, t / MODELING)
    return t / MODELING


@pytest.mark.parametrize(
    "args, mentions",
    [
        (["SRC", "--out", "OUT", "--create-pr"], ["--create-pr", "--push-to-hub"]),
        (["SRC", "--out", "OUT", "--private", "--commit-message", "m"], ["--private", "--commit-message"]),
        (["SRC", "--out", "OUT", "--push-revision", "dev"], ["--push-revision", "--push-to-hub"]),
        (["SRC", "--push-to-hub", "me/x", "--create-pr", "--private"], ["--private", "--create-pr"]),
        (["SRC", "--push-to-hub", "not a repo id"], ["--push-to-hub", "not a repo id"]),
        (["SRC", "--push-to-hub", "me/x", "--in-place"], ["--push-to-hub", "--in-place"]),
        (["SRC", "--push-to-hub", "me/x", "--check"], ["--push-to-hub"]),
        (["SRC", "SRC", "--push-to-hub", "me/x"], ["--push-to-hub", "one SOURCE"]),
        (["SRC", "--push-to-hub", "me/x", "--include-weights"], ["--include-weights", "--out"]),
        (["FILE", "--out", "OUT", "--include-weights"], ["--include-weights", MODELING]),
    ],
    ids=[
        "create-pr-alone",
        "private-alone",
        "push-revision-alone",
        "pr-and-private",
        "bad-repo-id",
        "in-place",
        "check",
        "two-sources",
        "weights-without-out",
        "weights-for-a-file",
    ],
)
def test_publishing_option_errors(tmp_path, hub_api, args, mentions):
    src = local_checkpoint(tmp_path)
    file = _file_source(tmp_path)
    before = snapshot(tmp_path)
    values = {"SRC": src, "OUT": tmp_path / "out", "FILE": file}

    result = run_cli(*(values.get(a, a) for a in args))

    assert_one_line_error(result, *mentions)
    assert hub_api.calls == []
    assert snapshot(tmp_path) == before


# -------------------------------------------------------------------------------------------- config.json auto_map


@pytest.mark.parametrize("ensure_ascii", [True, False], ids=["escaped", "utf8"])
def test_auto_map_pointing_elsewhere_is_made_local(tmp_path, hub_api, ensure_ascii):
    """A fine-tune saved from Hub code points auto_map at the base repo: loading would fetch its unpatched code."""
    config = config_from(ELSEWHERE, _name_or_path="Modèle-日本", zz_last=1)
    config["auto_map"]["AutoTokenizer"] = [f"{ELSEWHERE}--tokenization_deepseek.DeepseekTokenizer", None]
    original = hub_json({"zz_first": 0, **config}, ensure_ascii)  # keys in no sorted order
    src = local_checkpoint(tmp_path, original)
    (src / "tokenization_deepseek.py").write_text("class DeepseekTokenizer:\n    pass\n")
    out = tmp_path / "out"

    code, _, err = run_cli(src, "--out", out, "--push-to-hub", "me/x")

    assert code == 0, err
    written = (out / "config.json").read_bytes()
    # Byte for byte the same file but for the repo prefixes: other keys, their order, escaping, final newline.
    assert written == original.replace(f'"{ELSEWHERE}--'.encode(), b'"')
    assert json.loads(written)["auto_map"] == {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        "AutoTokenizer": ["tokenization_deepseek.DeepseekTokenizer", None],
    }
    assert (out / MODELING).read_text() == patched_text()
    assert "config.json: auto_map now takes the code from the patched files beside it" in err  # the edit is visible
    (commit,) = calls_named(hub_api.calls, "create_commit")
    uploaded = dict(commit["operations"])
    assert uploaded["config.json"].encode() == written
    assert "tokenization_deepseek.py" in uploaded


def test_diff_shows_the_auto_map_edit_out_would_make(tmp_path):
    """--diff on a checkpoint: the modeling file's diff, then config.json's as --out would write it; nothing written."""
    src = local_checkpoint(tmp_path, hub_json(config_from(ELSEWHERE)))
    before = snapshot(tmp_path)

    code, out, err = run_cli(src, "--diff")

    assert code == 1, err  # something would change
    modeling, config = out.split("--- a/", 2)[1:]
    assert modeling.startswith(f"{(src / MODELING).as_posix().lstrip('/')}\n")
    assert config.startswith(f"{(src / 'config.json').as_posix().lstrip('/')}\n")
    removed = [line for line in config.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line for line in config.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert len(removed) == len(added) == 3 and all(ELSEWHERE in line for line in removed)
    assert [line[1:].replace(f"{ELSEWHERE}--", "") for line in removed] == [line[1:] for line in added]
    assert snapshot(tmp_path) == before
    # without a foreign auto_map entry there is no config.json hunk
    plain = local_checkpoint(tmp_path / "plain", hub_json(config_from(None)))
    code, out, err = run_cli(plain, "--diff")
    assert code == 1, err
    assert out.count("--- a/") == 1 and "config.json" not in out


def test_config_without_foreign_auto_map_is_copied_as_it_is(tmp_path):
    """No auto_map entry changes: the bytes stay as they were, whatever their formatting."""
    original = json.dumps(config_from(None), indent=4, sort_keys=True).encode()  # no final newline either
    src = local_checkpoint(tmp_path, original)
    code, _, err = run_cli(src, "--out", tmp_path / "out")
    assert code == 0, err
    assert "auto_map" not in err
    assert (tmp_path / "out" / "config.json").read_bytes() == original


def test_auto_map_module_missing_locally_is_an_error(tmp_path, hub_api):
    config = config_from(None)
    config["auto_map"]["AutoTokenizer"] = ["moonshotai/Kimi-K2-Instruct--tokenization_kimi.TikTokenTokenizer", None]
    src = local_checkpoint(tmp_path, hub_json(config))
    before = snapshot(tmp_path)

    result = run_cli(src, "--out", tmp_path / "out", "--push-to-hub", "me/x")

    assert_one_line_error(result, "tokenization_kimi.py", "moonshotai/Kimi-K2-Instruct", "AutoTokenizer")
    assert hub_api.calls == []
    assert snapshot(tmp_path) == before


def test_modeling_file_only_in_another_repo_is_an_error_for_a_local_dir(tmp_path):
    src = local_checkpoint(tmp_path, hub_json(config_from(ELSEWHERE)))
    (src / MODELING).unlink()
    before = snapshot(tmp_path)

    result = run_cli(src, "--out", tmp_path / "out")

    assert_one_line_error(result, str(src), MODELING, ELSEWHERE)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------- Hub sources (worker process)

V3_REPO = "moe-rewrite-tests/v3"  # code, config, small weights and tokenizer files
FT_REPO = "moe-rewrite-tests/finetune"  # config and weights only; auto_map takes the code from V3_REPO
WITH_CODE_REPO = "moe-rewrite-tests/finetune-with-code"  # auto_map names NOT_CACHED, but the code is here too
ORPHAN_REPO = "moe-rewrite-tests/orphan"  # auto_map names NOT_CACHED, and no code here
NOT_CACHED = "moe-rewrite-tests/not-cached"
COMMIT = "1" * 40
WEIGHTS = random.Random(1).randbytes(2048)

WORKER = r"""
import io, json, sys, traceback
from contextlib import redirect_stderr, redirect_stdout
sys.path.insert(0, sys.argv[1])
import hfapi_double
import moe_rewrite.publish
from moe_rewrite.cli import main
moe_rewrite.publish.HfApi = hfapi_double.RecordingHfApi
for line in sys.stdin:
    request = json.loads(line)
    hfapi_double.reset(request["fail"])
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(request["args"])
        except BaseException:
            code = -1
            traceback.print_exc()
    print(json.dumps([code, out.getvalue(), err.getvalue(), hfapi_double.RecordingHfApi.calls]), flush=True)
"""


def _repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def _add_repo(cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    add_snapshot(_repo_dir(cache, repo_id), COMMIT, files, weight=False)
    set_ref(_repo_dir(cache, repo_id), "main", COMMIT)


def _build_cache(cache: Path) -> None:
    code = {name: (V3_DIR / name).read_bytes() for name in ("config.json", CONFIG, MODELING)}
    weights = {"model.safetensors": WEIGHTS, "model.safetensors.index.json": b'{"metadata": {}, "weight_map": {}}\n'}
    tokenizer = {"tokenizer.json": b'{"version": "1.0"}\n', "tokenizer_config.json": b'{"model_max_length": 256}\n'}
    _add_repo(cache, V3_REPO, {**code, **weights, **tokenizer})
    _add_repo(cache, FT_REPO, {"config.json": hub_json(config_from(V3_REPO)), **weights})
    _add_repo(cache, WITH_CODE_REPO, {**code, "config.json": hub_json(config_from(NOT_CACHED))})
    _add_repo(cache, ORPHAN_REPO, {"config.json": hub_json(config_from(NOT_CACHED))})


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache, run): run(*args, fail={}) -> (exit code, stdout, stderr, HfApi calls) of the command in a worker process
    reading this module's own Hub cache offline, with the recording HfApi in place."""
    cache = tmp_path_factory.mktemp("publish-hub-cache")
    _build_cache(cache)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(ROOT / "tests")],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def run(*args, fail: dict | None = None):
        worker.stdin.write(json.dumps({"args": [str(a) for a in args], "fail": fail or {}}) + "\n")
        worker.stdin.flush()
        reply = worker.stdout.readline()
        assert reply, f"the worker process died (exit code {worker.poll()})"
        code, out, err, calls = json.loads(reply)
        return code, out, err, [tuple(call) for call in calls]

    yield cache, run
    worker.stdin.close()
    worker.wait(timeout=30)


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_include_weights_links_weights_and_tokenizer_from_the_cache_snapshot(tmp_path, hub):
    cache, run = hub
    before = cache_state(cache)
    snap = _repo_dir(cache, V3_REPO) / "snapshots" / COMMIT
    out = tmp_path / "out"

    code, stdout, err, _ = run(V3_REPO, "--include-weights", "--out", out)

    assert code == 0, err
    assert stdout == ""
    assert "Traceback" not in err
    assert sorted(p.name for p in written_entries(out) if not p.is_symlink()) == sorted(
        ["config.json", CONFIG, MODELING]
    )
    assert sorted(p.name for p in written_entries(out) if p.is_symlink()) == sorted(LINKED)
    for name in LINKED:
        assert os.readlink(out / name) == str(snap / name), name  # into the cache snapshot, not a copy
        assert (out / name).read_bytes() == (snap / name).read_bytes(), name
    assert (out / MODELING).read_text() == patched_text()
    assert (out / "config.json").read_bytes() == (V3_DIR / "config.json").read_bytes()
    assert cache_state(cache) == before

    code, _, err, _ = run(V3_REPO, "--out", tmp_path / "code-only")  # without it: code and config only, as before
    assert code == 0, err
    assert not any(p.is_symlink() for p in (tmp_path / "code-only").iterdir())
    assert not (tmp_path / "code-only" / "model.safetensors").exists()


def test_push_from_a_hub_source_uploads_code_and_config_only(hub):
    _, run = hub

    code, stdout, err, calls = run(V3_REPO, "--push-to-hub", "me/v3-train", "--token", TOKEN)

    assert code == 0, err
    assert stdout == ""
    assert calls_named(calls, "HfApi") == [{"token": TOKEN}]
    (commit,) = calls_named(calls, "create_commit")
    assert [path for path, _ in commit["operations"]] == [MODELING, "config.json", CONFIG]  # no weights, no tokenizer
    assert dict(commit["operations"])[MODELING] == patched_text()
    assert_no_token(stdout, err)


def test_hub_auto_map_in_another_repo_fetches_that_repos_code(tmp_path, hub):
    """FT_REPO has config and weights; its auto_map takes the modeling and configuration code from V3_REPO: that code
    is fetched and rewritten, and config.json points at the local patched files."""
    cache, run = hub
    out = tmp_path / "out"

    code, _, err, calls = run(FT_REPO, "--include-weights", "--out", out, "--push-to-hub", "me/ft-train")

    assert code == 0, err
    assert f"Rewrote {V3_REPO}@{COMMIT[:12]}/{MODELING} -> " in err  # the repo the code comes from
    assert (out / MODELING).read_text() == patched_text()
    assert (out / CONFIG).read_bytes() == (V3_DIR / CONFIG).read_bytes()
    original = hub_json(config_from(V3_REPO))
    assert (out / "config.json").read_bytes() == original.replace(f'"{V3_REPO}--'.encode(), b'"')
    weights = _repo_dir(cache, FT_REPO) / "snapshots" / COMMIT / "model.safetensors"
    assert os.readlink(out / "model.safetensors") == str(weights)
    (commit,) = calls_named(calls, "create_commit")
    assert dict(commit["operations"]) == {name: (out / name).read_text() for name in (MODELING, "config.json", CONFIG)}


def test_hub_auto_map_naming_a_repo_whose_file_is_here_needs_no_fetch(tmp_path, hub):
    _, run = hub
    code, _, err, _ = run(WITH_CODE_REPO, "--out", tmp_path / "out")
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_bytes())
    assert all("--" not in ref for ref in config["auto_map"].values())


def test_hub_auto_map_repo_not_reachable_is_one_line(tmp_path, hub):
    _, run = hub
    result = run(ORPHAN_REPO, "--out", tmp_path / "out")
    assert_one_line_error(result[:3], ORPHAN_REPO, NOT_CACHED, "offline")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------- save_pretrained round trip


@pytest.mark.parametrize("auto_map", ["local", "elsewhere"])
def test_checkpoint_round_trip_loads_and_trains(tmp_path, auto_map):
    """A checkpoint saved by the ORIGINAL stand-in code, rewritten with --out, loads with trust_remote_code: the same
    weights, the patched code (also when config.json's auto_map named another repo), and it trains."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from conftest import build_model
    from transformers import AutoModelForCausalLM

    original = build_model(V3_DIR, seed=3)
    original.register_for_auto_class("AutoModelForCausalLM")
    saved = tmp_path / f"saved_{auto_map}"
    original.save_pretrained(saved)
    if auto_map == "elsewhere":  # as save_pretrained writes it for a model loaded from the Hub repo ELSEWHERE
        config = json.loads((saved / "config.json").read_bytes())
        config["auto_map"] = {key: f"{ELSEWHERE}--{ref}" for key, ref in config["auto_map"].items()}
        (saved / "config.json").write_bytes(hub_json(config))
    out = tmp_path / f"patched_roundtrip_{auto_map}"

    code, _, err = run_cli(saved, "--out", out)

    assert code == 0, err
    assert (out / "model.safetensors").is_symlink()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, torch_dtype=torch.float32)
    assert Path(model_module(model).__file__).read_text() == (out / MODELING).read_text()  # the patched code
    assert hasattr(type(model.model.layers[1].mlp), "moe_train")
    # The routed experts load fused (the default), holding exactly the saved per-expert weights.
    from moe_rewrite.training import unfuse_state_dict

    experts = model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "_MoeRewriteFusedExperts"
    expected = original.state_dict()
    state = unfuse_state_dict(model)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert same_bits(state[key], value), key

    model.train()
    before = experts.gate_up_proj.detach().clone()
    batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    assert not torch.equal(experts.gate_up_proj, before)
