"""Make the file's models load with fused routed experts (opt-in: --fuse-experts).

The PreTrainedModel subclass gets `from_pretrained` and `_from_config` overrides that call the generated
`_moe_rewrite_fuse_model` after loading, so every model class of the file (the base model, ForCausalLM, ...) comes out
of `AutoModel*.from_pretrained(..., trust_remote_code=True)` with each MoE layer's experts in two parameters. Running
without the option removes the overrides again.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from moe_rewrite.errors import RewriteError
from moe_rewrite.templates import render_model_methods

OUR_CALL = m.Call(func=m.Name("_moe_rewrite_fuse_model"))


def _is_pretrained_base(cls: cst.ClassDef) -> bool:
    base = m.Name("PreTrainedModel") | m.Attribute(attr=m.Name("PreTrainedModel"))
    return any(m.matches(arg.value, base) for arg in cls.bases)


def _is_ours(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.FunctionDef) and bool(m.findall(stmt, OUR_CALL))


def transform(module: cst.Module, enabled: bool) -> cst.Module:
    classes = [s for s in module.body if isinstance(s, cst.ClassDef) and _is_pretrained_base(s)]
    if enabled and len(classes) != 1:
        raise RewriteError(f"--fuse-experts: expected one PreTrainedModel subclass, found {len(classes)}")
    for cls in classes:
        body = [s for s in cls.body.body if not _is_ours(s)]
        if enabled:
            defined = {s.name.value for s in body if isinstance(s, cst.FunctionDef)}
            if defined & {"from_pretrained", "_from_config"}:
                raise RewriteError(f"--fuse-experts: {cls.name.value} defines from_pretrained or _from_config itself")
            body += render_model_methods(module)
        module = cst.ensure_type(
            module.deep_replace(cls, cls.with_changes(body=cls.body.with_changes(body=body))), cst.Module
        )
    return module
