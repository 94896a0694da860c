"""Choose the expert layout: fused experts (the default) or per-expert nn.Linear layers (--no-fuse-experts), and give
the file's PreTrainedModel subclass the methods that go with it.

Both layouts get runtime/experts/expert_linears.py (per-expert weights and LoRA adapters as the core reads them),
fused_views.py, fused_experts.py and fusing.py (the fused module and the fusing; --no-fuse-experts files can still
fuse at run time)
and fused_checkpoint.py (`save_pretrained` writes fused experts as the checkpoint's per-expert keys). The default adds
fused_loading.py: `from_pretrained`, `_from_config` and `post_init` overrides that fuse every MoE layer, so every model
class of the file (the base model, ForCausalLM, ...) comes out of `AutoModel*.from_pretrained(...,
trust_remote_code=True)` with each layer's experts in two parameters. --no-fuse-experts adds per_expert.py instead: the
grouped-GEMM core over the per-expert layers, and a `from_pretrained` that refuses expert weights arriving fused. A
file without a PreTrainedModel subclass (no model class to load) gets the MoE-level code only.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.codemods.kit import Context, Field, is_generated_method, marked, replace
from moe_rewrite.render import generated

READS: tuple[Field, ...] = ("projections",)
PROVIDES: tuple[Field, ...] = ()
PRETRAINED_BASE = m.Name("PreTrainedModel") | m.Attribute(attr=m.Name("PreTrainedModel"))
SHARED = [
    "expert_linears",
    "parameter_lora",
    "fp8_experts",
    "fused_views",
    "fused_experts",
    "fusing",
    "fused_checkpoint",
    "expert_parallel_model",
    "expert_parallel_checkpoint",
]  # both layouts' sections


def transform(module: cst.Module, context: Context) -> cst.Module:
    classes = [
        s
        for s in module.body
        if isinstance(s, cst.ClassDef) and any(m.matches(b.value, PRETRAINED_BASE) for b in s.bases)
    ]
    fused = _methods([name for name in [*SHARED, "fused_loading"] if generated(name, context.options)], module, context)
    if len(classes) > 1:
        context.need_per_expert_layers(
            f"fused-experts loading needs one PreTrainedModel subclass, found {len(classes)}"
        )
    elif classes and (clashes := _defined(classes[0], context) & {method.name.value for method in fused}):
        context.need_per_expert_layers(
            f"{classes[0].name.value} defines {', '.join(sorted(clashes))} itself, where moe-rewrite adds its own for "
            "fused experts"
        )
    layout = [*SHARED, "fused_loading" if context.options.fuse_experts is not False else "per_expert"]
    layout = [name for name in layout if generated(name, context.options)]  # e.g. fp8_experts only where asked
    context.sections |= set(layout)
    methods = _methods(layout, module, context)
    for cls in classes:  # earlier generated methods go everywhere; new ones only into a single base class
        body = [s for s in cls.body.body if not is_generated_method(s, context.index)]
        if len(classes) == 1:
            defined = _defined(cls, context)
            body += [method for method in methods if method.name.value not in defined]
        new_cls = cls.with_changes(body=cls.body.with_changes(body=body))
        module = replace(module, cls, new_cls)
    return module


def _methods(layout: list[str], module: cst.Module, context: Context) -> list[cst.FunctionDef]:
    return [marked(method) for name in layout for method in context.section(name, module).model_methods]


def _defined(cls: cst.ClassDef, context: Context) -> set[str]:
    """The class's own methods, not those an earlier run generated."""
    return {
        s.name.value
        for s in cls.body.body
        if isinstance(s, cst.FunctionDef) and not is_generated_method(s, context.index)
    }
