"""Load the generated code from templates/ and render it into CST nodes for the module being rewritten."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import libcst as cst
from libcst.helpers import parse_template_module

from moe_rewrite import __version__
from moe_rewrite.options import RewriteOptions

BLOCK_TEMPLATE = "moe_train_block.py"
METHOD_TEMPLATE = "moe_train_method.py"
AUX_LOSS_TEMPLATE = "aux_loss_block.py"
BIAS_UPDATE_TEMPLATE = "bias_update_methods.py"
CHECKPOINTING_TEMPLATE = "checkpointing_block.py"
FUSED_EXPERTS_TEMPLATE = "fused_experts_block.py"
COMPAT_CACHE_TEMPLATE = "compat_cache_helpers.py"
COMPAT_ROPE_TEMPLATE = "compat_rope_scaling.py"
COMPAT_GENERATION_TEMPLATE = "compat_generation.py"
FUSED_EXPERTS_METHODS = "fused_experts_methods.py"
PER_EXPERT_METHODS = "per_expert_methods.py"
SAVE_PRETRAINED_METHOD = "save_pretrained_method.py"
SAVE_CODE_TEMPLATE = "save_code_block.py"


def _template_dir() -> Path:
    # Inside the wheel the templates live in the package; in a source checkout they are at the repository root.
    packaged = Path(__file__).parent / "templates"
    return packaged if packaged.is_dir() else Path(__file__).parent.parent / "templates"


@lru_cache(maxsize=None)
def load_template(name: str) -> str:
    return (_template_dir() / name).read_text(encoding="utf-8")


def _render(name: str, module: cst.Module, **replacements: cst.BaseExpression) -> list[cst.BaseStatement]:
    """Parse a template with the target module's newline and indentation, returning its statements.

    The comment block at the top of a template is for people reading templates/ and is dropped.
    """
    text = load_template(name).replace("\n", module.default_newline)
    parsed = parse_template_module(text, config=module.config_for_parsing, **replacements)
    return list(parsed.body)


def render_statements(name: str, module: cst.Module) -> list[cst.BaseStatement]:
    """A template's statements, rendered for `module` (a template without placeholders)."""
    return _render(name, module)


def options_literal(options: RewriteOptions) -> cst.Dict:
    text = json.dumps(options.as_dict(__version__))
    return cst.ensure_type(cst.parse_expression(text), cst.Dict)


def banner_lines(moe_class: str, options: RewriteOptions) -> list[cst.EmptyLine]:
    comments = [
        f"# ---- moe-rewrite {__version__} ({options.describe()}): training path for {moe_class} ----",
        "# Generated code: edit moe-rewrite's templates/, not this block; running moe-rewrite again regenerates it.",
    ]
    return [cst.EmptyLine(), cst.EmptyLine()] + [cst.EmptyLine(comment=cst.Comment(c)) for c in comments]


def render_block(
    module: cst.Module, moe_class: str, options: RewriteOptions, extra_sections: tuple[str, ...] = ()
) -> list[cst.BaseStatement]:
    """The module-level helper block (with the opt-in sections asked for, then `extra_sections`: templates that other
    codemods' edits call), its first statement carrying the banner."""
    body = _render(BLOCK_TEMPLATE, module, options=options_literal(options))
    optional = [(options.aux_loss, AUX_LOSS_TEMPLATE), (True, SAVE_CODE_TEMPLATE), (options.fuse_experts, FUSED_EXPERTS_TEMPLATE)]
    wanted = [name for on, name in optional if on]
    for name in [*wanted, *extra_sections]:
        section = _render(name, module)
        # Two blank lines between top-level definitions, as in the rest of the block.
        section[0] = section[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)] * 2)
        body += section
    body[0] = body[0].with_changes(leading_lines=banner_lines(moe_class, options))
    return body


def render_model_methods(module: cst.Module, options: RewriteOptions) -> list[cst.FunctionDef]:
    """The PreTrainedModel subclass's save_pretrained, and the from_pretrained / _from_config / post_init that fuse
    the routed experts (with --no-fuse-experts: the from_pretrained that refuses fused expert keys)."""
    methods = _methods(SAVE_PRETRAINED_METHOD, module)
    return methods + _methods(FUSED_EXPERTS_METHODS if options.fuse_experts else PER_EXPERT_METHODS, module)


def _methods(name: str, module: cst.Module) -> list[cst.FunctionDef]:
    """The methods of a template's placeholder class, each preceded by one blank line as methods are."""
    (holder,) = _render(name, module)
    return [
        cst.ensure_type(method, cst.FunctionDef).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        for method in cst.ensure_type(holder, cst.ClassDef).body.body
    ]


def render_moe_methods(module: cst.Module, options: RewriteOptions) -> list[cst.FunctionDef]:
    """`moe_train`, and the bias-update methods when asked for."""
    methods = _methods(METHOD_TEMPLATE, module)
    if options.bias_update is not None:
        methods += _methods(BIAS_UPDATE_TEMPLATE, module)
    return methods
