"""Write results: atomic file writes, and an output checkpoint directory that links (never copies) big files."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from moe_rewrite.errors import RewriteError
from moe_rewrite.sources import Source, is_hub_code_file

# Files copied into an output checkpoint; everything else (weights, index, tokenizer) is linked.
COPIED_SUFFIXES = (".py",)
COPIED_NAMES = ("config.json", "generation_config.json")


def write_atomic(path: Path, data: bytes, mode_from: Path | None = None) -> None:
    """Write to a temp file in the same directory, then os.replace: readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode_from is not None:
            shutil.copymode(mode_from, tmp)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def link_atomic(target: Path, path: Path) -> None:
    tmp = path.parent / f".{path.name}.{os.getpid()}.link"
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def check_out_dir(out: Path, source: Source) -> None:
    """Refuse an output directory that is the source itself or an existing file; before anything is written."""
    if out.exists() and not out.is_dir():
        raise RewriteError(f"{out}: exists and is not a directory")
    if source.root is not None and out.resolve() == source.root.resolve():
        raise RewriteError(f"{out}: is the source checkpoint itself; use --in-place to rewrite it there")
    if source.root is None and out.resolve() == source.modeling_file.parent.resolve():
        raise RewriteError(f"{out}: holds the source file itself; use --in-place to rewrite it there")


def write_checkpoint(out: Path, source: Source, patched: str) -> tuple[list[Path], list[Path]]:
    """Fill `out` with the patched modeling file, copies of the other code/config files and links to the rest.

    A Hub source contributes its code and config files only. Returns (written, linked).
    """
    out.mkdir(parents=True, exist_ok=True)
    written, linked = [out / source.modeling_file.name], []
    write_atomic(written[0], patched.encode("utf-8"))
    if source.root is None:
        return written, linked
    for entry in sorted(source.root.iterdir()):
        if entry.name.startswith(".") or entry.name == source.modeling_file.name or out.resolve().is_relative_to(entry.resolve()):
            continue
        dest = out / entry.name
        if source.kind == "hub":
            if entry.is_file() and is_hub_code_file(entry.name):
                write_atomic(dest, entry.read_bytes())
                written.append(dest)
        elif entry.is_file() and (entry.suffix in COPIED_SUFFIXES or entry.name in COPIED_NAMES):
            write_atomic(dest, entry.read_bytes())
            written.append(dest)
        else:
            link_atomic(entry.resolve() if entry.is_symlink() else entry.absolute(), dest)
            linked.append(dest)
    return written, linked
