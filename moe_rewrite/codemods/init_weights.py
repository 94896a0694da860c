"""Make the PreTrainedModel subclass's `_init_weights` deterministic, and safe on transformers 5.x::

    # Before
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
        ...
    # After
    def _init_weights(self, module):
        if _moe_rewrite_loaded(module):  # moe-rewrite: keep what the checkpoint loaded (transformers 5.0 re-inits it)
            return
        std = self.config.initializer_range
        ...
        if getattr(module, "e_score_correction_bias", None) is not None:  # moe-rewrite: torch.empty; start at 0
            module.e_score_correction_bias.data.zero_()

The guard (with compat): transformers 5.0 calls _init_weights on every module after loading, and `.data.normal_()`
writes through its guards, so every loaded nn.Linear would be re-drawn; 5.x marks loaded parameters
`_is_hf_initialized`, and a module whose own parameters all carry it is left alone, as later 5.x releases do
themselves. The bias (always, V3 form): MoEGate creates `e_score_correction_bias` with torch.empty and nothing
initialises it, so models built with from_config route on whatever memory held; checkpoints still overwrite it.
Both lines carry the marker comment, so a later run replaces them.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

DESCRIPTION = "Keeps loaded weights on transformers 5.0 and zero-initialises the router's correction bias."

MARK = "# moe-rewrite:"
GUARD = "if _moe_rewrite_loaded(module):  # moe-rewrite: keep what the checkpoint loaded (transformers 5.0 re-inits it)\n    return\n"
BIAS = (
    'if getattr(module, "e_score_correction_bias", None) is not None:  # moe-rewrite: torch.empty; start at 0\n'
    "    module.e_score_correction_bias.data.zero_()\n"
)
TEMPLATE = "init_weights_helpers.py"  # _moe_rewrite_loaded, for the guard
PRETRAINED_BASE = m.Name("PreTrainedModel") | m.Attribute(attr=m.Name("PreTrainedModel"))
INIT_WEIGHTS = m.FunctionDef(name=m.Name("_init_weights"), params=m.Parameters(params=[m.Param(), m.Param(name=m.Name("module"))]))


def _ours(stmt: cst.BaseStatement) -> bool:
    if not isinstance(stmt, cst.If):
        return False
    comment = stmt.body.header.comment if isinstance(stmt.body, cst.IndentedBlock) else None
    return comment is not None and comment.value.startswith(MARK)


def _statement(text: str, module: cst.Module) -> cst.BaseStatement:
    return cst.parse_statement(text.replace("\n", module.default_newline), config=module.config_for_parsing)


def transform(module: cst.Module, guard: bool) -> tuple[cst.Module, bool]:
    """The module with the edits above (re)made (the bias line where the file has a correction bias), and whether the
    guard's helper is called."""
    correction_bias = bool(m.findall(module, m.Attribute(attr=m.Name("e_score_correction_bias"))))
    used = False
    for cls in module.body:
        if not (isinstance(cls, cst.ClassDef) and any(m.matches(b.value, PRETRAINED_BASE) for b in cls.bases)):
            continue
        for fn in cls.body.body:
            if not m.matches(fn, INIT_WEIGHTS):
                continue
            fn = cst.ensure_type(fn, cst.FunctionDef)
            body = [s for s in fn.body.body if not _ours(s)]
            if guard:
                docstring = m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())]))
                body.insert(1 if docstring else 0, _statement(GUARD, module))
            if correction_bias:
                body.append(_statement(BIAS, module))
            used = used or guard
            new_fn = fn.with_changes(body=fn.body.with_changes(body=body))
            module = cst.ensure_type(module.deep_replace(fn, new_fn), cst.Module)
    return module, used

