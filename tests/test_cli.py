"""The `moe-rewrite` command as a user sees it: exit codes, what lands on stdout/stderr, and what is (not) written."""

from __future__ import annotations

import io
import os
import random
import re
import shutil
import stat
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import ROOT, V3_DIR, assert_one_line_error, run_cli, snapshot, written_entries

from moe_rewrite import __version__, rewrite_source

PAIRS = ROOT / "tests" / "pairs"

MODELING = "modeling_deepseek.py"
LINKED = ("model.safetensors", "model.safetensors.index.json", "tokenizer.json")
COPIED = ("configuration_deepseek.py", "config.json")
# Small MoE snippets (tests/pairs) where the content is not the point: libcst needs ~0.5 s for a whole stand-in file.
SMALL_V3 = ROOT / "tests" / "pairs" / "v3_basic.in.py"
SMALL_V2 = ROOT / "tests" / "pairs" / "v2_basic.in.py"


# --------------------------------------------------------------------------------------------------------- helpers


@lru_cache(maxsize=None)
def patched_text(source: Path = V3_DIR / MODELING) -> str:
    """A modeling file rewritten with the default options (computed once: libcst is not fast)."""
    return rewrite_source(source.read_text()).text


def make_checkpoint(tmp_path: Path, name: str = "src", small: bool = False) -> Path:
    """A copy of the V3 stand-in checkpoint plus fake weights, weight index and tokenizer."""
    src = tmp_path / name
    shutil.copytree(V3_DIR, src)
    if small:
        shutil.copyfile(SMALL_V3, src / MODELING)
    (src / "model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    (src / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}\n')
    (src / "tokenizer.json").write_text('{"version": "1.0"}\n')
    return src


def copy_modeling(tmp_path: Path, name: str = MODELING, source: Path = V3_DIR / MODELING) -> Path:
    path = tmp_path / name
    shutil.copyfile(source, path)
    return path


def tree(path: Path) -> tuple[dict[str, bytes], list[str]]:
    """Every file's bytes (links as their targets) and every directory, even empty ones."""
    dirs = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_dir() and not p.is_symlink())
    return snapshot(path), dirs


def apply_unified_diff(old: str, diff: str) -> str:
    """Apply a unified diff (as difflib writes it) to `old`; every context and removed line must match."""
    old_lines = old.splitlines(keepends=True)
    lines = diff.splitlines(keepends=True)
    assert lines[0].startswith("--- ") and lines[1].startswith("+++ "), lines[:2]
    new, pos, i = [], 0, 2
    while i < len(lines):
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", lines[i])
        assert m, lines[i]
        start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
        assert start >= pos
        new += old_lines[pos:start]
        pos = start
        i += 1
        while i < len(lines) and not lines[i].startswith("@@"):
            tag, text = lines[i][0], lines[i][1:]
            if tag in " -":
                assert old_lines[pos] == text, (pos, old_lines[pos], text)
                pos += 1
            if tag in " +":
                new.append(text)
            assert tag in " -+", lines[i]
            i += 1
    return "".join(new + old_lines[pos:])


# ------------------------------------------------------------------------------------------------------------ --out


def test_out_from_checkpoint_dir(tmp_path):
    src = make_checkpoint(tmp_path)
    before = snapshot(src)
    out = tmp_path / "out"

    code, stdout, err = run_cli(src, "--out", out)

    assert code == 0, err
    assert stdout == ""
    assert "Traceback" not in err
    assert f"-> {out / MODELING}" in err
    assert sorted(p.name for p in written_entries(out)) == sorted((MODELING, *COPIED, *LINKED))
    patched = out / MODELING
    assert patched.is_file() and not patched.is_symlink()
    text = patched.read_text()
    assert "def moe_train(" in text
    assert text == patched_text()
    for name in COPIED:
        assert (out / name).is_file() and not (out / name).is_symlink(), name
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    for name in LINKED:
        link = out / name
        assert link.is_symlink(), name
        assert os.path.isabs(os.readlink(link)), name
        assert Path(os.readlink(link)) == (src / name).absolute(), name
        assert link.read_bytes() == (src / name).read_bytes(), name
    assert snapshot(src) == before

    first = snapshot(out)
    code, stdout, err = run_cli(src, "--out", out)
    assert code == 0, err
    assert stdout == ""
    assert snapshot(out) == first  # the same files, links and bytes; no leftover temp files
    assert snapshot(src) == before


def test_out_with_relative_paths_links_absolutely(tmp_path, monkeypatch):
    """Links made from a relative SOURCE still point at the source files from anywhere."""
    make_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)

    code, _, err = run_cli("src", "--out", "out")

    assert code == 0, err
    monkeypatch.chdir("/")
    for name in LINKED:
        link = tmp_path / "out" / name
        assert os.path.isabs(os.readlink(link)), name
        assert link.resolve() == (tmp_path / "src" / name).resolve(), name


def test_out_inside_the_source_dir(tmp_path):
    """--out SRC/patched must not link the output directory into itself."""
    src = make_checkpoint(tmp_path)
    out = src / "patched"

    code, _, err = run_cli(src, "--out", out)

    assert code == 0, err
    assert sorted(p.name for p in written_entries(out)) == sorted((MODELING, *COPIED, *LINKED))
    assert not (out / "patched").exists() and not (out / "patched").is_symlink()


def test_out_from_bare_py_file(tmp_path):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    path = copy_modeling(src_dir, "modeling_custom.py", SMALL_V3)
    shutil.copyfile(V3_DIR / "config.json", src_dir / "config.json")  # a sibling: not part of a bare-file source
    before = snapshot(src_dir)
    out = tmp_path / "out"

    code, stdout, err = run_cli(path, "--out", out)

    assert code == 0, err
    assert stdout == ""
    assert [p.name for p in written_entries(out)] == ["modeling_custom.py"]
    written = out / "modeling_custom.py"
    assert written.is_file() and not written.is_symlink()
    assert "def moe_train(" in written.read_text()
    assert snapshot(src_dir) == before


def test_out_says_what_it_holds_and_whether_it_has_weights(tmp_path):
    """Weights linked are counted; an output without any says so, and why, instead of "0 files linked"."""
    with_weights = make_checkpoint(tmp_path, "with", small=True)
    code, _, err = run_cli(with_weights, "--out", tmp_path / "o1")
    assert code == 0 and err.splitlines()[1] == f"  {tmp_path / 'o1'}: 2 code/config files copied, 3 files linked"
    no_weights = tmp_path / "code_only"
    shutil.copytree(V3_DIR, no_weights)
    shutil.copyfile(SMALL_V3, no_weights / MODELING)
    code, _, err = run_cli(no_weights, "--out", tmp_path / "o2")
    assert code == 0 and err.splitlines()[1] == (
        f"  {tmp_path / 'o2'}: 2 code/config files copied, no weights in {no_weights}: the output holds code and "
        "config only"
    )
    bare = copy_modeling(tmp_path, "bare.py", SMALL_V3)
    code, _, err = run_cli(bare, "--out", tmp_path / "o3")
    assert code == 0 and err.splitlines()[1] == (
        f"  {tmp_path / 'o3'}: {bare} is a single file: the output holds the patched file only"
    )
    assert "linked" not in err


def test_verbose_out_names_the_runtime_sections(tmp_path):
    """-v promises the sections the generated code holds: --out prints them too, as --check and --in-place do."""
    src = make_checkpoint(tmp_path, small=True)
    code, _, err = run_cli(src, "--out", tmp_path / "out", "-v")
    assert code == 0 and err.splitlines()[1].startswith(
        "  generated code: dispatch, route, grouped_mm, grouped_linear, "
    ), err
    code, _, err = run_cli(src, "--out", tmp_path / "out2")
    assert code == 0 and "generated code" not in err


# ------------------------------------------------------------------------------------------------------- --in-place


def test_in_place(tmp_path):
    path = copy_modeling(tmp_path)
    os.chmod(path, 0o750)
    original = path.read_bytes()

    code, stdout, err = run_cli(path, "--in-place")

    assert code == 1, err
    assert stdout == ""
    assert f"Rewriting {path}" in err and "Traceback" not in err
    assert err.endswith("\n1 file rewritten\n")
    once = path.read_bytes()
    assert once != original and b"def moe_train(" in once
    assert once.decode() == patched_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    assert [p.name for p in tmp_path.iterdir()] == [MODELING]  # no temp file left behind

    code, stdout, err = run_cli(path, "--in-place")

    assert code == 0, err
    assert (stdout, err) == ("", "1 file left unchanged\n")
    assert path.read_bytes() == once
    assert stat.S_IMODE(path.stat().st_mode) == 0o750


def test_in_place_on_a_checkpoint_dir(tmp_path):
    src = make_checkpoint(tmp_path)
    before = snapshot(src)

    code, _, err = run_cli(src, "--in-place")

    assert code == 1, err
    after = snapshot(src)
    assert after.pop(MODELING) != before.pop(MODELING)
    assert after == before  # only the modeling file changed


def test_in_place_several_files(tmp_path):
    v3 = copy_modeling(tmp_path, "v3.py", SMALL_V3)
    v2 = copy_modeling(tmp_path, "v2.py", SMALL_V2)
    done = tmp_path / "done.py"
    done.write_text(patched_text(SMALL_V3))
    done_bytes = done.read_bytes()

    code, _, err = run_cli(v3, v2, done, "--in-place")

    assert code == 1, err
    assert v3.read_text() == patched_text(SMALL_V3)
    assert v2.read_text() == patched_text(SMALL_V2)
    assert done.read_bytes() == done_bytes
    assert f"Rewriting {v3}" in err and f"Rewriting {v2}" in err and str(done) not in err


def test_in_place_one_bad_file_does_not_stop_the_others(tmp_path):
    """As black does: every file is checked; the good ones are rewritten, each bad one gets its one line, exit 2."""
    good = copy_modeling(tmp_path, "good.py", SMALL_V3)
    (tmp_path / "bad.py").write_text("x = 1\n")
    code, out, err = run_cli(tmp_path / "bad.py", good, tmp_path / "gone.py", "--in-place")
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(f"moe-rewrite: error: {tmp_path / 'bad.py'}: not a DeepSeek-family MoE file")
    assert lines[1].startswith(f"Rewriting {good}")
    assert lines[2].startswith(f"moe-rewrite: error: {tmp_path / 'gone.py'}: no such file")
    assert lines[3] == "1 file rewritten, 2 files failed"
    assert good.read_text() == patched_text(SMALL_V3)
    assert (tmp_path / "bad.py").read_text() == "x = 1\n" and not (tmp_path / "gone.py").exists()


def test_several_files_end_with_one_summary_line_and_quiet_and_verbose(tmp_path):
    """As black: a line per file rewritten, one summary line; -q prints nothing but errors, -v names the files left
    unchanged too."""
    v3, v2 = copy_modeling(tmp_path, "v3.py", SMALL_V3), copy_modeling(tmp_path, "v2.py", SMALL_V2)
    done = tmp_path / "done.py"
    done.write_text(patched_text(SMALL_V3))
    code, _, err = run_cli(v3, done, "--check", "-v")
    assert code == 1
    assert err.splitlines() == [
        err.splitlines()[0],
        "  generated code: dispatch, route, grouped_mm, grouped_linear, expert_output, backends, moe_train, "
        "expert_parallel, triton_block, triton_route, triton_gather, triton_swiglu, triton_sum_rows, triton_gemm, "
        "expert_linears, parameter_lora, fused_views, fused_experts, fusing, fused_checkpoint, "
        "expert_parallel_checkpoint, fused_loading (moe_rewrite/runtime/__init__.py SECTION_LIST)",
        f"{done}: already rewritten",
        "1 file would be rewritten, 1 file would be left unchanged",
    ] and err.startswith(f"would rewrite {v3} (V3 form")
    assert run_cli(v3, v2, done, "--check", "-q") == (1, "", "")
    code, _, err = run_cli(v3, v2, done, "--in-place")
    assert code == 1 and err.splitlines()[-1] == "2 files rewritten, 1 file left unchanged"
    assert run_cli(v3, v2, done, "--in-place", "--quiet") == (0, "", "")
    code, _, err = run_cli(v3, "--check", "-q", "-v")
    assert code == 2 and "exclude each other" in err


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_crlf_in_place_stays_crlf(tmp_path):
    path = tmp_path / MODELING
    lf = (V3_DIR / MODELING).read_bytes()
    assert b"\r" not in lf
    path.write_bytes(lf.replace(b"\n", b"\r\n"))

    code, _, err = run_cli(path, "--in-place")

    assert code == 1, err
    data = path.read_bytes()
    assert b"def moe_train(" in data
    assert data.count(b"\n") == data.count(b"\r\n")  # every line ends CRLF, the generated ones too
    assert b"\r\r" not in data
    assert data == patched_text().replace("\n", "\r\n").encode()

    code, _, err = run_cli(path, "--in-place")
    assert (code, err) == (0, "1 file left unchanged\n")
    assert path.read_bytes() == data


# --------------------------------------------------------------------------------------------------- --check, --diff


def test_check(tmp_path):
    path = copy_modeling(tmp_path)
    before = tree(tmp_path)

    code, stdout, err = run_cli(path, "--check")

    assert code == 1
    assert stdout == ""
    assert err.startswith(f"would rewrite {path} (V3 form")
    assert err.endswith(")\n1 file would be rewritten\n") and err.count("\n") == 2
    assert tree(tmp_path) == before

    path.write_text(patched_text())
    before = tree(tmp_path)
    assert run_cli(path, "--check") == (0, "", "1 file would be left unchanged\n")  # says so
    assert tree(tmp_path) == before


def test_diff(tmp_path):
    path = copy_modeling(tmp_path)
    original = path.read_text()
    before = tree(tmp_path)

    code, stdout, err = run_cli(path, "--diff")

    assert code == 1, err
    assert "Traceback" not in err
    posix = path.as_posix().lstrip("/")
    assert stdout.startswith(f"--- a/{posix}\n+++ b/{posix}\n@@ ")
    assert "\n+    def moe_train(" in stdout
    assert "\n-            assert not self.training" in stdout
    assert tree(tmp_path) == before
    expected = patched_text()
    assert apply_unified_diff(original, stdout) == expected

    path.write_text(expected)
    assert run_cli(path, "--diff") == (0, "", "1 file would be left unchanged\n")


# ----------------------------------------------------------------------------------------------- and a formatter

RUFF = Path(sys.executable).with_name("ruff")


def ruff_format(path: Path) -> None:
    """`ruff format` with its defaults (88 columns), as a repository that formats its code runs it."""
    if not RUFF.exists():
        pytest.skip(f"no ruff beside {sys.executable} (the test extra installs it)")
    command = [str(RUFF), "format", "--isolated", "--no-cache", str(path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def formatted_rewrite(tmp_path: Path) -> Path:
    """A file rewritten with the default options, then reformatted."""
    path = copy_modeling(tmp_path, source=SMALL_V3)
    assert run_cli(path, "--in-place")[0] == 1
    rewritten = path.read_text()
    ruff_format(path)
    assert path.read_text() != rewritten
    return path


def test_a_formatted_rewrite_is_up_to_date(tmp_path):
    path = formatted_rewrite(tmp_path)
    formatted = path.read_bytes()

    assert run_cli(path, "--check") == (0, "", "1 file would be left unchanged\n")
    assert run_cli(path, "--diff") == (0, "", "1 file would be left unchanged\n")
    assert run_cli(path, "--in-place") == (0, "", "1 file left unchanged\n")
    assert path.read_bytes() == formatted


def test_a_formatted_rewrite_with_an_edit_or_without_its_banner_is_rewritten(tmp_path):
    path = formatted_rewrite(tmp_path)
    formatted = path.read_text()
    edited = formatted.replace("other=0.0", "other=1.0", 1)  # a number in the generated Triton code
    assert edited != formatted
    path.write_text(edited)

    assert run_cli(path, "--check")[0] == 1
    assert run_cli(path, "--in-place")[0] == 1
    assert "other=1.0" not in path.read_text()
    assert run_cli(path, "--check")[0] == 0

    banner = re.search(r"^# ---- moe-rewrite .*\n", formatted, re.M).group()
    path.write_text(formatted.replace(banner, ""))  # the same code, but a later run could not find the block

    assert run_cli(path, "--check")[0] == 1


def test_a_formatted_rewrite_under_other_options_is_regenerated_and_converges(tmp_path):
    path = formatted_rewrite(tmp_path)

    assert run_cli(path, "--check", "--stacking", "sequential")[0] == 1
    code, _, err = run_cli(path, "--in-place", "--stacking", "sequential")

    assert code == 1, err
    text = path.read_text()
    assert text.count("# ---- moe-rewrite") == text.count('"stacking": "sequential"') == 1
    assert text.count("def moe_train(") == 1
    ruff_format(path)
    assert run_cli(path, "--in-place", "--stacking", "sequential") == (0, "", "1 file left unchanged\n")


# ----------------------------------------------------------------------------------------------------------- errors


def _missing_dir(t):
    return [t / "missing", "--out", t / "out"], [str(t / "missing")]


def _missing_py(t):
    return [t / "missing.py", "--check"], [str(t / "missing.py")]


def _dir_without_modeling(t):
    (t / "ckpt").mkdir()
    shutil.copyfile(V3_DIR / "config.json", t / "ckpt" / "config.json")
    return [t / "ckpt", "--out", t / "out"], [str(t / "ckpt"), MODELING]


def _not_moe(t):
    (t / "other.py").write_text(
        "import torch\n\n\nclass Foo(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
    )
    return [t / "other.py", "--in-place"], [str(t / "other.py")]


def _syntax_error(t):
    (t / "broken.py").write_text("def f(:\n    pass\n")
    return [t / "broken.py", "--in-place"], [str(t / "broken.py"), "syntax error"]


def _not_utf8(t):
    (t / "latin1.py").write_bytes(b"# caf\xe9\n")
    return [t / "latin1.py", "--in-place"], [str(t / "latin1.py")]


def _not_py(t):
    (t / "notes.txt").write_text("hello\n")
    return [t / "notes.txt", "--check"], [str(t / "notes.txt")]


def _out_and_in_place(t):
    return [make_checkpoint(t), "--out", t / "out", "--in-place"], ["--out", "--in-place"]


def _check_and_out(t):
    return [make_checkpoint(t), "--check", "--out", t / "out"], ["--out"]


def _no_mode(t):
    return [make_checkpoint(t)], ["--out"]


def _no_source(t):
    return ["--check"], ["SOURCE"]


def _out_is_source_dir(t):
    src = make_checkpoint(t, small=True)
    return [src, "--out", src], [str(src)]


def _out_is_source_files_dir(t):
    path = copy_modeling(t, source=SMALL_V3)
    return [path, "--out", t], [str(t)]


def _out_is_a_file(t):
    src = make_checkpoint(t, small=True)
    (t / "out").write_text("not a directory\n")
    return [src, "--out", t / "out"], [str(t / "out")]


def _out_with_two_sources(t):
    return [copy_modeling(t, "a.py"), copy_modeling(t, "b.py"), "--out", t / "out"], ["--out"]


def _in_place_hub_id(t):
    return ["nobody/nothing", "--in-place"], ["nobody/nothing", "in place", "--out"]


def _unknown_backend(t):
    return [make_checkpoint(t), "--out", t / "out", "--backend", "cutlass"], ["--backend", "cutlass"]


def _unknown_stacking(t):
    return [copy_modeling(t), "--in-place", "--stacking", "diagonal"], ["--stacking", "diagonal"]


def _unknown_option(t):
    return [copy_modeling(t), "--in-place", "--fast"], ["--fast"]


ERROR_CASES = [
    _missing_dir,
    _missing_py,
    _dir_without_modeling,
    _not_moe,
    _syntax_error,
    _not_utf8,
    _not_py,
    _out_and_in_place,
    _check_and_out,
    _no_mode,
    _no_source,
    _out_is_source_dir,
    _out_is_source_files_dir,
    _out_is_a_file,
    _out_with_two_sources,
    _in_place_hub_id,
    _unknown_backend,
    _unknown_stacking,
    _unknown_option,
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda f: f.__name__.lstrip("_"))
def test_error_exits_2_with_one_line_and_writes_nothing(tmp_path, case):
    args, mentions = case(tmp_path)
    out_existed = (tmp_path / "out").exists()
    before = tree(tmp_path)

    code, stdout, err = run_cli(*args)

    assert_one_line_error((code, stdout, err), *mentions)
    assert tree(tmp_path) == before
    assert (tmp_path / "out").exists() == out_existed


# ---------------------------------------------------------------------------------------------- options, version


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_backend_and_stacking_are_written_and_regenerated(tmp_path):
    path = copy_modeling(tmp_path)
    default = patched_text()

    code, _, err = run_cli(path, "--in-place", "--backend", "loop", "--stacking", "sequential")

    assert code == 1, err
    assert "backend=loop, stacking=sequential" in err
    text = path.read_text()
    options = re.findall(r"^_moe_rewrite_options = (.*)$", text, re.M)
    assert len(options) == 1
    assert '"backend": "loop"' in options[0] and '"stacking": "sequential"' in options[0]
    assert text.count("def moe_train(") == 1

    code, _, err = run_cli(path, "--in-place")

    assert code == 1, err
    assert "backend=auto, stacking=stack" in err
    text = path.read_text()
    assert text == default
    (options,) = re.findall(r"^_moe_rewrite_options = (.*)$", text, re.M)
    assert '"backend": "auto"' in options and '"stacking": "stack"' in options


def test_version():
    code, stdout, err = run_cli("--version")
    assert code == 0
    assert stdout.strip() == f"moe-rewrite, version {__version__}"
    assert err == ""


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(flag):
    code, stdout, err = run_cli(flag)
    assert code == 0
    assert err == ""
    assert stdout.startswith("Usage: moe-rewrite [OPTIONS] SOURCE...")
    for option in ("--out", "--in-place", "--check", "--diff", "--revision", "--backend", "--stacking"):
        assert option in stdout, option
    text = " ".join(stdout.split())
    # LoRA works on the default fused experts (tests/test_lora_parameters.py): --no-fuse-experts is not for LoRA
    assert "PEFT's LoRA adapts them (target_modules or target_parameters)" in text
    assert "modules (LoRA does not)" in text and "LoRA adapters on the routed experts need them" not in text
    assert "the runtime sections each file gets" in text and "moe-rewrite env" in text


class Terminal(io.StringIO):
    """stderr as a terminal: where the progress line shows."""

    def isatty(self) -> bool:
        return True


def run_on_a_terminal(*args) -> tuple[int, str]:
    from moe_rewrite.cli import main

    err = Terminal()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, err.getvalue()


def test_a_progress_line_shows_on_a_terminal_and_is_erased(tmp_path, monkeypatch):
    """On a terminal, "Rewriting PATH ..." shows while libcst works, then is erased (carriage return, erase line)
    before the next line: the screen keeps the usual lines, and a failure its one error line. Not with -q, and not
    when stderr is a file or a pipe (the other tests: their stderr is exact)."""
    monkeypatch.setenv("COLUMNS", "1000")  # the line is cut to the terminal's width, so that \r erases all of it
    path = copy_modeling(tmp_path, "small.py", SMALL_V3)
    erased = f"Rewriting {path} ...\r\033[K"
    code, err = run_on_a_terminal(path, "--check")
    assert code == 1 and err.startswith(f"{erased}would rewrite {path} (V3 form"), err
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    code, err = run_on_a_terminal(broken, "--check")
    assert (
        code == 2
        and err
        == f"Rewriting {broken} ...\r\033[Kmoe-rewrite: error: {broken}: syntax error at line 1, "
        + ("column 7: invalid syntax\n")
    )
    assert run_on_a_terminal(path, "--check", "-q") == (1, "")
    monkeypatch.setenv("COLUMNS", "20")
    assert run_on_a_terminal(path, "--check")[1].startswith(f"Rewriting {path}"[:19] + "\r\033[K")


# -------------------------------------------------------------------------------------------- python -m moe_rewrite


def run_module(*args, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **env_vars}
    return subprocess.run(
        [sys.executable, "-m", "moe_rewrite", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_python_m_error_unknown_repo_offline(tmp_path):
    """Not a path, so a Hub repo id; offline and not cached. A fresh process, so that huggingface_hub reads this
    environment (in-process, it may have been imported while collecting other test modules, before conftest pointed
    HF_HUB_CACHE at a temp dir and set HF_HUB_OFFLINE)."""
    (tmp_path / "empty_cache").mkdir()
    proc = run_module("nobody/nothing", "--out", tmp_path / "out", HF_HUB_CACHE=str(tmp_path / "empty_cache"))
    assert_one_line_error((proc.returncode, proc.stdout, proc.stderr), "nobody/nothing", "cache", "offline")
    assert [p.name for p in tmp_path.rglob("*")] == ["empty_cache"]


def test_python_m_success(tmp_path):
    out = tmp_path / "out"
    src = make_checkpoint(tmp_path, small=True)
    proc = run_module(src, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert (out / MODELING).read_text() == patched_text(SMALL_V3)
    assert sorted(p.name for p in written_entries(out)) == sorted((MODELING, *COPIED, *LINKED))


def test_in_place_through_a_symlink_rewrites_the_target_and_keeps_the_link(tmp_path):
    target = tmp_path / "vendor" / "modeling_deepseek.py"
    target.parent.mkdir()
    target.write_bytes((PAIRS / "v3_basic.in.py").read_bytes())
    link = tmp_path / "modeling_deepseek.py"
    link.symlink_to(target)
    code, _, err = run_cli(link, "--in-place")
    assert code == 1, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert "def moe_train(" in target.read_text()


def test_revision_with_a_local_path_is_refused(tmp_path):
    before = snapshot(tmp_path)
    code, _, err = run_cli(PAIRS / "v3_basic.in.py", "--revision", "main", "--check")
    assert code == 2 and err.count("\n") == 1
    assert "--revision applies to Hub repo ids" in err
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------- --skip-unrecognised

SKIPPED = "skipped (not a DeepSeek-family MoE file)"
# A dense model file that happens to be named like the MoE one (the pre-commit hooks match files by name).
DENSE = "import torch\n\n\nclass MLP(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
# Has a MoE class (forward() and moe_infer()) but not a structure the rewrite recognises: an error, not a skip.
UNRECOGNISED_MOE = (
    "class MoE:\n    def forward(self, x):\n        return self.moe_infer(x)\n\n"
    "    def moe_infer(self, x):\n        return x\n"
)


def dense_file(tmp_path: Path, folder: str = "dense") -> Path:
    path = tmp_path / folder / MODELING
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(DENSE)
    return path


def test_skip_unrecognised_in_place_rewrites_the_moe_file_and_reports_the_other(tmp_path):
    dense = dense_file(tmp_path)
    moe = copy_modeling(tmp_path, source=SMALL_V3)

    code, stdout, err = run_cli(dense, moe, "--in-place", "--skip-unrecognised")

    assert code == 1, err
    assert stdout == ""
    assert "Traceback" not in err
    assert f"{dense}: {SKIPPED}\n" in err and err.count(SKIPPED) == 1
    assert f"Rewriting {moe}" in err
    assert moe.read_text() == patched_text(SMALL_V3)
    assert dense.read_text() == DENSE

    # Already rewritten: only the skipped file is reported, exit 0.
    code, stdout, err = run_cli(dense, moe, "--in-place", "--skip-unrecognised")
    assert (code, stdout, err) == (0, "", f"{dense}: {SKIPPED}\n1 file left unchanged, 1 file skipped\n")
    assert moe.read_text() == patched_text(SMALL_V3)
    assert dense.read_text() == DENSE


@pytest.mark.parametrize("mode", ["--in-place", "--check", "--diff"])
def test_skip_unrecognised_alone_exits_0(tmp_path, mode):
    dense = dense_file(tmp_path)
    before = tree(tmp_path)

    code, stdout, err = run_cli(dense, mode, "--skip-unrecognised")

    assert (code, stdout, err) == (0, "", f"{dense}: {SKIPPED}\n1 file skipped\n")
    assert tree(tmp_path) == before


def test_skip_unrecognised_with_diff_prints_only_the_moe_diff(tmp_path):
    dense = dense_file(tmp_path)
    moe = copy_modeling(tmp_path, source=SMALL_V3)
    original = moe.read_text()
    before = tree(tmp_path)

    code, stdout, err = run_cli(moe, dense, "--diff", "--skip-unrecognised")

    assert code == 1, err
    assert err == f"{dense}: {SKIPPED}\n1 file would be rewritten, 1 file skipped\n"
    posix = moe.as_posix().lstrip("/")
    assert stdout.startswith(f"--- a/{posix}\n+++ b/{posix}\n@@ ")
    assert "dense" not in stdout
    assert apply_unified_diff(original, stdout) == patched_text(SMALL_V3)
    assert tree(tmp_path) == before


def test_skip_unrecognised_with_check(tmp_path):
    dense = dense_file(tmp_path)
    moe = copy_modeling(tmp_path, source=SMALL_V3)
    before = tree(tmp_path)

    code, stdout, err = run_cli(dense, moe, "--check", "--skip-unrecognised")

    assert code == 1, err
    assert stdout == ""
    summary = "1 file would be rewritten, 1 file skipped"
    assert err.splitlines() == [f"{dense}: {SKIPPED}", err.splitlines()[1], summary]
    assert err.splitlines()[1].startswith(f"would rewrite {moe} (V3 form")
    assert tree(tmp_path) == before


def test_skip_unrecognised_with_out_writes_nothing(tmp_path):
    dense = dense_file(tmp_path)

    code, stdout, err = run_cli(dense, "--out", tmp_path / "out", "--skip-unrecognised")

    assert (code, stdout, err) == (0, "", f"{dense}: {SKIPPED}\n")
    assert not (tmp_path / "out").exists()


NOT_MOE_MESSAGE = "not a DeepSeek-family MoE file: no class defines both forward() and moe_infer()"


def test_without_skip_unrecognised_a_dense_file_is_an_error_and_the_others_are_rewritten(tmp_path):
    dense = dense_file(tmp_path)
    moe = copy_modeling(tmp_path, source=SMALL_V3)
    dense_before = dense.read_bytes()

    code, stdout, err = run_cli(moe, dense, "--in-place")

    assert code == 2 and stdout == ""
    assert err.splitlines()[1] == f"moe-rewrite: error: {dense}: {NOT_MOE_MESSAGE}"
    assert moe.read_text() == patched_text(SMALL_V3) and dense.read_bytes() == dense_before


def _skip_syntax_error(t):
    (t / "broken").mkdir()
    (t / "broken" / MODELING).write_text("def f(:\n    pass\n")
    return t / "broken" / MODELING, ["syntax error"]


def _skip_unrecognised_moe(t):
    (t / "odd").mkdir()
    (t / "odd" / MODELING).write_text(UNRECOGNISED_MOE)
    return t / "odd" / MODELING, ["MoE.forward", "self.gate"]


def _skip_missing(t):
    return t / "gone" / MODELING, ["no such file"]


def _skip_not_utf8(t):
    (t / "latin1").mkdir()
    (t / "latin1" / MODELING).write_bytes(b"# caf\xe9\n")
    return t / "latin1" / MODELING, ["UTF-8"]


@pytest.mark.parametrize("mode", ["--in-place", "--check", "--diff"])
@pytest.mark.parametrize(
    "case",
    [_skip_syntax_error, _skip_unrecognised_moe, _skip_missing, _skip_not_utf8],
    ids=lambda f: f.__name__.removeprefix("_skip_"),
)
def test_skip_unrecognised_other_errors_still_exit_2_for_that_file(tmp_path, case, mode):
    """Only files that are not MoE files at all are skipped; any other error is that file's one line and exit 2,
    while the other files are handled as usual."""
    dense = dense_file(tmp_path)
    moe = copy_modeling(tmp_path, source=SMALL_V3)
    bad, mentions = case(tmp_path)
    before = tree(tmp_path)

    code, stdout, err = run_cli(dense, moe, bad, mode, "--skip-unrecognised")

    assert code == 2 and "Traceback" not in err
    skipped, done, error, summary = err.splitlines()[0], *err.splitlines()[-3:]
    assert skipped == f"{dense}: {SKIPPED}"
    rewritten = "rewritten" if mode == "--in-place" else "would be rewritten"
    assert summary == f"1 file {rewritten}, 1 file skipped, 1 file failed"
    assert done.startswith(f"{'Rewriting' if mode == '--in-place' else 'would rewrite'} {moe}") or mode == "--diff"
    assert error.startswith(f"moe-rewrite: error: {bad}:") and all(m in error for m in mentions), error
    files_before, files_after = before[0], snapshot(tmp_path)
    key = str(moe.relative_to(tmp_path))
    assert (files_after.pop(key) != files_before.pop(key)) == (mode == "--in-place")
    assert files_after == files_before


def test_help_lists_skip_unrecognised():
    code, stdout, _ = run_cli("--help")
    assert code == 0
    assert "--skip-unrecognised" in stdout


@pytest.mark.parametrize("where", ["under-a-file", "dangling-link"])
def test_an_output_directory_that_cannot_be_made_is_a_one_line_error(tmp_path, where):
    if where == "under-a-file":
        (tmp_path / "file.txt").write_text("x")
        out = tmp_path / "file.txt" / "sub"
    else:
        out = tmp_path / "link"
        out.symlink_to(tmp_path / "missing")
    before = snapshot(tmp_path)
    code, _, err = run_cli(PAIRS / "v3_basic.in.py", "--out", out)
    assert code == 2 and err.count("\n") == 1 and err.startswith("moe-rewrite: error:")
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before


def test_unreadable_text_is_named_once(tmp_path):
    bad = tmp_path / "modeling_deepseek.py"
    bad.write_bytes(b"\xff\xfe\x00 not utf-8")
    code, _, err = run_cli(bad, "--check")
    assert code == 2 and err.count(str(bad)) == 1 and "not UTF-8" in err


def test_an_option_that_changes_nothing_says_so(tmp_path):
    """The V2 form checkpoints its decoder layers itself: --gradient-checkpointing (the default) adds nothing, and
    asking for it says so; the V3 form gets it silently."""
    v2 = copy_modeling(tmp_path, "v2.py", SMALL_V2)
    code, _, err = run_cli(v2, "--check", "--gradient-checkpointing")
    assert code == 1 and f"note: --gradient-checkpointing changes nothing in {v2}" in err
    code, _, err = run_cli(v2, "--check")
    assert code == 1 and "note:" not in err
    v3 = copy_modeling(tmp_path, "v3.py")
    code, _, err = run_cli(v3, "--check", "--gradient-checkpointing")
    assert code == 1 and "note:" not in err


def test_env_names_the_versions_the_support_range_and_the_kernel(monkeypatch):
    import importlib.metadata

    import transformers

    from moe_rewrite.env import transformers_support

    code, stdout, err = run_cli("env")
    assert code == 0 and err == "", err
    lines = stdout.splitlines()
    assert f"torch: {importlib.metadata.version('torch')}" in lines
    assert f"transformers: {transformers.__version__}: in the tested range (4.46 to 5.24)" in lines
    assert "grouped_gemm: not installed" in lines
    cpu = "kernel on cpu (bf16, backend auto): sorted: rows sorted by expert, one matmul per expert's slice"
    assert f"{cpu} (activations on the CPU)" in lines
    assert "portable" not in stdout  # the kernel's one name is "sorted"
    assert "older than the tested releases" in transformers_support("4.40.2")
    assert "newer than the tested releases" in transformers_support("6.0.0")
    monkeypatch.setenv("MOE_REWRITE_BACKEND", "loop")
    assert (
        "kernel on cpu (bf16, backend loop): loop: MOE_REWRITE_BACKEND=loop (the per-expert loop)" in run_cli("env")[1]
    )


def test_env_is_a_subcommand_even_where_a_directory_is_named_env(tmp_path, monkeypatch):
    """A virtualenv named env/ in the current directory: `moe-rewrite env` still reports; that directory as a SOURCE
    is written ./env."""
    (tmp_path / "env").mkdir()
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run_cli("env")
    assert code == 0 and err == "" and stdout.startswith("moe-rewrite ") and "\ntorch: " in stdout
    assert_one_line_error(run_cli("env", "--check"), "env takes no arguments", "./env")
    assert_one_line_error(run_cli("./env", "--check"), "env", MODELING)  # the directory, as a SOURCE
    code, stdout, err = run_cli("env", "--help")
    assert code == 0 and stdout.startswith("Usage: moe-rewrite env") and err == ""
    assert list(tmp_path.iterdir()) == [tmp_path / "env"]


def test_env_prints_the_versions_before_importing_torch_or_libcst():
    """The versions come from package metadata: printed at once (0.2 s), before torch (seconds) loads for the kernel
    lines; libcst (1 s) is never imported."""
    probe = (
        "import sys; from moe_rewrite.env import PACKAGES, report; lines = report(); "
        "[next(lines) for _ in range(1 + len(PACKAGES))]; print(sorted({'torch', 'libcst'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "[]\n", proc.stderr


# ---------------------------------------------------------------------------------------------- every reason at once

# A removed import inside a block (compat refuses it) and a statement between the V2 loop's statements (the MoE
# rewrite refuses it): two unrelated reasons, compat's found first.
COMPAT_IN_A_BLOCK = "if True:\n    from transformers.utils.import_utils import is_torch_fx_available\n"
MOE_REASON = "`y = y * 2.0` sits between"
COMPAT_REASON = "compat: `from transformers.utils.import_utils import ...` inside a block; rerun with --no-compat"


def _two_reasons(text: str) -> str:
    loop = "            y = torch.empty_like(hidden_states)\n"
    assert text.count(loop) == 1
    return COMPAT_IN_A_BLOCK + text.replace(loop, loop + "            y = y * 2.0\n")


@pytest.mark.parametrize("mode", ["--in-place", "--check", "--diff", "--out"])
def test_every_reason_is_said_at_once_the_moe_form_one_first(tmp_path, mode):
    path = tmp_path / MODELING
    path.write_text(_two_reasons(SMALL_V2.read_text()))
    before = tree(tmp_path)

    result = run_cli(path, *([mode, tmp_path / "out"] if mode == "--out" else [mode]))

    assert_one_line_error(result, f"{path}: 2 reasons: (1) ", f"; (2) {COMPAT_REASON}")
    assert result[2].index(MOE_REASON) < result[2].index("(2) compat:")
    assert tree(tmp_path) == before
    # each reason alone is the one line it always was
    assert_one_line_error(run_cli(path, "--check", "--no-compat"), f"{path}: DeepseekV2MoE.forward: ", MOE_REASON)
    assert "reasons" not in run_cli(path, "--check", "--no-compat")[2]


def test_a_file_that_is_not_a_moe_file_is_told_that_alone(tmp_path):
    """Not a DeepSeek-family file: nothing else is said about it, and --skip-unrecognised still skips it."""
    dense = tmp_path / MODELING
    dense.write_text(COMPAT_IN_A_BLOCK + "\n\nclass Foo:\n    def forward(self, x):\n        return x\n")
    assert_one_line_error(run_cli(dense, "--check"), f"{dense}: {NOT_MOE_MESSAGE}")
    assert "compat" not in run_cli(dense, "--check")[2]
    assert run_cli(dense, "--check", "--skip-unrecognised") == (0, "", f"{dense}: {SKIPPED}\n1 file skipped\n")
