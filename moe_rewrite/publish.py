"""Write results: atomic file writes, an output checkpoint directory that links (never copies) big files, and a push of
its code and config files to a Hub repo in one commit."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from moe_rewrite import __version__
from moe_rewrite.errors import RewriteError
from moe_rewrite.sources import Source, auto_map_refs, is_hub_code_file, kind_of, parse_json, shown, split_class_ref

# Files copied into an output checkpoint; everything else (weights, index, tokenizer) is linked.
COPIED_SUFFIXES = (".py",)
COPIED_NAMES = ("config.json", "generation_config.json")

# In an output directory: what moe-rewrite wrote there ({"files": {name: sha256}, "links": {name: target}}), so a later
# run replaces only those, and never a file someone else put there (unless --force).
MANIFEST = ".moe-rewrite.json"

# huggingface_hub's client, imported by the first push (tests replace HfApi): the other commands skip its 0.3 s import.
HfApi = None
CommitOperationAdd = None


def is_code_or_config(name: str) -> bool:
    """What a push uploads: the code and the model's config files, never weights, indexes or tokenizer files."""
    return name.endswith(COPIED_SUFFIXES) or name in COPIED_NAMES


@dataclass(frozen=True)
class Checkpoint:
    """An output checkpoint before it is written: the files written (the patched modeling file first) and the links."""

    files: dict[str, bytes]
    links: dict[str, Path]  # name -> the source file it points at

    def code_and_config(self) -> dict[str, bytes]:
        return {name: data for name, data in self.files.items() if is_code_or_config(name)}


def _stage(path: Path, data: bytes, mode_from: Path | None = None) -> Path:
    """`data` in a temp file beside `path`, ready to be renamed over it (removed again if writing fails)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode_from is not None:
            shutil.copymode(mode_from, tmp)
        else:
            os.chmod(tmp, 0o644)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _stage_link(target: Path, path: Path) -> Path:
    tmp = path.parent / f".{path.name}.{os.getpid()}.link"
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    return tmp


def commit_staged(writes: list[tuple[Path, bytes | Path, Path | None]]) -> None:
    """Write every (path, bytes or link target, mode_from) or none: each is first staged in a temp file (or temp link)
    beside its path, and only when all are staged are they renamed into place. A failure or Ctrl-C while staging (disk
    full, a read-only directory) removes the temps and leaves every path as it was; readers never see a half-written
    file."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, content, mode_from in writes:
            tmp = _stage(path, content, mode_from) if isinstance(content, bytes) else _stage_link(content, path)
            staged.append((tmp, path))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in staged:
        os.replace(tmp, path)


def write_atomic(path: Path, data: bytes, mode_from: Path | None = None) -> None:
    """Write to a temp file in the same directory, then os.replace: readers never see a half-written file."""
    commit_staged([(path, data, mode_from)])


def check_out_dir(out: Path, source: Source) -> None:
    """Refuse an output directory that is the source itself or an existing file; before anything is written."""
    if out.is_symlink() and not out.exists():
        raise RewriteError(f"{shown(out)}: is a link to nothing")
    if out.exists() and not out.is_dir():
        raise RewriteError(f"{shown(out)}: exists and is not a directory")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise RewriteError(f"{shown(out)}: cannot be created, {shown(existing)} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RewriteError(f"{shown(out)}: cannot be written ({shown(existing)} is not writable)")
    if source.root is not None and out.resolve() == source.root.resolve():
        raise RewriteError(f"{shown(out)}: is the source checkpoint itself; use --in-place to rewrite it there")
    if source.root is None and out.resolve() == source.modeling_file.parent.resolve():
        raise RewriteError(f"{shown(out)}: holds the source file itself; use --in-place to rewrite it there")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest(out: Path) -> dict:
    if not (out / MANIFEST).is_file():  # none yet (check_out_files refuses a FIFO there: reading it would block)
        return {"files": {}, "links": {}}
    try:
        manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {"files": {}, "links": {}}
    ok = isinstance(manifest, dict) and all(isinstance(manifest.get(k), dict) for k in ("files", "links"))
    return manifest if ok else {"files": {}, "links": {}}


def check_out_files(out: Path, checkpoint: Checkpoint, force: bool) -> None:
    """Refuse to replace what moe-rewrite did not write in `out` (unless `force`): each name it would write or link
    must be absent, hold what moe-rewrite wrote there before (its manifest), or already hold what it would write."""
    if not out.is_dir():
        return
    manifest = _manifest(out)
    theirs = []
    for name, content in [*checkpoint.files.items(), *checkpoint.links.items(), (MANIFEST, None)]:
        path = out / name
        if not (path.exists() or path.is_symlink()):
            continue
        if path.is_dir() and not path.is_symlink():
            raise RewriteError(f"{shown(path)}: is a directory, where moe-rewrite would write its {shown(name)}")
        if not path.is_symlink() and not path.is_file():  # reading a FIFO would block
            raise RewriteError(
                f"{shown(path)}: {kind_of(path.stat().st_mode)}, where moe-rewrite would write its {shown(name)}"
            )
        if name == MANIFEST:
            continue
        if path.is_symlink():
            current = os.readlink(path)
            ours = manifest["links"].get(name) == current or (isinstance(content, Path) and Path(current) == content)
        else:
            try:
                digest = _sha256(path.read_bytes())
            except OSError as e:
                raise RewriteError(f"{shown(path)}: cannot read ({e.strerror})") from None
            ours = manifest["files"].get(name) == digest or (isinstance(content, bytes) and _sha256(content) == digest)
        if not ours:
            theirs.append(name)
    if theirs and not force:
        raise RewriteError(
            f"{shown(out)}: holds {', '.join(map(shown, theirs))}, which moe-rewrite did not write; rerun with --force "
            f"to replace {'them' if len(theirs) > 1 else 'it'}, or choose another --out"
        )


def plan_checkpoint(source: Source, patched: str) -> Checkpoint:
    """The patched modeling file, the other code/config files (config.json's auto_map made local) and links to the rest.

    A Hub source contributes its code and config files only, unless it holds the whole snapshot (--include-weights):
    then, as for a local checkpoint, weights, index and tokenizer files are linked, to the files of the cache snapshot.
    """
    files, links = {source.modeling_file.name: patched.encode("utf-8")}, {}
    if source.root is None:
        return Checkpoint(files, links)
    code_only = source.kind == "hub" and not source.weights
    for entry in sorted(source.root.iterdir()):
        if entry.name.startswith(".") or entry.name in files:
            continue
        if is_code_or_config(entry.name) and entry.exists() and not entry.is_file():  # a FIFO would block
            raise RewriteError(f"{shown(entry)}: {kind_of(entry.stat().st_mode)}, not a regular file")
        if code_only:
            if entry.is_file() and is_hub_code_file(entry.name):
                files[entry.name] = entry.read_bytes()
        elif entry.is_file() and is_code_or_config(entry.name):
            files[entry.name] = entry.read_bytes()
        else:
            try:
                links[entry.name] = (
                    entry.resolve(strict=True) if entry.is_symlink() and source.kind == "dir" else entry.absolute()
                )
            except (OSError, RuntimeError):
                raise RewriteError(f"{shown(entry)}: a link that leads nowhere (missing target or a loop)") from None
    for path in source.external:
        files.setdefault(path.name, path.read_bytes())
    if "config.json" in files:
        files["config.json"] = localize_auto_map(files["config.json"], files, source)
    return Checkpoint(files, links)


def changed_config(source: Source, checkpoint: Checkpoint) -> bytes | None:
    """The checkpoint's config.json when it differs from the source's (auto_map made local), else None."""
    config = source.root / "config.json" if source.root is not None else None
    planned = checkpoint.files.get("config.json")
    if config is None or planned is None or not config.is_file() or planned == config.read_bytes():
        return None
    return planned


def write_checkpoint(out: Path, checkpoint: Checkpoint) -> tuple[list[Path], list[Path]]:
    """Write the files and make the links in `out` (never a link to `out` or a directory holding it), all or none,
    and record them in its manifest. Returns (written, linked); written[0] is the patched modeling file."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(out)
    writes: list[tuple[Path, bytes | Path, Path | None]] = []
    written, linked = [], []
    for name, data in checkpoint.files.items():
        writes.append((out / name, data, None))
        manifest["files"][name] = _sha256(data)
        manifest["links"].pop(name, None)
        written.append(out / name)
    for name, target in checkpoint.links.items():
        if not out.resolve().is_relative_to(target.resolve()):
            writes.append((out / name, target, None))
            manifest["links"][name] = str(target)
            manifest["files"].pop(name, None)
            linked.append(out / name)
    writes.append((out / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8"), None))
    try:
        commit_staged(writes)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)  # only what this run made
        raise
    return written, linked


# ------------------------------------------------------------------------------------------------ config.json auto_map


def _local_ref(ref, key: str, files: dict[str, bytes], source: Source):
    """ "org/name--module.Cls" -> "module.Cls" when module.py is among the written files; other values as they are."""
    if not isinstance(ref, str) or "--" not in ref:
        return ref
    repo, module = split_class_ref(ref)
    if f"{module}.py" not in files:
        if source.kind == "hub":
            raise RewriteError(
                f"{source.spec}: config.json's auto_map {shown(key)} takes {module}.py from {repo}, which has no such "
                "file"
            )
        raise RewriteError(
            f"{shown(source.root / 'config.json')}: auto_map {shown(key)} takes {module}.py from {repo}, and "
            f"{shown(source.root)} has no {module}.py; copy that repo's {module}.py there"
        )
    return ref.rpartition("--")[2]


def localize_auto_map(data: bytes, files: dict[str, bytes], source: Source) -> bytes:
    """config.json with auto_map entries that take code from another repo pointed at the local (patched) files:
    otherwise transformers would load that repo's unpatched code. The bytes as they were when nothing changes;
    else written as the Hub writes it (indent 2, keys in their order, non-ASCII escaped only if it was)."""
    config = parse_json(data, source.root / "config.json" if source.root is not None else "config.json")
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not isinstance(auto_map, dict) or not any(repo for _, repo, _ in auto_map_refs(auto_map)):
        return data
    for key, value in auto_map.items():
        if isinstance(value, list):
            auto_map[key] = [_local_ref(ref, key, files, source) for ref in value]
        else:
            auto_map[key] = _local_ref(value, key, files, source)
    return (json.dumps(config, indent=2, sort_keys=False, ensure_ascii=data.isascii()) + "\n").encode("utf-8")


# ------------------------------------------------------------------------------------------------------ --push-to-hub


@dataclass(frozen=True)
class Push:
    """Where and how --push-to-hub commits."""

    repo_id: str
    message: str
    create_pr: bool = False  # open a pull request instead of committing to the branch
    private: bool = False  # only when the repo is created
    revision: str | None = None  # the branch to commit to (the PR's base with create_pr); None: the default branch
    token: str | None = field(default=None, repr=False)  # never printed: not in repr, redacted from errors


def default_commit_message(options: str) -> str:
    return f"Make the MoE layers trainable (moe-rewrite {__version__}; {options})"


def push_to_hub(push: Push, files: dict[str, bytes]) -> str:
    """Upload `files` to push.repo_id in one commit (a pull request with create_pr); returns its URL.
    The repo is created when missing, except for a pull request, which needs an existing repo."""
    global HfApi, CommitOperationAdd
    if HfApi is None:
        from huggingface_hub import HfApi
    if CommitOperationAdd is None:
        from huggingface_hub import CommitOperationAdd
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data) for name, data in files.items()]
    try:
        api = HfApi(token=push.token)
        if not push.create_pr:
            api.create_repo(push.repo_id, repo_type="model", private=push.private or None, exist_ok=True)
        info = api.create_commit(
            push.repo_id,
            operations,
            commit_message=push.message,
            revision=push.revision,
            create_pr=push.create_pr,
            repo_type="model",
        )
    except Exception as e:
        raise push_error(push, e) from None
    return getattr(info, "pr_url", None) or getattr(info, "commit_url", None) or push.repo_id


def _first_line(e: BaseException, token: str | None) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text.replace(token, "***") if token else text


def _is_network_error(e: BaseException) -> bool:
    """A connection that failed or timed out, as requests (huggingface_hub 0.x) or httpx (1.x) reports it."""
    names = {"ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "ConnectError", "TimeoutException"}
    network = type(e).__module__.startswith(("httpx", "requests", "urllib3"))
    return isinstance(e, (ConnectionError, TimeoutError)) or (
        network and bool(names & {c.__name__ for c in type(e).__mro__})
    )


def _network_reason(e: BaseException) -> str:
    """The reason inside the library's text ("Connection refused", "timed out"), not its object addresses."""
    import re

    text = str(e)
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found.group(1).strip()
    if "timed out" in text.lower() or "Timeout" in type(e).__name__:
        return "timed out"
    return "network error"


def push_error(push: Push, e: Exception) -> Exception:
    """The one-line RewriteError for a failed push (the exception itself when it is not a Hub or network error)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalTokenNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at, status = push.repo_id, getattr(getattr(e, "response", None), "status_code", None)
    pr_hint = "" if push.create_pr else "; propose the change with --create-pr"
    if isinstance(e, GatedRepoError):
        message = "gated repository: request access on the Hub with the account of the token"
    elif isinstance(e, RepositoryNotFoundError):
        message = "repository not found, or the token cannot see it (check --token or `hf auth login`)"
    elif isinstance(e, RevisionNotFoundError):
        message = f"branch {push.revision} not found (create it on the Hub first)"
    elif isinstance(e, LocalTokenNotFoundError) or status == 401:
        message = "not authenticated: pass --token or log in with `hf auth login`"
    elif status == 403:
        message = f"permission denied: the token cannot write to this repository{pr_hint}"
    elif isinstance(e, OfflineModeIsEnabled):
        message = "cannot push while HF_HUB_OFFLINE is set"
    elif _is_network_error(e):
        message = f"cannot reach the Hub ({_network_reason(e)}); nothing was pushed"
    elif isinstance(e, (HfHubHTTPError, OSError, ValueError)) or type(e).__module__.startswith(("httpx", "requests")):
        message = f"push failed ({_first_line(e, push.token)})"
    else:
        return e
    return RewriteError(f"{at}: {message}")
