"""Run RMSNorm through one fused Triton kernel each way where it applies (on by default; --no-fused-norm).

The published RMSNorm (every DeepSeek copy, and transformers' own model) runs four fp32 passes per row, 33 times per
Moonlight layer set. Where a class's forward is exactly that norm (proven statement by statement on the syntax tree,
up to names of locals, formatting and comments) and its __init__ sets the weight and epsilon as published, the forward
first asks whether the fused norm applies (CUDA, Triton; runtime/kernels/triton_rmsnorm.py) and returns it; the
published body stays below it and runs everywhere else (the CPU, torch.compile, MOE_REWRITE_FUSED_NORM=0)::

    # Before
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
    # After
    def forward(self, hidden_states):
        # moe-rewrite: the fused RMSNorm where it applies (CUDA, Triton); the published norm otherwise
        if _moe_rewrite_rmsnorm_applies(hidden_states, self.weight):
            return _moe_rewrite_rmsnorm(hidden_states, self.weight, self.variance_epsilon)
        input_dtype = hidden_states.dtype
        ...  # the published body, untouched

A norm that differs in any way (eps outside the rsqrt, no fp32 upcast, another reduction) is left as published, and
the summary says so; the file is still rewritten. Every run first takes back what an earlier one added, so
--no-fused-norm gives the published norm back and a second run changes nothing.
"""

from __future__ import annotations

import ast
import itertools

import libcst as cst

from moe_rewrite.codemods.kit import MARK, Context, Field, Note, class_methods, code, replace
from moe_rewrite.codemods.kit.prove import Differs, Proof, Template, closest, prove_function
from moe_rewrite.codemods.model.branch import first_branch, unbranched

READS: tuple[Field, ...] = ()
PROVIDES: tuple[Field, ...] = ("notes",)
CONCERN = "norm"  # its notes' concern

NOTE = f"{MARK}: the fused RMSNorm where it applies (CUDA, Triton); the published norm otherwise"
OUR_CALL = "_moe_rewrite_rmsnorm"
BRANCH = (
    "if _moe_rewrite_rmsnorm_applies({x}, self.weight):\n"
    "    return _moe_rewrite_rmsnorm({x}, self.weight, self.variance_epsilon)\n"
)

# The published body, in its names: x the input, d its dtype, y the fp32 copy, v the variance, z the normalised rows.
# The copies rebind the input (y is x) and the normalised rows (z is y); variants name them apart or compute the
# variance inside the rsqrt: each combination is a template, compared with the forward's body up to names of locals.
PUBLISHED = [
    "{d} = {x}.dtype",
    "{y} = {x}.to(torch.float32)",
    "{v} = {y}.pow(2).mean(-1, keepdim=True)",
    "{z} = {y} * torch.rsqrt({v} + self.variance_epsilon)",
    "return self.weight * {z}.to({d})",
]
RMS_ATTRIBUTES = {"rsqrt", "variance_epsilon"}  # a forward reading either, or a class named *RMSNorm*, is looked at
INLINE_VARIANCE = "{z} = {y} * torch.rsqrt({y}.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)"


def _templates() -> list[list[str]]:
    """The body's accepted spellings, the published one first."""
    found = []
    for y, z, inline in itertools.product(("hidden_states", "y"), ("y", "z"), (False, True)):
        names = {"x": "hidden_states", "d": "input_dtype", "v": "variance", "y": y, "z": y if z == "y" else "z"}
        lines = [PUBLISHED[0], PUBLISHED[1], INLINE_VARIANCE, PUBLISHED[4]] if inline else PUBLISHED
        found.append([line.format(**names) for line in lines])
    return found


# proven up to the names of locals: the input (bound to the forward's) and the names the body binds
TEMPLATES = [Template("\n".join(lines), params=("self", "hidden_states")) for lines in _templates()]


def _has_docstring(fn: cst.FunctionDef) -> bool:
    return fn.get_docstring() is not None


def _input(forward: cst.FunctionDef) -> str | None:
    """The forward's input name where it takes `(self, NAME)` alone."""
    params = forward.params
    plain = [p for p in params.params if p.default is None]
    if params.posonly_params or params.kwonly_params or params.star_arg != cst.MaybeSentinel.DEFAULT:
        return None
    if params.star_kwarg is not None or len(plain) != 2 or len(params.params) != 2 or plain[0].name.value != "self":
        return None
    return plain[1].name.value


def _find_norm(cls: cst.ClassDef, forward: cst.FunctionDef) -> str | None:
    """Why the class is not the published RMSNorm (one line), or None when it is."""
    x = _input(forward)
    if x is None:
        return "its forward does not take `(self, hidden_states)` alone"
    if not isinstance(forward.body, cst.IndentedBlock):
        return "its forward's body is on the `def` line"
    found = [prove_function(template, forward) for template in TEMPLATES]
    if any(isinstance(proof, Proof) for proof in found):
        return _check_init(cls)
    return closest(d for d in found if isinstance(d, Differs)).describe("norm", "the end of forward")


def _assigned(node: cst.CSTNode, attr: str) -> list[ast.AST]:
    """Every assignment to `self.<attr>` in `node` (plain, augmented, annotated, one of several targets): the value of
    a plain one-target assignment, the statement itself otherwise."""
    found: list[ast.AST] = []
    for n in ast.walk(ast.parse(code(node))):
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        else:
            continue
        hits = [
            t
            for target in targets
            for t in ast.walk(target)
            if isinstance(t, ast.Attribute) and t.attr == attr and ast.unparse(t.value) == "self"
        ]
        if hits:
            plain = isinstance(n, ast.Assign) and len(n.targets) == 1 and n.targets[0] is hits[0]
            found.append(n.value if plain else n)  # type: ignore[union-attr]
    return found


def _check_init(cls: cst.ClassDef) -> str | None:
    """Why __init__ does not set the weight and epsilon as published, or None: `self.weight =
    nn.Parameter(torch.ones(SIZE))` and `self.variance_epsilon = EPS`, SIZE and EPS parameters of __init__, and no
    other assignment to either anywhere in the class."""
    init = class_methods(cls).get("__init__")
    if init is None:
        return "it has no __init__"
    params = {p.name.value for p in [*init.params.params, *init.params.kwonly_params]}
    ones = {
        ast.dump(ast.parse(f"{parameter}.Parameter(torch.ones({size}))", mode="eval").body)
        for parameter in ("nn", "torch.nn")
        for size in params
    }
    weight = _assigned(init, "weight")
    if len(_assigned(cls, "weight")) != 1 or len(weight) != 1 or ast.dump(weight[0]) not in ones:
        return "its weight is not set once, as `self.weight = nn.Parameter(torch.ones(hidden_size))` in __init__"
    eps = _assigned(init, "variance_epsilon")
    if len(_assigned(cls, "variance_epsilon")) != 1 or len(eps) != 1:
        return "its epsilon is not set once, as `self.variance_epsilon = eps` in __init__"
    if not (isinstance(eps[0], ast.Name) and eps[0].id in params):
        return "its epsilon is not set from an __init__ parameter, as `self.variance_epsilon = eps`"
    return None


def _branched(forward: cst.FunctionDef, x: str, module: cst.Module) -> cst.FunctionDef:
    """The forward with the fused norm's branch as its first statement (after a docstring)."""
    at = 1 if _has_docstring(forward) else 0
    return first_branch(forward, BRANCH.format(x=x), NOTE, module, at)


def undo(module: cst.Module) -> cst.Module:
    """The module without the branches an earlier run put into RMSNorm forwards."""
    for cls in [s for s in module.body if isinstance(s, cst.ClassDef)]:
        forward = class_methods(cls).get("forward")
        if forward is None or not isinstance(forward.body, cst.IndentedBlock):
            continue
        plain = unbranched(forward, NOTE, OUR_CALL)
        if plain is not forward:
            module = replace(module, forward, plain)
    return module


def transform(module: cst.Module, context: Context) -> cst.Module:
    """The module with each proven RMSNorm's forward branching to the fused norm (with --fused-norm, the default);
    what was done or left, and why, in context.notes."""
    module = undo(module)
    notes, start = context.notes, len(context.notes)
    if not context.options.fused_norm:
        return module
    fused = []
    for cls in [s for s in module.body if isinstance(s, cst.ClassDef)]:
        forward = class_methods(cls).get("forward")
        if forward is None:
            continue
        if not (RMS_ATTRIBUTES & context.index.facts(forward).attributes or "RMSNorm" in cls.name.value):
            continue
        reason = _find_norm(cls, forward)
        if reason is not None:
            notes.append(Note(CONCERN, cls.name.value, False, reason))
            continue
        module = replace(module, forward, _branched(forward, _input(forward) or "", module))
        fused.append(cls.name.value)
    if fused:
        context.sections.add("triton_rmsnorm")
        names = ", ".join(fused)
        notes.insert(
            start,
            Note(CONCERN, names, True, f"fused RMSNorm in {names} (Triton on CUDA; the published norm elsewhere)"),
        )
    return module
