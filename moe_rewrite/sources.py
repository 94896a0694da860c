"""SOURCE -> files: a Hub repo id (through huggingface_hub), a local checkpoint directory, or a .py file."""

from __future__ import annotations

import json
import re
from fnmatch import fnmatch
from dataclasses import dataclass
from pathlib import Path

from moe_rewrite.errors import RewriteError

DEFAULT_MODELING_FILE = "modeling_deepseek.py"
# What trust_remote_code loading needs from a Hub repo: code and config, never weights.
HUB_CODE_PATTERNS = ["*.py", "*.json"]
HUB_IGNORE_PATTERNS = ["*.index.json"]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_code_file(name: str) -> bool:
    return any(fnmatch(name, p) for p in HUB_CODE_PATTERNS) and not any(fnmatch(name, p) for p in HUB_IGNORE_PATTERNS)


@dataclass(frozen=True)
class Source:
    spec: str  # what the user typed
    kind: str  # "file", "dir" or "hub"
    modeling_file: Path
    root: Path | None  # the checkpoint directory (local, or the Hub snapshot); None for a bare file

    def read(self) -> str:
        return read_text(self.modeling_file)


def read_text(path: Path) -> str:
    """A file's text with its line endings kept as they are (CRLF stays CRLF)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise RewriteError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise RewriteError(f"{path}: cannot read ({e.strerror})") from None


def modeling_file_name(root: Path) -> str:
    """The modeling module config.json's auto_map points at, else modeling_deepseek.py."""
    try:
        auto_map = json.loads(read_text(root / "config.json")).get("auto_map", {})
    except (RewriteError, ValueError, AttributeError):
        return DEFAULT_MODELING_FILE
    for key in ("AutoModelForCausalLM", "AutoModel"):
        ref = auto_map.get(key) if isinstance(auto_map, dict) else None
        if isinstance(ref, str) and "." in ref:
            module = ref.split("--")[-1].rsplit(".", 1)[0]
            return f"{module}.py"
    return DEFAULT_MODELING_FILE


def _from_dir(spec: str, root: Path, kind: str) -> Source:
    name = modeling_file_name(root)
    path = root / name
    if not path.is_file():
        raise RewriteError(f"{spec}: no {name} in this {'repository' if kind == 'hub' else 'directory'}")
    return Source(spec=spec, kind=kind, modeling_file=path, root=root)


def resolve(spec: str, revision: str | None = None, token: str | None = None) -> Source:
    path = Path(spec)
    if revision is not None and path.exists():
        raise RewriteError(f"{spec}: --revision applies to Hub repo ids, not to local paths")
    if path.is_dir():
        return _from_dir(spec, path, "dir")
    if path.is_file():
        if path.suffix != ".py":
            raise RewriteError(f"{spec}: not a .py file, a checkpoint directory or a Hub repo id")
        return Source(spec=spec, kind="file", modeling_file=path, root=None)
    if path.suffix == ".py" or not REPO_ID.match(spec):
        raise RewriteError(f"{spec}: no such file or directory")
    return _from_dir(spec, download_code(spec, revision, token), "hub")


def download_code(repo_id: str, revision: str | None, token: str | None) -> Path:
    """The repo's code and config files in the Hub cache (honours HF_HUB_OFFLINE and the cache), as a snapshot dir."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                token=token,
                allow_patterns=HUB_CODE_PATTERNS,
                ignore_patterns=HUB_IGNORE_PATTERNS,
                # huggingface_hub 1.x only blocks HTTP when offline; this makes it answer from the cache, as 0.x does.
                local_files_only=constants.HF_HUB_OFFLINE,
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
        raise RewriteError(f"{at}: cannot download from the Hub ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
