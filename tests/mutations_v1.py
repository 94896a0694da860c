"""Variants of the V1-form stand-in (fixtures/deepseek_moe, DeepSeekMoE 16B) for the exact-or-refused test
(tests/test_mutations.py): the eval call's flat arguments spelled otherwise, the names respelled, statements and casts
around the loop, `ep_size` added, the expert MLP with the published file's `pretraining_tp` branch, and what
moe-rewrite must refuse (unflattened arguments to the flat moe_infer, the public forks' `.float()` in the loop, an
edited moe_infer body, an edited pretraining_tp branch)."""

from __future__ import annotations

from mutations import Mutation, _after, _before

FORWARD_START = "    def forward(self, hidden_states):\n        residual = hidden_states\n"
FORWARD_END = "            y = y + self.shared_experts(residual)\n        return y\n"
FLAT = "        flat_topk_idx = topk_idx.view(-1)\n"
EVAL_CALL = "self.moe_infer(hidden_states, flat_topk_idx, topk_weight.view(-1, 1))"
BUFFER = "            y = torch.empty_like(hidden_states)\n"
LOOP = "                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])\n"
SUM = "            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)\n"
VIEW = "            y = y.view(*orig_shape)\n"
REPEAT = "            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)\n"
INIT = "        self.num_experts_per_tok = config.num_experts_per_tok\n        self.experts = nn.ModuleList(\n"
INFER_MUL = "                expert_out.mul_(flat_expert_weights[order[start:end]])\n"
MLP_FORWARD = (
    "    def forward(self, x):\n        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\n"
)
# The published V1 expert MLP's forward (Llama's of its time): with pretraining_tp > 1 each projection runs as slices
# of its weight; else the plain MLP, which is what moe-rewrite proves (moe_train refuses pretraining_tp > 1).
TP_FORWARD = """    def forward(self, x):
        if self.config.pretraining_tp > 1:
            part = self.intermediate_size // self.config.pretraining_tp
            gate_w = self.gate_proj.weight.split(part, dim=0)
            up_w = self.up_proj.weight.split(part, dim=0)
            down_w = self.down_proj.weight.split(part, dim=1)
            tp = range(self.config.pretraining_tp)
            gate = torch.cat([F.linear(x, gate_w[i]) for i in tp], dim=-1)
            up = torch.cat([F.linear(x, up_w[i]) for i in tp], dim=-1)
            mixed = (self.act_fn(gate) * up).split(part, dim=2)
            down = sum(F.linear(mixed[i], down_w[i]) for i in tp)
        else:
            down = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return down
"""


def _forward_respelled(text: str) -> str:
    """The fixture's MoE forward with its tokens, ids, weights and flat ids renamed (read off the loop, not by name)."""
    forward = text[text.index(FORWARD_START) : text.index(FORWARD_END) + len(FORWARD_END)]
    renamed = (
        forward.replace("flat_topk_idx", "flat_ids")
        .replace("topk_idx", "ids")
        .replace("topk_weight", "weights")
        .replace("hidden_states", "tokens")
    )
    return forward, renamed


def _fixture_text() -> str:
    return (Mutation("v1", "", "exact", ()).fixture / "modeling_deepseek.py").read_text()


V1_MUTATIONS = [
    Mutation(
        "v1",
        "eval_flat_name_of_its_own_and_reshape",
        "exact",
        (
            (FLAT, FLAT + "        flat_ids = topk_idx.reshape(-1)\n"),
            (EVAL_CALL, "self.moe_infer(hidden_states, flat_ids, topk_weight.reshape(-1, 1))"),
        ),
    ),
    Mutation(
        "v1",
        "eval_inline_view_by_keyword",
        "exact",
        (
            (
                EVAL_CALL,
                "self.moe_infer(\n                hidden_states,\n"
                "                flat_expert_indices=topk_idx.view(-1),\n"
                "                flat_expert_weights=topk_weight.view(-1, 1),\n            )",
            ),
        ),
    ),
    Mutation(
        "v1",
        "eval_keywords_reordered_expressions",
        "refused",  # putting them in order would change when each is evaluated
        (
            (
                EVAL_CALL,
                "self.moe_infer(hidden_states, flat_expert_weights=topk_weight.view(-1, 1), "
                "flat_expert_indices=topk_idx.view(-1))",
            ),
        ),
        why="pass them in moe_infer's order, or as plain names",
    ),
    Mutation(
        "v1",
        "eval_weights_not_flattened",
        "refused",
        ((EVAL_CALL, "self.moe_infer(hidden_states, flat_topk_idx, topk_weight)"),),
        why="so moe_infer should get (hidden_states, topk_idx.view(-1), topk_weight.view(-1, 1))",
    ),
    Mutation(
        "v1",
        "eval_ids_not_flattened",
        "refused",
        ((EVAL_CALL, "self.moe_infer(hidden_states, topk_idx, topk_weight.view(-1, 1))"),),
        why="the eval branch calls self.moe_infer(hidden_states, topk_idx, topk_weight.view(-1, 1))",
    ),
    Mutation("v1", "names_respelled", "exact", (_forward_respelled(_fixture_text()),)),
    Mutation(
        "v1",
        "statements_around_the_loop_ep_size_and_cast",
        "exact",  # kept in order, before and after moe_train; ep_size read as the class has it; V2's cast
        (
            _before(INIT, "        self.ep_size = 1\n"),
            _before(REPEAT, "            topk_weight = topk_weight * 2\n"),
            (VIEW, "            y = y.to(hidden_states.dtype).view(*orig_shape) * 0.5\n"),
        ),
    ),
    Mutation(
        "v1",
        "statement_between_loop_and_sum",
        "refused",
        (_after(LOOP, "            y = y * 2\n"),),
        why="`y = y * 2` sits between the replaced per-expert statements and uses what they compute",
    ),
    Mutation(
        "v1",
        "fork_float_in_the_loop",
        "refused",  # exact for 16/32-bit tokens (stored back in their dtype), not for float64 ones
        (
            (BUFFER, "            y = torch.empty_like(hidden_states, dtype=hidden_states.dtype)\n"),
            (LOOP, LOOP.replace("])\n", "]).float()\n")),
        ),
        why="DeepseekMoE.forward: the experts loop `for i, expert in enumerate(self.experts): ...` is not",
    ),
    Mutation(
        "v1",
        "moe_infer_scaled_out_of_place",
        "refused",
        ((INFER_MUL, "                expert_out = expert_out * flat_expert_weights[order[start:end]]\n"),),
        why="DeepseekMoE.moe_infer: `expert_out = expert_out * flat_expert_weights[order[start:end]]`",
    ),
    Mutation(
        "v1",
        "expert_pretraining_tp_branch",
        "exact",  # the published branch, not taken with pretraining_tp 1
        ((MLP_FORWARD, TP_FORWARD),),
        config=(("pretraining_tp", 1),),
    ),
    Mutation(
        "v1",
        "expert_pretraining_tp_else_scaled",
        "refused",
        ((MLP_FORWARD, TP_FORWARD.replace("down = self.down_proj(", "down = 0.5 * self.down_proj(")),),
        why="DeepseekMLP.forward: `return down` differs from the expert MLP",
    ),
]
