"""Nothing a user owns is lost, and no input gives a traceback, a hang or a partial write: --out never replaces a
file moe-rewrite did not write (without --force), tokens never show, hostile files get one line and exit 2, a write
that fails part-way leaves everything as it was, and the file outside the edits stays byte for byte."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from conftest import V2_DIR, V3_DIR, assert_one_line_error, run_cli, snapshot

from moe_rewrite import cli, publish, rewrite_source

SOURCE = (V3_DIR / "modeling_deepseek.py").read_text()


@pytest.fixture
def checkpoint(tmp_path):
    source = tmp_path / "ckpt"
    shutil.copytree(V3_DIR, source)
    (source / "model.safetensors").write_bytes(b"weights")
    return source


def test_out_never_replaces_a_file_moe_rewrite_did_not_write(checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the user's own weights")
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    assert_one_line_error(run_cli(checkpoint, "--out", out), "model.safetensors", "--force")
    assert snapshot(out) == before
    code, _, err = run_cli(checkpoint, "--out", out, "--force")
    assert code == 0, err
    assert (out / "model.safetensors").resolve() == (checkpoint / "model.safetensors").resolve()
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_a_second_run_replaces_what_the_first_wrote_but_not_later_edits(checkpoint, tmp_path):
    out = tmp_path / "out"
    assert run_cli(checkpoint, "--out", out)[0] == 0
    assert run_cli(checkpoint, "--out", out, "--no-fuse-experts")[0] == 0  # our own files: replaced
    assert "rewritten with --no-fuse-experts" in (out / "modeling_deepseek.py").read_text()
    (out / "config.json").write_text('{"edited": true}')
    assert_one_line_error(run_cli(checkpoint, "--out", out), "config.json", "did not write")
    assert (out / "config.json").read_text() == '{"edited": true}'


def test_a_directory_where_a_file_goes_is_refused_before_anything_is_written(checkpoint, tmp_path):
    out = tmp_path / "out"
    (out / "config.json").mkdir(parents=True)
    assert_one_line_error(run_cli(checkpoint, "--out", out), "config.json", "is a directory")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_a_write_that_fails_part_way_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "out"
    calls = []
    real = publish._stage

    def disk_full_on_the_third_file(path, data, mode_from=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data, mode_from)

    monkeypatch.setattr(publish, "_stage", disk_full_on_the_third_file)
    assert_one_line_error(run_cli(checkpoint, "--out", out), "No space left on device", "nothing was written")
    assert not out.exists()


def test_in_place_over_several_files_each_succeeds_or_fails_on_its_own(tmp_path, monkeypatch):
    """One file that cannot be written (or is refused) does not stop the others, is reported in one line and left
    as it was, without a temp file; the run exits 2."""
    first, second, third = (tmp_path / name / "modeling_deepseek.py" for name in ("a", "b", "c"))
    for path, src in ((first, V3_DIR), (second, V2_DIR), (third, V2_DIR)):
        path.parent.mkdir()
        shutil.copy(src / "modeling_deepseek.py", path)
    third.write_text(third.read_text() + "\ndef broken(:\n")
    before = {p: p.read_bytes() for p in (first, second, third)}
    real = publish._stage

    def disk_full_for_second(path, data, mode_from=None):
        if path == second:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data, mode_from)

    monkeypatch.setattr(publish, "_stage", disk_full_for_second)
    code, out, err = run_cli(first, second, third, "--in-place")
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert (
        len(lines) == 4 and lines[0].startswith(f"Rewriting {first}") and lines[3] == "1 file rewritten, 2 files failed"
    )
    assert lines[1] == f"moe-rewrite: error: {second}: No space left on device"
    assert lines[2].startswith(f"moe-rewrite: error: {third}: syntax error at line")
    assert first.read_bytes() != before[first] and b"def moe_train(" in first.read_bytes()
    assert second.read_bytes() == before[second] and third.read_bytes() == before[third]
    assert sorted(p.name for p in second.parent.iterdir()) == ["modeling_deepseek.py"]  # no temp file left
    monkeypatch.setattr(cli.os, "access", lambda path, mode: Path(path) != second.resolve())
    assert_one_line_error(run_cli(second, "--in-place"), str(second), "not writable")
    assert second.read_bytes() == before[second]


def test_tokens_never_show(checkpoint, tmp_path, monkeypatch, capsys):
    secret = "hf_SECRETsecret"
    code, out, err = run_cli(checkpoint, "--out", tmp_path / "o", "--token", f"{secret}\r\nX-Injected: 1")
    assert code == 2 and secret not in out + err and "--token" in err
    assert not (tmp_path / "o").exists()
    # whatever a library puts in an error message (a header echoed back, a URL), the token is masked
    assert cli._error(f"Hub said: bad header 'Bearer {secret}'", cli._secrets(["--token", secret])) == 2
    monkeypatch.setenv("HF_TOKEN", "hf_fromTheEnvironment")
    assert cli._error("request with hf_fromTheEnvironment failed", []) == 2
    err = capsys.readouterr().err
    assert secret not in err and "hf_fromTheEnvironment" not in err and err.count("***") == 2


def test_hostile_sources_get_one_line_and_exit_2(tmp_path):
    cases = {
        "nested": SOURCE + "\nX = " + "(" * 2000 + "1" + ")" * 2000 + "\n",
        "long_chain": SOURCE + "\nX = " + " + ".join(["1"] * 500) + "\n",
        "syntax": SOURCE + "\ndef broken(:\n",
    }
    for name, text in cases.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        code, out, err = run_cli(path, "--check")
        assert "Traceback" not in err and err.count("\n") <= 1 + (name == "long_chain"), (name, err)  # + summary
        if name == "long_chain":
            assert code == 1, err  # deep but legal: rewritten (would change)
        else:
            assert_one_line_error((code, out, err), str(path))


def test_fifo_symlink_loop_and_broken_config_in_a_checkpoint(checkpoint, tmp_path):
    fifo_dir = tmp_path / "fifo"
    shutil.copytree(checkpoint, fifo_dir)
    (fifo_dir / "config.json").unlink()
    os.mkfifo(fifo_dir / "config.json")
    assert_one_line_error(run_cli(fifo_dir, "--out", tmp_path / "o1"), "config.json", "not a regular file")
    loop_dir = tmp_path / "loop"
    shutil.copytree(checkpoint, loop_dir)
    os.symlink(loop_dir / "b.bin", loop_dir / "a.bin")
    os.symlink(loop_dir / "a.bin", loop_dir / "b.bin")
    assert_one_line_error(run_cli(loop_dir, "--out", tmp_path / "o2"), "a.bin")
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "config.json").write_text('{"auto_map": ')
    assert_one_line_error(run_cli(broken, "--out", tmp_path / "o3"), "config.json", "not valid JSON")
    for name in ("o1", "o2", "o3"):
        assert not (tmp_path / name).exists()


def test_include_weights_with_a_local_checkpoint_is_refused(checkpoint, tmp_path):
    assert_one_line_error(run_cli(checkpoint, "--out", tmp_path / "o", "--include-weights"), "--include-weights")


def test_bom_final_cr_and_user_names_with_the_generated_prefix_are_kept():
    text = "\ufeffMOE_REWRITE_DEBUG = False\n" + SOURCE + "\r"
    once = rewrite_source(text).text
    assert once.startswith("\ufeffMOE_REWRITE_DEBUG = False\n") and once.endswith("\r") and not once.endswith("\n\r\n")
    assert rewrite_source(once).text == once
    assert once.count("MOE_REWRITE_DEBUG = False") == 1


def test_ctrl_c_while_writing_leaves_no_temp_file_and_no_output(checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "out"
    calls = []
    real = publish._stage

    def interrupted_on_the_second_file(path, data, mode_from=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, data, mode_from)

    monkeypatch.setattr(publish, "_stage", interrupted_on_the_second_file)
    code, _, err = run_cli(checkpoint, "--out", out)
    assert code != 0 and "aborted" in err and "Traceback" not in err
    assert not out.exists()
    assert snapshot(checkpoint) == snapshot(V3_DIR) | {"model.safetensors": b"weights"}


@pytest.mark.parametrize("verbose", [False, True])
def test_a_bug_in_moe_rewrite_says_so_exits_3_and_writes_nothing(checkpoint, tmp_path, monkeypatch, verbose):
    """A codemod failing on its own assumptions is moe-rewrite's bug, not the file's: one line saying so (the
    traceback before it only with -v), exit 3, nothing written."""
    from moe_rewrite import __version__
    from moe_rewrite.codemods.moe import gate

    def broken(module, context):
        raise TypeError("'NoneType' object is not subscriptable")

    monkeypatch.setattr(gate, "transform", broken)
    before = snapshot(tmp_path)
    code, out, err = run_cli(checkpoint, "--out", tmp_path / "out", *(["-v"] if verbose else []))
    assert code == 3 and out == ""
    *traceback, line = err.rstrip("\n").split("\n")
    assert line == (
        f"moe-rewrite {__version__}: internal error (TypeError: 'NoneType' object is not subscriptable) while "
        f"rewriting {checkpoint / 'modeling_deepseek.py'}; this is a bug in moe-rewrite, please report it"
    )
    if verbose:
        assert traceback[0] == "Traceback (most recent call last):" and "in broken" in err
    else:
        assert traceback == []
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------- paths outside the checkpoint

CAUSAL_LM = "DeepseekV3ForCausalLM"


def _with_auto_map(checkpoint: Path, key: str, ref) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["auto_map"][key] = ref
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize(
    "ref",
    [
        f"../outside.{CAUSAL_LM}",  # a file beside the checkpoint
        "{tmp}/outside." + CAUSAL_LM,  # an absolute path
        f"other_pkg.modeling.{CAUSAL_LM}",  # a dotted module: another package
        f"sub/modeling_deepseek.{CAUSAL_LM}",  # a subdirectory: --out would link it unpatched
        f"{{tmp}}--outside.{CAUSAL_LM}",  # another directory's code, in the repo--module form
        f"a/b--c/d--modeling_deepseek.{CAUSAL_LM}",  # transformers splits on the one "--"
        7,
    ],
    ids=["parent", "absolute", "dotted", "subdirectory", "directory_repo", "two_repos", "not_a_string"],
)
@pytest.mark.parametrize("key", ["AutoModelForCausalLM", "AutoConfig"])
@pytest.mark.parametrize("mode", ["--in-place", "--out", "--check"])
def test_auto_map_naming_code_outside_the_checkpoint_is_refused(checkpoint, tmp_path, ref, key, mode):
    """--in-place must not rewrite a file outside the checkpoint, nor --out write a config transformers cannot load:
    only MODULE.py beside config.json (or a Hub repo's, which --out makes local) is followed."""
    outside = tmp_path / "outside.py"
    shutil.copyfile(V3_DIR / "modeling_deepseek.py", outside)
    (checkpoint / "sub").mkdir()
    shutil.copyfile(V3_DIR / "modeling_deepseek.py", checkpoint / "sub" / "modeling_deepseek.py")
    _with_auto_map(checkpoint, key, ref.replace("{tmp}", str(tmp_path)) if isinstance(ref, str) else ref)
    before = snapshot(tmp_path)
    args = [checkpoint, mode, *([tmp_path / "out"] if mode == "--out" else [])]
    assert_one_line_error(run_cli(*args), f"{checkpoint / 'config.json'}: auto_map {key}: ")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_tokenizer_without_a_slow_class_and_a_hub_repos_module_are_followed(checkpoint, tmp_path):
    _with_auto_map(checkpoint, "AutoTokenizer", [None, "tokenization_deepseek.Tok"])
    _with_auto_map(checkpoint, "AutoConfig", "org/name--configuration_deepseek.DeepseekV3Config")
    code, _, err = run_cli(checkpoint, "--out", tmp_path / "out")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]["AutoConfig"] == (
        "configuration_deepseek.DeepseekV3Config"
    )


def test_in_place_on_a_checkpoint_whose_modeling_file_links_outside_is_refused(checkpoint, tmp_path):
    """A checkpoint whose modeling file is a link into another tree (a Hub cache's blobs): --in-place would rewrite
    that tree's file; --out still works."""
    elsewhere = tmp_path / "blobs" / "modeling_deepseek.py"
    elsewhere.parent.mkdir()
    (checkpoint / "modeling_deepseek.py").rename(elsewhere)
    (checkpoint / "modeling_deepseek.py").symlink_to(elsewhere)
    before = snapshot(tmp_path)
    assert_one_line_error(run_cli(checkpoint, "--in-place"), "outside the checkpoint", str(elsewhere), "--out")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------- empty paths, FIFOs, deep JSON, odd names


class Hung(BaseException):
    """Raised by the alarm: a run that blocks (on a FIFO) fails the test instead of hanging it. A BaseException, so
    that no `except OSError` in the code under test turns it into an error line."""


@pytest.fixture
def no_hang():
    def hung(signum, frame):
        raise Hung("the run blocked for 20 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_an_empty_out_or_source_is_refused(checkpoint, tmp_path, monkeypatch):
    """`--out "$OUTDIR"` with OUTDIR unset must not write into the current directory."""
    monkeypatch.chdir(checkpoint)
    before = snapshot(tmp_path)
    assert_one_line_error(run_cli(checkpoint, "--out", ""), "--out", "empty path")
    assert_one_line_error(run_cli("", "--in-place"), "SOURCE", "empty path")
    assert_one_line_error(run_cli("", "--out", tmp_path / "out"), "SOURCE", "empty path")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("mode", ["--in-place", "--check", "--out"])
def test_a_fifo_as_config_json_in_the_source_is_named_and_never_read(checkpoint, tmp_path, mode, no_hang):
    (checkpoint / "config.json").unlink()
    os.mkfifo(checkpoint / "config.json")
    before = snapshot(tmp_path)
    args = [checkpoint, mode, *([tmp_path / "out"] if mode == "--out" else [])]
    assert_one_line_error(run_cli(*args), str(checkpoint / "config.json"), "a FIFO (named pipe), not a regular file")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["config.json", "modeling_deepseek.py", ".moe-rewrite.json"])
def test_a_fifo_in_out_is_named_and_never_read(checkpoint, tmp_path, name, no_hang):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / name)
    assert_one_line_error(run_cli(checkpoint, "--out", out), str(out / name), "a FIFO", "where moe-rewrite would write")
    assert [p.name for p in out.iterdir()] == [name]


def test_a_fifo_as_source_or_modeling_file_says_what_it_is(checkpoint, tmp_path, no_hang):
    fifo = tmp_path / "modeling.py"
    os.mkfifo(fifo)
    assert_one_line_error(run_cli(fifo, "--check"), str(fifo), "a FIFO (named pipe)", "not a .py file or a checkpoint")
    (checkpoint / "modeling_deepseek.py").unlink()
    os.mkfifo(checkpoint / "modeling_deepseek.py")
    assert_one_line_error(run_cli(checkpoint, "--in-place"), "modeling_deepseek.py", "a FIFO", "not a regular file")


@pytest.mark.parametrize("mode", ["--in-place", "--out"])
def test_a_config_json_nested_too_deeply_is_one_line(checkpoint, tmp_path, mode):
    (checkpoint / "config.json").write_text("[" * 100000)
    before = snapshot(tmp_path)
    args = [checkpoint, mode, *([tmp_path / "out"] if mode == "--out" else [])]
    assert_one_line_error(run_cli(*args), str(checkpoint / "config.json"), "not valid JSON")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_control_characters_in_file_names_are_escaped_on_the_one_line(tmp_path):
    """A newline (or an escape) in a name must not split the one-line output, nor leave the name ambiguous."""
    odd = tmp_path / "odd\ndir\x1b[31m"
    odd.mkdir()
    (odd / "broken.py").write_text("def f(:\n")
    code, out, err = run_cli(odd / "broken.py", "--check")
    assert_one_line_error((code, out, err), f"{tmp_path}/odd\\ndir\\x1b[31m/broken.py: syntax error")
    assert_one_line_error(run_cli(odd, "--check"), f"{tmp_path}/odd\\ndir\\x1b[31m: no modeling_deepseek.py")
    small = odd / "new\nline.py"
    shutil.copyfile(Path(__file__).parent / "pairs" / "v3_basic.in.py", small)
    code, out, err = run_cli(small, "--in-place")
    assert code == 1 and out == "" and len(err.splitlines()) == 2 and err.endswith("\n1 file rewritten\n"), err
    assert err.startswith(f"Rewriting {tmp_path}/odd\\ndir\\x1b[31m/new\\nline.py (V3 form")
