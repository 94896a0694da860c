"""Variants of the Kimi stand-in (fixtures/kimi) for the exact-or-refused test (tests/test_mutations.py): the training
guard respelled, the expert MLP's projections used in another order or written otherwise (they are read by use, not
by name), and what moe-rewrite must refuse."""

from __future__ import annotations

from mutations import Mutation

GUARD = '            raise NotImplementedError("KimiSparseMoeBlock runs in eval mode only")\n'
ELSE = "        else:\n" + GUARD
EXPERT_FORWARD = (
    "        mixed = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)\n"
    "        mixed = self.w2(mixed)\n"
    "        return mixed\n"
)
INPLACE = "        scores_for_choice += self.e_score_correction_bias.unsqueeze(0)\n"
VIEW = "        scores_for_choice = scores.view(tokens, -1)\n"
LOGITS = "        logits = F.linear("
KIMI = ("w1", "w3", "w2")  # gate, up, down as the stand-in's expert forward uses them

KIMI_MUTATIONS = [
    Mutation(
        "kimi",
        "guard_without_message",
        "exact",
        ((GUARD, "            raise NotImplementedError\n"),),
        projections=KIMI,
    ),
    Mutation(
        "kimi",
        "guard_runtime_error",
        "exact",
        ((GUARD, '            raise RuntimeError("eval only")\n'),),
        projections=KIMI,
    ),
    Mutation(
        "kimi",
        "guard_one_line",
        "exact",
        ((ELSE, '        else: raise NotImplementedError("eval only")\n'),),
        projections=KIMI,
    ),
    Mutation(
        "kimi",
        "guard_with_another_statement",
        "refused",
        ((GUARD, "            print('training')\n" + GUARD),),
        why="`if not self.training:` already has an else branch that moe-rewrite did not write",
    ),
    Mutation(
        "kimi",
        "expert_w1_w3_swapped",
        "exact",
        (
            (
                EXPERT_FORWARD,
                EXPERT_FORWARD.replace("self.w1(", "self.W(")
                .replace("self.w3(", "self.w1(")
                .replace("self.W(", "self.w3("),
            ),
        ),
        projections=("w3", "w1", "w2"),
    ),
    Mutation(
        "kimi",
        "expert_one_expression_product_swapped",
        "exact",
        ((EXPERT_FORWARD, "        return self.w2(self.w3(hidden_states) * self.act_fn(self.w1(hidden_states)))\n"),),
        projections=KIMI,
    ),
    Mutation(
        "kimi",
        "expert_down_as_gate",
        "refused",
        ((EXPERT_FORWARD, "        return self.w1(self.act_fn(self.w2(hidden_states)) * self.w3(hidden_states))\n"),),
        why="KimiBlockSparseMLP.__init__: the projections' sizes differ",
    ),
    Mutation(
        "kimi",
        "expert_output_scaled",
        "refused",
        ((EXPERT_FORWARD, EXPERT_FORWARD.replace("self.w2(mixed)", "self.w2(mixed) * 0.5")),),
        why="KimiBlockSparseMLP.forward: `return mixed` differs from the expert MLP",
    ),
    Mutation(
        "kimi",
        "gate_another_inplace_add",
        "refused",
        ((LOGITS, "        logits = 0\n        logits += 1\n" + LOGITS),),
        why="KimiMoEGate.forward: `logits += 1` changes a tensor in place",
    ),
    Mutation(
        "kimi",
        "gate_bias_added_out_of_place",
        "exact",
        ((VIEW + INPLACE, VIEW.replace("-1)", "-1) + self.e_score_correction_bias.unsqueeze(0)")),),
        projections=KIMI,
    ),
]
