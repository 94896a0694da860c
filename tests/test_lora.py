"""LoRA on the routed experts with standard PEFT adapters (`target_modules` naming gate_proj / up_proj / down_proj):
on the default (fused) output and on --no-fuse-experts outputs the adapted experts train through grouped GEMMs, equal
to the per-expert loop that runs PEFT's own modules; adapters keep PEFT's per-expert keys, so they move between the
layouts and the original file; merge_and_unload gives the adapted model."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from conftest import (  # noqa: E402
    FORM_DIRS,
    build_model,
    model_module,
    patched_checkpoint,
    per_expert_checkpoint,
)
from helpers import (  # noqa: E402
    PROJECTIONS,
    REL,
    assert_same_step,
    grouped_then_looped,
    lora,
    moe_layer,
    no_loop,
    rel_err,
)


def routed_adapted(model) -> int:
    return sum(
        1
        for name, m in model.named_modules()
        if ".experts." in name and name.endswith(tuple(PROJECTIONS)) and hasattr(m, "lora_A")
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fused", "per-expert"])
@pytest.mark.parametrize("form", ["v3", "v2"])
def test_lora_on_routed_experts_trains_grouped_like_the_loop(tmp_path_factory, monkeypatch, form, layout):
    ckpt = patched_checkpoint(tmp_path_factory, form, *(["--no-fuse-experts"] if layout == "per-expert" else []))
    model = build_model(ckpt, seed=1).train()
    moe_layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "moe_train")]
    experts = sum(len(moe.experts) for moe in moe_layers)
    adapted = lora(model)
    assert routed_adapted(adapted) == 3 * experts  # every routed expert's three projections
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert_same_step(*grouped_then_looped(monkeypatch, model, adapted, ids))
    frozen = [n for n, p in adapted.named_parameters() if "experts" in n and "lora" not in n]
    assert frozen and all(not dict(adapted.named_parameters())[n].requires_grad for n in frozen)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm needs torch >= 2.8")
@pytest.mark.parametrize("rank", [4, 8])  # bf16 rows of rank 4 are 8 bytes: torch._grouped_mm cannot take them
def test_lora_on_one_projection_with_the_torch_kernel(tmp_path_factory, monkeypatch, rank):
    """The GPU production kernel (torch._grouped_mm, bf16) on CPU, adapters on down_proj only."""
    model = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=2).train().to(torch.bfloat16)
    torch.manual_seed(3)
    config = peft.LoraConfig(r=rank, target_modules=["down_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert_same_step(*grouped_then_looped(monkeypatch, model, adapted, ids, kernel="torch"), rel=2e-2)  # bf16


def test_disabled_and_merged_adapters_run_grouped_as_the_base_layers(tmp_path_factory, monkeypatch):
    """disable_adapter() (as DPO's reference pass uses it) and merge_adapter() leave PEFT's layers running their base
    layer alone: the grouped GEMMs run the base weights (the merged ones once merged), not the loop."""
    ckpt = patched_checkpoint(tmp_path_factory, "v3")
    base = build_model(ckpt, seed=15).eval()
    adapted = lora(copy.deepcopy(base), seed=16).eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected_base, expected = base(input_ids=ids).logits, adapted(input_ids=ids).logits
        adapted.train()
        with monkeypatch.context() as patch:
            no_loop(patch, base)
            no_loop(patch, adapted.get_base_model())
            with adapted.disable_adapter():
                disabled = adapted(input_ids=ids).logits
            adapted.merge_adapter()
            merged = adapted(input_ids=ids).logits
            base.train()
            trained_base = base(input_ids=ids).logits
    assert rel_err(expected, expected_base) > 1e-3
    assert rel_err(disabled, trained_base) < REL and rel_err(merged, expected) < REL


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_adapters_the_grouped_gemms_cannot_reproduce_run_through_the_loop(tmp_path_factory):
    """DoRA changes the forward: the layer falls back to PEFT's own modules, with the same numbers as the loop."""
    model = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=4).train()
    adapted = lora(model, use_dora=True)
    moe = moe_layer(model)
    assert moe.moe_rewrite_expert_weights() is None
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    loss = adapted(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.slow
def test_adapters_move_between_layouts_and_onto_the_original_file(tmp_path_factory, tmp_path):
    """PEFT saves the standard per-expert keys (experts.{i}.gate_proj.lora_A.weight); they load onto the default
    output, a --no-fuse-experts output and the file as published, which all compute the same adapted model."""
    fused_ckpt = patched_checkpoint(tmp_path_factory, "v3")
    base = build_model(fused_ckpt, seed=5)
    trained = lora(copy.deepcopy(base), seed=6)
    trained.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors").keys()
    assert any(k.endswith("mlp.experts.0.gate_proj.lora_A.weight") for k in keys)
    assert not any("gate_up_proj" in k for k in keys)
    ids = torch.randint(0, base.config.vocab_size, (2, 9))
    trained.eval()
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
    state = model_module(base)._moe_rewrite_unfuse_state_dict(None, base)  # the checkpoint's per-expert keys
    for where in (per_expert_checkpoint(tmp_path_factory, "v3"), FORM_DIRS["v3"], fused_ckpt):
        other = build_model(where, seed=7)
        other.load_state_dict(state)
        loaded = peft.PeftModel.from_pretrained(other, tmp_path / "adapter").eval()
        assert routed_adapted(loaded) == routed_adapted(trained)
        with torch.no_grad():
            assert rel_err(loaded(input_ids=ids).logits, expected) < REL, where


def test_merge_and_unload_equals_the_adapted_model_and_saves_per_expert_keys(tmp_path_factory, tmp_path):
    model = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=8)
    adapted = lora(model, seed=9).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
    merged = adapted.merge_and_unload()
    assert routed_adapted(merged) == 0 and type(moe_layer(merged).experts).__name__ == "_MoeRewriteFusedExperts"
    with torch.no_grad():
        assert rel_err(merged(input_ids=ids).logits, expected) < REL
    merged.train()
    ids_t = torch.randint(0, model.config.vocab_size, (2, 5))
    assert torch.isfinite(merged(input_ids=ids_t, labels=ids_t).loss)
    merged.save_pretrained(tmp_path / "merged")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "merged" / "model.safetensors")
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in saved and not any("lora" in k for k in saved)


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_lora_on_the_experts_in_a_trainer(tmp_path_factory, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=10)
    adapted = lora(model, targets=["q_a_proj", *PROJECTIONS], seed=11)
    before = {n: p.detach().clone() for n, p in adapted.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (8, 12), generator=torch.Generator().manual_seed(12))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
    )
    Trainer(model=adapted, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids]).train()
    changed = {n for n, p in adapted.named_parameters() if not torch.equal(p, before[n])}
    assert any(".experts.0.gate_proj.lora_B" in n for n in changed) and any("q_a_proj.lora_B" in n for n in changed)
    assert all("lora" in n for n in changed)  # the base model stays frozen


def test_other_tuners_and_replaced_projections_run_as_the_modules_they_are(tmp_path_factory, monkeypatch):
    """What is not LoRA over the fused views (another PEFT tuner, a projection the user replaced) is not read as the
    fused weights: the loop runs the modules, with the loop's own numbers."""
    model = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=13).train()
    ia3 = peft.get_peft_model(model, peft.IA3Config(target_modules=["down_proj"], feedforward_modules=["down_proj"]))
    moe = moe_layer(model)
    assert moe.moe_rewrite_expert_weights() is None
    replaced = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=14).train()
    moe = moe_layer(replaced)
    old = moe.experts[0].up_proj
    moe.experts[0].up_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    assert moe.moe_rewrite_expert_weights() is None
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    assert torch.isfinite(ia3(input_ids=ids, labels=ids).loss)
