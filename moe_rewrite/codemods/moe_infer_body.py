"""Prove `moe_infer`: its body must be one moe-rewrite knows, up to local names, formatting, comments and docstrings.

Training runs `moe_train`, never `moe_infer`; the rewrite is exact only if the two compute the same thing. moe_train
computes what every published `moe_infer` computes (each token's expert outputs weighted by its top-k weights and
summed in the weights' dtype, then cast back to the tokens' dtype), so a `moe_infer` that does anything else (scales
the weights, renormalises them, skips or zeroes an expert) is refused, naming its first statement that no known body
has.

The comparison is on a normalised syntax tree (`ast`): parameters and local variables renamed in order of first
appearance, the docstring dropped; attribute names, calls, constants and operators kept. The `if self.ep_size > 1:`
blocks (expert parallelism) are left out: the generated training code refuses `ep_size > 1` at run time (moe_train
and the fused experts raise NotImplementedError), and eval runs the file's own moe_infer untouched.

Only fingerprints are stored (sha256 of the normalised dump, and of each statement for the error message), never the
published code. To fingerprint the moe_infer of a newly published file (the copy stays outside the repository)::

    python tests/fingerprint_moe_infer.py path/to/modeling_deepseek.py
"""

from __future__ import annotations

import ast
import hashlib
from copy import copy as shallow_copy
from dataclasses import dataclass

from moe_rewrite.errors import RewriteError

# sha256 of the normalised moe_infer -> where that body is published. Add a body only when it is the same in several
# independent copies of a published model file (see the module docstring for the command).
KNOWN_BODIES: dict[str, str] = {
    # DeepSeek's own modeling_deepseek.py: one body for the V2 and V3 forms (cnts.scatter_, argsort, a host-synced loop
    # over the experts skipping empty ones, torch.cat, the weighted sum in the weights' dtype). The same in copies of
    # DeepSeek-V2 / V2-Lite, DeepSeek-VL2's language model, DeepSeek-V3 and R1 in ten independent public repositories
    # (checked for issue 39; hand-edited forks that change it, e.g. `.to("cuda:0")` or a float argsort, are refused).
    "30987d9420ae7abf7e60e91b292c8b340053461c884f03a49e231fc113cd517d": "DeepSeek-V2/V2-Lite/VL2/V3/R1 as published",
    # moe-rewrite's own stand-ins, fixtures/deepseek_v3 and fixtures/deepseek_v2 (bincount instead of scatter_).
    "12079a1a88231841a342d4d851ec226b3f49f91ff54ca4e0e84d16691b0c0575": "moe-rewrite's stand-in fixtures",
}

# The statements of every known body, first 16 hex digits of their fingerprints (for the error message only).
KNOWN_STATEMENTS: frozenset[str] = frozenset(
    (
        # DeepSeek-V2/V2-Lite/VL2/V3/R1 as published
        "8f4d75a07cdd09fa 0dc252222a92c0d1 1c18a77ce3e6851e ee22a2562fc89ffc b50b4bbb250af258 402b64080e029e31 "
        "5c9102c395a89241 dd6cb9e328c2f8fe 898795805bfcc1c9 a39eb46fc9fce185 341afa45db4e5ac2 102484593373203e "
        "3d1e0aaa463df3ee 2d197cd16a91e0c9 223c3c0511aa879f d4adcc84cc33e4b7 3d93fba36a83cad4 e51cd7f0487ce4bf "
        "03163b28a60e63b6 ea123720a33c28d0 8036cd1fed28aa3d bd58d5f1971e96f7 bc09f20e1fe0555a "
        # moe-rewrite's stand-in fixtures
        "1a71848c918de410 a7820264d3f24cec f17fd5e8c8a6d31e 7b5bcc1b05abade8 44beac605596268e 0506fa77a47f9de1 "
        "a125a576381fce8b 2d606a89776e6fd6 0286a838e4a59172 034dd27c8b61f8ef e2d10904aed60149 3d1e0aaa463df3ee "
        "7ac048d897c81a0d 7804ac30fe0377c4 21236300ab46cb29 6f1edd9683e4e4b9 aed625df67f8b28a bc6f015ac911a03e "
        "ea123720a33c28d0 1a608dd3d26c2da8 c6f91a1d53bc313b c0e7570c0fd9a398 08751fddb84561a0"
    ).split()
)

NO_GRAD = "torch.no_grad()"  # the published decorator; moe_infer may also have none


@dataclass(frozen=True)
class Fingerprint:
    body: str  # sha256 of the whole normalised body
    statements: tuple[
        tuple[str, str], ...
    ]  # (sha256's first 16 hex digits, the statement's first line as written), in source order


def _is_ep_block(stmt: ast.stmt) -> bool:
    """`if self.ep_size > 1:` with no else (dumps leave out line numbers)."""
    return isinstance(stmt, ast.If) and not stmt.orelse and ast.dump(stmt.test) == EP_TEST


EP_TEST = ast.dump(ast.parse("self.ep_size > 1", mode="eval").body)
BODY_FIELDS = ("body", "orelse", "finalbody", "handlers")


def _drop_ep_blocks(stmts: list[ast.stmt]) -> list[ast.stmt]:
    kept = [s for s in stmts if not _is_ep_block(s)]
    for stmt in kept:
        for field in BODY_FIELDS:
            nested = getattr(stmt, field, None)
            if isinstance(nested, list) and nested and isinstance(nested[0], ast.stmt):
                setattr(stmt, field, _drop_ep_blocks(nested) or [ast.Pass()])
    return kept


def _statements(stmts: list) -> list[ast.stmt]:
    """Every statement, nested ones right after the statement holding them."""
    out = []
    for stmt in stmts:
        out.append(stmt)
        for field in BODY_FIELDS:
            nested = getattr(stmt, field, None)
            if isinstance(nested, list):
                out += _statements(nested)
    return out


class _Rename(ast.NodeVisitor):
    """Parameters and locals become _0, _1, ... in order of first appearance (a walk that does not look at names)."""

    def __init__(self, local_names: set[str]) -> None:
        self.local_names = local_names
        self.names: dict[str, str] = {}

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.local_names:
            node.id = self.names.setdefault(node.id, f"_{len(self.names)}")

    def visit_arg(self, node: ast.arg) -> None:
        node.arg = self.names.setdefault(node.arg, f"_{len(self.names)}")
        node.annotation = None


def _dump(node: object) -> str:
    """Like ast.dump, the same on every Python version: fields that are None or empty are left out (3.13's ast.dump
    leaves them out, older ones do not; newer Pythons add such fields), and so are type comments and string kinds."""
    if isinstance(node, list):
        return "[" + ", ".join(_dump(n) for n in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = (
        f"{f}={_dump(getattr(node, f))}"
        for f in node._fields
        if getattr(node, f, None) not in (None, []) and f not in ("type_comment", "kind")
    )
    return f"{type(node).__name__}({', '.join(fields)})"


def _sha(node: ast.AST) -> str:
    return hashlib.sha256(_dump(node).encode()).hexdigest()


def _short(node: ast.AST) -> str:
    return _sha(node)[:16]


def _header(stmt: ast.stmt) -> ast.stmt:
    """The statement without the statements nested in it (a compound statement's own line)."""
    copy = shallow_copy(stmt)
    for field in BODY_FIELDS:
        if isinstance(getattr(copy, field, None), list):
            setattr(copy, field, [])
    return copy


def _first_line(stmt: ast.stmt) -> str:
    return ast.unparse(_header(stmt)).split("\n")[0]


def fingerprint(code: str) -> Fingerprint:
    """The fingerprint of the body of the one function in `code` (its name and decorators are not part of it)."""
    function = ast.parse(code).body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError("not a function")
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]
    body = _drop_ep_blocks(body) or [ast.Pass()]
    stmts = _statements(body)
    lines = [_first_line(s) for s in stmts]  # before renaming: the file's own names
    local_names = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    for stmt in body:
        local_names |= {
            n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))
        }
    renamer = _Rename(local_names)
    renamer.visit(function.args)
    for stmt in body:
        renamer.visit(stmt)
    whole = ast.Module(body=[ast.arguments(**vars(function.args)), *body], type_ignores=[])  # type: ignore[list-item]
    return Fingerprint(body=_sha(whole), statements=tuple((_short(_header(s)), t) for s, t in zip(stmts, lines)))


def check_moe_infer(code: str, where: str) -> None:
    """Refuse (RewriteError naming `where` and the first unknown statement) a moe_infer that is not a known body."""
    function = ast.parse(code).body[0]
    assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
    decorators = [ast.unparse(d) for d in function.decorator_list]
    if isinstance(function, ast.AsyncFunctionDef) or decorators not in ([], [NO_GRAD]):
        shown = ", ".join(f"@{d}" for d in decorators) or "async def"
        raise RewriteError(
            f"{where}: {shown} is not how published files define moe_infer (@{NO_GRAD} or nothing); "
            "training could not reproduce it exactly"
        )
    found = fingerprint(code)
    if found.body in KNOWN_BODIES:
        return
    for sha, line in found.statements:
        if sha not in KNOWN_STATEMENTS:
            raise RewriteError(
                f"{where}: `{line}` is not in any published moe_infer moe-rewrite knows; "
                "training could not reproduce it exactly"
            )
    raise RewriteError(
        f"{where}: its statements are those of published moe_infer bodies, but not in an order moe-rewrite knows; "
        "training could not reproduce it exactly"
    )
