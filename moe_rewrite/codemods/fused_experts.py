"""Methods on the file's PreTrainedModel subclass, for fused experts (see `_MoeRewriteFusedExperts`).

Always: `save_pretrained`, which writes fused experts as the checkpoint's own per-expert keys. By default (not with
--no-fuse-experts): `from_pretrained` and `_from_config` overrides that call the generated `_moe_rewrite_fuse_model`
after loading, so every model class of the file (the base model, ForCausalLM, ...) comes out of
`AutoModel*.from_pretrained(..., trust_remote_code=True)` with each MoE layer's experts in two parameters. Running with
--no-fuse-experts removes those two. A file without a PreTrainedModel subclass (no model class to load) gets none.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.errors import RewriteError
from moe_rewrite.options import RewriteOptions
from moe_rewrite.templates import render_model_methods

PRETRAINED_BASE = m.Name("PreTrainedModel") | m.Attribute(attr=m.Name("PreTrainedModel"))
GENERATED_CALL = m.Call(func=m.Name("_moe_rewrite_fuse_model") | m.Name("_moe_rewrite_unfuse_state_dict"))


def _is_ours(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.FunctionDef) and bool(m.findall(stmt, GENERATED_CALL))


def transform(module: cst.Module, options: RewriteOptions) -> cst.Module:
    classes = [
        s for s in module.body if isinstance(s, cst.ClassDef) and any(m.matches(b.value, PRETRAINED_BASE) for b in s.bases)
    ]
    if len(classes) > 1 and options.fuse_experts:
        raise RewriteError(
            f"fused-experts loading needs one PreTrainedModel subclass, found {len(classes)}; "
            "rewrite with --no-fuse-experts"
        )
    for cls in classes:  # earlier generated methods go everywhere; new ones only into a single base class
        body = [s for s in cls.body.body if not _is_ours(s)]
        if len(classes) == 1:
            methods = render_model_methods(module, options)
            defined = {s.name.value for s in body if isinstance(s, cst.FunctionDef)}
            clashes = defined & {method.name.value for method in methods}
            if clashes and options.fuse_experts:
                raise RewriteError(
                    f"{cls.name.value} defines {', '.join(sorted(clashes))} itself, where moe-rewrite "
                    "adds its own for fused experts; rewrite with --no-fuse-experts"
                )
            body += [method for method in methods if method.name.value not in defined]
        new_cls = cls.with_changes(body=cls.body.with_changes(body=body))
        module = cst.ensure_type(module.deep_replace(cls, new_cls), cst.Module)
    return module
