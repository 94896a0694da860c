"""Run RoPE through one fused Triton kernel each way where it applies (on by default; --no-fused-rope).

The published `apply_rotary_pos_emb` (every DeepSeek V2/V3 copy, VL2's language model) gathers the table rows of
position_ids, copies q and k into rotate_half's lane order (view, transpose, reshape: even lanes, then odd) and
rotates them in four more passes. Where the module-level `rotate_half` and `apply_rotary_pos_emb` are exactly the
published ones (proven statement by statement on the syntax tree, up to names of locals, formatting and comments), the
function first asks whether the fused rotation applies (CUDA, Triton; runtime/kernels/triton_rope.py) and returns it;
the published body stays below it and runs everywhere else (the CPU, torch.compile, MOE_REWRITE_FUSED_ROPE=0)::

    # Before
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
        cos = cos[position_ids].unsqueeze(unsqueeze_dim)
        ...
    # After
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
        # moe-rewrite: the fused RoPE where it applies (CUDA, Triton); the published rotation otherwise
        if _moe_rewrite_rope_applies(q, k, cos, sin, position_ids, unsqueeze_dim):
            return _moe_rewrite_rope(q, k, cos, sin, position_ids)
        cos = cos[position_ids].unsqueeze(unsqueeze_dim)
        ...  # the published body, untouched

The same function without the view/transpose lines (lanes already in rotate_half's order, as Llama's) gets the
branch with `interleaved=False`. A function that differs in any other way is left as published, and the summary says
so; the file is still rewritten. Every run first takes back what an earlier one added, so --no-fused-rope gives the
published function back and a second run changes nothing.
"""

from __future__ import annotations

import ast

import libcst as cst

from moe_rewrite.codemods.kit import MARK, Context, Field, Index, Note, replace
from moe_rewrite.codemods.kit.prove import Differs, Proof, Template, closest, prove_function
from moe_rewrite.codemods.model.branch import first_branch, unbranched

READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ("notes",)
CONCERN = "rope"  # its notes' concern

NOTE = f"{MARK}: the fused RoPE where it applies (CUDA, Triton); the published rotation otherwise"
OUR_CALL = "_moe_rewrite_rope"
BRANCH = (
    "if _moe_rewrite_rope_applies({q}, {k}, {cos}, {sin}, {position_ids}, {unsqueeze_dim}):\n"
    "    return _moe_rewrite_rope({q}, {k}, {cos}, {sin}, {position_ids}{flag})\n"
)
ROTATE = "rotate_half"
APPLY = "apply_rotary_pos_emb"
PARAMS = ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim")

# rotate_half(x): the published spelling, then the stand-in fixtures' (one local for the half)
ROTATE_LINES = [
    [
        "x1 = x[..., : x.shape[-1] // 2]",
        "x2 = x[..., x.shape[-1] // 2 :]",
        "return torch.cat((-x2, x1), dim=-1)",
    ],
    [
        "half = x.shape[-1] // 2",
        "return torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
    ],
]
# apply_rotary_pos_emb's body; the de-interleave (lines 2 to 5) is absent from the not-interleaved form
TABLES = [
    "cos = cos[position_ids].unsqueeze(unsqueeze_dim)",
    "sin = sin[position_ids].unsqueeze(unsqueeze_dim)",
]
DEINTERLEAVE = [
    "b, h, s, d = q.shape",
    "q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)",
    "b, h, s, d = k.shape",
    "k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)",
]
ROTATION = [
    "q_embed = (q * cos) + (rotate_half(q) * sin)",
    "k_embed = (k * cos) + (rotate_half(k) * sin)",
    "return q_embed, k_embed",
]
APPLY_LINES = {True: TABLES + DEINTERLEAVE + ROTATION, False: TABLES + ROTATION}  # interleaved -> body
# proven up to the names of locals: the parameters (bound to the function's by position) and the names the body binds
ROTATE_TEMPLATES = [Template("\n".join(lines), params=("x",)) for lines in ROTATE_LINES]
APPLY_TEMPLATES = {interleaved: Template("\n".join(lines), params=PARAMS) for interleaved, lines in APPLY_LINES.items()}


def _params(fn: cst.FunctionDef, count: int) -> list[str] | None:
    """The names of `count` plain positional parameters, where the function takes those alone (the last one of
    apply_rotary_pos_emb with the published default, 1)."""
    params = fn.params
    if params.posonly_params or params.kwonly_params or params.star_kwarg is not None:
        return None
    if params.star_arg != cst.MaybeSentinel.DEFAULT or len(params.params) != count:
        return None
    defaults = [p.default for p in params.params]
    if count == len(PARAMS):
        last = defaults.pop()
        if not (isinstance(last, cst.Integer) and last.value == "1"):
            return None
    if any(d is not None for d in defaults):
        return None
    return [p.name.value for p in params.params]


def _differs(fn: cst.FunctionDef, templates: list[Template], what: str) -> str | None:
    """Why the function's body is none of the templates (proven up to the names of locals), or None where it is one."""
    if not isinstance(fn.body, cst.IndentedBlock):
        return "its body is on the `def` line"
    found = [prove_function(template, fn) for template in templates]
    if any(isinstance(proof, Proof) for proof in found):
        return None
    return closest(d for d in found if isinstance(d, Differs)).describe(what, "the end of the function")


def _functions(module: cst.Module, name: str) -> list[cst.FunctionDef]:
    return [s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == name]


def _rebound(module: cst.Module, name: str, index: Index) -> bool:
    """Whether a module-level statement other than its one `def` binds `name` (an assignment, an import); only the
    statements naming it are parsed."""
    for line in module.body:
        if isinstance(line, (cst.FunctionDef, cst.ClassDef)) or name not in index.facts(line).names:
            continue
        for node in (node for stmt in ast.parse(module.code_for_node(line)).body for node in ast.walk(stmt)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
                return True
            if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
                return True
    return False


def _find_rope(module: cst.Module, index: Index) -> tuple[cst.FunctionDef | None, bool | None, str | None]:
    """(apply_rotary_pos_emb, whether it de-interleaves, why it is not the published RoPE or None)."""
    applies, rotates = _functions(module, APPLY), _functions(module, ROTATE)
    if len(applies) != 1:
        return None, None, f"{len(applies)} module-level definitions of {APPLY}" if applies else None
    fn = applies[0]
    if len(rotates) != 1:
        return fn, None, f"{len(rotates)} module-level definitions of {ROTATE}"
    if any(_rebound(module, name, index) for name in (APPLY, ROTATE)):
        return fn, None, f"{APPLY} or {ROTATE} is also bound by another module-level statement"
    if _params(rotates[0], 1) is None:
        return fn, None, f"{ROTATE} does not take `(x)` alone"
    reason = _differs(rotates[0], ROTATE_TEMPLATES, ROTATE)
    if reason is not None:
        return fn, None, f"{ROTATE}: {reason}"
    if _params(fn, len(PARAMS)) is None:
        return fn, None, "it does not take `(q, k, cos, sin, position_ids, unsqueeze_dim=1)` alone"
    order = [True, False]
    reasons = [_differs(fn, [APPLY_TEMPLATES[i]], APPLY) for i in order]
    for interleaved, reason in zip(order, reasons):
        if reason is None:
            return fn, interleaved, None
    return fn, None, reasons[0]


def _branched(fn: cst.FunctionDef, interleaved: bool, module: cst.Module) -> cst.FunctionDef:
    """The function with the fused rotation's branch as its first statement (after a docstring)."""
    names = dict(zip(PARAMS, (p.name.value for p in fn.params.params)))
    text = BRANCH.format(**names, flag="" if interleaved else ", interleaved=False")
    return first_branch(fn, text, NOTE, module, 1 if fn.get_docstring() is not None else 0)


def undo(module: cst.Module) -> cst.Module:
    """The module without the branches an earlier run put into module-level functions."""
    for fn in [s for s in module.body if isinstance(s, cst.FunctionDef)]:
        if not isinstance(fn.body, cst.IndentedBlock):
            continue
        plain = unbranched(fn, NOTE, OUR_CALL)
        if plain is not fn:
            module = replace(module, fn, plain)
    return module


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with a proven apply_rotary_pos_emb branching to the fused rotation (with --fused-rope, the default);
    what was done or left, and why, in context.notes."""
    module = undo(module)
    notes = context.notes
    if not context.options.fused_rope:
        return module
    fn, interleaved, reason = _find_rope(module, context.index)
    if fn is None:
        if reason is not None:
            notes.append(Note(CONCERN, APPLY, False, reason))
        return module
    if interleaved is None:
        notes.append(Note(CONCERN, APPLY, False, reason))
        return module
    module = replace(module, fn, _branched(fn, interleaved, module))
    context.sections.add("triton_rope")
    layout = "" if interleaved else ", lanes not interleaved"
    notes.append(
        Note(CONCERN, APPLY, True, f"fused {APPLY}{layout} (Triton on CUDA; the published rotation elsewhere)")
    )
    return module
