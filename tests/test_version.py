"""The version moves whenever the generated code changes: the banner of a rewritten file names the release that wrote
it, and `--check` / the CHANGELOG's upgrade advice rely on that. tests/pairs/generated.version records the version
beside a fingerprint of everything moe-rewrite generates (each runtime section's code and every golden diff, the
version itself blanked out); a change to either without a new version fails here."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from goldens import section_hashes

from moe_rewrite import __version__

PAIRS = Path(__file__).parent / "pairs"
RECORD = PAIRS / "generated.version"


def generated_fingerprint() -> str:
    """sha256 over the section hashes (computed now) and the golden diffs on disk (test_codemod checks that they are
    what the rewrite gives now), with this version's string blanked: only the generated code counts."""
    digest = hashlib.sha256(section_hashes().encode())
    for path in sorted(PAIRS.rglob("*.diff")):
        text = path.read_bytes().decode().replace(__version__, "VERSION")
        digest.update(path.relative_to(PAIRS).as_posix().encode() + b"\0" + text.encode())
    return digest.hexdigest()


def _recorded() -> tuple[str, str]:
    fields = dict(line.split(" ", 1) for line in RECORD.read_text().splitlines() if line.strip())
    return fields["version"], fields["fingerprint"]


def test_the_version_moves_with_the_generated_code():
    version, fingerprint = _recorded()
    now = generated_fingerprint()
    if os.environ.get("MOE_REWRITE_UPDATE_PAIRS") and (version, fingerprint) != (__version__, now):
        assert now == fingerprint or __version__ != version, (
            f"the generated code changed, but moe_rewrite/__init__.py still says {version}: bump it and the CHANGELOG"
        )
        RECORD.write_text(f"version {__version__}\nfingerprint {now}\n")
        return
    assert now == fingerprint, (
        f"the generated code changed since {version} was recorded: bump moe_rewrite/__init__.py's version (and the "
        "CHANGELOG) if you have not, then run `make update-pairs` and review the goldens"
    )
    assert __version__ == version, f"{RECORD.name} records {version}; run `make update-pairs` to record {__version__}"


def test_the_changelog_names_the_version():
    """The release the banner names has its CHANGELOG section (or is the one being prepared under Unreleased)."""
    changelog = (Path(__file__).parent.parent / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(__version__)}\b", changelog, re.M), f"CHANGELOG.md has no '## {__version__}'"
