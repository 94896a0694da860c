"""codemods/moe/expert_parallel.py: the published MoE __init__'s `assert config.ep_size == dist.get_world_size()` goes
and `self.ep_rank = dist.get_rank()` becomes `_moe_rewrite_ep_rank(config)` (the rank's place in its group of ep
consecutive ranks); any other spelling of that branch stays as published, with a summary line saying why."""

from __future__ import annotations

import libcst as cst
import pytest
from conftest import FIXTURES, run_cli
from mutations import Mutation

from moe_rewrite.codemods.kit import Context, MoeClassInfo
from moe_rewrite.codemods.moe import expert_parallel
from moe_rewrite.options import RewriteOptions
from moe_rewrite.rewrite import rewrite_source

ASSERT = "            assert config.ep_size == dist.get_world_size()\n"
EP_SIZE = "            self.ep_size = config.ep_size\n"
EP_RANK = "            self.ep_rank = dist.get_rank()\n"
LO = "            lo = self.ep_rank * self.experts_per_rank\n"
OURS = (
    f"            {expert_parallel.NOTE}\n"  # the note, then our call, where the published assignment was
    "            self.ep_rank = _moe_rewrite_ep_rank(config)\n"
)
LEFT = "expert parallelism: DeepseekV2MoE.__init__ left as published (ep_size must equal the world size): "


def _init(text: str, moe: str) -> str:
    """The MoE class's __init__ as text."""
    start = text.index(f"class {moe}(")
    start = text.index("    def __init__(", start)
    return text[start : text.index("    def ", start + 1)]


def _moe_ep(text: str, form: str = "v2", moe: str = "DeepseekV2MoE") -> tuple[str, list[str]]:
    """The expert_parallel codemod alone on `text` (the MoE class as moe_forward finds it): (its output, its summary
    lines). The whole rewrite takes a second and a half per file; this one codemod a tenth of that."""
    options = RewriteOptions(expert_parallel=True)  # the lines are said only where expert parallelism is generated
    context = Context(options=options, moe=MoeClassInfo(name=moe, gate_class="MoEGate", form=form))
    return expert_parallel.transform(cst.parse_module(text), context).code, context.chosen


V2_TEXT = (FIXTURES / "deepseek_v2" / "modeling_deepseek.py").read_text()


@pytest.mark.parametrize("form, moe", [("v3", "DeepseekV3MoE"), ("v2", "DeepseekV2MoE")])
def test_the_published_branch_lifts_the_world_size_restriction(form, moe):
    published = (FIXTURES / f"deepseek_{form}" / "modeling_deepseek.py").read_text()
    result = rewrite_source(published)
    init = _init(result.text, moe)
    want = _init(published, moe).replace(ASSERT, "").replace(EP_RANK, OURS)
    assert init == want and "get_world_size" not in init and "dist.get_rank()" not in init
    assert "def _moe_rewrite_ep_rank(config):" in result.text  # the runtime it calls, in the generated block
    assert not [line for line in result.chosen if line.startswith("expert parallelism")]
    # a second run finds its own call (the whole second run: test_codemod.py's test_fixture_under_options)
    assert _moe_ep(result.text, form, moe) == (result.text, [])


def test_a_reformatted_assert_is_the_same_assert_and_its_comment_stays():
    variant = Mutation(
        "v2",
        "reformatted",
        "exact",
        (
            (
                ASSERT,
                "            # DeepSeek's check\n            assert (\n                config.ep_size ==\n"
                "                dist.get_world_size()\n            )\n",
            ),
        ),
    ).apply(V2_TEXT)
    text, chosen = _moe_ep(variant)
    assert not chosen
    assert "get_world_size" not in _init(text, "DeepseekV2MoE")
    assert "            # DeepSeek's check\n" + EP_SIZE in text and OURS in text


def test_a_local_dist_elsewhere_is_not_the_module_one():
    """Another function's own `dist` (the generated runtime has some) is not the one __init__ reads."""
    local = "def _local(torch):\n    dist = torch.distributed\n    return dist\n\n\n"
    variant = Mutation("v2", "local_dist", "exact", (("class MoEGate(", local + "class MoEGate("),)).apply(V2_TEXT)
    text, chosen = _moe_ep(variant)
    assert not chosen and OURS in text


LEFT_AS_PUBLISHED = [
    ("assert_le", ((ASSERT, ASSERT.replace("==", "<=")),), "0 `assert config.ep_size == dist.get_world_size()`"),
    ("two_asserts", ((ASSERT, ASSERT + ASSERT),), "2 `assert config.ep_size == dist.get_world_size()`"),
    (
        "rank_from_environ",
        ((EP_RANK, '            self.ep_rank = int(os.environ["RANK"])\n'),),
        'ep_rank is not set once as `self.ep_rank = dist.get_rank()` (`self.ep_rank = int(os.environ["RANK"])`)',
    ),
    ("no_ep_size", ((EP_SIZE, ""),), "the branch does not set `self.ep_size = config.ep_size` once"),
    ("rank_read_again", ((LO, LO.replace("self.ep_rank", "dist.get_rank()")),), "get_rank is read again in __init__"),
    (
        "assert_shares_its_line",
        ((ASSERT + EP_SIZE, ASSERT.rstrip("\n") + "; " + EP_SIZE.lstrip()),),
        "is not a statement line of its own in the branch",
    ),
    (
        "dist_from_torch",
        (("import torch.distributed as dist\n", "from torch import distributed as dist\n"),),
        "`dist` is not bound by `import torch.distributed as dist` alone",
    ),
    (
        "dist_local_in_init",
        ((ASSERT, "            dist = torch.distributed\n" + ASSERT),),
        "`dist` is not bound by `import torch.distributed as dist` alone",
    ),
    (
        "dist_rebound",
        (("import torch.distributed as dist\n", "import torch.distributed as dist\n\ndist = None\n"),),
        "`dist` is not bound by `import torch.distributed as dist` alone",
    ),
]


@pytest.mark.parametrize("name, edits, why", LEFT_AS_PUBLISHED, ids=[case[0] for case in LEFT_AS_PUBLISHED])
def test_another_branch_is_left_as_published_and_said(name, edits, why):
    variant = Mutation("v2", name, "exact", edits).apply(V2_TEXT)
    text, chosen = _moe_ep(variant)
    assert text == variant
    assert len(chosen) == 1 and chosen[0].startswith(LEFT) and why in chosen[0], chosen


def test_the_summary_says_it_under_the_file(tmp_path):
    source = tmp_path / "modeling_deepseek.py"
    source.write_text(Mutation("v2", "assert_le", "exact", ((ASSERT, ASSERT.replace("==", "<=")),)).apply(V2_TEXT))
    code, _, err = run_cli(source, "--out", tmp_path / "out", "--expert-parallel")
    assert code == 0, err
    assert f"\n  {LEFT}0 `assert config.ep_size == dist.get_world_size()` in the branch, not one\n" in err, err
    assert "assert config.ep_size <= dist.get_world_size()\n" in (tmp_path / "out" / "modeling_deepseek.py").read_text()
    # without expert parallelism (the default) ep_size > 1 is refused at the first forward: nothing to say
    code, _, err = run_cli(source, "--out", tmp_path / "plain")
    assert code == 0 and "expert parallelism" not in err, err


def test_the_esft_form_keeps_its_branch():
    published = (FIXTURES / "deepseek_v2_esft" / "modeling_deepseek.py").read_text()
    text, chosen = _moe_ep(published, form="esft")
    assert text == published
    assert chosen == [f"{LEFT}ESFT form: its moe_ep exchanges rows over the whole world"]


@pytest.mark.parametrize(
    "path, moe", [("deepseek_moe/modeling_deepseek.py", "DeepseekMoE"), ("kimi/modeling_kimi.py", "KimiSparseMoeBlock")]
)
def test_a_file_without_the_branch_gets_no_change_and_no_line(path, moe):
    published = (FIXTURES / path).read_text()
    text, chosen = _moe_ep(published, form="v2", moe=moe)
    assert text == published and chosen == []
