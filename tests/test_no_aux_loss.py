"""aux_loss_alpha = 0 (set for fine-tuning) in a V2-form file: the published gate returns no aux loss in training and
the published `AddAuxiliaryLoss.apply(y, aux_loss)` fails on None. Rewritten, it trains without the aux loss (alpha 0:
it weighs nothing) and says so in one warning per process: the published loop's numbers with the loss skipped, fp32,
every gradient. config.moe_rewrite_train_without_aux_loss = True, the opt-in earlier releases asked for, is still
accepted, silently."""

from __future__ import annotations

import shutil
import warnings

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


def _without_aux_loss(published):
    """The reference: the published loop, its AddAuxiliaryLoss skipped where the gate gives None."""
    reference = _load(published)
    module = model_module(reference)
    published_add = module.AddAuxiliaryLoss

    class SkipNone:
        @staticmethod
        def apply(y, loss):
            assert loss is None  # alpha 0: the gate gives no aux loss
            return y

    module.AddAuxiliaryLoss = SkipNone
    try:
        return _step(reference, IDS)
    finally:
        module.AddAuxiliaryLoss = published_add


def _assert_same(run, reference):
    (loss, grads), (own_loss, own_grads) = run, reference
    assert abs(loss - own_loss) <= ATOL and grads.keys() == own_grads.keys()
    assert any(".mlp.gate." in name for name in grads)  # the router still trains through the weights
    for name, grad in own_grads.items():
        assert (grads[name] - grad).abs().max().item() <= ATOL, name


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_alpha_0_trains_without_the_aux_loss_and_says_so_once(checkpoints):
    """Alpha 0: the aux loss weighs nothing, so the layers train without it, no switch needed: the published loop's
    numbers with the loss skipped (where the published file itself fails on None), and one warning for the process,
    however many layers and steps."""
    rewritten, published = checkpoints
    with pytest.raises(AttributeError):  # what the published file does: None.numel()
        _step(_load(published), IDS)
    model = _load(rewritten)
    model_module(model)._moe_rewrite_no_aux_loss_said.clear()  # as in a fresh process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _step(model, IDS)
        again = _step(model, IDS)
    said = [w for w in caught if "aux_loss_alpha = 0" in str(w.message)]
    assert len(said) == 1 and "train without it" in str(said[0].message), [str(w.message) for w in caught]
    reference = _without_aux_loss(published)
    _assert_same(run, reference)
    _assert_same(again, reference)
    with torch.no_grad():
        assert torch.isfinite(model.eval()(input_ids=IDS).logits).all()  # eval has no aux loss to add


def test_the_old_opt_in_is_still_accepted_silently(checkpoints):
    rewritten, published = checkpoints
    model = _load(rewritten)
    setattr(model.config, OPT_IN, True)  # the MoE layers share the model's config
    model_module(model)._moe_rewrite_no_aux_loss_said.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _step(model, IDS)
    assert not [w for w in caught if "aux_loss_alpha" in str(w.message)]
    _assert_same(run, _without_aux_loss(published))


def test_no_aux_loss_with_another_alpha_says_why(checkpoints):
    """A gate that returns no aux loss in training while alpha is not 0 (here: negative, which the published gate
    also skips) is an error naming config.aux_loss_alpha, not a silent change."""
    rewritten, _ = checkpoints
    model = _load(rewritten)
    model.config.aux_loss_alpha = -0.1
    with pytest.raises(ValueError, match=r"config\.aux_loss_alpha = -0\.1"):
        _step(model, IDS)


def test_a_file_rewritten_with_the_old_note_gets_the_new_one_once():
    from moe_rewrite.codemods.moe.no_aux_loss import NOTE
    from moe_rewrite.options import RewriteOptions
    from moe_rewrite.rewrite import rewrite_source

    text = rewrite_source((V2_DIR / "modeling_deepseek.py").read_text(), RewriteOptions()).text
    assert text.count(NOTE) == 1
    old = "# moe-rewrite: with aux_loss_alpha = 0, an error, or no aux loss (config.moe_rewrite_train_without_aux_loss)"
    again = rewrite_source(text.replace(NOTE, old), RewriteOptions()).text
    assert again == text
