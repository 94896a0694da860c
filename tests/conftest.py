"""Shared test fixtures: the stand-in checkpoints, isolated Hub/module caches, patched-model builders."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
V3_DIR = FIXTURES / "deepseek_v3"
V2_DIR = FIXTURES / "deepseek_v2"
FORM_DIRS = {"v3": V3_DIR, "v2": V2_DIR}
PAIRS = ROOT / "tests" / "pairs"


def _isolate_hf() -> None:
    """No test touches the network or the user's caches. Set at import time: huggingface_hub and transformers read
    these variables when they are first imported, which happens while pytest collects the test modules."""
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="moe-rewrite-tests-hf-"))
    os.environ["HF_HOME"] = str(home)
    os.environ["HF_HUB_CACHE"] = str(home / "hub")
    os.environ["HF_MODULES_CACHE"] = str(home / "modules")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ.pop("MOE_REWRITE_BACKEND", None)


_isolate_hf()


def _interpret_triton_without_a_gpu() -> None:
    """Without a GPU, tests/test_triton_kernels.py runs the Triton kernels in Triton's interpreter, which must be
    chosen before triton is first imported."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()


def forget_runtime_settings() -> None:
    """Make every loaded patched module and runtime section read its environment variables and choose its kernels
    again (the generated code does both once per process): every dict named `_moe_rewrite_*_cache`
    (runtime/kernels/dispatch.py) in a module holding the generated options is emptied."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", {})
        if "_moe_rewrite_options" not in namespace:
            continue
        for name, cache in list(namespace.items()):
            if name.startswith("_moe_rewrite_") and name.endswith("_cache") and isinstance(cache, dict):
                cache.clear()


def patch_runtime(monkeypatch, name: str, value) -> None:
    """Set `name` to `value` in every runtime section that holds it, for the test. A rewritten file holds one binding
    per name (its sections in one module); the runtime package holds one per section that defines or imports it."""
    sections = [m for key, m in sys.modules.items() if key.startswith("moe_rewrite.runtime.") and name in vars(m)]
    assert sections, f"no runtime section holds {name}"
    for module in sections:
        monkeypatch.setattr(module, name, value)


def runtime_env(monkeypatch, name: str, value: str | None) -> None:
    """Set (None: unset) an environment variable that the generated code reads, as if the process started with it."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    forget_runtime_settings()


@pytest.fixture(autouse=True)
def _fresh_runtime_settings():
    forget_runtime_settings()
    yield
    forget_runtime_settings()


@pytest.fixture(autouse=True)
def _seeded_rng(request):
    """Every test draws from global RNGs seeded from its own id: fresh inputs per test, the same on every run, so a
    failure reproduces."""
    import hashlib
    import random

    seed = int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:4], "little")
    random.seed(seed)
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(seed)


def assert_one_line_error(result: tuple[int, str, str], *mentions: str) -> None:
    """(exit code, stdout, stderr) of bad input: exit 2, nothing on stdout, one `moe-rewrite: error:` line naming each
    of `mentions`, no traceback."""
    code, out, err = result
    assert code == 2, result
    assert out == ""
    assert "Traceback" not in err
    assert err.startswith("moe-rewrite: error:"), err
    assert err.endswith("\n") and err.count("\n") == 1, err
    for text in mentions:
        assert text in err, (text, err)


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run the CLI in-process like a user would, capturing (exit code, stdout, stderr)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from moe_rewrite.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under path with its bytes (links as their targets), to prove nothing was modified."""
    result = {}
    for p in sorted(path.rglob("*")):
        if p.is_symlink():
            result[str(p.relative_to(path))] = b"->" + os.readlink(p).encode()
        elif p.is_file():
            result[str(p.relative_to(path))] = p.read_bytes()
    return result


def written_entries(out: Path) -> list[Path]:
    """What an --out run put in `out`, less the manifest (.moe-rewrite.json) every such run writes there."""
    assert (out / ".moe-rewrite.json").is_file()
    return [p for p in out.iterdir() if p.name != ".moe-rewrite.json"]


_counter = iter(range(10**6))


def patched_checkpoint(tmp_path_factory, form: str, *options: str) -> Path:
    """Rewrite a stand-in checkpoint through the CLI into a fresh, uniquely named directory."""
    # transformers names the dynamic module after the directory: keep names unique per variant.
    out = tmp_path_factory.mktemp("ckpt") / f"patched_{form}_{next(_counter)}"
    code, _, err = run_cli(FORM_DIRS[form], "--out", out, *options)
    assert code == 0, err
    return out


def per_expert_checkpoint(tmp_path_factory, form: str, *options: str):
    """A stand-in rewritten with --no-fuse-experts: models load with the per-expert nn.Linear layers (the layout LoRA
    needs), whose training path these tests check. test_fused.py fuses them, and loads default rewrites (fused)."""
    return patched_checkpoint(tmp_path_factory, form, "--no-fuse-experts", *options)


@pytest.fixture(scope="module", params=["v3", "v2"])
def form(request):
    """The two published forms, each test once per form (module-scoped: its checkpoints are rewritten once)."""
    return request.param


@pytest.fixture(scope="module")
def patched(tmp_path_factory, form):
    return per_expert_checkpoint(tmp_path_factory, form)


def build_model(path: Path, seed: int = 0, **config_overrides):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=True, **config_overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=True, torch_dtype=torch.float32)


def same_bits(a, b) -> bool:
    """Bit-for-bit equal tensors, NaNs included: the stand-ins leave e_score_correction_bias uninitialised, as the
    published V3 file does (a checkpoint fills it), so a saved and reloaded copy may hold NaNs, which torch.equal
    calls different."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def per_expert_grads(grads: dict, projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict:
    """Gradients of fused experts (gate_up_proj (E, 2I, H), down_proj (E, H, I)) under the per-expert names, the
    experts' (gate, up, down) projections named `projections` (Kimi's: w1, w3, w2)."""
    gate, up, down = projections
    out = {}
    for name, grad in grads.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], grad.shape[1] // 2
            for i in range(grad.shape[0]):
                out[f"{prefix}{i}.{gate}.weight"], out[f"{prefix}{i}.{up}.weight"] = (
                    grad[i, :half],
                    grad[i, half:],
                )
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            out.update({f"{prefix}{i}.{down}.weight": grad[i] for i in range(grad.shape[0])})
        else:
            out[name] = grad
    return out


def model_module(model):
    return sys.modules[type(model).__module__]


def _gloo_rank(rank: int, world: int, init_file: str, worker, args: tuple) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        worker(rank, *args)
        # Every rank finishes its collectives before any tears down: a rank that destroys the group while its peer
        # still talks to it aborts the peer's gloo thread (SIGABRT, "terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(worker, tmp_path: Path, *args, world: int = 2) -> None:
    """Run worker(rank, *args, out_dir) in `world` processes joined by a gloo process group; out_dir is tmp_path."""
    import torch.multiprocessing

    init_file = str(tmp_path / "init")
    torch.multiprocessing.spawn(
        _gloo_rank, args=(world, init_file, worker, (*args, str(tmp_path))), nprocs=world, join=True
    )


# The Hub cache as huggingface_hub stores downloads (test_hub.py, test_publish.py).
MODELING = "modeling_deepseek.py"
WEIGHT_SIZE = 4 << 30  # a sparse 4 GiB "weight": copying or reading it would show


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(repo_dir: Path, commit: str, files: dict[str, bytes], weight: bool = True) -> Path:
    """snapshots/<commit>/<name> -> ../../blobs/<id>, as huggingface_hub stores downloads."""
    blobs, snap = repo_dir / "blobs", repo_dir / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    entries = {name: (git_blob_id(data), data) for name, data in files.items()}
    if weight:  # LFS files are stored under their sha256
        entries["model.safetensors"] = (hashlib.sha256(commit.encode()).hexdigest(), None)
    for name, (blob_id, data) in entries.items():
        blob = blobs / blob_id
        if data is None:
            with open(blob, "wb") as f:
                f.truncate(WEIGHT_SIZE)
        else:
            blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)
    return snap


def set_ref(repo_dir: Path, ref: str, commit: str) -> None:
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it


def cache_state(cache: Path) -> dict[str, object]:
    """Every entry of the cache: links with their targets, small files with their bytes, the weight by size/mtime."""
    state = {}
    for p in sorted(cache.rglob("*")):
        key = str(p.relative_to(cache))
        if p.is_symlink():
            state[key] = os.readlink(p)
        elif p.is_dir():
            state[key] = "dir"
        else:
            st = p.stat()
            state[key] = (st.st_size, st.st_mtime_ns, p.read_bytes() if st.st_size < WEIGHT_SIZE else None)
    return state
