"""Every Context field a codemod fills for a later one is declared: each codemod touches (`context.<name>`) only the
Context's shared parts (kit.SHARED) and the fields in its READS / PROVIDES, assigns only what it PROVIDES, and
calls a field's accessor (kit.ACCESSORS) only for what it READS, so that rewrite.check_order, which checks the
declarations' order, covers every field read."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import typing

import pytest

from moe_rewrite.codemods import kit
from moe_rewrite.codemods.kit import ACCESSORS, SHARED, Context, Field
from moe_rewrite.rewrite import CODEMODS

FIELDS = set(typing.get_args(Field))
CODEMODS_DIR = pathlib.Path(kit.__file__).parent.parent


def undeclared(source: str, reads: tuple[str, ...], provides: tuple[str, ...]) -> list[str]:
    """What the source does with `context` that its declarations do not allow, a line each."""
    wrong = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "context"):
            continue
        name, line = node.attr, f"line {node.lineno}: context.{node.attr}"
        if name in SHARED:
            continue
        if name in ACCESSORS:
            if ACCESSORS[name] not in reads:
                wrong.append(f"{line} reads {ACCESSORS[name]}, not in READS")
        elif name not in FIELDS:
            wrong.append(f"{line} is neither a Field nor a shared part of the Context")
        elif isinstance(node.ctx, ast.Store) and name not in provides:
            wrong.append(f"{line} is assigned, not in PROVIDES")
        elif name not in {*reads, *provides}:
            wrong.append(f"{line} is in neither READS nor PROVIDES")
    return sorted(wrong, key=lambda line: int(line.split()[1].rstrip(":")))


def test_the_context_is_all_declared():
    """Each of the Context's fields and methods is a Field, a Field's accessor or a shared part."""
    members = {f.name for f in dataclasses.fields(Context)}
    members |= {name for name, _ in inspect.getmembers(Context, inspect.isfunction) if not name.startswith("_")}
    assert members == FIELDS | set(ACCESSORS) | SHARED
    assert set(ACCESSORS.values()) <= FIELDS


@pytest.mark.parametrize("codemod", CODEMODS, ids=lambda c: c.__name__.rsplit(".", 1)[-1])
def test_a_codemod_touches_only_the_context_fields_it_declares(codemod):
    source = pathlib.Path(codemod.__file__).read_text()
    assert undeclared(source, codemod.READS, codemod.PROVIDES) == []


def test_only_codemods_touch_the_context():
    """Their helper modules are handed what they need, not the Context: else their accesses would go unchecked."""
    codemod_files = {pathlib.Path(c.__file__) for c in CODEMODS}
    for path in sorted(CODEMODS_DIR.rglob("*.py")):
        if path in codemod_files or path.name == "context.py":
            continue
        tree = ast.parse(path.read_text())
        uses = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "context"
        ]
        assert uses == [], f"{path.relative_to(CODEMODS_DIR)} touches the Context at lines {uses}"


def test_an_undeclared_access_is_found():
    source = (
        "def transform(module, context):\n"
        "    context.sections.add('x')\n"
        "    context.notes.append(1)\n"
        "    context.sdpa_classes = ()\n"
        "    context.moe_class()\n"
        "    context.attention\n"
    )
    found = undeclared(source, (), ("notes",))
    assert found == [
        "line 4: context.sdpa_classes is assigned, not in PROVIDES",
        "line 5: context.moe_class reads moe, not in READS",
        "line 6: context.attention is neither a Field nor a shared part of the Context",
    ]
    assert undeclared(source.replace("    context.attention\n", ""), ("moe",), ("notes", "sdpa_classes")) == []
    assert undeclared("context.notes", ("moe",), ()) == ["line 1: context.notes is in neither READS nor PROVIDES"]


def test_a_note_is_its_summary_line():
    """The CLI and RewriteResult.attention/loss/norm/rope print notes as these lines; nothing reads their text."""
    left = kit.Note("attention", "DeepseekV3Attention", False, "it does not keep `self.config`")
    assert str(left) == "attention: DeepseekV3Attention left as published: it does not keep `self.config`"
    done = kit.Note("norm", "A, B", True, "fused RMSNorm in A, B (Triton on CUDA; the published norm elsewhere)")
    assert str(done) == "norm: fused RMSNorm in A, B (Triton on CUDA; the published norm elsewhere)"


def test_the_cli_prints_notes_by_their_fields(capsys):
    """Left as published: always said; rewritten: with -v only, whatever the note's text says."""
    from moe_rewrite.cli import Reporter
    from moe_rewrite.options import RewriteOptions
    from moe_rewrite.rewrite import RewriteResult

    notes = (kit.Note("rope", "f", True, "fused f, not left as published: (a test)"), kit.Note("norm", "N", False, "x"))
    result = RewriteResult("", False, "v3", "MoE", "Gate", RewriteOptions(), notes=notes)
    assert result.rope == ("rope: fused f, not left as published: (a test)",) and result.attention == ()
    Reporter(0).attention(result)
    assert capsys.readouterr().err == "  norm: N left as published: x\n"
    Reporter(1).attention(result)
    assert (
        capsys.readouterr().err == "  rope: fused f, not left as published: (a test)\n  norm: N left as published: x\n"
    )
