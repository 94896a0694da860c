"""The layout of moe_rewrite/runtime/: one section list (runtime/__init__.py's SECTION_LIST) that the files, the
sub-packages' docstrings and render.py agree with, and one-way layering of the packages (PACKAGES: a section imports
only sections of its own package or of the packages before it)."""

from __future__ import annotations

import ast
from pathlib import Path

from moe_rewrite import render
from moe_rewrite.runtime import BY_NAME, PACKAGES, SECTION_LIST

RUNTIME = Path(render.__file__).parent / "runtime"

# (importing section, imported section) -> why the import goes against the layering. None today; an entry here is a
# known debt, to be paid by moving the shared piece down.
ALLOWED_BACKWARD: dict[tuple[str, str], str] = {}


def _sections_on_disk() -> dict[str, str]:
    """{file stem: package} for every module under runtime/ but the packages' __init__.py."""
    found = {}
    for path in RUNTIME.rglob("*.py"):
        if path.name != "__init__.py":
            assert path.parent.parent == RUNTIME, f"{path}: a section lives in runtime/<package>/"
            assert path.stem not in found, f"two files named {path.stem}.py"
            found[path.stem] = path.parent.name
    return found


def test_every_file_is_listed_and_every_listed_section_is_a_file():
    assert len(BY_NAME) == len(SECTION_LIST), "a section name listed twice"
    assert _sections_on_disk() == {entry.name: entry.package for entry in SECTION_LIST}
    assert sorted(p.name for p in RUNTIME.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(PACKAGES)
    assert all((RUNTIME / package / "__init__.py").is_file() for package in PACKAGES)
    assert {entry.package for entry in SECTION_LIST} == set(PACKAGES)


def test_render_derives_from_the_list():
    assert list(render.SECTIONS) == [entry.name for entry in SECTION_LIST if not entry.fallback]
    assert all(render.SECTIONS[entry.name] == entry.does for entry in SECTION_LIST if not entry.fallback)
    assert render.CORE_SECTIONS == {entry.name for entry in SECTION_LIST if entry.core}
    assert all(render.section_file(entry.name).is_file() for entry in SECTION_LIST)
    assert {BY_NAME[name].package for name in render.CORE_SECTIONS} == {"kernels", "moe"}


def _imports(entry) -> list[tuple[int, ast.ImportFrom]]:
    tree = ast.parse(render.section_file(entry.name).read_text(encoding="utf-8"))
    return [(node.lineno, node) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]


def test_sections_import_only_sections_of_their_package_or_earlier_ones():
    wrong, seen = [], set()
    for entry in SECTION_LIST:
        for line, node in _imports(entry):
            parts = (node.module or "").split(".")
            target = [entry.package, *parts] if node.level == 1 else parts if node.level == 2 else []
            where = f"runtime/{entry.package}/{entry.name}.py:{line}"
            if len(target) != 2 or target[1] not in BY_NAME or BY_NAME[target[1]].package != target[0]:
                wrong.append(f"{where}: a relative import that names no section ({'.' * node.level}{node.module})")
                continue
            imported = BY_NAME[target[1]]
            if PACKAGES.index(imported.package) > PACKAGES.index(entry.package):
                seen.add((entry.name, imported.name))
                if (entry.name, imported.name) not in ALLOWED_BACKWARD:
                    later = f"{imported.package}/{imported.name}"
                    wrong.append(f"{where}: {entry.package}/ imports {later}, of a later package")
    assert wrong == []
    assert set(ALLOWED_BACKWARD) <= seen, "an allowed exception that no longer occurs: remove it"


def _docstring_lines(path: Path) -> list[str]:
    return (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or "").splitlines()


def test_each_package_docstring_lists_its_sections():
    """One line per section, `    name: what it does`, as in SECTION_LIST and in its order."""
    for package in PACKAGES:
        lines = _docstring_lines(RUNTIME / package / "__init__.py")
        listed = [line for line in lines if line.startswith("    ")]
        expected = [f"    {entry.name}: {entry.does}" for entry in SECTION_LIST if entry.package == package]
        assert listed == expected, f"runtime/{package}/__init__.py"


def test_the_runtime_docstring_names_the_packages_in_layering_order():
    lines = _docstring_lines(RUNTIME / "__init__.py")
    named = [line.split()[0] for line in lines if line.startswith("    ") and not line.startswith("     ")]
    assert named == list(PACKAGES)
