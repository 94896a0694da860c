"""DeepSeek's ESFT fork of V2 (expert-specialised fine-tuning): one per-expert loop in training and eval, moe_ep for
expert parallelism. The stand-in is fixtures/deepseek_v2_esft. Rewritten with --no-fuse-experts (fused experts
cannot be frozen one by one, so the defaults choose it, and --fuse-experts is refused), its single-process loop
becomes the grouped path in training and eval with the same numbers, frozen experts keep no gradient, and the
expert-parallel path is kept. Its expert forward casts x to the expert's weight dtype and back (trainable fp32
experts beside frozen bf16 ones): the grouped GEMMs run where every expert has x's dtype, the experts' own forward
(the published loop) where they differ."""

from __future__ import annotations

import copy
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    ROOT,
    assert_one_line_error,
    build_model,
    model_module,
    per_expert_grads,
    run_cli,
)

ESFT_DIR = ROOT / "fixtures" / "deepseek_v2_esft"
ATOL = 1e-5


def test_fused_experts_asked_for_are_refused_with_the_option_that_works(tmp_path):
    assert_one_line_error(
        run_cli(ESFT_DIR, "--out", tmp_path / "out", "--fuse-experts"), "ESFT form", "rewrite with --no-fuse-experts"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
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


def _selected(name: str, selected: set[int]) -> bool:
    parts = name.split(".")
    return "experts" in parts and int(parts[parts.index("experts") + 1]) in selected


def test_the_expert_forward_is_the_esft_one_with_its_casts():
    """The stand-in's expert MLP is ESFT's: x cast to the expert's weight dtype, the result cast back."""
    text = (ESFT_DIR / "modeling_deepseek.py").read_text()
    assert "        x = x.to(self.gate_proj.weight.dtype)\n" in text and "return down_proj.to(in_dtype)" in text


@pytest.mark.parametrize(
    ("dtype", "trained_dtype", "atol"), [(torch.float32, torch.float64, ATOL), (torch.bfloat16, torch.float32, 1e-4)]
)
def test_experts_in_another_dtype_train_like_the_published_loop(models, dtype, trained_dtype, atol):
    """ESFT's practice: the selected experts trained in a wider dtype beside the frozen rest (float64 beside float32
    as the reference; ESFT's float32 beside bfloat16). The experts' dtypes differ from x's, so their own forward runs
    (the published loop): the loss and every gradient are the published ones (up to the rest of the rewritten
    model's roundings: SDPA, the fused loss)."""
    rewritten, load_published = models
    selected = {2, 6}
    runs = []
    for model in (rewritten, load_published()):
        model = copy.deepcopy(model) if model is rewritten else model
        model.to(dtype).zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            p.requires_grad_(_selected(name, selected))
        for name, module in model.named_modules():
            if name.split(".")[-2:-1] == ["experts"] and int(name.split(".")[-1]) in selected:
                module.to(trained_dtype)
        runs.append(model.train())
    mod = model_module(runs[0])
    loops = []
    real_loop = mod._moe_rewrite_loop
    mod._moe_rewrite_loop = lambda *args: loops.append(1) or real_loop(*args)
    try:
        ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(14))
        (loss, grads), (own_loss, own_grads) = (_step(model, ids) for model in runs)
    finally:
        mod._moe_rewrite_loop = real_loop
    assert loops, "the per-expert loop did not run"
    assert abs(loss - own_loss) <= atol * 10 and grads.keys() == own_grads.keys() and grads
    assert {g.dtype for g in grads.values()} == {trained_dtype}
    for name, grad in own_grads.items():
        assert (grads[name] - grad).abs().max().item() <= atol, name


def test_experts_in_x_dtype_run_the_grouped_gemms(models):
    """Every expert in x's dtype: the casts do nothing, and the grouped GEMMs run (never the loop)."""
    rewritten, load_published = models
    published = load_published()
    mod = model_module(rewritten)
    real_loop = mod._moe_rewrite_loop

    def no_loop(*args):
        raise AssertionError("the per-expert loop ran")

    rewritten.requires_grad_(True)  # an earlier test froze all but a few experts
    mod._moe_rewrite_loop = no_loop
    try:
        rewritten.zero_grad(set_to_none=True)
        ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(15))
        loss, grads = _step(rewritten.train(), ids)
    finally:
        mod._moe_rewrite_loop = real_loop
    own_loss, own_grads = _step(published.train(), ids)
    assert abs(loss - own_loss) <= ATOL and grads.keys() == own_grads.keys()
    for name, grad in own_grads.items():
        assert (grads[name] - grad).abs().max().item() <= ATOL, name
