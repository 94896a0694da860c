"""The attention core through SDPA: the runtime section against the published eager core (CPU, fp32), and the
codemod on snippets: what it rewrites, what it leaves as published and says so, idempotence, --no-sdpa."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli, runtime_env

from moe_rewrite import RewriteOptions, rewrite_source
from moe_rewrite.runtime.model import attention

PAIRS = Path(__file__).parent / "pairs"
B, H, S, QK, V = 2, 3, 9, 24, 16
MIN = torch.finfo(torch.float32).min


def eager_core(q, k, v, mask, scale):
    """The published core, written out: scores times the scale, plus the mask, fp32 softmax, value matmul."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is not None:
        scores = scores + mask
    scores = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(scores, v)


def additive_mask(padding: str, seq: int = S) -> torch.Tensor:
    """The 4-D mask the published Model forward builds: causal, plus padded keys at the lowest fp32 value."""
    keep = torch.ones(B, seq)
    if padding == "left":
        keep[0, :4] = 0  # queries 0-3 of the first row see no key at all: fully masked rows
    elif padding == "right":
        keep[0, -3:] = 0
    mask = torch.full((seq, seq), MIN).triu(1)[None, None].repeat(B, 1, 1, 1)
    return mask.masked_fill(keep[:, None, None, :] == 0, MIN)


def qkv(seq: int = S, dtype=torch.float32):
    return [torch.randn(B, H, seq, d, dtype=dtype, requires_grad=True) for d in (QK, QK, V)]


@pytest.mark.parametrize("seq", [S, 130])
@pytest.mark.parametrize("padding", ["none (causal, mask None)", "causal", "right", "left"])
def test_sdpa_equals_the_published_core_with_gradients(padding, seq):
    """Outputs and the gradients of q, k and v within 1e-5, fully masked rows (left padding) included: there the
    published core averages every value uniformly (score + lowest value is the lowest value), and so does SDPA."""
    q, k, v = qkv(seq)
    mask = None if padding.startswith("none") else additive_mask(padding, seq)
    reference_mask = additive_mask("causal", seq) if mask is None else mask
    grad_out = torch.randn(B, H, seq, V)
    expected = eager_core(q, k, v, reference_mask, QK**-0.5)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    got = attention._moe_rewrite_attention(q, k, v, mask, QK**-0.5, 0.0)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    assert got.shape == (B, H, seq, V)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkv", got_grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")
    if padding == "left":  # the fully masked rows: the uniform average of the values
        torch.testing.assert_close(got[0, :, :4], v[0].mean(dim=1, keepdim=True).expand(H, 4, V), atol=1e-5, rtol=0)


def test_equal_head_dims_on_cpu_keep_the_gradient_of_fully_masked_rows():
    """torch's CPU flash kernel (it runs equal head dims) loses log(keys) in a fully masked row's logsumexp and
    scales that row's gradient by the number of keys; the CPU choice is the math kernel, which does not."""
    q, k, v = [torch.randn(B, H, S, QK, requires_grad=True) for _ in range(3)]
    mask = additive_mask("left")
    expected = torch.autograd.grad(eager_core(q, k, v, mask, 0.3).sum(), (q, k, v))
    got = torch.autograd.grad(attention._moe_rewrite_attention(q, k, v, mask, 0.3, 0.0).sum(), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    flash = torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION])
    with flash:  # what torch's own choice gives: the reason for the math kernel (fails when torch fixes it)
        other = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    q_grad = torch.autograd.grad(other.sum(), q)[0]
    torch.testing.assert_close(q_grad[0, :, :4], expected[0][0, :, :4] * S, atol=1e-4, rtol=1e-4)


def test_fully_masked_rows_of_a_kernel_that_zeroes_them_get_the_published_rows_and_gradients():
    """cuDNN's masked kernel returns zeros (and no gradient) for a query that sees no key; the fix-up
    (_moe_rewrite_fully_masked_rows) puts back the published row, the mean of the values, and the published gradient
    of q, k and v through it (the softmax's at the uniform point). The kernel is stood in for by the published core
    with those rows zeroed, so the fix-up alone makes the difference; the other rows stay the kernel's."""
    generator = torch.Generator().manual_seed(7)
    q, k, v = [torch.randn(B, H, S, d, generator=generator).requires_grad_() for d in (QK, QK, V)]
    mask = additive_mask("left")
    grad_out = torch.randn(B, H, S, V, generator=generator)
    expected = eager_core(q, k, v, mask, QK**-0.5)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    seen = (mask > MIN).any(dim=-1, keepdim=True)
    kernel = eager_core(q, k, v, mask, QK**-0.5) * seen  # zeros in the fully masked rows, as cuDNN gives
    assert not bool(seen[0, 0, :4].any()) and bool(seen[1].all())
    got = attention._moe_rewrite_fully_masked_rows(kernel, q, k, v, mask, QK**-0.5)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out, retain_graph=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkv", got_grads, expected_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")
    kernel_grads = torch.autograd.grad(kernel, (q, k), grad_out)
    assert (kernel_grads[0][0, :, :4] == 0).all() and (expected_grads[0][0, :, :4] != 0).all()  # the difference


def test_a_single_query_without_mask_sees_every_key():
    q, k, v = [torch.randn(B, H, n, d) for n, d in ((1, QK), (S, QK), (S, V))]
    got = attention._moe_rewrite_attention(q, k, v, None, QK**-0.5, 0.0)
    torch.testing.assert_close(got, eager_core(q, k, v, None, QK**-0.5), atol=1e-5, rtol=1e-5)


def test_no_mask_with_a_cache_is_refused():
    """SDPA's is_causal is aligned top-left: with more keys than queries it would be wrong, so a mask is needed."""
    q, k, v = [torch.randn(B, H, n, d) for n, d in ((3, QK), (S, QK), (S, V))]
    with pytest.raises(ValueError, match="attention over 9 keys for 3 queries needs a mask"):
        attention._moe_rewrite_attention(q, k, v, None, QK**-0.5, 0.0)


def test_an_fp32_mask_with_bf16_queries_keeps_fully_masked_rows_finite():
    """float32's lowest value is -inf in bfloat16, and a row of -inf is NaN after softmax: the mask is clamped to the
    query dtype's lowest value first, so a fully masked row is the uniform average, as published."""
    q, k, v = [t.detach() for t in qkv(dtype=torch.bfloat16)]
    mask = additive_mask("left")
    assert torch.isinf(mask.to(torch.bfloat16)).any()  # what a plain cast would pass
    got = attention._moe_rewrite_attention(q, k, v, mask, QK**-0.5, 0.0)
    assert not got.isnan().any()
    uniform = v[0].float().mean(dim=1, keepdim=True).expand(H, 4, V)
    torch.testing.assert_close(got[0, :, :4].float(), uniform, atol=2e-2, rtol=0)
    expected = eager_core(q.float(), k.float(), v.float(), mask, QK**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def test_dropout_drops_in_training_only_through_p():
    q, k, v = [t.detach() for t in qkv()]
    plain = attention._moe_rewrite_attention(q, k, v, None, QK**-0.5, 0.0)
    dropped = attention._moe_rewrite_attention(q, k, v, None, QK**-0.5, 0.5)
    assert not torch.allclose(plain, dropped)
    torch.testing.assert_close(attention._moe_rewrite_attention(q, k, v, None, QK**-0.5, 0.0), plain)


def test_the_backend_is_chosen_once_per_device_dtype_and_head_dims(monkeypatch):
    """On a GPU: cuDNN where its kernel runs the dims, else flash with v padded where q/k and v differ, else torch's
    own choice; float32 and CPU never probe (CPU: the math kernel, see the next test). The probe runs once per key
    (a CUDA device object needs no GPU here)."""
    probes = []

    def probe(device, dtype, qk, v, runs):
        probes.append((dtype, qk, v))
        return runs

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(attention, "_moe_rewrite_cudnn_attention_runs", lambda *a: probe(*a, runs=False))
    assert attention._moe_rewrite_attention_backend(cuda, torch.bfloat16, 192, 128) == "flash_padded"
    assert attention._moe_rewrite_attention_backend(cuda, torch.bfloat16, 192, 128) == "flash_padded"
    assert attention._moe_rewrite_attention_backend(cuda, torch.bfloat16, 128, 128) == "sdpa"
    assert attention._moe_rewrite_attention_backend(cuda, torch.float32, 192, 128) == "sdpa"
    assert attention._moe_rewrite_attention_backend(cpu, torch.bfloat16, 192, 128) == "math"
    assert probes == [(torch.bfloat16, 192, 128), (torch.bfloat16, 128, 128)]
    monkeypatch.setattr(attention, "_moe_rewrite_cudnn_attention_runs", lambda *a: probe(*a, runs=True))
    assert attention._moe_rewrite_attention_backend(cuda, torch.float16, 192, 128) == "cudnn"
    assert attention._moe_rewrite_attention_backend(cuda, torch.bfloat16, 192, 128) == "flash_padded"  # kept
    assert len(probes) == 3


def test_the_probe_saves_nothing_for_an_enclosing_gradient_checkpoint(monkeypatch):
    """The first attention call probes cuDNN with a small forward and backward, inside the first layer's forward,
    often under gradient checkpointing: tensors its graph saves must not reach the checkpoint's hooks, or the
    recomputed forward (which no longer probes) saves fewer and backward fails (seen on the H200, change 30). Here
    the probe's SDPA runs on the CPU (no backend pinned) under counting hooks like a checkpoint's."""
    import contextlib

    import torch.nn.attention

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda *a, **k: contextlib.nullcontext())
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        assert attention._moe_rewrite_cudnn_attention_runs(torch.device("cpu"), torch.float32, 24, 16)
    assert packed == []


def test_the_probe_is_invisible_to_selective_checkpointing(monkeypatch):
    """torch's selective activation checkpointing records the outputs of the operators its policy keeps during the
    forward and hands them back, in order, to the recomputed forward. A probe that runs in the first forward only
    would shift them: on the H100 the recomputed attention got the probe's output ("shape '[2, 4096, 2048]' is
    invalid for input of size 8192", change 48). A layer that probes on its first call, checkpointed with a policy
    keeping the attention's and the products' outputs: the same gradients as without checkpointing."""
    import contextlib
    from functools import partial

    import torch.nn.attention
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda *a, **k: contextlib.nullcontext())
    generator = torch.Generator().manual_seed(0)
    q, v, w = (torch.randn(2, 3, 16, d, generator=generator, requires_grad=True) for d in (24, 16, 16))
    probes = []

    def layer(q, v, w):
        if not probes:  # as _moe_rewrite_attention_backend: once, then the choice is kept
            probes.append(attention._moe_rewrite_cudnn_attention_runs(torch.device("cpu"), torch.float32, 24, 16))
        out = torch.nn.functional.scaled_dot_product_attention(q, q, v, is_causal=True)
        return (out @ w).square().sum()

    def policy(ctx, op, *args, **kwargs):
        kept = "attention" in str(op) or op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE

    contexts = partial(create_selective_checkpoint_contexts, policy)
    got = torch.autograd.grad(checkpoint(layer, q, v, w, use_reentrant=False, context_fn=contexts), (q, v, w))
    assert probes == [True]
    want = torch.autograd.grad(layer(q, v, w), (q, v, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_probe_runs_when_the_first_call_is_under_inference_mode(monkeypatch):
    """The first attention call may come under torch.inference_mode() (an evaluation or generation before training):
    the probe's small backward still runs (its thread does not inherit the mode), so training later gets cuDNN; the
    probe under the caller's mode failed, and the choice was kept for the process."""
    import contextlib

    import torch.nn.attention

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", lambda *a, **k: contextlib.nullcontext())
    with torch.inference_mode():
        assert attention._moe_rewrite_cudnn_attention_runs(torch.device("cpu"), torch.float32, 24, 16)


def test_moe_rewrite_sdpa_0_keeps_the_published_core(monkeypatch):
    assert attention._moe_rewrite_sdpa_enabled()
    runtime_env(monkeypatch, "MOE_REWRITE_SDPA", "0")
    assert not attention._moe_rewrite_sdpa_enabled()


# ---- the codemod ----

ATTENTION = '''

class SelfAttention(nn.Module):
    """Multi-head attention, written for moe-rewrite's tests in the published eager core's structure."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.heads = config.heads
        self.scale = config.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.qkv = nn.Linear(config.width, 3 * config.heads * config.head_dim, bias=False)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        b, n, _ = hidden_states.size()
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)

        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if scores.size() != (b, self.heads, n, n):
            raise ValueError(f"scores of size {scores.size()}")
        assert attention_mask is not None
        if attention_mask is not None:
            if attention_mask.size() != (b, 1, n, n):
                raise ValueError(f"mask of size {attention_mask.size()}")
            scores = scores + attention_mask

        # the softmax in fp32
        scores = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        scores = nn.functional.dropout(scores, p=self.attention_dropout, training=self.training)
        out = torch.matmul(scores, v)
        if out.size() != (b, self.heads, n, v.size(-1)):
            raise ValueError(f"output of size {out.size()}")

        out = out.transpose(1, 2).contiguous()
        out = out.reshape(b, n, -1)
        if not output_attentions:
            scores = None
        return out, scores


ATTENTION_CLASSES = {
    "eager": SelfAttention,
}


class TinyPreTrainedModel(PreTrainedModel):
    """A model base."""

    _supports_flash_attn_2 = True
'''
SNIPPET = (PAIRS / "v3_basic.in.py").read_text().replace(
    "from transformers.activations import ACT2FN\n",
    "from transformers import PreTrainedModel\nfrom transformers.activations import ACT2FN\n",
) + ATTENTION
BRANCH = """\
        # moe-rewrite: SDPA where the config asks for it; the published core otherwise
        if self.config._attn_implementation == "sdpa" and not output_attentions and _moe_rewrite_sdpa_enabled():
            scores = None
            out = _moe_rewrite_attention(
                q,
                k,
                v,
                attention_mask,
                {scale},
                self.attention_dropout if self.training else 0.0,
            )
        else:
"""
CORE_START = "        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale\n"
CORE_END = '            raise ValueError(f"output of size {out.size()}")\n'
DEFAULT_LINE = (
    "attention: SDPA in SelfAttention (loads default to sdpa; attn_implementation='eager' keeps the published core)"
)


def _core(text: str) -> str:
    start = text.index(CORE_START)
    return text[start : text.index(CORE_END, start) + len(CORE_END)]


def test_the_published_core_goes_into_the_else_of_an_sdpa_branch():
    result = rewrite_source(SNIPPET)
    core = _core(SNIPPET)
    indented = "".join(f"    {line}" if line.strip() else line for line in core.splitlines(keepends=True))
    # the blank line above the core stays above the branch; inside the else, the core as published, a level deeper
    assert "\n\n" + BRANCH.format(scale="self.scale") + indented in result.text
    # the markers on the line above: a formatter wrapping a long line would move a trailing one into its parentheses
    assert (
        "# moe-rewrite: the eager class runs SDPA when the config says sdpa\n"
        'ATTENTION_CLASSES["sdpa"] = SelfAttention\n' in result.text
    )
    assert "    _supports_flash_attn_2 = True\n    # moe-rewrite: loads default to SDPA" in result.text
    assert "\n    _supports_sdpa = True\n" in result.text
    assert "attention" in result.sections and "def _moe_rewrite_attention(" in result.text
    assert result.attention == (DEFAULT_LINE,)
    again = rewrite_source(result.text)
    assert not again.changed and again.text == result.text


def test_no_sdpa_leaves_the_attention_as_published_and_takes_an_earlier_branch_back():
    plain = rewrite_source(SNIPPET, RewriteOptions(sdpa=False))
    assert _core(plain.text) == _core(SNIPPET) and "_moe_rewrite_attention" not in plain.text
    assert "_supports_sdpa" not in plain.text and '["sdpa"]' not in plain.text
    assert plain.attention == ()
    assert "no-sdpa" in RewriteOptions(sdpa=False).describe()
    rewritten = rewrite_source(SNIPPET).text
    assert rewrite_source(rewritten, RewriteOptions(sdpa=False)).text == plain.text


def test_cli_no_sdpa_and_the_summary_line(tmp_path):
    path = tmp_path / "modeling_deepseek.py"
    path.write_text(SNIPPET)
    code, _, err = run_cli(path, "--check", "--no-sdpa")
    assert code == 1 and "no-sdpa" in err and "attention:" not in err
    code, _, err = run_cli(path, "--in-place", "-v")
    assert code == 1 and f"\n  {DEFAULT_LINE}\n" in err
    left = path.with_name("left.py")
    left.write_text(_variant(SOFTMAX, SOFTMAX.replace("torch.float32", "torch.float16")))
    code, _, err = run_cli(left, "--check")
    assert code == 1 and "\n  attention: SelfAttention left as published: `scores = nn.functional.softmax(" in err
    assert "_moe_rewrite_attention(" in path.read_text()


def _variant(old: str, new: str) -> str:
    assert SNIPPET.count(old) == 1, old
    return SNIPPET.replace(old, new)


SCORES = "        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale\n"
SOFTMAX = "        scores = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)\n"
DROPOUT = "        scores = nn.functional.dropout(scores, p=self.attention_dropout, training=self.training)\n"
REWRITTEN = {
    "two-statement score": (
        SCORES,
        "        scores = torch.matmul(q, k.transpose(2, 3))\n        scores = scores * self.scale\n",
        "self.scale",
    ),
    "another scale expression": (SCORES, SCORES.replace("self.scale", "(self.scale * 2)"), "self.scale * 2"),
    "the torch.nn.functional spelling": (SOFTMAX, SOFTMAX.replace("nn.functional", "torch.nn.functional"), None),
    "no .contiguous() after the core": (
        "        out = out.transpose(1, 2).contiguous()\n",
        "        out = out.transpose(1, 2)\n",
        None,
    ),
    "no assert, no shape checks": (
        '        if scores.size() != (b, self.heads, n, n):\n            raise ValueError(f"scores of size '
        '{scores.size()}")\n        assert attention_mask is not None\n',
        "",
        None,
    ),
    # the softmax scale proved a Python number (attention_scale.py): a conditional expression, float()
    "a scale of numbers only": (
        "        self.scale = config.head_dim**-0.5\n",
        "        self.scale = float(config.head_dim) ** -0.5 if config.head_dim else 1.0\n",
        None,
    ),
    "reformatted with comments": (
        SOFTMAX,
        "        scores = nn.functional.softmax(  # upcast\n            scores,\n            dim=-1,\n"
        "            dtype=torch.float32,  # fp32\n        ).to(\n            q.dtype\n        )\n",
        None,
    ),
}


@pytest.mark.parametrize("case", REWRITTEN, ids=list(REWRITTEN))
def test_variants_of_the_published_core_are_rewritten(case):
    old, new, scale = REWRITTEN[case]
    text = _variant(old, new)
    result = rewrite_source(text)
    assert result.attention == (DEFAULT_LINE,)
    assert BRANCH.format(scale=scale or "self.scale") in result.text
    assert not rewrite_source(result.text).changed
    assert (
        rewrite_source(result.text, RewriteOptions(sdpa=False)).text
        == rewrite_source(text, RewriteOptions(sdpa=False)).text
    )


LEFT = {
    "an extra score term": (
        SCORES,
        SCORES.replace("* self.scale", "* self.scale + self.bias"),
        "the scores `scores = torch.matmul(q, k.transpose(2, 3)) * self.scale + self.bias` are not "
        "`torch.matmul(Q, K.transpose(2, 3))` times a scale",
    ),
    "an extra mask term": (
        "            scores = scores + attention_mask\n",
        "            scores = scores + attention_mask + self.bias\n",
        "where the published core has the mask add",
    ),
    "the softmax in another dtype": (
        SOFTMAX,
        SOFTMAX.replace("torch.float32", "torch.float16"),
        "`scores = nn.functional.softmax(scores, dim=-1, dtype=torch.float16).to(q.dtype)` where the published core "
        "has the fp32 softmax `.to(Q.dtype)`",
    ),
    "dropout before the softmax": (
        SOFTMAX + DROPOUT,
        DROPOUT + SOFTMAX,
        "where the published core has the fp32 softmax",
    ),
    "the mask reassigned before the core": (
        SCORES,
        "        attention_mask = attention_mask * 2\n" + SCORES,
        "`attention_mask` is reassigned before the core",
    ),
    "the scores read after the core": (
        "        out = out.reshape(b, n, -1)\n",
        "        out = out.reshape(b, n, -1) + scores.sum()\n",
        "`scores` is read after the core",
    ),
    "a scale reading the scores": (SCORES, SCORES.replace("self.scale", "scores.max()"), "is not a number SDPA"),
    # a tensor reaching SDPA's scale=, which takes a float (issue 47): the core stays as published
    "a learnable temperature in the scale": (
        "        self.scale = config.head_dim**-0.5\n",
        "        self.scale = nn.Parameter(torch.ones(1)) * config.head_dim**-0.5\n",
        "the softmax scale `self.scale` may be a tensor, which SDPA's scale= does not take: `self.scale = "
        "nn.Parameter(torch.ones(1)) * config.head_dim ** (-0.5)` is not proved a number",
    ),
    "a per-head scale buffer": (
        "        self.scale = config.head_dim**-0.5\n",
        '        self.register_buffer("scale", torch.full((config.heads, 1, 1), config.head_dim**-0.5))\n',
        "`self.scale` is set nowhere in the class (a buffer?)",
    ),
    "a scale made a tensor": (
        "        self.scale = config.head_dim**-0.5\n",
        "        self.scale = torch.tensor(config.head_dim) ** -0.5\n",
        "`self.scale = torch.tensor(config.head_dim) ** (-0.5)` is not proved a number",
    ),
    "a scale assigned a tensor elsewhere too": (
        "        self.scale = config.head_dim**-0.5\n",
        "        self.scale = config.head_dim**-0.5\n        self.scale = self.scale * torch.ones(())\n",
        "`self.scale = self.scale * torch.ones(())` is not proved a number",
    ),
    "a forward's local scale from a tensor": (
        SCORES,
        "        scale = hidden_states.new_tensor(self.scale)\n" + SCORES.replace("self.scale", "scale"),
        "the softmax scale `scale` may be a tensor, which SDPA's scale= does not take: "
        "`hidden_states.new_tensor(self.scale)` is not proved a number",
    ),
    "a test for eager elsewhere": (
        "ATTENTION_CLASSES = {",
        'EAGER = config._attn_implementation == "eager"\nATTENTION_CLASSES = {',
        "the file reads `EAGER = config._attn_implementation == 'eager'`",
    ),
    "a lookup in a dict without the eager class": (
        "ATTENTION_CLASSES = {",
        "LAYER = OTHER_CLASSES[config._attn_implementation]\nATTENTION_CLASSES = {",
        "the file reads `LAYER = OTHER_CLASSES[config._attn_implementation]`",
    ),
    "no self.config": (
        "        self.config = config\n        self.heads",
        "        self.heads",
        "it does not keep `self.config`",
    ),
    # the kit's rules (kit/prove.py): a line's second statement is not hidden behind a proven first one, and the
    # globals the core reads are not bound in the forward
    "a second statement on the softmax's line": (
        SOFTMAX,
        SOFTMAX.replace("\n", "; scores = scores * 2\n"),
        "`scores = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype); scores = scores * 2` "
        "where the published core has the fp32 softmax `.to(Q.dtype)` (2 statements on one line)",
    ),
    "a second statement on the score's line": (
        SCORES,
        SCORES.replace("\n", "; scores = scores * 2\n"),
        "are not `torch.matmul(Q, K.transpose(2, 3))` times a scale (2 statements on one line)",
    ),
    "the mask reassigned on a shared line": (
        SCORES,
        "        n = n; attention_mask = attention_mask * 2\n" + SCORES,
        "`attention_mask` is reassigned before the core",
    ),
    "nn bound in the forward": (
        SCORES,
        "        nn = self.functions\n" + SCORES,
        "where the published core has the fp32 softmax `.to(Q.dtype)` (`nn` is bound in the function)",
    ),
    "torch imported in the forward": (
        SCORES,
        "        import numpy as torch\n" + SCORES,
        "times a scale (`torch` is bound in the function)",
    ),
}


@pytest.mark.parametrize("case", LEFT, ids=list(LEFT))
def test_other_attention_is_left_as_published_with_a_line_saying_why(case):
    old, new, reason = LEFT[case]
    text = _variant(old, new)
    result = rewrite_source(text)
    assert result.changed  # the rest of the file is still rewritten
    (line,) = result.attention
    assert line.startswith("attention: SelfAttention left as published: ") and reason in line, line
    assert "_moe_rewrite_attention" not in result.text and "_supports_sdpa" not in result.text
    plain = rewrite_source(text, RewriteOptions(sdpa=False)).text  # the same, but for the banner's options
    assert plain == result.text.replace("stacking=stack)", "stacking=stack, no-sdpa)", 1)


class _Config:
    heads, head_dim, width, attention_dropout = 3, 8, 16, 0.0

    def __init__(self, implementation: str) -> None:
        self._attn_implementation = implementation


def test_the_rewritten_class_gives_the_published_numbers_under_sdpa_and_eager():
    """The rewritten snippet run as a module: the sdpa branch and the published core (eager, and sdpa with
    output_attentions) give the same output and input gradient, with left padding."""
    namespace: dict = {}
    exec(compile(rewrite_source(SNIPPET).text, "rewritten.py", "exec"), namespace)
    layer = namespace["SelfAttention"](_Config("sdpa"))
    x = torch.randn(B, 6, 16)
    keep = torch.ones(B, 6)
    keep[0, :2] = 0
    mask = torch.full((6, 6), MIN).triu(1)[None, None].repeat(B, 1, 1, 1).masked_fill(keep[:, None, None] == 0, MIN)
    runs = {}
    for implementation, output_attentions in [("sdpa", False), ("eager", False), ("sdpa", True)]:
        layer.config = _Config(implementation)
        xi = x.clone().requires_grad_()
        out, weights = layer(xi, attention_mask=mask, output_attentions=output_attentions)
        assert (weights is None) != output_attentions
        out.square().sum().backward()
        runs[implementation, output_attentions] = (out.detach(), xi.grad)
    for key in [("eager", False), ("sdpa", True)]:
        for a, b in zip(runs["sdpa", False], runs[key]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_lookup_in_the_extended_dict_and_a_flash_test_are_kept():
    text = _variant(
        "ATTENTION_CLASSES = {",
        'FLASH = config._attn_implementation == "flash_attention_2"\nATTENTION_CLASSES = {',
    )
    text += "\n\ndef layer(config):\n    return ATTENTION_CLASSES[config._attn_implementation](config)\n"
    assert rewrite_source(text).attention == (DEFAULT_LINE,)


def test_a_class_without_the_core_is_not_reported():
    """Classes whose forward has no matmul and softmax (MLP, gate, MoE) are not attention: no line."""
    result = rewrite_source((PAIRS / "v3_basic.in.py").read_text())
    assert result.attention == ()
    assert ast.parse(result.text) and "_moe_rewrite_attention" not in result.text
    assert textwrap.dedent(BRANCH).splitlines()[1] not in result.text
