"""The generated code: moe_rewrite/runtime/ holds it as real, importable Python, one file per section; this module
renders a section into CST nodes for the file being rewritten.

A section file is a module docstring (for people reading runtime/), imports (so that the file imports, lints and
tests on its own), then the code moe-rewrite copies: module-level statements go into the generated block in front of
the MoE class, and the methods of a placeholder `class MoE:` / `class Model:` go into the file's MoE class / its
PreTrainedModel subclass. The docstring, the imports and the placeholder classes themselves are not copied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import libcst as cst
import libcst.helpers
import libcst.matchers as m

from moe_rewrite import __version__
from moe_rewrite.options import RewriteOptions

# Every section, in the order the generated block holds them: name -> what it does, in one sentence.
SECTIONS = {
    "dispatch": "the kernel choice: grouped-GEMM kernel and Triton kernels per device and dtype, once per process",
    "route": "the route: rows sorted by expert, and the gather, un-sort and weighted combine along it",
    "grouped_linear": "the grouped GEMM with autograd over weight sources, and the gather of x's rows",
    "expert_output": "act_fn(gate) * up, the down GEMM and the weighted combine as one autograd node",
    "backends": "the expert MLPs outside the grouped GEMMs: SonicMoE's kernels and the per-expert loop",
    "moe_train": "MoE.moe_train: the routed experts in training mode, LoRA adapters' GEMMs included",
    "expert_parallel": "expert parallelism (ep_size > 1): rows to the ranks holding their experts and back, all-to-all",
    "triton_block": "the column block of the row-wise Triton kernels",
    "triton_route": "the route in one Triton launch",
    "triton_gather": "the gather of each token's row to its top-k places in Triton",
    "triton_swiglu": "SwiGLU and its backward in Triton",
    "triton_sum_rows": "the weighted un-sort and sum of each token's rows, and its backward, in Triton",
    "triton_gemm": "a Triton grouped GEMM for few rows per expert on sm90",
    "expert_linears": "weight sources over per-expert nn.Linear weights and the LoRA adapters PEFT puts on experts",
    "parameter_lora": "PEFT's LoRA on the fused expert parameters (target_parameters) and eval mode under it",
    "fp8_experts": "FP8 block-quantized checkpoints: FP8Linear layers found, the others dequantized on loading",
    "fused_views": "expert i of the fused experts as a module of nn.Linear views of the fused parameters",
    "fused_experts": "the routed experts fused into two parameters",
    "fusing": "MoE.moe_rewrite_fuse_experts, and the fused layout's moe_rewrite_expert_weights",
    "fused_checkpoint": "per-expert checkpoint keys into fused experts and back (save_pretrained)",
    "expert_parallel_model": "the model under expert parallelism: its groups, FSDP2 on two meshes, gradients",
    "expert_parallel_checkpoint": "whole checkpoints and adapters gathered from expert-parallel or FSDP2 ranks",
    "fused_loading": "from_pretrained and from_config fuse every MoE layer's experts",
    "per_expert": "the grouped-GEMM core over per-expert nn.Linear layers (--no-fuse-experts)",
    "aux_loss": "the sequence-wise balance loss (--aux-loss)",
    "bias_update": "aux-loss-free balancing, bias += RATE * sign(mean load - load) (--bias-update)",
    "no_aux_loss": "AddAuxiliaryLoss where aux_loss_alpha = 0 gives no aux loss: a clear error, or none (opt-in)",
    "attention": "the attention core through torch's scaled_dot_product_attention, its backend chosen once per shape",
    "lm_loss": "the causal-LM loss in chunks, without float32 logits over the vocabulary, in training with labels",
    "triton_cross_entropy": "the fused loss's cross-entropy rows (logsumexp, loss, gradient in place) in Triton",
    "triton_rmsnorm": "RMSNorm and its backward in Triton where they apply (CUDA); the published norm elsewhere",
    "triton_rope": "RoPE and its backward in Triton where they apply (CUDA); the published RoPE elsewhere",
    "checkpoint_layer": "gradient_checkpointing_enable() checkpoints the decoder layers",
    "compat_cache": "Cache methods that later transformers releases removed",
    "compat_rope_scaling": "config.rope_scaling as the file expects it on transformers 5.x",
    "compat_generation": "generation position ids sliced as transformers 4.x passed them",
    "init_guards": "_init_weights keeps loaded weights and rebuilds non-persistent buffers on transformers 5.x",
}
# The core's sections: moe_train and everything it calls, which every rewritten MoE layer needs
CORE_SECTIONS = frozenset(
    ["dispatch", "route", "grouped_linear", "expert_output", "backends", "moe_train", "expert_parallel"]
    + ["triton_block", "triton_route", "triton_gather", "triton_swiglu", "triton_sum_rows", "triton_gemm"]
)
# What a section may import at module level, since the import is not copied: the names every file moe-rewrite rewrites
# binds (`import torch`; the DeepSeek files bind more, the smallest forms it accepts only torch), and the sibling
# sections (`from .route import ...`), whose code the block holds. Anything else goes inside the function.
FILE_IMPORTS = ("import torch",)
OPTIONS_NAME = "_moe_rewrite_options"  # dispatch.py's options dict, filled with the rewrite's options
# expert_linears.py's (gate, up, down) projection names, filled with the file's experts' own (Kimi's w1, w3, w2)
PROJECTIONS_NAME = "MOE_REWRITE_PROJECTIONS"
PLACEHOLDERS = ("MoE", "Model")


@dataclass(frozen=True)
class Section:
    statements: list[cst.BaseStatement]  # module-level, for the generated block
    moe_methods: list[cst.FunctionDef]  # for the MoE class
    model_methods: list[cst.FunctionDef]  # for the PreTrainedModel subclass


RUNTIME_DIR = Path(__file__).parent / "runtime"  # the sections, one module each


@lru_cache(maxsize=None)
def load_section(name: str) -> str:
    return (RUNTIME_DIR / f"{name}.py").read_text(encoding="utf-8")


def _is_header(stmt: cst.BaseStatement) -> bool:
    """The section's docstring and imports: there for the section as a module, not copied."""
    return m.matches(stmt, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom() | m.Expr(m.SimpleString())]))


def _check_import(name: str, stmt: cst.SimpleStatementLine, module: cst.Module) -> None:
    node = stmt.body[0]
    if isinstance(node, cst.ImportFrom) and node.relative and node.module is not None:
        sibling = cst.helpers.get_full_name_for_node(node.module)
        if len(node.relative) == 1 and (RUNTIME_DIR / f"{sibling}.py").exists():
            return
    code = module.code_for_node(node)
    if isinstance(node, (cst.Import, cst.ImportFrom)) and code not in FILE_IMPORTS:
        raise ValueError(
            f"runtime/{name}.py: `{code}` would not be in the rewritten file (module-level imports are not copied, "
            f"and the file is known to have only {', '.join(FILE_IMPORTS)}): import it inside the function using it"
        )


def _methods(cls: cst.ClassDef) -> list[cst.FunctionDef]:
    """A placeholder class's methods, each preceded by one blank line as methods are."""
    return [
        cst.ensure_type(method, cst.FunctionDef).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        for method in cls.body.body
    ]


def render_section(
    name: str,
    module: cst.Module,
    options: RewriteOptions | None = None,
    projections: tuple[str, str, str] | None = None,
) -> Section:
    """Section `name` parsed with the target module's newline and indentation; with `options`, dispatch's options dict
    holds them; with `projections`, MOE_REWRITE_PROJECTIONS names the file's expert projections."""
    text = load_section(name).replace("\n", module.default_newline)
    parsed = cst.parse_module(text, config=module.config_for_parsing)
    statements, methods = [], {placeholder: [] for placeholder in PLACEHOLDERS}
    for stmt in parsed.body:
        if _is_header(stmt):
            _check_import(name, cst.ensure_type(stmt, cst.SimpleStatementLine), parsed)
            continue
        if isinstance(stmt, cst.ClassDef) and stmt.name.value in PLACEHOLDERS:
            methods[stmt.name.value] += _methods(stmt)
            continue
        if options is not None and m.matches(
            stmt, m.SimpleStatementLine(body=[m.Assign([m.AssignTarget(m.Name(OPTIONS_NAME))])])
        ):
            assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
            stmt = stmt.with_changes(body=[assign.with_changes(value=options_literal(options))])  # type: ignore[attr-defined]
        if projections is not None and m.matches(
            stmt, m.SimpleStatementLine(body=[m.Assign([m.AssignTarget(m.Name(PROJECTIONS_NAME))])])
        ):
            assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
            quoted = ", ".join(f'"{name}"' for name in projections)  # identifiers: no escaping needed
            names = cst.ensure_type(cst.parse_expression(f"({quoted})"), cst.Tuple)
            stmt = stmt.with_changes(body=[assign.with_changes(value=names)])  # type: ignore[attr-defined]
        statements.append(stmt)
    if statements:  # the blank lines after the section's imports are not the code's
        statements[0] = statements[0].with_changes(leading_lines=[])
    return Section(statements, methods["MoE"], methods["Model"])


def render_statements(name: str, module: cst.Module) -> list[cst.BaseStatement]:
    """A section's module-level statements, rendered for `module`."""
    return render_section(name, module).statements


def options_literal(options: RewriteOptions) -> cst.Dict:
    text = json.dumps(options.as_dict(__version__))
    return cst.ensure_type(cst.parse_expression(text), cst.Dict)


def ordered(sections: set[str]) -> list[str]:
    return [name for name in SECTIONS if name in sections]


def banner_lines(moe_class: str, options: RewriteOptions) -> list[cst.EmptyLine]:
    comments = [
        f"# ---- moe-rewrite {__version__} ({options.describe()}): training path for {moe_class} ----",
        "# Generated code: edit moe_rewrite/runtime/ in moe-rewrite, not this block; a new run regenerates it.",
    ]
    return [cst.EmptyLine(), cst.EmptyLine()] + [cst.EmptyLine(comment=cst.Comment(c)) for c in comments]
