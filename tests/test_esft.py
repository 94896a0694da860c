"""DeepSeek's ESFT fork of V2 (expert-specialised fine-tuning): one per-expert loop in training and eval, moe_ep for
expert parallelism. The stand-in is fixtures/deepseek_v2_esft. Rewritten with --no-fuse-experts (fused experts
cannot be frozen one by one, so the defaults choose it, and --fuse-experts is refused), its single-process loop
becomes the grouped path in training and eval with the same numbers, frozen experts keep no gradient, and the
expert-parallel path is kept."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import ROOT, assert_one_line_error, build_model, per_expert_grads, run_cli  # noqa: E402

ESFT_DIR = ROOT / "fixtures" / "deepseek_v2_esft"
ATOL = 1e-5


def test_fused_experts_asked_for_are_refused_with_the_option_that_works(tmp_path):
    assert_one_line_error(
        run_cli(ESFT_DIR, "--out", tmp_path / "out", "--fuse-experts"), "ESFT form", "rewrite with --no-fuse-experts"
    )
    assert not (tmp_path / "out").exists()


def test_the_defaults_choose_per_expert_layers_and_say_so(tmp_path):
    """The form needs --no-fuse-experts: the defaults choose it, the summary says so, the banner records it, and the
    output is the --no-fuse-experts one, which a second run with the defaults leaves as it is (--check, --diff,
    --in-place: the pre-commit hooks)."""
    code, _, err = run_cli(ESFT_DIR, "--out", tmp_path / "default")
    assert code == 0, err
    assert "(ESFT form, DeepseekV2MoE; backend=auto, stacking=stack, no-fuse-experts;" in err
    assert "\n  experts: per-expert nn.Linear, as with --no-fuse-experts (DeepseekV2MoE.forward: ESFT form:" in err
    written = tmp_path / "default" / "modeling_deepseek.py"
    assert "# ---- moe-rewrite " in written.read_text() and "(backend=auto, stacking=stack, no-fuse-experts)" in (
        written.read_text()
    )
    assert run_cli(ESFT_DIR, "--out", tmp_path / "explicit", "--no-fuse-experts")[0] == 0
    assert written.read_text() == (tmp_path / "explicit" / "modeling_deepseek.py").read_text()
    before = written.read_text()
    for mode in ("--check", "--diff", "--in-place"):
        assert run_cli(written, mode)[:2] == (0, ""), mode
    assert written.read_text() == before


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(rewritten, published) with the same weights."""
    base = tmp_path_factory.mktemp("esft")
    out = base / "esft_rewritten"
    code, _, err = run_cli(ESFT_DIR, "--out", out, "--no-fuse-experts")
    assert code == 0 and "ESFT form" in err, err
    text = (out / "modeling_deepseek.py").read_text()
    assert "y = self.moe_ep(hidden_states, topk_idx)" in text and "for i, expert in enumerate(self.experts)" not in text
    assert run_cli(out / "modeling_deepseek.py", "--check", "--no-fuse-experts")[0] == 0  # a second run changes nothing
    rewritten = build_model(out, seed=11)
    rewritten.save_pretrained(base / "weights")
    published = base / "esft_published"
    shutil.copytree(ESFT_DIR, published)
    shutil.copy(base / "weights" / "model.safetensors", published / "model.safetensors")
    from transformers import AutoModelForCausalLM

    return rewritten, lambda: AutoModelForCausalLM.from_pretrained(
        published, trust_remote_code=True, torch_dtype=torch.float32
    )


def _step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), per_expert_grads({n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def test_training_and_eval_equal_the_published_loop(models):
    rewritten, load_published = models
    published = load_published()
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        torch.testing.assert_close(
            rewritten.eval()(input_ids=ids).logits, published.eval()(input_ids=ids).logits, rtol=0, atol=ATOL
        )
    rewritten.zero_grad(set_to_none=True)
    loss, grads = _step(rewritten.train(), ids)
    own_loss, own_grads = _step(published.train(), ids)
    assert abs(loss - own_loss) <= ATOL and grads.keys() == own_grads.keys()
    for name, grad in own_grads.items():
        assert (grads[name] - grad).abs().max().item() <= ATOL, name


def test_only_the_selected_experts_train_and_the_frozen_keep_no_gradient(models):
    """ESFT's practice: freeze the whole model but a few experts per layer."""
    rewritten, load_published = models
    published = load_published()
    selected = {1, 5}
    for model in (rewritten, published):
        model.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            parts = name.split(".")
            p.requires_grad_("experts" in parts and int(parts[parts.index("experts") + 1]) in selected)
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(13))
    _, grads = _step(rewritten.train(), ids)
    _, own_grads = _step(published.train(), ids)
    assert grads.keys() == own_grads.keys() and grads
    assert all(int(n.split(".")[n.split(".").index("experts") + 1]) in selected for n in grads)
    assert all(p.grad is None for p in rewritten.parameters() if not p.requires_grad)
    for name, grad in own_grads.items():
        assert (grads[name] - grad).abs().max().item() <= ATOL, name
