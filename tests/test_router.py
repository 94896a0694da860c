"""Training the router the way DeepSeek does: --aux-loss, --bias-update, --gradient-checkpointing (V3 form)."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import PAIRS, build_model, model_module, patched_checkpoint, run_cli, run_ranks  # noqa: E402
from helpers import moe_layer, rel_err  # noqa: E402

ALL_OPTIONS = ("--aux-loss", "--bias-update", "0.05")  # gradient checkpointing is on by default


@pytest.fixture(scope="module")
def aux_ckpt(tmp_path_factory):
    return patched_checkpoint(tmp_path_factory, "v3", "--aux-loss")


def reference_balance_loss(scores_logits, topk_ids, batch_size, alpha):
    """DeepSeek-V3 report eq. 17-20, one sequence at a time, in float64 with plain loops over experts."""
    num_experts = scores_logits.shape[-1]
    top_k = topk_ids.shape[-1]
    s = torch.sigmoid(scores_logits.double())
    s = s / s.sum(-1, keepdim=True)
    s = s.view(batch_size, -1, num_experts)
    ids = topk_ids.view(batch_size, -1, top_k)
    seq_len = s.shape[1]
    total = 0
    for b in range(batch_size):
        loss = 0
        for i in range(num_experts):
            f_i = num_experts / (top_k * seq_len) * (ids[b] == i).any(-1).double().sum()
            p_i = s[b, :, i].mean()
            loss = loss + f_i * p_i
        total = total + loss
    return alpha * total / batch_size


def test_aux_loss_value_and_gradient_match_the_report(aux_ckpt):
    model = build_model(aux_ckpt, seed=int(torch.randint(0, 10**6, ())))
    moe = moe_layer(model).train()
    module = model_module(moe)
    alpha = moe.config.aux_loss_alpha
    assert alpha > 0
    x = torch.randn(3, 7, moe.config.hidden_size)
    flat = x.view(-1, x.shape[-1])
    ids, _ = moe.gate(x)
    loss = module._moe_rewrite_balance_loss(moe, flat, ids, 3)
    logits64 = flat.double() @ moe.gate.weight.double().t()
    assert abs(loss.item() - reference_balance_loss(logits64, ids, 3, alpha).item()) < 1e-6 * alpha

    # The model's output, hence its loss value, is the same with and without the loss attached.
    with_loss = moe(x)
    moe.config.aux_loss_alpha = 0.0
    without = moe(x)
    moe.config.aux_loss_alpha = alpha
    assert torch.equal(with_loss, without)
    # y * 0 leaves only the balance loss's path to the router: its gradient must be the reference's.
    (with_loss * 0).sum().backward()
    w64 = moe.gate.weight.detach().double().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(reference_balance_loss(flat.double() @ w64.t(), ids, 3, alpha), w64)
    assert torch.count_nonzero(ref_grad) > 0
    assert rel_err(moe.gate.weight.grad, ref_grad) < 1e-5


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_aux_loss_changes_nothing_in_eval(aux_ckpt, tmp_path_factory):
    plain = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=3).eval()
    every = build_model(patched_checkpoint(tmp_path_factory, "v3", *ALL_OPTIONS), seed=3).eval()
    every.load_state_dict(plain.state_dict(), strict=True)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, every(input_ids=ids).logits)


def _skewed_bias_model(tmp_path_factory, rate="0.05"):
    model = build_model(patched_checkpoint(tmp_path_factory, "v3", "--bias-update", rate), seed=5)
    moe = moe_layer(model).train()
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[:2] = 1.0  # experts 0 and 1 (one group) take every token
    return model, moe


def _load(moe, x):
    ids, _ = moe.gate(x)
    return torch.bincount(ids.flatten(), minlength=moe.config.n_routed_experts).double()


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_bias_moves_toward_balance_and_gets_no_gradient(tmp_path_factory):
    model, moe = _skewed_bias_model(tmp_path_factory)
    x = torch.randn(4, 16, moe.config.hidden_size)
    first = _load(moe, x)
    imbalance = [(first.max() / first.mean()).item()]
    for _ in range(12):
        moe(x).sum().backward()
        assert moe.gate.e_score_correction_bias.grad is None
        assert not moe.gate.e_score_correction_bias.requires_grad
        moe.moe_rewrite_update_bias()
        load = _load(moe, x)
        imbalance.append((load.max() / load.mean()).item())
    assert imbalance[0] >= 3.9  # 2 of 8 experts took everything
    assert imbalance[-1] < imbalance[0] / 2
    bias = moe.gate.e_score_correction_bias
    assert (bias[:2] < 1.0).all() and (bias[2:] > 0).any()


def test_bias_update_counts_each_token_once_under_recomputation(tmp_path_factory):
    model, moe = _skewed_bias_model(tmp_path_factory)
    x = torch.randn(2, 5, moe.config.hidden_size, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    y.sum().backward()  # recomputes the forward inside backward
    load = moe._moe_rewrite_load
    assert load.sum().item() == 2 * 5 * moe.config.num_experts_per_tok
    assert torch.equal(load, _load(moe, x.detach()).float())


def test_register_bias_update_runs_after_each_optimizer_step(tmp_path_factory):
    from moe_rewrite.training import register_bias_update

    model, moe = _skewed_bias_model(tmp_path_factory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    handle = register_bias_update(model, optimizer)
    ids = torch.randint(0, 256, (2, 12))
    before = moe.gate.e_score_correction_bias.clone()
    model(input_ids=ids, labels=ids).loss.backward()
    expected = before + 0.05 * torch.sign(moe._moe_rewrite_load.mean() - moe._moe_rewrite_load)
    optimizer.step()
    assert torch.equal(moe.gate.e_score_correction_bias, expected)  # the update, and nothing from AdamW
    assert moe._moe_rewrite_load.sum() == 0
    handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("with_callback", [True, False])
def test_bias_update_callback_in_a_trainer(tmp_path_factory, tmp_path, with_callback):
    """transformers' Trainer with BiasUpdateCallback: after 3 optimizer steps every bias entry moved by a whole number
    of updates (0.05 each, at most 3), the overloaded experts' down; without the callback it does not move (AdamW
    leaves it: it gets no gradient)."""
    from transformers import Trainer, TrainingArguments

    from moe_rewrite.training import BiasUpdateCallback

    model, moe = _skewed_bias_model(tmp_path_factory)
    before = moe.gate.e_score_correction_bias.detach().clone()
    ids = torch.randint(0, 256, (8, 12), generator=torch.Generator().manual_seed(21))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[BiasUpdateCallback()] if with_callback else []
    )
    trainer.train()
    steps = (moe.gate.e_score_correction_bias.detach() - before) / 0.05
    if not with_callback:
        assert torch.equal(steps, torch.zeros_like(steps))
        return
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.round().abs().max() == 3  # one per step
    assert (steps[:2] < 0).all()  # experts 0 and 1 took every token: their bias goes down


def _rank_worker(rank, ckpt, out_dir):
    model = build_model(ckpt, seed=7)
    moe = moe_layer(model).train()
    torch.manual_seed(100 + rank)  # every rank sees different tokens
    x = torch.randn(2, 6, moe.config.hidden_size)
    moe(x)
    torch.save({"load": moe._moe_rewrite_load.clone(), "x": x}, os.path.join(out_dir, f"load{rank}.pt"))
    moe.moe_rewrite_update_bias()
    torch.save(moe.gate.e_score_correction_bias.detach().clone(), os.path.join(out_dir, f"bias{rank}.pt"))


@pytest.mark.slow
def test_two_ranks_apply_identical_updates_from_summed_loads(tmp_path_factory, tmp_path):
    ckpt = patched_checkpoint(tmp_path_factory, "v3", "--bias-update", "0.01")
    run_ranks(_rank_worker, tmp_path, ckpt)
    biases = [torch.load(tmp_path / f"bias{r}.pt") for r in range(2)]
    loads = [torch.load(tmp_path / f"load{r}.pt")["load"] for r in range(2)]
    assert torch.equal(biases[0], biases[1])
    assert not torch.equal(loads[0], loads[1])  # the ranks really routed different tokens
    total = loads[0] + loads[1]
    initial = moe_layer(build_model(ckpt, seed=7)).gate.e_score_correction_bias.detach()
    assert torch.equal(biases[0], initial + 0.01 * torch.sign(total.mean() - total))


def _saved_bytes(model, ids):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    return loss, total


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("rewritten", [True, False], ids=["with-option", "without"])
@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_gradient_checkpointing_enable_works_with_identical_gradients(tmp_path_factory, rewritten, reentrant):
    options = () if rewritten else ("--no-gradient-checkpointing",)
    plain = build_model(patched_checkpoint(tmp_path_factory, "v3", *options), seed=11).train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert checkpointed.is_gradient_checkpointing
    ids = torch.randint(0, 256, (2, 16))
    loss_plain, saved_plain = _saved_bytes(plain, ids)
    loss_ckpt, saved_ckpt = _saved_bytes(checkpointed, ids)
    if not rewritten:  # the published V3 form advertises support and silently ignores it
        assert saved_ckpt == saved_plain
        return
    assert saved_ckpt < saved_plain / 2
    assert torch.equal(loss_plain, loss_ckpt)
    loss_plain.backward()
    loss_ckpt.backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        if a.grad is None:
            assert b.grad is None, name
        else:
            assert rel_err(b.grad, a.grad) < 1e-6, name


def test_router_options_are_refused_for_the_v2_form(tmp_path):
    code, _, err = run_cli(PAIRS / "v2_basic.in.py", "--check", "--aux-loss")
    assert code == 2 and "apply to the V3 form" in err and err.count("\n") == 1
    for rate in ("-1", "0", "inf", "nan"):
        code, _, err = run_cli(PAIRS / "v3_basic.in.py", "--check", "--bias-update", rate)
        assert code == 2 and "positive" in err, rate


@pytest.mark.slow
def test_options_regenerate_and_revert(tmp_path_factory):
    out = patched_checkpoint(tmp_path_factory, "v3", *ALL_OPTIONS, "--no-fuse-experts")
    patched = (out / "modeling_deepseek.py").read_text()
    assert "def moe_rewrite_update_bias(self):" in patched and "_moe_rewrite_checkpoint_layer(" in patched
    assert (
        "_moe_rewrite_fuse_model" not in patched and "rewritten with --no-fuse-experts" in patched
    )  # its from_pretrained
    assert '"bias_update": 0.05' in patched
    assert "aux-loss, bias-update=0.05, no-fuse-experts" in patched
    code, _, err = run_cli(out / "modeling_deepseek.py", "--in-place")
    assert code == 1, err
    reverted = (out / "modeling_deepseek.py").read_text()
    default = (patched_checkpoint(tmp_path_factory, "v3") / "modeling_deepseek.py").read_text()
    assert reverted == default
    explicit = patched_checkpoint(tmp_path_factory, "v3", "--fuse-experts")
    assert (explicit / "modeling_deepseek.py").read_text() == default


def test_bias_update_in_a_bf16_model_is_not_rounded_away(tmp_path_factory):
    """A bf16 bias cannot hold 2.0 - 0.001: the updates accumulate in fp32 and the parameter follows."""
    model, moe = _skewed_bias_model(tmp_path_factory, rate="0.001")
    model.to(torch.bfloat16)
    with torch.no_grad():
        moe.gate.e_score_correction_bias[:2] = 2.0
    x = torch.randn(2, 8, moe.config.hidden_size, dtype=torch.bfloat16)
    for _ in range(20):
        moe(x)
        moe.moe_rewrite_update_bias()
    assert torch.allclose(moe._moe_rewrite_bias[:2], torch.full((2,), 1.98), atol=1e-6)
    assert (moe.gate.e_score_correction_bias[:2].float() < 2.0).all()


def _fsdp2_worker(rank, ckpt, out_dir):
    from torch.distributed.fsdp import fully_shard

    from moe_rewrite.training import register_bias_update

    model = build_model(ckpt, seed=9).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    register_bias_update(model, optimizer)
    torch.manual_seed(200 + rank)
    ids = torch.randint(0, 256, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    moe = moe_layer(model)
    load = moe._moe_rewrite_load.clone()
    optimizer.step()
    bias = moe.gate.e_score_correction_bias.full_tensor().detach().clone()
    torch.save({"load": load, "bias": bias}, os.path.join(out_dir, f"fsdp{rank}.pt"))


@pytest.mark.slow
def test_bias_update_under_fsdp2_updates_the_sharded_bias_identically(tmp_path_factory, tmp_path):
    ckpt = patched_checkpoint(tmp_path_factory, "v3", "--bias-update", "0.01")
    run_ranks(_fsdp2_worker, tmp_path, ckpt)
    results = [torch.load(tmp_path / f"fsdp{r}.pt") for r in range(2)]
    assert torch.equal(results[0]["bias"], results[1]["bias"])
    total = results[0]["load"] + results[1]["load"]
    initial = moe_layer(build_model(ckpt, seed=9)).gate.e_score_correction_bias.detach()
    assert torch.equal(results[0]["bias"], initial + 0.01 * torch.sign(total.mean() - total))
