"""The causal-LM loss without float32 logits: the runtime section against the published statements (CPU, fp32), the
rewritten stand-ins in training against their own published loss (the opt-out), and the codemod on snippets: what it
rewrites, what it leaves as published and says so, idempotence, --no-fused-loss."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, model_module, run_cli, runtime_env

from moe_rewrite import RewriteOptions, rewrite_source
from moe_rewrite.runtime.model import lm_loss

B, S, H, V = 2, 7, 16, 40
TOL = 1e-5


def published(hidden, weight, labels):
    """The published statements: lm_head, upcast, shift, mean cross-entropy over labels != -100."""
    logits = torch.nn.functional.linear(hidden, weight).float()
    shift_logits = logits[..., :-1, :].contiguous().view(-1, weight.shape[0])
    shift_labels = labels[..., 1:].contiguous().view(-1)
    return torch.nn.CrossEntropyLoss()(shift_logits, shift_labels)


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def leaves(ignored: bool, all_ignored: bool = False):
    hidden = torch.randn(B, S, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (B, S))
    if ignored:
        labels[0, :3] = -100  # a prompt
        labels[1, -2:] = -100  # right padding
    if all_ignored:
        labels[:] = -100
    return hidden, weight, labels


def grads_of(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk_rows", [None, 1, 4], ids=["one-chunk", "row-chunks", "ragged-chunks"])
@pytest.mark.parametrize("ignored", [False, True], ids=["all-labels", "ignored-labels"])
def test_fused_loss_and_gradients_equal_the_published_loss(monkeypatch, chunk_rows, ignored):
    if chunk_rows is not None:  # chunk boundaries inside the 14 rows (4: the last chunk holds 2)
        monkeypatch.setattr(lm_loss, "MOE_REWRITE_LOSS_CHUNK_BYTES", chunk_rows * V * 4)
    hidden, weight, labels = leaves(ignored)
    want = published(hidden, weight, labels)
    loss, logits = lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    assert isinstance(logits, lm_loss._MoeRewriteNoLogits) and loss.dtype == torch.float32
    assert abs(loss.item() - want.item()) <= TOL * abs(want.item())
    for got, expected in zip(grads_of(loss, hidden, weight), grads_of(want, hidden, weight)):
        assert rel(got, expected) <= TOL


@pytest.mark.parametrize("bad", [V, V + 100, -1, -5], ids=["vocab", "above", "minus-one", "negative"])
def test_a_label_out_of_the_vocabulary_raises_the_published_error(bad):
    """Any label but -100 outside [0, vocab) raises what the published loss raises on the CPU, before any kernel
    (IndexError "Target N is out of bounds.", the first such label); one in the first position, which the shift drops,
    is not checked (as published)."""
    hidden, weight, labels = leaves(ignored=True)
    labels[1, 4], labels[1, 2] = bad, V + 7  # row order: the (1, 2) label is met first
    with pytest.raises(IndexError) as published_error:
        published(hidden, weight, labels)
    with pytest.raises(IndexError) as error:
        lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    assert str(error.value) == str(published_error.value) == f"Target {V + 7} is out of bounds."
    labels[1, 2] = 0
    with pytest.raises(IndexError, match=f"^Target {bad} is out of bounds.$"):
        lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    labels[1, 4], labels[0, 0] = 0, bad  # the first label predicts nothing
    loss, _ = lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    assert torch.allclose(loss, published(hidden, weight, labels), rtol=TOL)


def test_the_missing_logits_say_why_and_the_output_keeps_the_published_layout(patched):
    """In training with labels the output's logits are _MoeRewriteNoLogits in the published slot: outputs[0], .loss,
    ["loss"], to_tuple() and return_dict=False as the published layout (loss, logits, ...); reading them (an attribute,
    indexing, arithmetic, len) raises an error naming both opt-outs; what walks outputs (hasattr, DataParallel's
    gather, accelerate's fp32 conversion, pytree, pickling) keeps it without raising."""
    import copy
    import pickle

    import torch.utils._pytree as pytree
    from torch.nn.parallel.scatter_gather import gather

    model = build_model(patched, seed=3).train()
    ids, mask, labels = _batch(model)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    model.config.moe_rewrite_fused_loss = False
    plain = model(input_ids=ids, attention_mask=mask, labels=labels)
    model.config.moe_rewrite_fused_loss = True
    missing = out.logits
    no_logits = model_module(model)._MoeRewriteNoLogits  # the rendered file's own class
    assert isinstance(missing, no_logits) and missing is no_logits()
    assert out[0] is out.loss is out["loss"] and out[1] is missing and out["logits"] is missing
    assert list(out.keys()) == list(plain.keys()) and len(out.to_tuple()) == len(plain.to_tuple())
    flat = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    model.config.moe_rewrite_fused_loss = False
    plain_flat = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    model.config.moe_rewrite_fused_loss = True
    assert len(flat) == len(plain_flat) and flat[1] is missing and torch.equal(flat[0], out.loss)
    opt_outs = ["model.config.moe_rewrite_fused_loss = False", "--no-fused-loss"]
    for use in (
        lambda x: x.shape,
        lambda x: x.float(),
        lambda x: x[..., :-1, :],
        lambda x: x + 1,
        lambda x: 2 * x,
        lambda x: len(x),
        lambda x: bool(x),
        lambda x: x.argmax(-1) == labels,
    ):
        with pytest.raises((TypeError, AttributeError)) as error:
            use(missing)
        assert all(name in str(error.value) for name in opt_outs), str(error.value)
    assert not hasattr(missing, "dtype") and not hasattr(missing, "__dataclass_fields__")
    assert "moe_rewrite_fused_loss = False" in repr(out)
    assert gather([missing, missing], "cpu") is missing
    assert pickle.loads(pickle.dumps(missing)) is missing and copy.deepcopy(missing) is missing
    assert copy.copy(out).logits is missing
    leaves_, spec = pytree.tree_flatten(out)
    assert pytree.tree_unflatten(leaves_, spec).logits is missing
    try:
        from accelerate.utils import convert_to_fp32
    except ImportError:
        return
    assert convert_to_fp32(out).logits is missing


def test_every_label_ignored_gives_nan_and_zero_gradients_as_published():
    hidden, weight, labels = leaves(True, all_ignored=True)
    want = published(hidden, weight, labels)
    loss, _ = lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    assert torch.isnan(want) and torch.isnan(loss)
    for got, expected in zip(grads_of(loss, hidden, weight), grads_of(want, hidden, weight)):
        assert torch.equal(got, expected) and not got.any()


def test_a_frozen_weight_gets_no_gradient_and_the_hidden_states_theirs():
    hidden, weight, labels = leaves(True)
    weight.requires_grad_(False)
    loss, _ = lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    loss.backward()
    assert weight.grad is None
    (want,) = grads_of(published(hidden, weight, labels), hidden)
    assert rel(hidden.grad, want) <= TOL


def test_gradient_accumulation_scales_through_the_loss_gradient(monkeypatch):
    """Two micro-batches, each loss * 0.5 backward: the weight's gradients add up as the published ones do."""
    monkeypatch.setattr(lm_loss, "MOE_REWRITE_LOSS_CHUNK_BYTES", 3 * V * 4)
    hidden, weight, labels = leaves(True)
    other = torch.randn(B, S, H, requires_grad=True)
    for x in (hidden, other):
        (lm_loss._moe_rewrite_lm_loss(x, weight, labels)[0] * 0.5).backward()
    got = weight.grad.clone()
    weight.grad = None
    for x in (hidden, other):
        (published(x, weight, labels) * 0.5).backward()
    assert rel(got, weight.grad) <= TOL


def test_under_autocast_the_gemms_run_in_its_dtype_and_the_leaves_get_float32_gradients(monkeypatch):
    """As lm_head under torch.autocast: bf16 logits, upcast; several chunks (the weight gradient accumulated in
    float32, or bf16 products added where addmm has no out_dtype, as on the CPU)."""
    monkeypatch.setattr(lm_loss, "MOE_REWRITE_LOSS_CHUNK_BYTES", 4 * V * 2)
    hidden, weight, labels = leaves(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = published(hidden, weight, labels)
        loss, _ = lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    assert loss.dtype == torch.float32 and abs(loss.item() - want.item()) <= 1e-3 * abs(want.item())
    for got, expected in zip(grads_of(loss, hidden, weight), grads_of(want, hidden, weight)):
        assert got.dtype == torch.float32 and rel(got, expected) <= 1e-2


def test_the_weight_gradient_is_summed_in_place_over_the_chunks(monkeypatch):
    """bf16 chunks sum the weight's gradient in float32 through torch's out_dtype GEMMs (CUDA only: emulated here with
    the same signatures): the first chunk's product is the sum, and every later one is added into it in place
    (out=total). An out-of-place addmm copies the sum first: 1.3 GB a chunk at Moonlight's vocabulary (change 48). The
    gradient equals a float32 sum of the chunks' products."""
    real_mm, real_addmm, calls = torch.mm, torch.addmm, []

    def mm(a, b, *args, out_dtype=None, **kwargs):
        if out_dtype is None:
            return real_mm(a, b, *args, **kwargs)
        calls.append("mm")
        return real_mm(a.to(out_dtype), b.to(out_dtype))

    def addmm(total, a, b, *args, out_dtype=None, out=None, **kwargs):
        if out_dtype is None:
            return real_addmm(total, a, b, *args, out=out, **kwargs)
        calls.append("addmm in place" if out is total else "addmm")
        result = real_addmm(total, a.to(out_dtype), b.to(out_dtype))
        return out.copy_(result) if out is not None else result

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(lm_loss, "MOE_REWRITE_LOSS_CHUNK_BYTES", 4 * V * 2)  # 4 rows a chunk: 4 chunks of 14 rows
    hidden, weight, labels = (t.detach() for t in leaves(True))
    hidden, weight = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    loss, _ = lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    (got,) = grads_of(loss, weight)
    assert calls == ["mm", "addmm in place", "addmm in place", "addmm in place"]
    want = published(hidden.float(), weight.float(), labels)
    assert got.dtype == torch.bfloat16 and rel(got.float(), grads_of(want, weight)[0]) <= 1e-2


def test_labels_of_another_shape_are_refused():
    hidden, weight, labels = leaves(False)
    with pytest.raises(ValueError, match="labels of shape"):
        lm_loss._moe_rewrite_lm_loss(hidden, weight, labels[:, 1:])


def test_the_torch_rows_give_the_loss_rows_and_the_gradient_in_place():
    """_moe_rewrite_cross_entropy_torch, the rows the Triton kernel also computes (test_triton_kernels.py)."""
    logits = torch.randn(5, V)
    target = torch.tensor([3, -100, 0, V - 1, 7])
    scale = torch.tensor([0.25])
    z = logits.clone().requires_grad_(True)
    losses = torch.nn.functional.cross_entropy(z, target, reduction="none")
    (grad,) = torch.autograd.grad((losses * 0.25).sum(), z)
    rows = lm_loss._moe_rewrite_cross_entropy_torch(logits, target, scale)
    assert torch.allclose(rows, losses, atol=1e-6) and rows[1] == 0
    assert torch.allclose(logits, grad, atol=1e-7) and not logits[1].any()


# The rewritten stand-ins, trained: the fused loss against the same model's published loss (the config opt-out)


def _batch(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding, its labels ignored
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100  # a prompt
    return ids, mask, labels


def test_rewritten_model_trains_with_the_published_loss_and_gradients(patched, monkeypatch):
    model = build_model(patched, seed=3).train()
    monkeypatch.setattr(model_module(model), "MOE_REWRITE_LOSS_CHUNK_BYTES", 5 * model.config.vocab_size * 4)
    ids, mask, labels = _batch(model)
    runs = {}
    for fused in (True, False):
        model.config.moe_rewrite_fused_loss = fused
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        runs[fused] = out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (fused, fused_grads), (plain, plain_grads) = runs[True], runs[False]
    assert isinstance(fused.logits, model_module(model)._MoeRewriteNoLogits) and plain.logits.dtype == torch.float32
    assert abs(fused.loss.item() - plain.loss.item()) <= TOL * abs(plain.loss.item())
    assert fused_grads.keys() == plain_grads.keys() and "lm_head.weight" in fused_grads
    for name, grad in plain_grads.items():
        assert (fused_grads[name] - grad).abs().max().item() <= TOL * max(grad.abs().max().item(), 1.0), name


@pytest.mark.parametrize("case", ["eval", "no-labels", "config-opt-out", "env-opt-out"])
def test_otherwise_the_published_float32_logits_are_returned(patched, monkeypatch, case):
    """The published statements run: logits = lm_head(final hidden states).float(), bit for bit, and its loss."""
    model = build_model(patched, seed=4).train(case != "eval")
    if case == "config-opt-out":
        model.config.moe_rewrite_fused_loss = False
    if case == "env-opt-out":
        runtime_env(monkeypatch, "MOE_REWRITE_FUSED_LOSS", "0")
    ids, mask, labels = _batch(model)
    out = model(
        input_ids=ids, attention_mask=mask, labels=None if case == "no-labels" else labels, output_hidden_states=True
    )
    want = model.lm_head(out.hidden_states[-1]).float()
    assert out.logits.dtype == torch.float32 and torch.equal(out.logits, want)
    if case != "no-labels":
        assert torch.equal(out.loss, published(out.hidden_states[-1], model.lm_head.weight, labels))


def test_a_hooked_or_wrapped_lm_head_falls_back_to_the_published_loss(patched):
    model = build_model(patched, seed=5).train()
    applies = model_module(model)._moe_rewrite_fused_loss_applies
    assert applies(model)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: None)
    assert not applies(model)
    handle.remove()
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
    assert not applies(model)
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(4, 4))  # a wrapper, as PEFT's on lm_head
    assert not applies(model)


# The codemod on snippets

SNIPPET = """\
import torch
from torch import nn
from torch.nn import CrossEntropyLoss


class ToyForCausalLM(nn.Module):
    def forward(self, input_ids, labels=None, return_dict=None):
        outputs = self.model(input_ids)
        hidden_states = outputs[0]
        logits = self.lm_head(hidden_states)
        logits = logits.float()

        loss = None
        if labels is not None:
            # Shift so that tokens < n predict n
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss_fct = CrossEntropyLoss()
            shift_logits = shift_logits.view(-1, self.config.vocab_size)
            shift_labels = shift_labels.view(-1)
            shift_labels = shift_labels.to(shift_logits.device)
            loss = loss_fct(shift_logits, shift_labels)

        if not return_dict:
            output = (logits,) + outputs[1:]
            return (loss,) + output if loss is not None else output
        return dict(loss=loss, logits=logits)
"""
EXPECTED = """\
        hidden_states = outputs[0]
        # moe-rewrite: the loss without float32 logits in training with labels; the published loss otherwise
        if labels is not None and self.training and _moe_rewrite_fused_loss_applies(self):
            loss, logits = _moe_rewrite_lm_loss(hidden_states, self.lm_head.weight, labels)
        else:
            logits = self.lm_head(hidden_states)
            logits = logits.float()

            loss = None
            if labels is not None:
                # Shift so that tokens < n predict n
"""


def _snippet_forward(text: str) -> tuple[str, list[str]]:
    """The snippet's forward alone, through the codemod (the MoE codemods need a whole file)."""
    import libcst as cst

    from moe_rewrite.codemods.kit import Context
    from moe_rewrite.codemods.model import lm_loss as codemod

    context = Context(RewriteOptions())
    return codemod.transform(cst.parse_module(text), context).code, [str(note) for note in context.notes]


def test_the_published_loss_goes_into_the_else_of_a_fused_branch():
    text, lines = _snippet_forward(SNIPPET)
    assert EXPECTED in text
    assert lines == [
        "loss: fused linear cross-entropy in ToyForCausalLM (no logits in training with labels, reading them says "
        "why; config.moe_rewrite_fused_loss = False keeps them)"
    ]
    again, _ = _snippet_forward(text)
    assert again == text
    import libcst as cst

    from moe_rewrite.codemods.model import lm_loss as codemod

    assert codemod.undo(cst.parse_module(text)).code == SNIPPET


MUTATIONS = {
    "no upcast": ("        logits = logits.float()\n", "", "are not the published loss"),
    "a label smoothing": ("CrossEntropyLoss()", "CrossEntropyLoss(label_smoothing=0.1)", "not the published loss"),
    "another shift": ("labels[..., 1:]", "labels[..., 2:]", "not the published loss"),
    "logits read after": (
        "        if not return_dict:\n",
        "        logits = logits * 2\n        if not return_dict:\n",
        "`logits` is used after the loss: `logits = logits * 2`",
    ),
    "labels rebound": (
        "        outputs = self.model(input_ids)\n",
        "        outputs = self.model(input_ids)\n        labels = input_ids\n",
        "reassigned before",
    ),
    "another import": (
        "from torch.nn import CrossEntropyLoss\n",
        "from mylib import CrossEntropyLoss\n",
        "not imported from torch.nn",
    ),
    # accepted before the prover of codemods/kit: the forward's own CrossEntropyLoss, a statement after a `;`
    "the loss class bound in forward": (
        "        outputs = self.model(input_ids)\n",
        "        outputs = self.model(input_ids)\n        CrossEntropyLoss = FocalLoss\n",
        "are not the published loss: `CrossEntropyLoss` is bound in the function",
    ),
    "a second statement on a line": (
        "        logits = logits.float()\n",
        "        logits = logits.float(); logits = logits * 2\n",
        "are not the published loss: 2 statements on one line",
    ),
    "labels rebound on a shared line": (
        "        outputs = self.model(input_ids)\n",
        "        outputs = self.model(input_ids); labels = input_ids\n",
        "`labels` is reassigned before the loss",
    ),
}


@pytest.mark.parametrize("case", MUTATIONS, ids=list(MUTATIONS))
def test_a_loss_that_differs_is_left_as_published_with_a_line(case):
    old, new, reason = MUTATIONS[case]
    assert old in SNIPPET
    text = SNIPPET.replace(old, new, 1)
    rewritten, lines = _snippet_forward(text)
    assert rewritten == text
    assert len(lines) == 1 and lines[0].startswith("loss: ToyForCausalLM left as published: ") and reason in lines[0]


def test_nn_cross_entropy_spelling_is_accepted():
    text = SNIPPET.replace("loss_fct = CrossEntropyLoss()", "loss_fct = nn.CrossEntropyLoss()")
    assert "_moe_rewrite_lm_loss(" in _snippet_forward(text)[0]


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_no_fused_loss_keeps_the_published_loss_and_takes_an_earlier_branch_back(tmp_path):
    from conftest import V3_DIR

    source = (V3_DIR / "modeling_deepseek.py").read_text()
    fused = rewrite_source(source)
    assert "_moe_rewrite_lm_loss(hidden_states" in fused.text and "lm_loss" in fused.sections
    plain = rewrite_source(fused.text, RewriteOptions(fused_loss=False))
    assert plain.text == rewrite_source(source, RewriteOptions(fused_loss=False)).text
    assert "_moe_rewrite_lm_loss" not in plain.text and plain.loss == ()
    assert "no-fused-loss" in RewriteOptions(fused_loss=False).describe()
    path = tmp_path / "modeling_deepseek.py"
    path.write_text(source)
    code, _, err = run_cli(path, "--check", "--no-fused-loss", "-v")
    assert code == 1 and "no-fused-loss" in err and "loss:" not in err
    code, _, err = run_cli(path, "--check", "-v")
    assert code == 1 and "loss: fused linear cross-entropy in DeepseekV3ForCausalLM" in err


def test_bench_script_runs_on_the_cpu_at_tiny_sizes():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    args = "--device cpu --tokens 64 --hidden 32 --vocab 1000 --dtype float32 --repeats 2 --chunk-tokens 16,1024"
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "bench_loss.py"), *args.split()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {row["impl"] for row in result["rows"]} == {"published", "fused"}
    assert result["loss_rel_diff"] <= 1e-5
