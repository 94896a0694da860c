"""Exact or refused, on hand-edited variants of the stand-ins (tests/mutations.py, mutations_kimi.py, mutations_v1.py):
each variant is either refused (exit 2, one line, nothing written) or rewritten, and then one training step gives the
variant's own numbers, loss and every gradient: V2, V1 and ESFT forms, their own per-expert loop; V3 form, its own eval
branch run with gradients (its MoE layers in eval mode, moe_infer without its no_grad). Variants rewritten with options
that change training on purpose (--aux-loss, --bias-update) are checked against the unedited stand-in rewritten with
the same options."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # a rewrite and a training step per variant: minutes in all (`make test` runs them)
pytest.importorskip("transformers")

from conftest import assert_one_line_error, build_model, per_expert_grads, run_cli  # noqa: E402
from helpers import SigmoidCopied, eval_branch_with_grads  # noqa: E402
from mutations import MUTATIONS, variant_text  # noqa: E402
from mutations_kimi import KIMI_MUTATIONS  # noqa: E402
from mutations_v1 import V1_MUTATIONS  # noqa: E402

ATOL = 1e-5  # fp32, the same sums in another order


def _train_step(model, ids, projections=("gate_proj", "up_proj", "down_proj")) -> tuple[float, dict]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), per_expert_grads(grads, projections)


@pytest.mark.parametrize("mutation", MUTATIONS + KIMI_MUTATIONS + V1_MUTATIONS, ids=lambda mu: f"{mu.form}_{mu.name}")
def test_variant_is_rewritten_exactly_or_refused(mutation, tmp_path):
    variant = tmp_path / f"variant_{mutation.form}_{mutation.name}"  # one module cache entry per variant
    shutil.copytree(mutation.fixture, variant)
    text = variant_text(mutation)
    (variant / mutation.modeling).write_text(text)
    if mutation.config:
        config = json.loads((variant / "config.json").read_text())
        (variant / "config.json").write_text(json.dumps(config | dict(mutation.config), indent=2))
    out = tmp_path / f"rewritten_{mutation.form}_{mutation.name}"
    result = run_cli(variant, "--out", out, *mutation.options)
    if mutation.expect == "refused":
        assert mutation.why
        assert_one_line_error(result, mutation.modeling, mutation.why)
        assert not out.exists() and (variant / mutation.modeling).read_text() == text
        return
    assert result[0] == 0, result[2]
    if mutation.attention:  # the attention through SDPA, or left as published with its mask and a line saying why
        written = (out / mutation.modeling).read_text()
        if mutation.attention == "sdpa":
            assert "= _moe_rewrite_attention(" in written and "left as published" not in result[2], result[2]
            assert "= _moe_rewrite_sdpa_mask(" in written
        else:
            assert f"\n  {mutation.attention}" in result[2], result[2]
            assert "= _moe_rewrite_attention(" not in written and "= _moe_rewrite_sdpa_mask(" not in written
    if mutation.mask:  # the attention through SDPA, the Model's 4-D mask left as published with a line saying why
        written = (out / mutation.modeling).read_text()
        assert f"\n  {mutation.mask}" in result[2], result[2]
        assert "= _moe_rewrite_attention(" in written and "= _moe_rewrite_sdpa_mask(" not in written
    rewritten = build_model(out, seed=5)
    with torch.no_grad():
        for name, p in rewritten.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(6)) * 0.1)
    rewritten.save_pretrained(tmp_path / "weights")
    shutil.copy(tmp_path / "weights" / "model.safetensors", variant / "model.safetensors")
    from transformers import AutoModelForCausalLM

    own, info = AutoModelForCausalLM.from_pretrained(
        variant, trust_remote_code=True, torch_dtype=torch.float32, output_loading_info=True
    )
    own.train()
    # save_pretrained of the default (fused) layout writes exactly the variant's own keys: nothing dropped or added
    from safetensors import safe_open

    with safe_open(tmp_path / "weights" / "model.safetensors", "pt") as saved:
        assert set(saved.keys()) == set(own.state_dict())
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # and the saved checkpoint reloads into the rewritten class with the same logits
    shutil.copy(tmp_path / "weights" / "model.safetensors", out / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, torch_dtype=torch.float32)
    probe = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert (reloaded.eval()(input_ids=probe).logits - rewritten.eval()(input_ids=probe).logits).abs().max() <= 1e-6
    if mutation.reference == "fixture":  # the unedited stand-in, rewritten with the same options, same weights
        reference = tmp_path / f"reference_{mutation.form}_{mutation.name}"
        assert run_cli(mutation.fixture, "--out", reference, *mutation.options)[0] == 0
        shutil.copy(tmp_path / "weights" / "model.safetensors", reference / "model.safetensors")
        own = AutoModelForCausalLM.from_pretrained(reference, trust_remote_code=True, torch_dtype=torch.float32).train()
    elif mutation.form in ("v3", "kimi"):
        eval_branch_with_grads(own)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(7))
    loss, grads = _train_step(rewritten.train(), ids, mutation.projections)
    with SigmoidCopied():  # Kimi's router adds its bias in place to the sigmoid's output (a no-op for the others)
        own_loss, own_grads = _train_step(own, ids)
    assert abs(loss - own_loss) <= ATOL
    # an expert no token picks: fused experts give it zero gradients, per-expert modules none
    assert own_grads.keys() <= grads.keys()
    assert not any(grads[name].any() for name in grads.keys() - own_grads.keys())
    for name, grad in own_grads.items():
        assert (grads[name] - grad).abs().max().item() <= ATOL, name
