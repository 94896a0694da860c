"""The pre-commit hooks (.pre-commit-hooks.yaml) run by the real `pre-commit` tool on a throwaway repository.

pre-commit builds the hooks' environment by pip-installing this project and its dependencies (from PyPI): that needs
the network, once per module. Without it the tests fail, they do not skip. README's snippet (`repo: local`,
`language: system`) runs the installed command instead, with no environment to build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, V2_DIR, V3_DIR, snapshot

from moe_rewrite import RewriteOptions, rewrite_source

MODELING = "modeling_deepseek.py"
SKIPPED = "skipped (not a DeepSeek-family MoE file)"
# What the hook repository needs to build and install the package (the rest of the working tree is not shipped).
PROJECT_FILES = ("pyproject.toml", "README.md", ".pre-commit-hooks.yaml", "moe_rewrite")

VENDORED = f"vendor/deepseek/{MODELING}"  # V3 form, deep in the tree
AT_ROOT = MODELING  # V2 form, at the repository root
DENSE = f"models/dense/{MODELING}"  # named like one, but a dense model: reported and skipped
LOOKALIKE = "vendor/deepseek/old_modeling_deepseek.py"  # a MoE file whose name does not match the hooks' regex
UNRELATED = "train.py"
DENSE_TEXT = (
    "import torch\n\n\nclass DenseMLP(torch.nn.Module):\n"
    "    def __init__(self, d):\n        super().__init__()\n        self.up = torch.nn.Linear(d, d)\n\n"
    "    def forward(self, x):\n        return self.up(x)\n"
)
UNRELATED_TEXT = "import torch\n\n\ndef main():\n    print(torch.__version__)\n"
# The user's options pass through `args:`; a non-default backend shows they reach the command.
OPTIONS = RewriteOptions(backend="loop")
CONFIG = """\
repos:
  - repo: {repo}
    rev: {rev}
    hooks:
      - id: moe-rewrite
        args: [--backend, loop]
      - id: moe-rewrite-check
        args: [--backend, loop]
"""


def _git(cwd: Path, env: dict[str, str], *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc.stdout.strip()


def _commit_all(path: Path, env: dict[str, str]) -> str:
    _git(path, env, "init", "-q")
    _git(path, env, "add", "-A")
    _git(path, env, "commit", "-q", "-m", "snapshot")
    return _git(path, env, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """A process environment with a private PRE_COMMIT_HOME (shared by the module's tests: the hook environment is
    built once) and git isolated from the user's configuration and from any repository the tests run inside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "PRE_COMMIT")) or k.startswith("GIT_SSL")}
    env.update(
        PRE_COMMIT_HOME=str(tmp_path_factory.mktemp("pre-commit-home")),
        PRE_COMMIT_COLOR="never",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="test",
        GIT_AUTHOR_EMAIL="test@example.com",
        GIT_COMMITTER_NAME="test",
        GIT_COMMITTER_EMAIL="test@example.com",
    )
    return env


@pytest.fixture(scope="module")
def hook_repo(tmp_path_factory, env) -> tuple[Path, str]:
    """A committed snapshot of this project's working tree (which may hold uncommitted changes), as pre-commit's
    `repo:`."""
    repo = tmp_path_factory.mktemp("hook-repo")
    for name in PROJECT_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copyfile(src, repo / name)
    return repo, _commit_all(repo, env)


def make_consumer(path: Path, env: dict[str, str], hook_repo: tuple[Path, str] | None, config: str = "") -> Path:
    """A training framework's repository: vendored modeling files, a look-alike, unrelated code, the hook config
    (CONFIG with `hook_repo`, else `config`)."""
    files = {
        VENDORED: (V3_DIR / MODELING).read_bytes(),
        AT_ROOT: (V2_DIR / MODELING).read_bytes(),
        DENSE: DENSE_TEXT.encode(),
        LOOKALIKE: (V3_DIR / MODELING).read_bytes(),
        UNRELATED: UNRELATED_TEXT.encode(),
        ".pre-commit-config.yaml": (
            config if hook_repo is None else CONFIG.format(repo=hook_repo[0], rev=hook_repo[1])
        ).encode(),
    }
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    _commit_all(path, env)
    return path


def files(path: Path) -> dict[str, bytes]:
    return {k: v for k, v in snapshot(path).items() if not k.startswith(".git" + os.sep) and k != ".git"}


def pre_commit(cwd: Path, env: dict[str, str], *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", *args, "--color", "never"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory, env, hook_repo) -> tuple[Path, str]:
    """Build the hooks' environment once (pip-installs this project and its dependencies into PRE_COMMIT_HOME)."""
    consumer = make_consumer(tmp_path_factory.mktemp("install"), env, hook_repo)
    proc = pre_commit(consumer, env, "install-hooks", timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"pre-commit could not build the hook environment (network?):\n{proc.stdout}\n{proc.stderr}")
    return hook_repo


@pytest.fixture(scope="module")
def expected() -> dict[str, bytes]:
    return {
        VENDORED: rewrite_source((V3_DIR / MODELING).read_text(), OPTIONS).text.encode(),
        AT_ROOT: rewrite_source((V2_DIR / MODELING).read_text(), OPTIONS).text.encode(),
    }


@pytest.mark.slow  # git repositories and pre-commit runs, or processes on gloo: over 10 s
def test_rewrite_hook_rewrites_fails_then_passes(tmp_path, env, installed, expected):
    consumer = make_consumer(tmp_path, env, installed)
    before = files(consumer)

    first = pre_commit(consumer, env, "run", "moe-rewrite", "--all-files")

    output = first.stdout + first.stderr
    assert first.returncode == 1, output
    assert "Traceback" not in output
    assert "files were modified by this hook" in output
    assert f"Rewriting {VENDORED} (V3 form" in output
    assert f"Rewriting {AT_ROOT} (V2 form" in output
    assert "backend=loop" in output and "backend=auto" not in output
    assert f"{DENSE}: {SKIPPED}" in output and output.count(SKIPPED) == 1
    assert LOOKALIKE not in output and UNRELATED not in output
    after = files(consumer)
    for name in (VENDORED, AT_ROOT):
        assert after.pop(name) == expected[name], name
        del before[name]
    assert after == before  # the dense file, the look-alike, the unrelated file and the config: bytes unchanged

    # Everything rewritten: the dense file is still reported, and does not fail the hook by itself.
    second = pre_commit(consumer, env, "run", "moe-rewrite", "--all-files", "--verbose")

    output = second.stdout + second.stderr
    assert second.returncode == 0, output
    assert f"{DENSE}: {SKIPPED}" in output and output.count(SKIPPED) == 1
    assert "Rewriting" not in output
    rewritten = files(consumer)
    assert rewritten == {**before, **expected}

    # The check hook (same args) agrees that nothing is left to do.
    check = pre_commit(consumer, env, "run", "moe-rewrite-check", "--all-files")
    assert check.returncode == 0, check.stdout + check.stderr
    assert files(consumer) == rewritten


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_check_hook_fails_with_the_diff_and_changes_nothing(tmp_path, env, installed, expected):
    consumer = make_consumer(tmp_path, env, installed)
    before = files(consumer)

    proc = pre_commit(consumer, env, "run", "moe-rewrite-check", "--all-files")

    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output
    assert "files were modified by this hook" not in output
    for name in (VENDORED, AT_ROOT):
        assert f"--- a/{name}\n+++ b/{name}\n@@ " in output, name
    assert "\n+    def moe_train(" in output
    assert "\n-            assert not self.training" in output
    assert f"{DENSE}: {SKIPPED}" in output and output.count(SKIPPED) == 1
    assert f"a/{LOOKALIKE}" not in output and f"a/{UNRELATED}" not in output
    assert files(consumer) == before
    assert _git(consumer, env, "status", "--porcelain") == ""


def readme_snippet() -> str:
    """The .pre-commit-config.yaml of README.md's pre-commit section, as a user copies it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## pre-commit") :]
    return section[section.index("```yaml\n") + len("```yaml\n") : section.index("```\n", section.index("```yaml"))]


def installed_command(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` with a `moe-rewrite` command on PATH that runs this working tree's code, as `pip install .` in a clone
    would give (the README's hooks are `language: system`: they run whatever `moe-rewrite` the PATH finds)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    command = bin_dir / "moe-rewrite"
    command.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m moe_rewrite "$@"\n')
    command.chmod(0o755)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": str(ROOT)}


def readme_consumer(tmp_path: Path, env: dict[str, str], extra: str = "") -> Path:
    """A consumer repository whose .pre-commit-config.yaml is README's, as written, plus `extra` repos."""
    snippet = readme_snippet()
    assert "<" not in snippet, "a placeholder in README's pre-commit snippet"
    consumer = tmp_path / "consumer"
    consumer.mkdir()
    return make_consumer(consumer, env, None, snippet + extra)


@pytest.mark.slow  # git repositories and pre-commit runs, or processes on gloo: over 10 s
def test_the_readme_snippet_works_as_written(tmp_path, env):
    """README's config, copied as it is, with moe-rewrite installed: both hooks run, and then pass."""
    env = installed_command(tmp_path, env)
    consumer = readme_consumer(tmp_path, env)
    check = pre_commit(consumer, env, "run", "moe-rewrite-check", "--all-files")
    assert check.returncode == 1 and f"--- a/{VENDORED}" in check.stdout + check.stderr
    rewrite = pre_commit(consumer, env, "run", "moe-rewrite", "--all-files")
    assert rewrite.returncode == 1 and f"Rewriting {VENDORED} (V3 form" in rewrite.stdout + rewrite.stderr
    options = RewriteOptions(backend="auto")
    assert (consumer / VENDORED).read_text() == rewrite_source((V3_DIR / MODELING).read_text(), options).text
    again = pre_commit(consumer, env, "run", "--all-files")
    assert again.returncode == 0, again.stdout + again.stderr


RUFF_HOOK = """\
  - repo: local
    hooks:
      - id: ruff-format
        name: ruff format
        entry: {ruff} format --isolated --no-cache
        language: system
        types: [python]
"""


@pytest.mark.slow  # git repositories and pre-commit runs, or processes on gloo: over 10 s
def test_the_readme_hooks_and_a_formatter_settle(tmp_path, env):
    """README's hooks then `ruff format` on the same files: the first commit attempt rewrites and reformats, the next
    passes and changes nothing (a formatted rewrite is up to date)."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip(f"no ruff beside {sys.executable} (the test extra installs it)")
    env = installed_command(tmp_path, env)
    consumer = readme_consumer(tmp_path, env, RUFF_HOOK.format(ruff=ruff))

    first = pre_commit(consumer, env, "run", "--all-files")

    output = first.stdout + first.stderr
    assert first.returncode == 1, output
    assert f"Rewriting {VENDORED} (V3 form" in output and f"Rewriting {AT_ROOT} (V2 form" in output
    formatted = files(consumer)
    assert formatted[VENDORED] != rewrite_source((V3_DIR / MODELING).read_text(), RewriteOptions()).text.encode()

    second = pre_commit(consumer, env, "run", "--all-files")

    assert second.returncode == 0, second.stdout + second.stderr
    assert "Rewriting" not in second.stdout + second.stderr
    assert files(consumer) == formatted
