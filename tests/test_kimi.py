"""Kimi's MoE block (fixtures/kimi, our stand-in for Kimi-Linear's modeling_kimi.py): its `else: raise
NotImplementedError` training guard replaced by the training path, experts named w1/w2/w3 read by their use, the
router's in-place bias add made out of place. One training step equals the published eval path run with gradients
(fp32, a padding mask, an expert no token picks), eval is unchanged, and the checkpoint's `experts.N.w1.weight` keys
load into the fused experts and are written back."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import FIXTURES, assert_one_line_error, build_model, per_expert_grads, run_cli  # noqa: E402
from helpers import SigmoidCopied, eval_branch_with_grads  # noqa: E402

KIMI = FIXTURES / "kimi"
KIMI_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down as the expert's forward uses them
ATOL = 1e-5  # fp32, the same sums in another order


@pytest.fixture(scope="module")
def kimi_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi") / "rewritten"
    code, _, err = run_cli(KIMI, "--out", out)
    assert code == 0, err
    return out, err


def test_summary_names_the_kimi_block(kimi_out):
    out, err = kimi_out
    assert "V3 form, KimiSparseMoeBlock + KimiMoEGate" in err
    text = (out / "modeling_kimi.py").read_text()
    assert 'MOE_REWRITE_PROJECTIONS = ("w1", "w3", "w2")' in text
    assert "raise NotImplementedError" not in text.split("class KimiSparseMoeBlock")[1].split("def moe_train")[0]
    assert "scores_for_choice +=" not in text and "assert not self.training" not in text
    # compat: the list of tied keys as 5.x reads it, the source as transformers' default get_input_embeddings() gives
    assert "compat: _tied_weights_keys as a dict in KimiLinearForCausalLM" in err
    assert '_tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}' in text


def _step(model, ids, mask, labels, projections=("gate_proj", "up_proj", "down_proj")):
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), per_expert_grads(grads, projections)


def test_training_step_equals_the_published_eval_path_with_gradients(kimi_out, tmp_path):
    out, _ = kimi_out
    rewritten = build_model(out, seed=3)
    with torch.no_grad():
        for name, p in rewritten.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
                p[5] = -4.0  # expert 5: chosen by no token
    rewritten.save_pretrained(tmp_path / "weights")
    published_dir = tmp_path / "published"
    shutil.copytree(KIMI, published_dir)
    shutil.copy(tmp_path / "weights" / "model.safetensors", published_dir / "model.safetensors")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(tmp_path / "weights" / "model.safetensors", "pt") as saved:
        keys = set(saved.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in keys and not any("gate_up" in k for k in keys)
    published, info = AutoModelForCausalLM.from_pretrained(
        published_dir, trust_remote_code=True, torch_dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert set(published.state_dict()) == keys

    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():  # eval: the rewritten file gives the published logits
        same = published.eval()(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(rewritten.eval()(input_ids=ids, attention_mask=mask).logits, same)

    loss, grads = _step(rewritten.train(), ids, mask, labels, KIMI_PROJECTIONS)
    published.train()
    eval_branch_with_grads(published)
    with SigmoidCopied():
        own_loss, own_grads = _step(published, ids, mask, labels)
    assert abs(loss - own_loss) <= ATOL
    experts = "model.layers.1.block_sparse_moe.experts"
    empty = {f"{experts}.5.{name}.weight" for name in KIMI_PROJECTIONS}  # fused: zero rows; published: no gradient
    assert grads.keys() - own_grads.keys() == empty and own_grads.keys() <= grads.keys()
    assert not any(grads[name].any() for name in empty)
    for name, grad in own_grads.items():
        assert (grads[name] - grad).abs().max().item() <= ATOL, name
    assert grads["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].abs().sum() > 0  # in the weights


@pytest.mark.parametrize(
    "edit",
    [
        ("self.embed_tokens = nn.Embedding(", "self.wte = nn.Embedding("),  # not the attribute the default reads
        (  # an in-file base answers get_input_embeddings() itself: not transformers' default
            '    base_model_prefix = "model"\n',
            '    base_model_prefix = "model"\n\n    def get_input_embeddings(self):\n        return None\n',
        ),
    ],
    ids=["no_embed_tokens", "base_answers"],
)
def test_a_tied_list_compat_cannot_resolve_is_refused(tmp_path, edit):
    """Where neither the class nor transformers' default says which weight lm_head is tied to, compat refuses (5.x
    cannot read the list) and names the way out; nothing is written."""
    variant = tmp_path / "kimi"
    shutil.copytree(KIMI, variant)
    path = variant / "modeling_kimi.py"
    text = path.read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1]))
    assert_one_line_error(run_cli(variant, "--out", tmp_path / "out"), "_tied_weights_keys is a list", "--no-compat")
    assert not (tmp_path / "out").exists()
