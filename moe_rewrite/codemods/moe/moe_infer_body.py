"""Prove `moe_infer`: its body must be one moe-rewrite knows, up to local names, formatting, comments and docstrings.

Training runs `moe_train`, never `moe_infer`; the rewrite is exact only if the two compute the same thing. moe_train
computes what every published `moe_infer` computes (each token's expert outputs weighted by its top-k weights and
summed in the weights' dtype, then cast back to the tokens' dtype), so a `moe_infer` that does anything else (scales
the weights, renormalises them, skips or zeroes an expert) is refused, naming its first statement that no known body
has.

The comparison is on a normalised syntax tree (`ast`): parameters renamed by position and local variables in order of
first appearance, the docstring dropped; attribute names, calls, constants and operators kept. The
`if self.ep_size > 1:` blocks (expert parallelism) are left out: the generated training code refuses `ep_size > 1` at
run time (moe_train and the fused experts raise NotImplementedError), and eval runs the file's own moe_infer untouched.

Only fingerprints are stored (sha256 of the normalised dump, and of each statement for the error message), never the
published code. To fingerprint the moe_infer of a newly published file (the copy stays outside the repository)::

    python tests/fingerprint_moe_infer.py path/to/modeling_deepseek.py
"""

from __future__ import annotations

import ast
import hashlib
from copy import copy as shallow_copy
from copy import deepcopy
from dataclasses import dataclass

from moe_rewrite.codemods.kit.normalise import Canonical, stable_dump
from moe_rewrite.errors import RewriteError

# sha256 of the normalised moe_infer -> where that body is published. Add a body only when it is the same in several
# independent copies of a published model file (see the module docstring for the command).
KNOWN_BODIES: dict[str, str] = {
    # DeepSeek's own modeling_deepseek.py: one body for the V2 and V3 forms (cnts.scatter_, argsort, a host-synced loop
    # over the experts skipping empty ones, torch.cat, the weighted sum in the weights' dtype). The same in copies of
    # DeepSeek-V2 / V2-Lite, DeepSeek-VL2's language model, DeepSeek-V3 and R1 in ten independent public repositories
    # (checked for issue 39; hand-edited forks that change it, e.g. `.to("cuda:0")` or a float argsort, are refused).
    "7ef4e5b788f55b1c84a7a9800d7b3cf4b600c179d16209dd04ad389a42c26f77": "DeepSeek-V2/V2-Lite/VL2/V3/R1 as published",
    # Kimi-Linear's modeling_kimi.py (KimiSparseMoeBlock): DeepSeek's body without `sorted_tokens_shape = ...`, which
    # only its expert-parallel blocks read. The same in two independent public copies (checked for issue 35).
    "7b20555250960408ca4755f7838daf1834905653cfff837d5d91f0dd10d97268": "Kimi-Linear as published",
    # moe-rewrite's own stand-ins, fixtures/deepseek_v3 and fixtures/deepseek_v2 (bincount instead of scatter_).
    "22a4428b86a91653b7472042724d66cde97a4d525cb421a7c24254a9a1ceb707": "moe-rewrite's stand-in fixtures",
    # moe-rewrite's Kimi stand-in, fixtures/kimi: the same, counting `self.config.num_experts` (Kimi's name).
    "5057959d62c6e03a95ea856f540229dbc11829ea30949c8fd11094e8ca49f593": "moe-rewrite's Kimi stand-in fixture",
    # DeepSeekMoE 16B (the V1 form, deepseek-moe-16b-base/-chat): flat ids and (tokens * top_k, 1) weights, argsort,
    # bincount, a host-synced loop over the experts, each output scaled in place in the tokens' dtype and summed by
    # scatter_reduce_. The same in copies of it in two independent public repositories (checked for issue 35).
    "07a714befa9a5aa26d6346a81af89d6728221cdb9a6073b46383a8a5dc37c854": "DeepSeekMoE 16B (V1) as published",
    # moe-rewrite's own V1 stand-in, fixtures/deepseek_moe
    "336a90e9b6cfcaaa92b0d96175e5710238bc11ad9bbcb70a184b378f9861f1f3": "moe-rewrite's V1 stand-in fixture",
}
# The bodies above that take flat arguments, as the V1 form calls them: `moe_infer(tokens, topk_idx.view(-1),
# topk_weight.view(-1, 1))`; the others take (tokens, top_k) ids and weights.
FLAT_ARGUMENTS = frozenset(
    {
        "07a714befa9a5aa26d6346a81af89d6728221cdb9a6073b46383a8a5dc37c854",
        "336a90e9b6cfcaaa92b0d96175e5710238bc11ad9bbcb70a184b378f9861f1f3",
    }
)

# The statements of every known body, first 16 hex digits of their fingerprints (for the error message only).
KNOWN_STATEMENTS: frozenset[str] = frozenset(
    (
        # DeepSeek-V2/V2-Lite/VL2/V3/R1 as published
        "00323ab0ce102d1a 920d3d4c13128605 e12b4bebb7f38b3d 838e6541b10e04b8 f6cde572ba48fc21 51f7d1cab03bfc09 "
        "15bfdd843a8a34ba 7a43f2bde94ef00a f1e4b50899ff87e3 e3692592a5acb75e d5b122d6aaaee963 0576102cf207a723 "
        "3d1e0aaa463df3ee 2c369b139f73283c aba8bf99bfe22775 cedd4a3c167b377c bdadf3d1f08b0aa9 ac178496f0ec6915 "
        "2a9890e098f73fb5 9148e4756acf28ba 112c80bc660db2da 8b9ead4fa6b271b0 58ef89aac281237d "
        # moe-rewrite's stand-in fixtures
        "21ec121f0690ef9d 7b3f49b951da11b4 5ca24678743d0ea3 a2fc838384087eda da614fb490b95c67 a1166c008d0ebbc0 "
        "66af0b61de99782d 7a43f2bde94ef00a f1e4b50899ff87e3 e3692592a5acb75e 0576102cf207a723 3d1e0aaa463df3ee "
        "3d6ecba3d7d15b37 f861b64558929fe5 a872d834a751eaf5 5f5522f2f6e42274 fa13b12d69b171d5 1758362a2eb7ccba "
        "9148e4756acf28ba 112c80bc660db2da 4286a82c64b588c4 6a0e2d26730c9527 07c679304645e516 "
        # moe-rewrite's Kimi stand-in (the others are the stand-ins')
        "c0260c9d6fc9e363 "
        # DeepSeekMoE 16B (V1) as published
        "cd4e2883486cc255 e70273127b1f40d5 a975e08cbedb6095 5ca02e584cabee94 e3692592a5acb75e 8f0594127e525359 "
        "7a284fe730d12237 3d1e0aaa463df3ee 0a090a4e6d4fb279 aba8bf99bfe22775 88dc305678ebc9c4 cedd4a3c167b377c "
        "02a0f0994e1f2e06 19cdb380405118be 58ef89aac281237d "
        # moe-rewrite's V1 stand-in fixture
        "f1e4b50899ff87e3 23202cfe1f6aa7ce 1d7d1631b75ddedf ac178496f0ec6915"
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


def _sha(node: ast.AST) -> str:
    return hashlib.sha256(stable_dump(node).encode()).hexdigest()


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
    params = [a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)]
    local_names = set(params)
    for stmt in body:
        local_names |= {
            n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))
        }
    # each statement on its own, its locals numbered from 0 (so that the first statement that no known body has is
    # the one named, whatever came before it), then the whole body with one numbering; parameters by position
    statements = []
    for stmt in stmts:
        header = deepcopy(_header(stmt))
        Canonical(params, local_names).visit(header)
        statements.append((_short(header), _first_line(stmt)))
    renamer = Canonical(params, local_names)
    renamer.visit(function.args)
    for stmt in body:
        renamer.visit(stmt)
    whole = ast.Module(body=[ast.arguments(**vars(function.args)), *body], type_ignores=[])  # type: ignore[list-item]
    return Fingerprint(body=_sha(whole), statements=tuple(statements))


def check_moe_infer(code: str, where: str) -> str:
    """Refuse (RewriteError naming `where` and the first unknown statement) a moe_infer that is not a known body; for a
    known one, how it takes its arguments: "flat" (FLAT_ARGUMENTS) or "topk"."""
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
        return "flat" if found.body in FLAT_ARGUMENTS else "topk"
    for sha, line in found.statements:
        if sha not in KNOWN_STATEMENTS:
            raise RewriteError(
                f"{where}: `{line}` is not in any published moe_infer moe-rewrite knows; "
                "training could not reproduce it exactly"
            )
    raise RewriteError(
        f"{where}: each statement is in a published moe_infer moe-rewrite knows, but not the whole (the order, or the "
        "names passed between statements, differ); training could not reproduce it exactly"
    )
