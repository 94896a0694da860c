"""The fused RoPE codemod on snippets: what it rewrites, what it leaves as published and says so, idempotence,
--no-fused-rope; the rewritten function on the CPU gives the published numbers (the fused kernel runs on CUDA only:
tests/test_triton_kernels.py and tests/test_cuda_kernels.py test it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli

from moe_rewrite import RewriteOptions, rewrite_source
from moe_rewrite.runtime.kernels import triton_rope

PAIRS = Path(__file__).parent / "pairs"
# The published functions, as every DeepSeek V2/V3 copy writes them (in our words: the docstrings are ours)
ROPE = '''

def rotate_half(x):
    """The two halves of the last dim, (a, b), as (-b, a)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    """q and k rotated by the table rows of position_ids."""
    # the rows of the positions, broadcast over the heads
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)

    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)

    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)

    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
'''
SNIPPET = (PAIRS / "v3_basic.in.py").read_text() + ROPE
BRANCH = '''\
    """q and k rotated by the table rows of position_ids."""
    # moe-rewrite: the fused RoPE where it applies (CUDA, Triton); the published rotation otherwise
    if _moe_rewrite_rope_applies(q, k, cos, sin, position_ids, unsqueeze_dim):
        return _moe_rewrite_rope(q, k, cos, sin, position_ids)
    # the rows of the positions, broadcast over the heads
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
'''
FUSED_LINE = "rope: fused apply_rotary_pos_emb (Triton on CUDA; the published rotation elsewhere)"
DEINTERLEAVE = """
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)

    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
"""
LEFT = "rope: apply_rotary_pos_emb left as published: "


def test_the_published_rope_gets_the_fused_branch_first():
    result = rewrite_source(SNIPPET)
    assert BRANCH in result.text
    assert ROPE.split("    # the rows of the positions, broadcast over the heads\n")[1] in result.text
    assert "triton_rope" in result.sections and "def _moe_rewrite_rope(" in result.text
    assert result.rope == (FUSED_LINE,)
    again = rewrite_source(result.text)
    assert not again.changed and again.text == result.text


def test_no_fused_rope_leaves_the_rope_as_published_and_takes_an_earlier_branch_back():
    plain = rewrite_source(SNIPPET, RewriteOptions(fused_rope=False))
    assert ROPE in plain.text and "_moe_rewrite_rope(" not in plain.text and plain.rope == ()
    assert "triton_rope" not in plain.sections
    assert "no-fused-rope" in RewriteOptions(fused_rope=False).describe()
    rewritten = rewrite_source(SNIPPET).text
    assert rewrite_source(rewritten, RewriteOptions(fused_rope=False)).text == plain.text


def test_other_spellings_are_fused_and_the_not_interleaved_form_gets_its_flag():
    """Names of locals and parameters, parentheses and the stand-in fixtures' rotate_half do not matter; without the
    view/transpose lines the lanes are taken as they are."""
    spelled = """

def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(query, key, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    batch, heads, length, dim = query.shape
    query = query.view(batch, heads, length, dim // 2, 2).transpose(4, 3).reshape(batch, heads, length, dim)
    batch, heads, length, dim = key.shape
    key = key.view(batch, heads, length, dim // 2, 2).transpose(4, 3).reshape(batch, heads, length, dim)
    q_rotated = query * cos + rotate_half(query) * sin
    k_rotated = (key * cos) + (rotate_half(key) * sin)
    return q_rotated, k_rotated
"""
    assert spelled != ROPE
    result = rewrite_source(SNIPPET.replace(ROPE, spelled))
    assert result.rope == (FUSED_LINE,), result.rope
    assert "_moe_rewrite_rope_applies(query, key, cos, sin, position_ids, unsqueeze_dim)" in result.text
    llama = rewrite_source(SNIPPET.replace(DEINTERLEAVE, ""))
    assert llama.rope == (FUSED_LINE.replace("emb (", "emb, lanes not interleaved ("),)
    assert "return _moe_rewrite_rope(q, k, cos, sin, position_ids, interleaved=False)" in llama.text


VARIANTS = {
    # (old, new, what the summary line says)
    "another lane order": ("transpose(4, 3)", "transpose(3, 4).flip(-1)", "`q = q.view(b, h, s, d // 2, 2)"),
    "sin and cos swapped": (
        "(q * cos) + (rotate_half(q) * sin)",
        "(q * sin) + (rotate_half(q) * cos)",
        "`q_embed = (q * sin) + (rotate_half(q) * cos)` where the published apply_rotary_pos_emb has "
        "`q_embed = (q * cos)",
    ),
    "rotate_half the other way": ("torch.cat((-x2, x1)", "torch.cat((x2, -x1)", "rotate_half: `return torch.cat((x2"),
    "a scaled k": ("return q_embed, k_embed", "return q_embed, 2 * k_embed", "`return q_embed, 2 * k_embed`"),
    "unsqueeze at 2": ("unsqueeze_dim=1", "unsqueeze_dim=2", "does not take `(q, k, cos, sin, position_ids, unsq"),
    "only q de-interleaved": (
        "\n    b, h, s, d = k.shape\n    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)\n",
        "",
        "`q_embed = (q * cos) + (rotate_half(q) * sin)` where the published apply_rotary_pos_emb has "
        "`b, h, s, d = k.shape`",
    ),
    "rotate_half rebound": (
        "\n\ndef apply_rotary_pos_emb",
        "\nrotate_half = None\n\n\ndef apply_rotary_pos_emb",
        "apply_rotary_pos_emb or rotate_half is also bound by another module-level statement",
    ),
    # fused before the prover of codemods/kit, which compared only a line's first statement
    "a second statement on a line": (
        "    sin = sin[position_ids].unsqueeze(unsqueeze_dim)\n",
        "    sin = sin[position_ids].unsqueeze(unsqueeze_dim); sin = -sin\n",
        "has `sin = sin[position_ids].unsqueeze(unsqueeze_dim)` (2 statements on one line)",
    ),
}


@pytest.mark.parametrize("case", VARIANTS)
def test_a_rope_that_differs_is_left_as_published_with_a_line(case):
    old, new, says = VARIANTS[case]
    assert old in ROPE
    rope = ROPE.replace(old, new)
    result = rewrite_source(SNIPPET.replace(ROPE, rope))
    assert rope in result.text and "_moe_rewrite_rope(" not in result.text and "triton_rope" not in result.sections
    assert len(result.rope) == 1 and result.rope[0].startswith(LEFT), result.rope
    assert says in result.rope[0], result.rope[0]


def test_cli_no_fused_rope_and_the_summary_lines(tmp_path):
    path = tmp_path / "modeling_deepseek.py"
    path.write_text(SNIPPET)
    code, _, err = run_cli(path, "--check", "--no-fused-rope")
    assert code == 1 and "no-fused-rope" in err and "rope:" not in err
    code, _, err = run_cli(path, "--in-place", "-v")
    assert code == 1 and f"\n  {FUSED_LINE}\n" in err
    left = path.with_name("left.py")
    left.write_text(SNIPPET.replace("torch.cat((-x2, x1)", "torch.cat((x1, -x2)"))
    code, _, err = run_cli(left, "--check")
    assert code == 1 and f"\n  {LEFT}rotate_half: `return torch.cat((x1, -x2), dim=-1)` where" in err


def test_the_rewritten_rope_gives_the_published_numbers_on_the_cpu():
    """Off CUDA the branch is not taken: the published body runs, its outputs and gradients bit for bit."""
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    cos, sin = torch.randn(7, 8), torch.randn(7, 8)
    position_ids = torch.arange(1, 6).unsqueeze(0)
    assert not triton_rope._moe_rewrite_rope_applies(q, k, cos, sin, position_ids, 1)
    rewritten = rewrite_source(SNIPPET).text
    runs = []
    for code in (ROPE, rewritten[rewritten.index("\ndef rotate_half") :]):  # the functions are the file's last
        namespace = {"torch": torch, **vars(triton_rope)}
        exec(compile(code, "rope", "exec"), namespace)
        leaves = [q.clone().requires_grad_(True), k.clone().requires_grad_(True)]
        out = namespace["apply_rotary_pos_emb"](*leaves, cos, sin, position_ids)
        torch.autograd.backward(out, [torch.linspace(-1, 1, 8).expand_as(o) for o in out])
        runs.append((*out, *(leaf.grad for leaf in leaves)))
    assert "_moe_rewrite_rope_applies(q, k" in rewritten
    for a, b in zip(*runs):
        assert torch.equal(a, b)
