"""moe_infer's proof (moe_rewrite/codemods/moe/moe_infer_body.py): the stand-ins' bodies are known, the comparison
ignores names, formatting, comments, docstrings and the expert-parallel blocks, and sees every constant, operator,
attribute and call; the eval call's keyword arguments are bound to moe_infer's parameters."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from moe_rewrite import RewriteError, rewrite_source
from moe_rewrite.codemods.moe.moe_infer_body import KNOWN_BODIES, check_moe_infer, fingerprint

ROOT = Path(__file__).resolve().parent.parent


def _moe_infer(path: Path) -> str:
    """The stand-in's moe_infer, decorator included, dedented."""
    text = path.read_text()
    start = text.index("    @torch.no_grad()\n    def moe_infer(")
    return textwrap.dedent(text[start : text.index("\n\n\nclass ", start)] + "\n")


V3 = _moe_infer(ROOT / "fixtures" / "deepseek_v3" / "modeling_deepseek.py")
DECORATED = "@torch.no_grad()\n"


@pytest.mark.parametrize("form", ["deepseek_v3", "deepseek_v2"])
def test_the_stand_ins_bodies_are_known(form):
    code = _moe_infer(ROOT / "fixtures" / form / "modeling_deepseek.py")
    assert fingerprint(code).body in KNOWN_BODIES
    check_moe_infer(code, "M.moe_infer")


def _same(a: str, b: str) -> bool:
    return fingerprint(a).body == fingerprint(b).body


PARAMETER_RENAMED = (
    ("def moe_infer(self, x,", "def moe_infer(self, hidden,"),
    ("x[order // k]", "hidden[order // k]"),
    ("device=x.device", "device=hidden.device"),
)


@pytest.mark.parametrize(
    "edits",
    [
        PARAMETER_RENAMED,
        (("counts", "sizes"),),  # a local, everywhere
        (("routed = x[order // k]", "routed = (\n        x[\n            order // k\n        ]  # comment\n    )"),),
        (('"""Send every (token, slot) pair to its expert, one batch per expert."""', '"""Another docstring."""'),),
        (("# number of routed slots", "# how many slots"),),
        (("dist.all_to_all_single(incoming, per_expert)", "pass"),),  # inside `if self.ep_size > 1:`
        ((DECORATED, ""),),  # decorators are checked apart
    ],
    ids=["parameter", "local", "format", "docstring", "comment", "ep-block", "decorator"],
)
def test_the_comparison_ignores(edits):
    edited = V3
    for old, new in edits:
        assert old in edited
        edited = edited.replace(old, new)
    assert edited != V3 and _same(V3, edited)


@pytest.mark.parametrize(
    "old, new",
    [
        ("unsqueeze(-1)).sum(dim=1)", "unsqueeze(-1)).sum(dim=2)"),  # a constant
        ("per_slot * topk_weight", "per_slot / topk_weight"),  # an operator
        ("topk_weight.unsqueeze(-1)", "topk_weight.unsqueeze(-1).softmax(-1)"),  # a call
        ("to(unsorted.dtype)", "to(topk_weight.dtype)"),  # which name is read
        ("torch.cat(pieces, dim=0)", "th.cat(pieces, dim=0)"),  # a global is not a local
        ("if count == 0:\n            continue", "if count == 0:\n            break"),  # control flow
    ],
    ids=["constant", "operator", "call", "name", "global", "control-flow"],
)
def test_the_comparison_sees(old, new):
    assert V3.count(old) == 1
    edited = V3.replace(old, new)
    assert not _same(V3, edited)
    with pytest.raises(RewriteError, match="training could not reproduce it exactly"):
        check_moe_infer(edited, "M.moe_infer")


def test_the_refusal_names_the_first_statement_no_known_body_has():
    doc = '"""Send every (token, slot) pair to its expert, one batch per expert."""\n'
    edited = V3.replace(doc, doc + "    topk_weight = topk_weight * self.routed_scaling_factor\n")
    with pytest.raises(RewriteError) as info:
        check_moe_infer(edited, "DeepseekV3MoE.moe_infer")
    assert str(info.value) == (
        "DeepseekV3MoE.moe_infer: `topk_weight = topk_weight * self.routed_scaling_factor` is not in any published "
        "moe_infer moe-rewrite knows; training could not reproduce it exactly"
    )


def test_statements_in_another_order_are_refused():
    edited = V3.replace("    pieces = []\n    offset = 0\n", "    offset = 0\n    pieces = []\n")
    assert edited != V3
    with pytest.raises(RewriteError, match="each statement is in a published moe_infer moe-rewrite knows, but not the"):
        check_moe_infer(edited, "M.moe_infer")


def test_another_decorator_is_refused():
    with pytest.raises(RewriteError, match=r"@functools.cache is not how published files define moe_infer"):
        check_moe_infer(V3.replace(DECORATED, "@functools.cache\n"), "M.moe_infer")


PAIR = (ROOT / "tests" / "pairs" / "v3_basic.in.py").read_text()
CALL = "self.moe_infer(hidden_states, topk_idx, topk_weight)"


def test_keyword_arguments_are_bound_by_name():
    """In another order: moe_train and moe_rewrite_infer get them by position, out_dtype is the tokens' dtype, and the
    --aux-loss and --bias-update statements read the tokens and the ids."""
    text = PAIR.replace(CALL, "self.moe_infer(topk_weight=topk_weight, topk_ids=topk_idx, x=hidden_states)")
    new = rewrite_source(text).text
    assert "y = self.moe_rewrite_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)" in new
    assert "y = self.moe_train(hidden_states, topk_idx, topk_weight, out_dtype=hidden_states.dtype)" in new
    assert rewrite_source(new).text == new  # a second run changes nothing
    from moe_rewrite import RewriteOptions

    new = rewrite_source(text, RewriteOptions(aux_loss=True, bias_update=0.001)).text
    assert "self.moe_rewrite_count_load(topk_idx)\n" in new
    assert "y = _moe_rewrite_with_balance_loss(self, y, hidden_states, topk_idx)\n" in new


def test_a_global_statement_in_the_eval_branch_is_left_out_of_the_training_copy():
    text = "CALLS = 0\n" + PAIR.replace(
        f"            y = {CALL}", f"            global CALLS\n            CALLS += 1\n            y = {CALL}"
    )
    new = rewrite_source(text).text
    compile(new, "modeling_deepseek.py", "exec")  # declaring CALLS again after its use would not compile
    assert new.count("global CALLS") == 1 and new.count("CALLS += 1") == 2
