"""A syntax tree normalised for fingerprints: names canonical (`Canonical`) and a dump that is the same on every
Python version (`stable_dump`). moe/moe_infer_body.py proves moe_infer by the sha256 of such dumps (the published bodies
are not stored here): a change to either changes every fingerprint, so neither changes."""

from __future__ import annotations

import ast


class Canonical(ast.NodeVisitor):
    """Parameters become _p0, _p1, ... by position; other locals _0, _1, ... in order of first appearance (a walk that
    does not look at names)."""

    def __init__(self, params: list[str], local_names: set[str]) -> None:
        self.local_names = local_names
        self.names = {name: f"_p{i}" for i, name in enumerate(params)}
        self.count = 0

    def _canonical(self, name: str) -> str:
        if name not in self.names:
            self.names[name], self.count = f"_{self.count}", self.count + 1
        return self.names[name]

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.local_names:
            node.id = self._canonical(node.id)

    def visit_arg(self, node: ast.arg) -> None:
        node.arg = self._canonical(node.arg)
        node.annotation = None


def stable_dump(node: object) -> str:
    """Like ast.dump, the same on every Python version: fields that are None or empty are left out (3.13's ast.dump
    leaves them out, older ones do not; newer Pythons add such fields), and so are type comments and string kinds."""
    if isinstance(node, list):
        return "[" + ", ".join(stable_dump(n) for n in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = (
        f"{f}={stable_dump(getattr(node, f))}"
        for f in node._fields
        if getattr(node, f, None) not in (None, []) and f not in ("type_comment", "kind")
    )
    return f"{type(node).__name__}({', '.join(fields)})"
