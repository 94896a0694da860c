"""aux_loss_alpha = 0 (set for fine-tuning) in a V2-form file: the published gate returns no aux loss in training and
the published `AddAuxiliaryLoss.apply(y, aux_loss)` fails on None. Rewritten, training says why in one error naming
config.aux_loss_alpha and the opt-in; with config.moe_rewrite_train_without_aux_loss = True it trains without the aux
loss: the published loop's numbers, fp32, every gradient."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import V2_DIR, build_model, model_module, patched_checkpoint, per_expert_grads  # noqa: E402

ATOL = 1e-5  # fp32, the same sums in another order
OPT_IN = "moe_rewrite_train_without_aux_loss"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(rewritten, published) V2 stand-ins with the same weights."""
    out = patched_checkpoint(tmp_path_factory, "v2")
    saved = tmp_path_factory.mktemp("weights")
    build_model(out, seed=21).save_pretrained(saved)
    published = tmp_path_factory.mktemp("published") / "v2_published_alpha0"
    shutil.copytree(V2_DIR, published)
    for path in (out, published):
        shutil.copy(saved / "model.safetensors", path / "model.safetensors")
    return out, published


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, torch_dtype=torch.float32, aux_loss_alpha=0.0
    )


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model.train()(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), per_expert_grads({n: p.grad for n, p in model.named_parameters() if p.grad is not None})


IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(22))


def test_alpha_0_says_why_and_names_the_opt_in(checkpoints):
    rewritten, published = checkpoints
    with pytest.raises(AttributeError):  # what the published file does: None.numel()
        _step(_load(published), IDS)
    model = _load(rewritten)
    with pytest.raises(ValueError, match=rf"config\.aux_loss_alpha = 0\.0.*config\.{OPT_IN} = True"):
        _step(model, IDS)
    with torch.no_grad():
        assert torch.isfinite(model.eval()(input_ids=IDS).logits).all()  # eval has no aux loss to add


def test_alpha_0_with_the_opt_in_trains_without_the_aux_loss(checkpoints, monkeypatch):
    """The reference: the published loop, its AddAuxiliaryLoss skipped where the gate gives None."""
    rewritten, published = checkpoints
    reference = _load(published)
    published_add = model_module(reference).AddAuxiliaryLoss

    class SkipNone:
        @staticmethod
        def apply(y, loss):
            assert loss is None  # alpha 0: the gate gives no aux loss
            return y

    monkeypatch.setattr(model_module(reference), "AddAuxiliaryLoss", SkipNone)
    own_loss, own_grads = _step(reference, IDS)
    monkeypatch.setattr(model_module(reference), "AddAuxiliaryLoss", published_add)
    model = _load(rewritten)
    setattr(model.config, OPT_IN, True)  # the MoE layers share the model's config
    loss, grads = _step(model, IDS)
    assert abs(loss - own_loss) <= ATOL and grads.keys() == own_grads.keys()
    assert any(".mlp.gate." in name for name in grads)  # the router still trains through the weights
    for name, grad in own_grads.items():
        assert (grads[name] - grad).abs().max().item() <= ATOL, name
