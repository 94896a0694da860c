"""SOURCE -> files: a Hub repo id (through huggingface_hub), a local checkpoint directory, or a .py file."""

from __future__ import annotations

import ast
import json
import re
import stat
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from moe_rewrite.errors import RewriteError

DEFAULT_MODELING_FILE = "modeling_deepseek.py"
# What trust_remote_code loading needs from a Hub repo: code and config, never weights.
HUB_CODE_PATTERNS = ["*.py", "*.json"]
HUB_IGNORE_PATTERNS = ["*.index.json"]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A model page's address, as pasted from a browser: https://huggingface.co/org/name[/tree/REVISION[/...]]
HUB_URL = re.compile(
    r"^(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/(?P<repo>[^/?#]+/[^/?#]+)"
    r"(?:/(?:tree|blob|resolve)/(?P<revision>[^/?#]+))?(?:[/?#].*)?$"
)


def shown(path) -> str:
    """A path (or any name) as messages show it: as it is, except for control characters (a newline, a tab, an escape
    in a file name), written as Python escapes them, so that a message stays one line and says what the name holds."""
    text = str(path)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def kind_of(mode: int) -> str:
    """What a file that is neither a regular file nor a directory is, for messages."""
    kinds = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device"}
    return next((name for test, name in kinds.items() if test(mode)), "a special file")


def hub_repo(spec: str, revision: str | None = None) -> tuple[str, str | None] | None:
    """(repo id, revision) when `spec` names a Hub model repo, by id (org/name) or by its page's URL (whose
    /tree/REVISION gives the revision); None for anything else. A local path of that shape is not a repo."""
    if Path(spec).exists():
        return None
    found = HUB_URL.match(spec)
    if found is None:
        return (spec, revision) if REPO_ID.match(spec) else None
    repo, in_url = found.group("repo"), found.group("revision")
    if repo.split("/")[0] in ("datasets", "spaces") or not REPO_ID.match(repo):
        raise RewriteError(f"{shown(spec)}: not a Hub model repository")
    if revision is not None and in_url is not None and revision != in_url:
        raise RewriteError(f"{shown(spec)}: names revision {shown(in_url)}, but --revision says {shown(revision)}")
    return repo, revision or in_url


def is_hub_code_file(name: str) -> bool:
    return any(fnmatch(name, p) for p in HUB_CODE_PATTERNS) and not any(fnmatch(name, p) for p in HUB_IGNORE_PATTERNS)


@dataclass(frozen=True)
class Source:
    spec: str  # what the user typed
    kind: str  # "file", "dir" or "hub"
    modeling_file: Path
    root: Path | None  # the checkpoint directory (local, or the Hub snapshot); None for a bare file
    weights: bool = False  # a Hub snapshot with every file (--include-weights), not only code and config
    # Code that config.json's auto_map takes from other Hub repos ("org/name--module.Class") and root lacks.
    external: tuple[Path, ...] = ()
    revision: str | None = None  # a Hub source's --revision
    # The auto_map module that imports modeling_file relatively, when that is where the MoE classes are.
    via: str | None = None

    @property
    def name(self) -> str:
        """The modeling file as messages name it: its path, or for a Hub source `org/name@REV/file`, not the Hub
        cache's snapshot path (REV: the --revision given, else the commit the snapshot holds)."""
        if self.kind != "hub" or self.root is None:
            return shown(self.modeling_file)
        snapshot = self.modeling_file.parent
        if snapshot != self.root:  # taken from another repo (auto_map): the cache names it models--org--name
            repo = snapshot.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
            return shown(f"{repo}@{snapshot.name[:12]}/{self.modeling_file.name}")
        return shown(f"{self.spec}@{self.revision or self.root.name[:12]}/{self.modeling_file.name}")

    def read(self) -> str:
        return read_text(self.modeling_file)


def read_text(path: Path) -> str:
    """A file's text with its line endings kept as they are (CRLF stays CRLF); only regular files are read (a FIFO
    would block)."""
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise RewriteError(f"{shown(path)}: {kind_of(mode)}, not a regular file")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise RewriteError(f"{shown(path)}: not UTF-8 text") from None
    except OSError as e:
        raise RewriteError(f"{shown(path)}: cannot read ({e.strerror})") from None


def parse_json(text: str | bytes, path) -> object:
    """JSON as json.loads reads it; text that is not JSON, or nests too deeply for the parser (100000 `[`), is a
    one-line error naming `path`."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise RewriteError(f"{shown(path)}: not valid JSON ({e})") from None
    except RecursionError:
        raise RewriteError(f"{shown(path)}: not valid JSON (nested too deeply)") from None


# How transformers reads an auto_map entry (dynamic_module_utils.get_class_from_dynamic_module, 4.46 to 5.x): an
# optional "REPO--" (then the code is that repo's; split on "--"), then "MODULE.CLASS", split on its one "."; MODULE.py
# is joined to the checkpoint's path (or REPO's). So "../x.C" and "pkg.mod.C" do not load, "/abs.C" and "sub/m.C" read
# files outside the checkpoint's top level, and "/a/dir--m.C" another directory's code. moe-rewrite follows MODULE.py
# beside config.json only, or a Hub repo's (REPO an org/name), whose code --out makes local.
MODULE = re.compile(r"^[^./\\\s\x00-\x1f\x7f]+$")  # a file name: no path, no space or control character


def _ref_problem(ref: object) -> str | None:
    """Why moe-rewrite does not follow an auto_map class reference, or None."""
    if ref is None:  # a tokenizer's missing slow or fast class
        return None
    if not isinstance(ref, str):
        return f"a JSON {type(ref).__name__}, not a class reference (MODULE.CLASS)"
    *repo, local = ref.split("--")
    parts = local.split(".")
    if len(repo) > 1 or (repo and not REPO_ID.match(repo[0])) or len(parts) != 2 or not MODULE.match(parts[0]):
        return (
            f"{shown(repr(ref))} is not MODULE.CLASS with MODULE.py beside config.json, nor ORG/NAME--MODULE.CLASS: "
            "moe-rewrite follows only modules in the checkpoint"
        )
    return None


def read_config(root: Path | None) -> dict | None:
    """config.json as a dict (None without a checkpoint directory or config.json; read_auto_map has checked it)."""
    path = None if root is None else root / "config.json"
    if path is None or not (path.exists() or path.is_symlink()):
        return None
    config = parse_json(read_text(path), path)
    return config if isinstance(config, dict) else None


def read_auto_map(root: Path) -> dict:
    """config.json's auto_map, every class reference checked ({} without config.json or auto_map). A config.json that
    is not a regular file or not JSON, and a reference to code outside the checkpoint (or one transformers cannot
    read) are one-line errors: --in-place must not rewrite a file outside the checkpoint, nor --out write a config
    transformers cannot load."""
    path = root / "config.json"
    if not (path.exists() or path.is_symlink()):
        return {}
    config = parse_json(read_text(path), path)
    if not isinstance(config, dict):
        raise RewriteError(f"{shown(path)}: not a JSON object")
    auto_map = config.get("auto_map", {})
    if not isinstance(auto_map, dict):
        raise RewriteError(f"{shown(path)}: auto_map is not a JSON object")
    for key, value in auto_map.items():
        for ref in value if isinstance(value, list) else [value]:
            problem = _ref_problem(ref)
            if problem is not None:
                raise RewriteError(f"{shown(path)}: auto_map {shown(key)}: {problem}")
    return auto_map


def split_class_ref(ref: str) -> tuple[str | None, str]:
    """An auto_map class reference -> (repo or None, module): "org/name--mod.Cls" -> ("org/name", "mod")."""
    repo, _, local = ref.rpartition("--")
    return repo or None, local.rsplit(".", 1)[0]


def auto_map_refs(auto_map: dict) -> list[tuple[str, str | None, str]]:
    """Every class reference as (auto_map key, repo or None, module); tokenizer entries are lists (slow, fast)."""
    refs = []
    for key, value in auto_map.items():
        for ref in value if isinstance(value, list) else [value]:
            if isinstance(ref, str) and "." in ref:
                refs.append((key, *split_class_ref(ref)))
    return refs


def modeling_file_name(root: Path) -> str:
    """The modeling module config.json's auto_map points at, else modeling_deepseek.py."""
    auto_map = read_auto_map(root)
    for key in ("AutoModelForCausalLM", "AutoModel"):
        ref = auto_map.get(key)
        if isinstance(ref, str) and "." in ref:
            return f"{split_class_ref(ref)[1]}.py"
    return DEFAULT_MODELING_FILE


def _foreign_repo_of(root: Path, file_name: str) -> str | None:
    """The other repo config.json's auto_map takes the module `file_name` from, if any."""
    refs = auto_map_refs(read_auto_map(root))
    return next((repo for _, repo, module in refs if repo and f"{module}.py" == file_name), None)


def _from_dir(
    spec: str, root: Path, kind: str, weights: bool = False, external: tuple[Path, ...] = (), revision=None
) -> Source:
    name = modeling_file_name(root)
    path = root / name
    if path.exists() and not path.is_file():
        read_text(path)  # a FIFO or a device: one line saying what it is
    if not path.is_file():
        path = next((p for p in external if p.name == name), None)
    if path is None:
        where = "repository" if kind == "hub" else "directory"
        repo = _foreign_repo_of(root, name)
        hint = f" (config.json's auto_map takes it from {repo}: put that repo's {name} here)" if repo else ""
        raise RewriteError(f"{shown(spec)}: no {shown(name)} in this {where}{hint}")
    moe_file = imported_moe_file(path, (*(p for p in root.iterdir() if p.suffix == ".py"), *external))
    via = None if moe_file == path else path.name
    return Source(spec, kind, moe_file, root, weights=weights, external=external, revision=revision, via=via)


# ------------------------------------------------------------------------------------- a wrapper's relative imports


def _syntax_tree(path: Path) -> ast.Module:
    try:
        return ast.parse(read_text(path), filename=str(path))
    except (SyntaxError, ValueError, RecursionError) as e:
        raise RewriteError(f"{shown(path)}: not valid Python ({e.__class__.__name__})") from None


def holds_moe_class(tree: ast.Module) -> bool:
    """A module-level class defining both forward() and moe_infer(): what the MoE codemod rewrites."""
    return any(
        isinstance(node, ast.ClassDef)
        and {"forward", "moe_infer"} <= {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        for node in tree.body
    )


def _relative_modules(tree: ast.Module, path: Path) -> list[str]:
    """The modules `path` imports relatively (`from .mod import X`, `from . import mod`), as file names; one beyond
    the checkpoint (`from ..x`, `from .pkg.mod`) is a one-line error: transformers copies only the top level."""
    names = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        dots = "." * node.level
        if node.level > 1 or (node.module and "." in node.module):
            raise RewriteError(
                f"{shown(path)}: imports {dots}{node.module or ''} relatively, outside the checkpoint's top level; "
                "moe-rewrite follows modules beside config.json only"
            )
        modules = [node.module] if node.module else [a.name for a in node.names]
        names += [f"{module}.py" for module in modules]
    return names


def imported_moe_file(path: Path, candidates: tuple[Path, ...]) -> Path:
    """The file holding the MoE classes: `path` itself, or the one file that `path` reaches through relative imports
    among `candidates` (the checkpoint's .py files), as transformers loads a wrapper (DeepSeek-OCR's
    modeling_deepseekocr.py imports `.modeling_deepseekv2`). Read as syntax trees only, never imported. `path` when
    no file reached holds them (the rewrite then says it is not a MoE file); several are a one-line error."""
    tree = _syntax_tree(path)
    if holds_moe_class(tree):
        return path
    by_name = {p.name: p for p in reversed(candidates)}  # the checkpoint's own before another repo's
    seen, queue, found = {path.name}, [(path, tree)], []
    while queue:
        importer, tree = queue.pop(0)
        for name in _relative_modules(tree, importer):
            if name in seen:
                continue
            seen.add(name)
            module = by_name.get(name)
            if module is None or not module.is_file():
                raise RewriteError(
                    f"{shown(importer)}: imports .{name.removesuffix('.py')}, and the checkpoint has no {shown(name)}"
                )
            module_tree = _syntax_tree(module)
            if holds_moe_class(module_tree):
                found.append(module)
            queue.append((module, module_tree))
    if len(found) > 1:
        raise RewriteError(
            f"{shown(path)}: imports several MoE files relatively ({', '.join(shown(p.name) for p in found)}); "
            "rewrite each as SOURCE on its own (--in-place)"
        )
    return found[0] if found else path


def fetch_referenced_code(spec: str, root: Path, token: str | None) -> tuple[Path, ...]:
    """Code that config.json's auto_map takes from other Hub repos and `root` lacks: those repos' top-level .py files
    (the referenced modules and what they import relatively), at their default branch, as transformers fetches them."""
    refs = auto_map_refs(read_auto_map(root))
    repos = sorted({repo for _, repo, module in refs if repo and not (root / f"{module}.py").is_file()})
    found: dict[str, Path] = {}
    for repo in repos:
        try:
            snapshot = download_snapshot(repo, None, token)
        except RewriteError as e:
            raise RewriteError(f"{shown(spec)}: config.json's auto_map takes code from {e}") from None
        for path in sorted(snapshot.glob("*.py")):
            if not (root / path.name).exists():
                found.setdefault(path.name, path)
    return tuple(found.values())


def resolve(spec: str, revision: str | None = None, token: str | None = None, weights: bool = False) -> Source:
    if not spec:
        raise RewriteError("SOURCE is an empty path (an unset variable?); name a checkpoint, a .py file or a repo id")
    path = Path(spec)
    if revision is not None and path.exists():
        raise RewriteError(f"{shown(spec)}: --revision applies to Hub repo ids, not to local paths")
    if weights and path.exists():
        raise RewriteError(f"{shown(spec)}: --include-weights needs a Hub repo id (a checkpoint's are linked anyway)")
    if path.is_dir():
        return _from_dir(spec, path, "dir")
    if path.exists() and not path.is_file():
        raise RewriteError(f"{shown(spec)}: {kind_of(path.stat().st_mode)}, not a .py file or a checkpoint directory")
    if path.is_file():
        if path.suffix != ".py":
            raise RewriteError(f"{shown(spec)}: not a .py file, a checkpoint directory or a Hub repo id")
        return Source(spec=spec, kind="file", modeling_file=path, root=None)
    repo = hub_repo(spec, revision)
    if path.suffix == ".py" or repo is None:
        raise RewriteError(f"{shown(spec)}: no such file or directory")
    spec, revision = repo
    root = download_snapshot(spec, revision, token, weights)
    return _from_dir(spec, root, "hub", weights, fetch_referenced_code(spec, root, token), revision)


# A Hub that accepts connections and never answers must not hang the command: after HUB_PATIENCE seconds it says it
# is waiting, after HUB_DEADLINE it falls back to the cached snapshot (or fails, naming HF_HUB_OFFLINE=1).
HUB_PATIENCE = 5.0
HUB_DEADLINE = 60.0


def _hub_deadline() -> float:
    """HUB_DEADLINE, or MOE_REWRITE_HUB_TIMEOUT seconds."""
    import os

    try:
        return float(os.environ.get("MOE_REWRITE_HUB_TIMEOUT") or HUB_DEADLINE)
    except ValueError:
        raise RewriteError("MOE_REWRITE_HUB_TIMEOUT: not a number of seconds") from None


def download_snapshot(repo_id: str, revision: str | None, token: str | None, weights: bool = False) -> Path:
    """The repo's code and config files (with `weights`, every file, shown with huggingface_hub's progress bars) in
    the Hub cache (honours HF_HUB_OFFLINE and the cache), as a snapshot dir.

    The code-and-config fetch runs in a worker thread: after HUB_PATIENCE seconds without an answer a line says that
    the Hub is being contacted; with no answer after the deadline the cached snapshot is used, with a line saying so,
    or the command fails with one line. With `weights` that fetch comes first, so a Hub that never answers is caught
    the same way; once it has answered, the weights download with their progress bars and no deadline."""
    import sys
    import threading

    from huggingface_hub import constants

    at = f"{repo_id}@{revision}" if revision else repo_id
    if constants.HF_HUB_OFFLINE:
        return _snapshot(repo_id, revision, token, weights, at, offline=True)
    done: dict = {}

    def fetch() -> None:
        try:
            done["path"] = _snapshot(repo_id, revision, token, False, at, offline=False)
        except BaseException as e:  # handed to the caller's thread
            done["error"] = e

    worker = threading.Thread(target=fetch, daemon=True)  # daemon: a Hub that never answers does not block exit
    worker.start()
    deadline = _hub_deadline()
    patience = min(HUB_PATIENCE, deadline / 2)
    worker.join(patience)
    if worker.is_alive():
        print(f"moe-rewrite: contacting the Hub for {at} ...", file=sys.stderr, flush=True)
        worker.join(deadline - patience)
    if worker.is_alive():
        try:
            path = _snapshot(repo_id, revision, token, weights, at, offline=True)
        except RewriteError:
            raise RewriteError(
                f"{at}: the Hub did not answer within {deadline:g} s and the repo is not in the local cache; check "
                "the network, or set HF_HUB_OFFLINE=1 to work from the cache"
            ) from None
        print(
            f"moe-rewrite: the Hub did not answer within {deadline:g} s; using the cached snapshot of {at} "
            f"({path.name[:12]})",
            file=sys.stderr,
            flush=True,
        )
        return path
    if "error" in done:
        raise done["error"]
    return _snapshot(repo_id, revision, token, True, at, offline=False) if weights else done["path"]


def _snapshot(repo_id: str, revision: str | None, token: str | None, weights: bool, at: str, offline: bool) -> Path:
    """huggingface_hub's snapshot_download, its errors as one-line RewriteErrors naming `at`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                token=token,
                allow_patterns=None if weights else HUB_CODE_PATTERNS,
                ignore_patterns=None if weights else HUB_IGNORE_PATTERNS,
                # huggingface_hub 1.x only blocks HTTP when offline; this makes it answer from the cache, as 0.x does.
                local_files_only=offline,
            )
        )
    except GatedRepoError:
        raise RewriteError(f"{at}: gated repository; accept its terms on the Hub and pass --token") from None
    except RepositoryNotFoundError:
        raise RewriteError(f"{at}: repository not found on the Hub (a private one needs --token)") from None
    except RevisionNotFoundError:
        raise RewriteError(f"{at}: revision not found on the Hub") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise RewriteError(f"{at}: not in the local Hub cache, and the Hub cannot be reached (offline)") from None
    except HfHubHTTPError as e:
        raise RewriteError(f"{at}: Hub request failed ({str(e).splitlines()[0]})") from None
    except (OSError, ValueError) as e:
        raise RewriteError(
            f"{at}: cannot download from the Hub ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
