"""The fused RMSNorm codemod on snippets: what it rewrites, what it leaves as published and says so, idempotence,
--no-fused-norm; the rewritten norm on the CPU gives the published numbers (the fused kernel runs on CUDA only:
tests/test_triton_kernels.py and tests/test_cuda_kernels.py test it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli

from moe_rewrite import RewriteOptions, rewrite_source
from moe_rewrite.runtime.kernels import triton_rmsnorm

PAIRS = Path(__file__).parent / "pairs"
# The published norm, as every DeepSeek copy writes it (its docstring in __init__, as there)
NORM = '''

class TinyRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        """
        TinyRMSNorm is equivalent to T5LayerNorm
        """
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        # remembered to cast back
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
'''
SNIPPET = (PAIRS / "v3_basic.in.py").read_text() + NORM
BRANCH = """\
    def forward(self, hidden_states):
        # moe-rewrite: the fused RMSNorm where it applies (CUDA, Triton); the published norm otherwise
        if _moe_rewrite_rmsnorm_applies(hidden_states, self.weight):
            return _moe_rewrite_rmsnorm(hidden_states, self.weight, self.variance_epsilon)
        # remembered to cast back
        input_dtype = hidden_states.dtype
"""
FUSED_LINE = "norm: fused RMSNorm in TinyRMSNorm (Triton on CUDA; the published norm elsewhere)"
RSQRT = "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)"


def test_the_published_norm_gets_the_fused_branch_first():
    result = rewrite_source(SNIPPET)
    assert BRANCH in result.text
    # the published body stays, below the branch
    assert NORM.split("    def forward(self, hidden_states):\n")[1].split("\n", 2)[2] in result.text
    assert "triton_rmsnorm" in result.sections and "def _moe_rewrite_rmsnorm(" in result.text
    assert result.norm == (FUSED_LINE,)
    again = rewrite_source(result.text)
    assert not again.changed and again.text == result.text


def test_no_fused_norm_leaves_the_norm_as_published_and_takes_an_earlier_branch_back():
    plain = rewrite_source(SNIPPET, RewriteOptions(fused_norm=False))
    assert NORM in plain.text and "_moe_rewrite_rmsnorm" not in plain.text and plain.norm == ()
    assert "no-fused-norm" in RewriteOptions(fused_norm=False).describe()
    rewritten = rewrite_source(SNIPPET).text
    assert rewrite_source(rewritten, RewriteOptions(fused_norm=False)).text == plain.text


VARIANTS = {
    # (old, new, what the summary line says)
    "eps outside the rsqrt": (
        RSQRT,
        "hidden_states = hidden_states * torch.rsqrt(variance) + self.variance_epsilon",
        "`hidden_states = hidden_states * torch.rsqrt(variance) + self.variance_epsilon` where the published norm "
        f"has `{RSQRT}`",
    ),
    "no fp32 upcast": (
        "        hidden_states = hidden_states.to(torch.float32)\n",
        "",
        "`variance = hidden_states.pow(2).mean(-1, keepdim=True)` where the published norm has "
        "`hidden_states = hidden_states.to(torch.float32)`",
    ),
    "a mean over another dim": ("mean(-1,", "mean(1,", "`variance = hidden_states.pow(2).mean(1, keepdim=True)`"),
    "the weight added": ("self.weight *", "self.weight +", "`return self.weight + hidden_states.to(input_dtype)`"),
    "a bias": (
        "hidden_states.to(input_dtype)\n",
        "hidden_states.to(input_dtype) + self.bias\n",
        "`return self.weight * hidden_states.to(input_dtype) + self.bias`",
    ),
    "the weight not ones": ("torch.ones(hidden_size)", "torch.randn(hidden_size)", "its weight is not set once"),
    "eps fixed": ("self.variance_epsilon = eps", "self.variance_epsilon = 1e-5", "its epsilon is not set from"),
    "eps reset in forward": (
        "        input_dtype = hidden_states.dtype\n",
        "        self.variance_epsilon = 0.0\n        input_dtype = hidden_states.dtype\n",
        "`self.variance_epsilon = 0.0` where the published norm has `input_dtype = hidden_states.dtype`",
    ),
    # fused before the prover of codemods/kit, which compared only a line's first statement
    "a second statement on a line": (
        "        input_dtype = hidden_states.dtype\n",
        "        input_dtype = hidden_states.dtype; hidden_states = hidden_states * 2\n",
        "where the published norm has `input_dtype = hidden_states.dtype` (2 statements on one line)",
    ),
}


@pytest.mark.parametrize("case", VARIANTS)
def test_a_norm_that_differs_is_left_as_published_with_a_line(case):
    old, new, says = VARIANTS[case]
    assert old in NORM
    norm = NORM.replace(old, new)
    result = rewrite_source(SNIPPET.replace(NORM, norm))
    assert norm in result.text and "_moe_rewrite_rmsnorm" not in result.text
    assert len(result.norm) == 1 and result.norm[0].startswith("norm: TinyRMSNorm left as published: ")
    assert says in result.norm[0], result.norm[0]


def test_other_spellings_of_the_published_norm_are_fused():
    """The names of locals and the variance inside the rsqrt (the stand-in fixtures' spelling) do not matter."""
    spelled = NORM.replace(
        "        hidden_states = hidden_states.to(torch.float32)\n"
        "        variance = hidden_states.pow(2).mean(-1, keepdim=True)\n"
        f"        {RSQRT}\n"
        "        return self.weight * hidden_states.to(input_dtype)\n",
        "        x = hidden_states.to(torch.float32)\n"
        "        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)\n"
        "        return self.weight * x.to(input_dtype)\n",
    ).replace("input_dtype", "dtype")
    assert spelled != NORM
    result = rewrite_source(SNIPPET.replace(NORM, spelled))
    assert result.norm == (FUSED_LINE,)


def test_cli_no_fused_norm_and_the_summary_lines(tmp_path):
    path = tmp_path / "modeling_deepseek.py"
    path.write_text(SNIPPET)
    code, _, err = run_cli(path, "--check", "--no-fused-norm")
    assert code == 1 and "no-fused-norm" in err and "norm:" not in err
    code, _, err = run_cli(path, "--in-place", "-v")
    assert code == 1 and f"\n  {FUSED_LINE}\n" in err
    left = path.with_name("left.py")
    left.write_text(SNIPPET.replace(RSQRT, RSQRT.replace("torch.rsqrt", "1 / torch.sqrt")))
    code, _, err = run_cli(left, "--check")
    assert code == 1 and "\n  norm: TinyRMSNorm left as published: `hidden_states = hidden_states * 1 / torch" in err


def test_the_rewritten_norm_gives_the_published_numbers_on_the_cpu():
    """Off CUDA the branch is not taken: the published body runs, its output and gradients bit for bit."""
    import torch.nn as nn

    x = torch.randn(2, 5, 24)
    assert not triton_rmsnorm._moe_rewrite_rmsnorm_applies(x, torch.ones(24))
    rewritten = rewrite_source(SNIPPET).text
    runs = []
    for code in (NORM, rewritten[rewritten.index("\nclass TinyRMSNorm") :]):  # the class is the file's last
        namespace = {"nn": nn, "torch": torch, **vars(triton_rmsnorm)}
        exec(compile(code, "norm", "exec"), namespace)
        norm = namespace["TinyRMSNorm"](24)
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, 24))
        leaf = x.clone().requires_grad_(True)
        y = norm(leaf)
        (y * torch.linspace(-1, 1, 24)).sum().backward()
        runs.append((y, leaf.grad, norm.weight.grad))
    assert "_moe_rewrite_rmsnorm_applies(hidden_states" in rewritten
    for a, b in zip(*runs):
        assert torch.equal(a, b)
