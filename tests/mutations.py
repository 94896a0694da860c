"""Variants of the stand-in fixtures for the exact-or-refused test (tests/test_mutations.py): each one edits the MoE
forward, the router or the attention the way people hand-edit these files (statements inserted before, after and
inside the regions moe-rewrite replaces, statements split, casts moved, guards respelled, names changed, one-line
branches) and says what moe-rewrite must do with it: "exact" (rewrite it, and training gives the variant's own
numbers) or "refused" (exit 2, one line, nothing written). An attention it cannot prove is neither: it stays as
published, with a line saying why, and the rest of the file is rewritten ("exact").

    python tests/mutations.py OUT_DIR    # writes OUT_DIR/<form>_<name>/modeling_deepseek.py, to look at them
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

# The V2-form training branch of the stand-in, and the V3 eval branch and router guard, as anchors for the edits.
V2_REPEAT = "            # one copy of each token per chosen expert\n"
V2_BUFFER = "            y = torch.empty_like(hidden_states)\n"
V2_LOOP = (
    "            for i, expert in enumerate(self.experts):\n"
    "                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])\n"
)
V2_SUM = "            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)\n"
V2_FLAT = "        flat_topk_idx = topk_idx.view(-1)\n"
V2_AFTER_IF = "        if self.config.n_shared_experts is not None:\n"
ESFT_LOOP = (
    "            for i, expert in enumerate(self.experts):\n"
    "                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])\n"
    "        else:\n"
)
ESFT_SUM = "        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)\n"
ESFT_BUFFER = "            y = torch.empty_like(hidden_states)\n"
# ESFT's expert forward: x cast to the expert's weight dtype, the result cast back
ESFT_CAST = "        x = x.to(self.gate_proj.weight.dtype)\n"
ESFT_CAST_BACK = "        return down_proj.to(in_dtype)\n"
V3_INFER = "            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)\n"
V3_BRANCH = "        if not self.training:\n" + V3_INFER
V3_GUARD = "            assert not self.training\n"
# moe_infer (the same in both stand-ins) and the places around the MoE class
MI_DEF = "    def moe_infer(self, x, topk_ids, topk_weight):\n"
MI_DECORATED = "    @torch.no_grad()\n" + MI_DEF
MI_DOC = '        """Send every (token, slot) pair to its expert, one batch per expert."""\n'
MI_ROUTED = "        routed = x[order // k]\n"
MI_DEVICE = "device=x.device)\n"
MI_COUNTS = "        counts = per_expert.cpu().numpy()\n"
MI_LOOP = "        for local_idx, count in enumerate(counts):\n"
MI_EXPERT = "            expert = self.experts[first_expert + local_idx]\n"
MI_SUM = "        combined = (per_slot * topk_weight.unsqueeze(-1)).sum(dim=1)\n"
EVAL_CALL = "            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)\n"
V3_MOE_START = "        residual = hidden_states\n        orig_shape = hidden_states.shape\n        topk_idx, topk_weight = self.gate"
# The expert MLP class of both stand-ins (DeepseekV3MLP, DeepseekV2MLP) and the MoE's list of experts (ep_size == 1).
MLP_FORWARD = "        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\n"
MLP_GATE = "        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)\n"
MLP_ACT = "        self.act_fn = ACT2FN[config.hidden_act]\n"
EXPERTS_LIST = "            self.experts = nn.ModuleList(\n"
EXPERTS_ITER = "                    for _ in range(config.n_routed_experts)\n                ]\n            )\n"


@dataclass(frozen=True)
class Mutation:
    form: str  # "v2", "v3", "esft", "kimi" or "v1"
    name: str
    expect: str  # "exact" or "refused"
    edits: tuple[tuple[str, str], ...]  # (old, new) text replacements, each old found exactly once
    why: str = ""  # for "refused": what the one-line error must say
    options: tuple[str, ...] = ()  # for the rewrite
    # for "exact": the numbers to match: the variant's own ("own"), or the unedited stand-in rewritten with the same
    # options ("fixture"; for options that change training on purpose, such as --aux-loss)
    reference: str = "own"
    # for attention edits: "sdpa" (the core runs through SDPA) or what the line under the file's line must say about
    # the attention left as published (the Model's 4-D mask then stays as published too)
    attention: str = ""
    # for edits of the Model's mask on its way: what the line saying the 4-D mask stays as published must say (the
    # attention still runs through SDPA, with that mask)
    mask: str = ""
    # the experts' (gate, up, down) projections as the variant's expert MLP uses them (for its gradients' names)
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # config.json keys the variant sets (the published file reads one the stand-in's config leaves out)
    config: tuple[tuple[str, object], ...] = ()

    @property
    def fixture(self) -> Path:
        if self.form == "kimi":
            return FIXTURES / "kimi"
        if self.form == "v1":
            return FIXTURES / "deepseek_moe"
        return FIXTURES / ("deepseek_v2_esft" if self.form == "esft" else f"deepseek_{self.form}")

    @property
    def modeling(self) -> str:
        return "modeling_kimi.py" if self.form == "kimi" else "modeling_deepseek.py"

    def apply(self, text: str) -> str:
        for old, new in self.edits:
            if text.count(old) != 1:
                raise AssertionError(f"{self.form}_{self.name}: anchor found {text.count(old)} times: {old!r}")
            text = text.replace(old, new)
        return text


def _before(anchor: str, line: str) -> tuple[str, str]:
    return anchor, line + anchor


def _after(anchor: str, line: str) -> tuple[str, str]:
    return anchor, anchor + line


def _expert_mlp_mutations(form: str) -> list[Mutation]:
    """The expert MLP as people hand-edit it, in either form: what the grouped GEMMs would compute differently is
    refused naming the class and statement; the same computation written otherwise is rewritten exactly."""
    mlp = "DeepseekV3MLP" if form == "v3" else "DeepseekV2MLP"
    # the second `self.experts = nn.ModuleList(` (ep_size == 1), anchored on the comprehension that follows it
    experts_dict = (
        EXPERTS_LIST + "                [\n                    " + mlp,
        "            self.experts = nn.ModuleDict(\n                {\n                    str(_): " + mlp,
    )
    subclass = (
        f"\n\nclass PrunedMLP({mlp}):\n    def forward(self, x):\n"
        "        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 0.5\n"
    )
    same_subclass = (
        f"\n\nclass RenamedMLP({mlp}):\n    def forward(self, hidden):\n"
        "        return self.down_proj(self.up_proj(hidden) * self.act_fn(self.gate_proj(hidden)))\n"
    )

    def experts_of(cls: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """Both branches' experts (ep_size > 1 and == 1) built from `cls`."""
        call = (
            "(\n                        config, intermediate_size=config.moe_intermediate_size\n                    )\n"
        )
        ep = "                    (\n                        "
        return (
            (f"{ep}{mlp}(\n", f"{ep}{cls}(\n"),
            (f"                    {mlp}{call}{EXPERTS_ITER}", f"                    {cls}{call}{EXPERTS_ITER}"),
        )

    moe = "DeepseekV3MoE" if form == "v3" else "DeepseekV2MoE"
    attention = "DeepseekV3Attention" if form == "v3" else "DeepseekV2Attention"
    moe_subclass = (
        f"class PrunedMoE({moe}):\n    def __init__(self, config):\n        super().__init__(config)\n"
        "        self.experts = nn.ModuleList(\n            [HalfMLP(config, intermediate_size=config.moe_intermediate_size)"
        " for _ in range(config.n_routed_experts)]\n        )\n\n\n"
        f"class HalfMLP({mlp}):\n    def forward(self, x):\n"
        "        return 0.5 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\n\n\n"
    )
    return [
        Mutation(
            form,
            "expert_class_of_a_moe_subclass",
            "refused",
            ((f"class {attention}(nn.Module):\n", moe_subclass + f"class {attention}(nn.Module):\n"),),
            why="HalfMLP.forward: `return 0.5 * self.down_proj(",
        ),
        Mutation(
            form,
            "expert_bias",
            "refused",
            ((MLP_GATE, MLP_GATE.replace("bias=False", "bias=True")),),
            why=f"{mlp}.__init__: `self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=True)`",
        ),
        Mutation(
            form,
            "expert_gelu_hard_coded",
            "refused",
            ((MLP_FORWARD, MLP_FORWARD.replace("self.act_fn(", "F.gelu(")),),
            why=f"{mlp}.forward: `return self.down_proj(F.gelu(",
        ),
        Mutation(
            form,
            "expert_output_scaled",
            "refused",
            ((MLP_FORWARD, MLP_FORWARD.replace("return self", "return 0.5 * self")),),
            why=f"{mlp}.forward: `return 0.5 * self.down_proj(",
        ),
        Mutation(
            form,
            "expert_gate_up_swapped",
            "exact",  # read by use: up_proj is the gate here, gate_proj the up projection
            (
                (
                    MLP_FORWARD,
                    "        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))\n",
                ),
            ),
            projections=("up_proj", "gate_proj", "down_proj"),
        ),
        Mutation(
            form,
            "expert_norm_inside",
            "refused",
            (
                _after(MLP_ACT, "        self.norm = nn.LayerNorm(self.intermediate_size)\n"),
                (
                    MLP_FORWARD,
                    "        return self.down_proj(self.norm(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))\n",
                ),
            ),
            why=f"{mlp}.__init__: `self.norm = nn.LayerNorm(self.intermediate_size)`",
        ),
        Mutation(
            form,
            "expert_activation_per_expert",
            "refused",
            (
                (
                    MLP_ACT,
                    '        self.act_fn = ACT2FN[config.hidden_act if intermediate_size is None else "gelu"]\n',
                ),
            ),
            why=f"{mlp}.__init__: `self.act_fn = ACT2FN[config.hidden_act if",
        ),
        Mutation(
            form,
            "expert_subclass_own_forward",
            "refused",
            (_after(MLP_FORWARD, subclass), *experts_of("PrunedMLP")),
            why="PrunedMLP.forward: `return self.down_proj(",
        ),
        Mutation(
            form,
            "expert_training_only_scale",
            "refused",
            (
                (
                    MLP_FORWARD,
                    "        out = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\n"
                    "        if self.training:\n            out = out * 0.5\n        return out\n",
                ),
            ),
            why=f"{mlp}.forward: `if self.training: ...`",
        ),
        Mutation(
            form,
            "experts_in_a_module_dict",
            "refused",
            (
                experts_dict,
                (
                    EXPERTS_ITER,
                    "                    for _ in range(config.n_routed_experts)\n                }\n            )\n",
                ),
            ),
            why="`self.experts = nn.ModuleDict(",
        ),
        Mutation(
            form,
            "expert_two_statements",
            "exact",
            (
                (
                    MLP_FORWARD,
                    "        hidden = self.act_fn(self.gate_proj(x)) * self.up_proj(x)  # the gated activation\n"
                    "        down_proj = self.down_proj(\n            hidden\n        )\n        return down_proj\n",
                ),
            ),
        ),
        Mutation(
            form,
            "expert_product_other_order",
            "exact",
            ((MLP_FORWARD, "        return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))\n"),),
        ),
        Mutation(
            form,
            "expert_subclass_same_forward",
            "exact",
            (_after(MLP_FORWARD, same_subclass), *experts_of("RenamedMLP")),
        ),
    ]


MUTATIONS = [
    # Expert MLP, containers and expert subclasses (V3 and V2)
    *_expert_mlp_mutations("v3"),
    *_expert_mlp_mutations("v2"),
    # V2 form: around and inside the per-expert statements
    Mutation(
        "v2",
        "weights_scaled_before_repeat",
        "exact",
        (_before(V2_REPEAT, "            topk_weight = topk_weight * 0.5\n"),),
    ),
    Mutation(
        "v2",
        "weights_scaled_before_loop",
        "exact",
        (_after(V2_BUFFER, "            topk_weight = topk_weight * 0.5\n"),),
    ),
    Mutation(
        "v2", "weights_scaled_before_sum", "exact", (_after(V2_LOOP, "            topk_weight = topk_weight * 0.5\n"),)
    ),
    Mutation(
        "v2",
        "tokens_scaled_before_repeat",
        "exact",
        (_before(V2_REPEAT, "            hidden_states = hidden_states * 1.5\n"),),
    ),
    Mutation(
        "v2", "check_kept_before_loop", "exact", (_before(V2_LOOP, "            assert topk_weight.dim() == 2\n"),)
    ),
    Mutation("v2", "output_scaled_after_sum", "exact", (_after(V2_SUM, "            y = y * 2.0\n"),)),
    Mutation("v2", "zero_buffer", "exact", ((V2_BUFFER, "            y = torch.zeros_like(hidden_states)\n"),)),
    Mutation(
        "v2",
        "sum_into_another_name",
        "exact",
        (
            (V2_SUM, V2_SUM.replace("            y = (", "            out = (")),
            ("            y = y.to(hidden_states", "            y = out.to(hidden_states"),
        ),
    ),
    Mutation(
        "v2",
        "names_changed",
        "exact",
        (
            (V2_FLAT, "        flat_ids = topk_idx.view(-1)\n"),
            (
                V2_LOOP,
                "            for e, mlp in enumerate(self.experts):\n                y[flat_ids == e] = mlp(hidden_states[flat_ids == e])\n",
            ),
        ),
    ),
    Mutation(
        "v2",
        "reformatted_loop",
        "exact",
        (
            (
                V2_LOOP,
                "            for (i, expert) in enumerate(self.experts):\n                y[(flat_topk_idx == i)] = expert(\n"
                "                    hidden_states[flat_topk_idx == i]  # routed to i\n                )\n",
            ),
        ),
    ),
    Mutation(
        "v2",
        "output_scaled_before_sum",
        "refused",
        (_after(V2_LOOP, "            y = y * 2.0\n"),),
        why="`y = y * 2.0` sits between the replaced per-expert statements",
    ),
    Mutation(
        "v2",
        "cast_before_sum",
        "refused",
        (_after(V2_LOOP, "            y = y.float()\n"),),
        why="`y = y.float()` sits between",
    ),
    Mutation(
        "v2",
        "sum_split",
        "refused",
        (
            (
                V2_SUM,
                "            y = y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)\n            y = y.sum(dim=1)\n",
            ),
        ),
        why="expected one `y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)`",
    ),
    Mutation(
        "v2",
        "loop_body_scaled",
        "refused",
        (("= expert(hidden_states[flat_topk_idx == i])\n", "= expert(hidden_states[flat_topk_idx == i]) * 2.0\n"),),
        why="is not `for i, expert in enumerate(self.experts)",
    ),
    Mutation(
        "v2",
        "tokens_scaled_after_repeat",
        "refused",
        (_before(V2_BUFFER, "            hidden_states = hidden_states * 1.5\n"),),
        why="`hidden_states = hidden_states * 1.5` sits between",
    ),
    Mutation(
        "v2",
        "ids_changed_in_branch",
        "refused",
        (_before(V2_LOOP, "            topk_idx = topk_idx.flip(-1)\n"),),
        why="`topk_idx` is assigned again",
    ),
    Mutation(
        "v2",
        "flat_ids_other_order",
        "refused",
        ((V2_FLAT, "        flat_topk_idx = topk_idx.flip(-1).view(-1)\n"),),
        why="should be assigned once, as `flat_topk_idx = topk_idx.view(-1)`",
    ),
    Mutation(
        "v2",
        "repeated_tokens_read_after",
        "refused",
        (_before(V2_AFTER_IF, "        self.rows_seen = hidden_states.shape[0]\n"),),
        why="`self.rows_seen = hidden_states.shape[0]` reads `hidden_states`",
    ),
    # ESFT form (one loop for training and eval under `if self.ep_size == 1:`, the sum after it)
    Mutation(
        "esft",
        "weights_scaled_before_loop",
        "exact",
        (_after(ESFT_BUFFER, "            topk_weight = topk_weight * 0.5\n"),),
        options=("--no-fuse-experts",),
    ),
    Mutation(
        "esft",
        "output_scaled_after_sum",
        "exact",
        (_after(ESFT_SUM, "        y = y * 2.0\n"),),
        options=("--no-fuse-experts",),
    ),
    Mutation(
        "esft",
        "output_scaled_after_loop",
        "refused",
        ((ESFT_LOOP, ESFT_LOOP.replace("        else:\n", "            y = y * 2.0\n        else:\n")),),
        why="`y = y * 2.0` sits between",
        options=("--no-fuse-experts",),
    ),
    Mutation(
        "esft",
        "statement_before_sum",
        "refused",
        (_before(ESFT_SUM, "        y = y.float()\n"),),
        why="no weighted sum right after",
        options=("--no-fuse-experts",),
    ),
    Mutation(
        "esft",
        "expert_casts_to_up_proj_dtype",
        "exact",
        ((ESFT_CAST, ESFT_CAST.replace("gate_proj", "up_proj")),),
        options=("--no-fuse-experts",),
    ),
    Mutation(
        "esft",
        "expert_without_cast_back",
        "refused",
        ((ESFT_CAST_BACK, "        return down_proj\n"),),
        why="DeepseekV2MLP.forward: `x = x.to(self.gate_proj.weight.dtype)` differs from the expert MLP",
        options=("--no-fuse-experts",),
    ),
    Mutation(
        "esft",
        "expert_cast_to_a_fixed_dtype",
        "refused",
        ((ESFT_CAST, "        x = x.to(torch.float32)\n"),),
        why="DeepseekV2MLP.forward: `x = x.to(torch.float32)` differs from the expert MLP",
        options=("--no-fuse-experts",),
    ),
    Mutation(
        "esft",
        "expert_cast_to_a_buffer_dtype",
        "refused",
        ((ESFT_CAST, "        x = x.to(self.act_fn.weight.dtype)\n"),),
        why="casts x to self.act_fn.weight.dtype, which is not one of its projections",
        options=("--no-fuse-experts",),
    ),
    # V3 form: the eval branch and the training guards
    Mutation("v3", "output_scaled_in_eval", "exact", (_after(V3_INFER, "            y = y * 2.0\n"),)),
    Mutation(
        "v3", "weights_scaled_in_eval", "exact", (_before(V3_INFER, "            topk_weight = topk_weight * 0.5\n"),)
    ),
    Mutation(
        "v3",
        "renamed_result",
        "exact",
        ((V3_INFER, V3_INFER.replace("            y =", "            out =") + "            y = out\n"),),
    ),
    Mutation("v3", "one_line_branch", "exact", ((V3_BRANCH, "        if not self.training: " + V3_INFER.lstrip()),)),
    Mutation("v3", "guard_is_false", "exact", ((V3_GUARD, "            assert self.training is False\n"),)),
    Mutation(
        "v3", "guard_equals_false", "exact", ((V3_GUARD, "            assert self.training == False  # noqa: E712\n"),)
    ),
    Mutation("v3", "guard_with_message", "exact", ((V3_GUARD, '            assert not self.training, "eval only"\n'),)),
    Mutation(
        "v3",
        "guard_as_raise",
        "exact",
        ((V3_GUARD, '            if self.training:\n                raise NotImplementedError("eval only")\n'),),
    ),
    Mutation(
        "v3", "guard_in_moe_forward", "exact", ((V3_MOE_START, "        assert not self.training\n" + V3_MOE_START),)
    ),
    Mutation(
        "v3",
        "guard_unknown_spelling",
        "refused",
        ((V3_GUARD, "            assert self.training != True  # noqa: E712\n"),),
        why="the check on `self.training != True`",
    ),
    Mutation(
        "v3",
        "eval_branch_reads_training",
        "refused",
        (_after(V3_INFER, "            y = y * (2.0 if self.training else 1.0)\n"),),
        why="depends on training mode",
    ),
    Mutation(
        "v3",
        "eval_under_no_grad",
        "refused",
        ((V3_INFER, "            with torch.no_grad():\n    " + V3_INFER),),
        why="does not assign the result of self.moe_infer",
    ),
]


def _moe(form: str) -> str:
    return f"DeepseekV{form[1]}MoE"


def _moe_infer_and_paths_around_it(form: str) -> list[Mutation]:
    """moe_infer's body (proved against the published one), the eval call's shape, global statements, helpers that
    read self.training, subclasses of the MoE class: the same families for the V3 and V2 forms."""
    moe, attention = _moe(form), f"class DeepseekV{form[1]}Attention(nn.Module):\n"
    keywords = EVAL_CALL.replace(
        "self.moe_infer(hidden_states, topk_idx, topk_weight)",
        "self.moe_infer(topk_weight=topk_weight, x=hidden_states, topk_ids=topk_idx)",
    )
    post = "    def _post(self, y):\n        return y * (2.0 if self.training else 1.0)\n\n"
    unknown = "is not in any published moe_infer moe-rewrite knows"
    mutations = [
        Mutation(
            form,
            "moe_infer_scales_weights",
            "refused",
            (_after(MI_DOC, "        topk_weight = topk_weight * self.config.routed_scaling_factor\n"),),
            why=f"{moe}.moe_infer: `topk_weight = topk_weight * self.config.routed_scaling_factor` {unknown}",
        ),
        Mutation(
            form,
            "moe_infer_normalises_weights",
            "refused",
            (_after(MI_DOC, "        topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)\n"),),
            why="`topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)` " + unknown,
        ),
        Mutation(
            form,
            "moe_infer_skips_pruned_expert",
            "refused",
            (_before(MI_EXPERT, "            if first_expert + local_idx == 3:\n                continue\n"),),
            why=f"`if first_expert + local_idx == 3:` {unknown}",
        ),
        Mutation(
            form,
            "moe_infer_zeroes_pruned_expert",
            "refused",
            (
                (
                    MI_SUM,
                    MI_SUM.replace(
                        "topk_weight.unsqueeze(-1)", "topk_weight.masked_fill(topk_ids == 3, 0).unsqueeze(-1)"
                    ),
                ),
            ),
            why=unknown,
        ),
        Mutation(
            form,
            "moe_infer_other_constant",
            "refused",
            ((MI_SUM, MI_SUM.replace("sum(dim=1)", "sum(dim=0)")),),
            why=unknown,
        ),
        Mutation(
            form,
            "moe_infer_inference_mode",
            "refused",
            ((MI_DECORATED, MI_DECORATED.replace("no_grad", "inference_mode")),),
            why="@torch.inference_mode() is not how published files define moe_infer",
        ),
        Mutation(
            form,
            "moe_infer_renamed_reformatted",
            "exact",
            (
                (MI_DEF, MI_DEF.replace("(self, x,", "(self, tokens,")),
                (MI_ROUTED, "        routed = tokens[\n            order // k\n        ]\n"),
                (MI_DEVICE, "device=tokens.device)\n"),
                (MI_COUNTS, "        sizes = per_expert.cpu().numpy()\n"),
                (MI_LOOP, "        for (local_idx, count) in enumerate(sizes):\n"),
            ),
        ),
        Mutation(
            form,
            "moe_infer_comments_docstring",
            "exact",
            (
                (MI_DOC, '        """Route the tokens.\n\n        Another docstring, on two lines.\n        """\n'),
                _before(MI_SUM, "        # the weighted sum, in the weights' dtype\n"),
                (MI_EXPERT, MI_EXPERT.rstrip("\n") + "  # this rank's expert\n"),
            ),
        ),
        Mutation(form, "moe_infer_not_decorated", "exact", ((MI_DECORATED, MI_DEF),)),
        # the eval branch's call: keywords bound to moe_infer's own parameters
        Mutation(form, "call_keywords_other_order", "exact", ((EVAL_CALL, keywords),)),
        Mutation(
            form,
            "call_keywords_renamed_parameters",
            "exact",
            (
                (EVAL_CALL, keywords.replace("x=", "tokens=")),
                (MI_DEF, MI_DEF.replace("(self, x,", "(self, tokens,")),
                (MI_ROUTED, MI_ROUTED.replace("x[", "tokens[")),
                (MI_DEVICE, "device=tokens.device)\n"),
            ),
        ),
        Mutation(
            form,
            "call_unknown_keyword",
            "refused",
            ((EVAL_CALL, EVAL_CALL.replace("topk_idx, topk_weight)", "topk_idx, weights=topk_weight)")),),
            why="moe_infer's parameters are x, topk_ids, topk_weight",
        ),
        Mutation(
            form,
            "call_double_star",
            "refused",
            (
                (
                    EVAL_CALL,
                    EVAL_CALL.replace("topk_idx, topk_weight)", "**dict(topk_ids=topk_idx, topk_weight=topk_weight))"),
                ),
            ),
            why="should take three arguments (tokens, topk ids, topk weights), by position or by moe_infer's parameter names",
        ),
        # subclasses of the MoE class that override what moe-rewrite proved
        Mutation(
            form,
            "subclass_overrides_moe_infer",
            "refused",
            (
                _before(
                    attention,
                    f"class PrunedMoE({moe}):\n    def moe_infer(self, x, topk_ids, topk_weight):\n"
                    "        return super().moe_infer(x, topk_ids, topk_weight * 0.5)\n\n\n",
                ),
            ),
            why=f"PrunedMoE derives from {moe} and overrides moe_infer",
        ),
        Mutation(
            form,
            "subclass_of_subclass_overrides_forward",
            "refused",
            (
                _before(
                    attention,
                    f"class BaseMoE({moe}):\n    pass\n\n\nclass MyMoE(BaseMoE):\n    def forward(self, hidden_states):\n"
                    "        return super().forward(hidden_states) * 2.0\n\n\n",
                ),
            ),
            why=f"MyMoE derives from {moe} and overrides forward",
        ),
    ]
    if form == "v3":
        mutations += [
            Mutation(
                form,
                "call_keywords_aux_loss",
                "exact",
                ((EVAL_CALL, keywords),),
                options=("--aux-loss",),
                reference="fixture",
            ),
            Mutation(
                form,
                "call_keywords_bias_update",
                "exact",
                ((EVAL_CALL, keywords),),
                options=("--bias-update", "0.001"),
                reference="fixture",
            ),
            Mutation(
                form,
                "call_keywords_moved_expression",
                "refused",
                ((EVAL_CALL, keywords.replace("topk_weight=topk_weight,", "topk_weight=topk_weight.float(),")),),
                why="pass them in moe_infer's order, or as plain names",
            ),
            Mutation(
                form,
                "global_in_eval_branch",
                "exact",
                (
                    _before(f"class {moe}(nn.Module):\n", "EVAL_CALLS = 0\n\n\n"),
                    _before(EVAL_CALL, "            global EVAL_CALLS\n            EVAL_CALLS += 1\n"),
                ),
            ),
            Mutation(
                form,
                "helper_method_reads_training",
                "refused",
                (_before(MI_DECORATED, post), _after(EVAL_CALL, "            y = self._post(y)\n")),
                why="`y = self._post(y)` in the eval branch calls _post(), which reads `.training`",
            ),
            Mutation(
                form,
                "submodule_reads_training",
                "refused",
                (
                    _before(
                        f"class {moe}(nn.Module):\n",
                        "class Scale(nn.Module):\n    def forward(self, y):\n"
                        "        return y * (2.0 if self.training else 1.0)\n\n\n",
                    ),
                    _after("        self.gate = MoEGate(config)\n", "        self.post = Scale()\n"),
                    _after(EVAL_CALL, "            y = self.post(y)\n"),
                ),
                why="`y = self.post(y)` in the eval branch calls post(), which reads `.training`",
            ),
            Mutation(
                form,
                "helper_function_reads_training_through_method",
                "refused",
                (
                    _before(
                        f"class {moe}(nn.Module):\n",
                        "def _scale(module, y):\n    return y * (2.0 if module.training else 1.0)\n\n\n",
                    ),
                    _before(MI_DECORATED, "    def _post(self, y):\n        return _scale(self, y)\n\n"),
                    _after(EVAL_CALL, "            y = self._post(y)\n"),
                ),
                why="`y = self._post(y)` in the eval branch calls _post() -> _scale(), which reads `.training`",
            ),
        ]
    else:  # V2: the training branch is rewritten in place, its own statements run in training as before
        mutations += [
            Mutation(
                form,
                "global_in_training_branch",
                "exact",
                (
                    _before(f"class {moe}(nn.Module):\n", "TRAIN_CALLS = 0\n\n\n"),
                    _before(V2_REPEAT, "            global TRAIN_CALLS\n            TRAIN_CALLS += 1\n"),
                ),
            ),
            Mutation(
                form,
                "helper_reads_training_in_training_branch",
                "exact",
                (_before(MI_DECORATED, post), _after(V2_SUM, "            y = self._post(y)\n")),
            ),
        ]
    return mutations


# moe_infer's body, the call's shape, MoE subclasses, helpers (V3 and V2)
MUTATIONS += _moe_infer_and_paths_around_it("v3") + _moe_infer_and_paths_around_it("v2")


# The eager attention's core in the V3 stand-in (the V2 one is the same but for the class name)
SCORE = "            torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale\n"
SCORE_START = "        attn_weights = (\n" + SCORE + "        )\n"
SOFTMAX_DTYPE = "            attn_weights, dim=-1, dtype=torch.float32\n"
CONTIGUOUS = "        attn_output = attn_output.transpose(1, 2).contiguous()\n"
LEFT = "attention: DeepseekV3Attention left as published: "


def _attention_mutations() -> list[Mutation]:
    """The eager attention as people hand-edit it: each variant runs through SDPA with the variant's own numbers, or
    is left as published (its mask too) with a line saying why; the rest of the file is rewritten either way."""
    alibi = "        alibi = -0.01 * torch.arange(kv_seq_len, dtype=query_states.dtype, device=query_states.device)\n"
    return [
        Mutation(
            "v3",
            "attention_scale_expression",
            "exact",
            ((SCORE, SCORE.replace("self.softmax_scale", "(self.softmax_scale * 0.5)")),),
            attention="sdpa",
        ),
        Mutation(
            "v3",
            "attention_two_statement_score",
            "exact",
            (
                (
                    SCORE_START,
                    "        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))\n"
                    "        attn_weights = attn_weights * self.softmax_scale\n",
                ),
            ),
            attention="sdpa",
        ),
        Mutation(
            "v3",
            "attention_no_contiguous",
            "exact",
            ((CONTIGUOUS, CONTIGUOUS.replace(".contiguous()", "")),),
            attention="sdpa",
        ),
        Mutation(
            "v3",
            "attention_extra_score_term",
            "exact",
            ((SCORE_START, alibi + SCORE_START.replace("self.softmax_scale\n", "self.softmax_scale + alibi\n")),),
            attention=LEFT + "the scores `attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * "
            "self.softmax_scale + alibi` are not",
        ),
        Mutation(
            "v3",
            "attention_softmax_dtype",
            "exact",
            ((SOFTMAX_DTYPE, SOFTMAX_DTYPE.replace("float32", "float64")),),
            attention=LEFT + "`attn_weights = nn.functional.softmax(",
        ),
        Mutation(
            "v3",
            "attention_mask_reassigned",
            "exact",
            (_before(SCORE_START, "        attention_mask = attention_mask * 1\n"),),
            attention=LEFT + "`attention_mask` is reassigned before the core",
        ),
        Mutation(  # a line's second statement, not hidden behind the proven softmax (kit/prove.py)
            "v3",
            "attention_second_statement_on_a_line",
            "exact",
            (
                (
                    "        ).to(query_states.dtype)\n",
                    "        ).to(query_states.dtype); attn_weights = attn_weights * 2\n",
                ),
            ),
            attention=LEFT + "`attn_weights = nn.functional.softmax(",
        ),
        Mutation(  # a global the core reads, bound in the forward (kit/prove.py)
            "v3",
            "attention_nn_bound_in_forward",
            "exact",
            (_before(SCORE_START, "        from torch import nn\n"),),
            attention=LEFT + "`attn_weights = nn.functional.softmax(",
        ),
    ]


MUTATIONS += _attention_mutations()

DECODER_START = "        attn_in = self.input_layernorm(hidden_states)\n"
ATTENTION_INIT = "        self._init_rope()\n"
MASK_LEFT = "attention mask: DeepseekV3Model left as published: "
SCALE_LEFT = LEFT + "the softmax scale `self.softmax_scale * "


def _mask_and_scale_mutations() -> list[Mutation]:
    """The Model's mask edited on its way to the attention core, and a tensor softmax scale (issue 47): the 4-D mask
    (or the core) stays as published with a line saying why, and training gives the variant's own numbers. Without
    the checks, the mask became None (a plain causal model: the window or the in-place edit skipped, the decoder's
    raise or arithmetic failing on None) and the tensor scale reached SDPA's scale=, which takes a float."""
    return [
        Mutation(  # (a) a per-layer sliding window under a None guard
            "v3",
            "mask_window_in_decoder_layer",
            "exact",
            (
                _before(
                    DECODER_START,
                    "        if attention_mask is not None:\n"
                    "            far = torch.ones_like(attention_mask, dtype=torch.bool).tril(-4)\n"
                    "            attention_mask = attention_mask.masked_fill(far, torch.finfo(attention_mask.dtype).min)\n",
                ),
            ),
            mask=MASK_LEFT + "DeepseekV3DecoderLayer.forward uses the mask: `if attention_mask is not None:`",
        ),
        Mutation(  # (b) arithmetic on the mask without a guard
            "v3",
            "mask_arithmetic_in_decoder_layer",
            "exact",
            (_before(DECODER_START, "        attention_mask = attention_mask * 1.0\n"),),
            mask=MASK_LEFT + "DeepseekV3DecoderLayer.forward uses the mask: `attention_mask = attention_mask * 1.0`",
        ),
        Mutation(  # (c) a store into the mask in the attention forward (in place: a subscript store `mask[...] = `
            # fails on the expanded mask built without a 2-D one, as this training step has it; tests/test_attention_mask.py)
            "v3",
            "mask_stored_into_in_attention",
            "exact",
            (
                _before(
                    SCORE_START,
                    "        if attention_mask is not None:\n            attention_mask.data = attention_mask.data - 1.0\n",
                ),
            ),
            mask=MASK_LEFT + "DeepseekV3Attention.forward uses the mask outside its core: "
            "`if attention_mask is not None:`",
        ),
        Mutation(  # (d) the decoder layer raises without a mask
            "v3",
            "mask_required_by_decoder_layer",
            "exact",
            (
                _before(
                    DECODER_START,
                    "        if attention_mask is None:\n"
                    '            raise ValueError("the decoder layer needs the 4-D mask")\n',
                ),
            ),
            mask=MASK_LEFT + "DeepseekV3DecoderLayer.forward uses the mask: `if attention_mask is None:`",
        ),
        Mutation(  # a learnable temperature
            "v3",
            "attention_scale_learnable_temperature",
            "exact",
            (
                _after(ATTENTION_INIT, "        self.temperature = nn.Parameter(torch.full((1,), 0.8))\n"),
                (SCORE, SCORE.replace("self.softmax_scale", "(self.softmax_scale * self.temperature)")),
            ),
            attention=SCALE_LEFT + "self.temperature` may be a tensor",
        ),
        Mutation(  # a per-head scale buffer
            "v3",
            "attention_scale_per_head_buffer",
            "exact",
            (
                _after(
                    ATTENTION_INIT,
                    '        self.register_buffer("head_scale", torch.linspace(0.5, 1.5, self.num_heads).view(-1, 1, 1), '
                    "persistent=False)\n",
                ),
                (SCORE, SCORE.replace("self.softmax_scale", "(self.softmax_scale * self.head_scale)")),
            ),
            attention=SCALE_LEFT + "self.head_scale` may be a tensor",
        ),
    ]


MUTATIONS += _mask_and_scale_mutations()


def variant_text(mutation: Mutation) -> str:
    return mutation.apply((mutation.fixture / mutation.modeling).read_text())


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    for mutation in MUTATIONS:
        target = out / f"{mutation.form}_{mutation.name}"
        target.mkdir(parents=True, exist_ok=True)
        (target / mutation.modeling).write_text(variant_text(mutation))
    print(f"{len(MUTATIONS)} variants in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
