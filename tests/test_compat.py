"""The rewritten stand-ins across transformers releases, each in its own environment (`make test` builds them in
.venv-tf/RELEASE with the same torch): every stage passes on every release, the stand-ins as published (and rewritten
with --no-compat) fail where the real files fail, and wherever those run a stage the rewritten file gives the same
numbers, which are also the same on every release."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import FORM_DIRS, ROOT, build_model, per_expert_grads, run_cli  # noqa: E402

pytestmark = pytest.mark.slow  # every release runs every stage in a subprocess of its own

STAGES = ("import", "load", "eval", "generate", "train", "save")
# The releases `make test` builds environments for, and the one this suite runs in.
RELEASES = sorted(
    {*os.environ.get("MOE_REWRITE_COMPAT_RELEASES", "4.46.3 4.57.6 5.12.1 5.24.0").split(), transformers.__version__}
)
# Where the published files first fail on each release (measured on the real files: ../shared/TRANSFORMERS_COMPAT.md).
PUBLISHED_FAILS = {
    "4.46": None,
    "4.48": None,
    "4.51": ("generate", "get_max_length"),
    "4.53": ("generate", "get_max_length"),
    "4.55": ("eval", "get_usable_length"),
    "4.57": ("eval", "get_usable_length"),
    "5.0": ("import", "is_torch_fx_available"),
    "5.12": ("import", "is_torch_fx_available"),
    "5.13": ("import", "is_torch_fx_available"),
    "5.24": ("import", "modeling_attn_mask_utils"),
}
ATOL = 1e-6
NATIVE_ATOL = 1e-5  # vs transformers' own deepseek_v3 / deepseek_v2: the same math in another order
NATIVE_RELEASES = [r for r in RELEASES if int(r.split(".")[0]) >= 5]
# transformers' own model fails by itself there (measured): (release minor, form) -> (stage, message fragment)
NATIVE_FAILS = {
    (minor, "v2"): ("eval", "'DeepseekV2Moe' object has no attribute 'num_experts'") for minor in ("5.0", "5.12")
}
# where transformers merges the per-expert keys into fused ones even for a --no-fuse-experts output (measured; 5.12.1
# and later load them into the per-expert modules)
MERGES_FOR_PER_EXPERT = {"5.0"}


def _python(release: str) -> str | None:
    if release == transformers.__version__:
        return sys.executable
    path = ROOT / ".venv-tf" / release / "bin" / "python"
    return str(path) if path.exists() else None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per form: the stand-in as published, rewritten, rewritten with --no-compat or --no-fuse-experts, and `native`
    (its config without auto_map, so transformers loads its own class for the model_type); all with the same weights
    (the router's
    correction bias drawn away from zero, so routing depends on it)."""
    base = tmp_path_factory.mktemp("compat")
    dirs = {}
    for form, source in FORM_DIRS.items():
        published = base / f"published_{form}"
        shutil.copytree(source, published)
        variants = {"published": published}
        for name, options in (("rewritten", ()), ("nocompat", ("--no-compat",)), ("nofuse", ("--no-fuse-experts",))):
            variants[name] = base / f"{name}_{form}"
            code, _, err = run_cli(published, "--out", variants[name], *options)
            assert code == 0, err
        model = build_model(variants["rewritten"], seed=1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
        model.save_pretrained(base / f"weights_{form}")
        variants["native"] = base / f"native_{form}"
        variants["native"].mkdir()
        config = json.loads((variants["rewritten"] / "config.json").read_text())
        del config["auto_map"]
        (variants["native"] / "config.json").write_text(json.dumps(config))
        for path in variants.values():
            shutil.copy(base / f"weights_{form}" / "model.safetensors", path / "model.safetensors")
        dirs[form] = variants
    return dirs


_results: dict = {}


def run_release(release: str, checkpoints, tmp_path_factory) -> dict:
    """compat_stages.py over every checkpoint, under that release's interpreter, with its own module cache."""
    if release not in _results:
        python = _python(release)
        if python is None:
            message = f"no environment for transformers {release} (.venv-tf/{release}); `make test` builds it"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        out = tmp_path_factory.mktemp(f"stages-{release}")
        paths = [str(p) for variants in checkpoints.values() for p in variants.values()]
        env = {**os.environ, "HF_MODULES_CACHE": str(out / "modules"), "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(
            [python, str(ROOT / "tests" / "compat_stages.py"), str(out / "results.pt"), *paths],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = torch.load(out / "results.pt", weights_only=False)
        assert results and all(r["transformers"] == release for r in results.values())
        _results[release] = {form: {k: results[str(p)] for k, p in v.items()} for form, v in checkpoints.items()}
    return _results[release]


def expected_failure(release: str, variant: str, form: str) -> tuple[str, str] | None:
    """(stage, message fragment) of the first failing stage, or None when all pass."""
    minor = ".".join(release.split(".")[:2])
    if minor not in PUBLISHED_FAILS:
        pytest.fail(f"no recorded behaviour of the published files on transformers {minor}: add it to PUBLISHED_FAILS")
    candidates = [PUBLISHED_FAILS[minor]]
    if variant == "published":
        # The V3 router asserts it is not training; transformers saves no modeling file for remote code.
        candidates.append(("train", "AssertionError") if form == "v3" else ("save", "modeling_deepseek.py"))
    found = [c for c in candidates if c is not None]
    return min(found, key=lambda c: STAGES.index(c[0])) if found else None


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    return request.param


@pytest.mark.parametrize("form", ["v3", "v2"])
def test_rewritten_file_passes_every_stage(release, form, checkpoints, tmp_path_factory):
    stages = run_release(release, checkpoints, tmp_path_factory)[form]["rewritten"]["stages"]
    assert stages == dict.fromkeys(STAGES, "ok"), (release, stages)


@pytest.mark.parametrize("variant", ["published", "nocompat"])
@pytest.mark.parametrize("form", ["v3", "v2"])
def test_stand_in_fails_where_the_published_files_fail(release, form, variant, checkpoints, tmp_path_factory):
    stages = run_release(release, checkpoints, tmp_path_factory)[form][variant]["stages"]
    failure = expected_failure(release, variant, form)
    if failure is None:
        assert stages == dict.fromkeys(STAGES, "ok"), stages
        return
    stage, fragment = failure
    ran = STAGES[: STAGES.index(stage)]
    assert {s: stages.get(s) for s in ran} == dict.fromkeys(ran, "ok"), stages
    assert fragment in stages.get(stage, ""), (stage, fragment, stages)


def _assert_same_numbers(ours: dict, theirs: dict, stages: dict, atol: float = ATOL, grads: bool = True) -> int:
    """Compare what both ran; returns how many numbers were compared."""
    compared = 0
    if stages.get("eval") == "ok":
        assert (ours["logits"] - theirs["logits"]).abs().max().item() <= atol
        compared += 1
    if stages.get("generate") == "ok":
        assert torch.equal(ours["generated"], theirs["generated"])
        compared += 1
    if stages.get("train") == "ok":
        assert abs(ours["loss"].item() - theirs["loss"].item()) <= atol
        mine, other = per_expert_grads(ours["grads"]), per_expert_grads(theirs["grads"])
        assert mine.keys() == other.keys()
        for name, grad in other.items() if grads else ():
            assert (mine[name] - grad).abs().max().item() <= atol, name
        compared += 1
    return compared


@pytest.mark.parametrize("form", ["v3", "v2"])
def test_same_numbers_as_the_file_without_compat(release, form, checkpoints, tmp_path_factory):
    """Where the published file or the --no-compat rewrite runs a stage, the default rewrite gives its numbers."""
    runs = run_release(release, checkpoints, tmp_path_factory)[form]
    expected = 0  # the eval, generate and train stages each file runs before it fails where the published files fail
    for variant in ("published", "nocompat"):
        failure = expected_failure(release, variant, form)
        ran = STAGES if failure is None else STAGES[: STAGES.index(failure[0])]
        expected += len({"eval", "generate", "train"}.intersection(ran))
    if expected == 0:
        pytest.skip(f"nothing to compare: on transformers {release} both files stop before eval")
    compared = sum(
        _assert_same_numbers(runs["rewritten"], runs[v], runs[v]["stages"]) for v in ("published", "nocompat")
    )
    assert compared == expected, {v: runs[v]["stages"] for v in ("published", "nocompat")}


@pytest.mark.parametrize("form", ["v3", "v2"])
def test_same_numbers_on_every_release(release, form, checkpoints, tmp_path_factory):
    """The rewritten file gives the numbers it gives on this suite's own transformers, on every release."""
    reference = run_release(transformers.__version__, checkpoints, tmp_path_factory)[form]["rewritten"]
    ours = run_release(release, checkpoints, tmp_path_factory)[form]["rewritten"]
    assert _assert_same_numbers(ours, reference, dict.fromkeys(STAGES, "ok")) == 3


@pytest.mark.parametrize("form", ["v3", "v2"])
@pytest.mark.parametrize("native_release", NATIVE_RELEASES)
def test_same_numbers_as_transformers_own_model(native_release, form, checkpoints, tmp_path_factory):
    """transformers 5.x's own implementation of the model type, given the same checkpoint (per-expert keys), runs every
    stage and gives the rewritten file's eval logits, greedy tokens, training loss and (V3) gradients. transformers'
    DeepseekV2 has no sequence-level aux loss, which the V2 file adds to the gradients only (not to the loss)."""
    runs = run_release(native_release, checkpoints, tmp_path_factory)[form]
    broken = NATIVE_FAILS.get((".".join(native_release.split(".")[:2]), form))
    if broken is not None:  # still compare what transformers' model runs
        assert broken[1] in runs["native"]["stages"][broken[0]], runs["native"]["stages"]
        assert _assert_same_numbers(runs["rewritten"], runs["native"], runs["native"]["stages"], atol=NATIVE_ATOL) == 0
        return
    assert runs["native"]["stages"] == dict.fromkeys(STAGES, "ok"), runs["native"]["stages"]
    assert runs["native"]["class"].startswith(f"transformers.models.deepseek_{form}.")
    stages = runs["native"]["stages"]
    assert _assert_same_numbers(runs["rewritten"], runs["native"], stages, atol=NATIVE_ATOL, grads=form == "v3") == 3


@pytest.mark.parametrize("form", ["v3", "v2"])
def test_no_fuse_experts_output_runs_or_refuses_merged_keys(release, form, checkpoints, tmp_path_factory):
    """The --no-fuse-experts rewrite gives the default rewrite's numbers; where transformers merges the per-expert keys
    as it loads, it fails to load with the generated one-line reason instead of training on random experts."""
    runs = run_release(release, checkpoints, tmp_path_factory)[form]
    stages = runs["nofuse"]["stages"]
    if ".".join(release.split(".")[:2]) in MERGES_FOR_PER_EXPERT:
        assert stages["import"] == "ok" and "rewritten with --no-fuse-experts" in stages["load"], stages
        return
    assert stages == dict.fromkeys(STAGES, "ok"), stages
    assert _assert_same_numbers(runs["rewritten"], runs["nofuse"], stages) == 3
