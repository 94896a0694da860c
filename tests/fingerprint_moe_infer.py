"""Print the fingerprints of the moe_infer methods in published modeling files, for KNOWN_BODIES and KNOWN_STATEMENTS
in moe_rewrite/codemods/moe/moe_infer_body.py (add a body only when several independent copies of a published model
file have it; never copy the file into the repository)::

    python tests/fingerprint_moe_infer.py path/to/modeling_deepseek.py ...
"""

from __future__ import annotations

import ast
import sys

from moe_rewrite.codemods.moe.moe_infer_body import KNOWN_BODIES, fingerprint


def main(argv: list[str]) -> int:
    for path in argv:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "moe_infer"):
                found = fingerprint(ast.unparse(fn))
                print(f"{path}: {cls.name}.moe_infer {found.body} ({KNOWN_BODIES.get(found.body, 'not known')})")
                print("  statements: " + " ".join(sha for sha, _ in found.statements))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
