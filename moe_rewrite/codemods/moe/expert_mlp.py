"""Prove the expert MLP: the grouped GEMMs compute every routed expert as `down(act_fn(gate(x)) * up(x))` from the
three projections' weights and the first expert's `act_fn`, so the file's expert class must compute exactly that, or
the file is refused naming the difference. Nothing is changed in the file; the projections' names are read from the
forward's use, not their names (Kimi's `w2(act_fn(w1(x)) * w3(x))`: w1 gate, w3 up, w2 down) and passed on to the
generated code (Context.projections, MOE_REWRITE_PROJECTIONS), so that checkpoint keys and PEFT see the file's names.

The class X of the routed experts comes from the MoE class's `__init__` (and its in-file subclasses'): every
`self.experts = ...` there must be an `nn.ModuleList` of `X(...)` built in a comprehension (`... if lo <= i < hi
else None` allowed in the `ep_size > 1` branch only). X (with its methods resolved through its in-file bases, down to
nn.Module) must be the published MLP, up to names and formatting::

    # Accepted
    class DeepseekV3MLP(nn.Module):
        def __init__(self, config, hidden_size=None, intermediate_size=None):
            super().__init__()
            self.config = config
            self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
            self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
            self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
            self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
            self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))  # or with the product swapped
            return down_proj

    # Refused (examples)
    self.experts = nn.ModuleDict({str(i): DeepseekV3MLP(config) for i in range(n)})   # not an nn.ModuleList
    self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=True)   # a bias the GEMMs drop
    self.norm = nn.LayerNorm(self.intermediate_size)                                  # a submodule they skip
    return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))                # not act_fn
    return self.down_proj(self.act_fn(self.down_proj(x)) * self.up_proj(x))         # down used as the gate
    class PrunedMLP(DeepseekV3MLP): def forward(self, x): ...                        # checked as its own forward

    # Accepted too: DeepSeek's ESFT fork, the MLP between a cast to the weights' dtype and the cast back
        def forward(self, x):
            in_dtype = x.dtype
            x = x.to(self.gate_proj.weight.dtype)
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj.to(in_dtype)

Such experts get per-expert layers (--no-fuse-experts: one module, and dtype, per expert) and moe_train runs the
grouped GEMMs only where every expert's weights have x's dtype (the casts do nothing), else the experts' own forward
(the published loop): exact either way.
"""

from __future__ import annotations

import dataclasses

import libcst as cst

from moe_rewrite.codemods.kit import Context, Field, top_classes
from moe_rewrite.codemods.moe.expert_class import chain_or_any, expert_class
from moe_rewrite.codemods.moe.expert_mlp_proof import check_expert_class, expert_casts
from moe_rewrite.errors import RewriteError

READS: tuple[Field, ...] = ("moe",)
PROVIDES: tuple[Field, ...] = ("projections",)


def transform(module: cst.Module, context: Context) -> cst.Module:
    classes = top_classes(module)
    moe = context.moe_class().name
    # the MoE class and its in-file subclasses (one may build its experts from another class)
    layers = [name for name in classes if classes[moe] in chain_or_any(name, classes)]
    experts = sorted({expert_class(name, classes) for name in layers})
    found = {check_expert_class(expert, classes) for expert in experts}
    if len(found) != 1:
        raise RewriteError(
            f"{moe}: its expert classes name their gate, up and down projections differently "
            f"({'; '.join(', '.join(names) for names in sorted(found))}); the generated code reads one set of names"
        )
    context.projections = found.pop()
    casts = sorted(filter(None, (expert_casts(expert, classes) for expert in experts)))
    if casts:
        context.need_per_expert_layers(
            f"{casts[0]}: casts x to its weights' dtype and back (ESFT: fp32 experts beside bf16 ones), which "
            "fused experts, one dtype for all, cannot express"
        )
        if not context.options.expert_casts:
            context.options = dataclasses.replace(context.options, expert_casts=True)
            context.rendered.clear()  # the sections hold the dtype check (render.features)
    return module
