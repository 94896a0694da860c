"""PEFT's LoRA on the fused expert parameters (ParamWrapper): `target_parameters=["experts.gate_up_proj",
"experts.down_proj"]`, and on transformers 5.x what peft makes of `target_modules` naming gate_proj / up_proj /
down_proj for model_type deepseek_v2/v3. Training and eval run the adapters as grouped GEMMs, equal to PEFT's own
forward (W + BA as the parameter, expert by expert); adapters in the standard per-expert format load onto the default
output. `make test` runs this module on the main environment's transformers and again on a 5.x release."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from conftest import build_model, patched_checkpoint, per_expert_checkpoint, runtime_env  # noqa: E402
from helpers import PROJECTIONS, REL, assert_same_step, grouped_then_looped, no_loop, rel_err  # noqa: E402

V5 = int(transformers.__version__.split(".")[0]) >= 5
PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]
# How users get PEFT's wrappers on the fused parameters: target_parameters everywhere, and on transformers 5.x
# target_modules too (peft converts them for deepseek_v2/v3).
TARGETS = ["target_parameters", *(["target_modules"] if V5 else [])]
RANK, ALPHA = 4, 8
ROUTED = r".*\.experts\.\d+\.(gate_proj|up_proj|down_proj)"  # every routed expert's projections, as a regex


def wrap(model, targets, seed=0, rank=RANK):
    """The model under PEFT with adapters on every routed expert, their B weights drawn non-zero."""
    torch.manual_seed(seed)
    where = {"target_parameters": PARAMETERS} if targets == "target_parameters" else {"target_modules": PROJECTIONS}
    config = peft.LoraConfig(r=rank, lora_alpha=ALPHA, init_lora_weights=False, **where)
    return peft.get_peft_model(model, config, autocast_adapter_dtype=False)


def moe_blocks(model):
    return [m for m in model.modules() if hasattr(m, "moe_rewrite_infer")]


def wrapped_parameters(model):
    """Per MoE layer, the parameter names of the PEFT wrappers around its experts."""
    names = []
    for moe in moe_blocks(model):
        experts, found = moe.experts, []
        while type(experts).__name__ == "ParamWrapper":
            found.append(experts.parameter_name)
            experts = experts.base_layer
        assert type(experts).__name__ == "_MoeRewriteFusedExperts"
        names.append(sorted(found))
    return names


@pytest.mark.parametrize("targets", TARGETS)
@pytest.mark.parametrize("form", ["v3", "v2"])
def test_lora_on_the_fused_parameters_trains_grouped_like_peft_forward(tmp_path_factory, monkeypatch, form, targets):
    model = build_model(patched_checkpoint(tmp_path_factory, form), seed=1).train()
    adapted = wrap(model, targets)
    assert wrapped_parameters(adapted) == [["down_proj", "gate_up_proj"]] * len(moe_blocks(model))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    grouped, looped = grouped_then_looped(monkeypatch, model, adapted, ids)  # the loop: PEFT's W + BA per expert
    assert_same_step(grouped, looped)
    assert any(".experts.base_layer.lora_A" in name for name in grouped[1])  # gate_up_proj's adapter trains


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm needs torch >= 2.8")
def test_lora_on_the_fused_parameters_with_the_torch_kernel(tmp_path_factory, monkeypatch):
    """The GPU production kernel (torch._grouped_mm, bf16) on CPU: rank 8 rows are 16 bytes (the kernel's alignment),
    rank 4 rows fall back to the sorted pass."""
    model = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=2).train().to(torch.bfloat16)
    torch.manual_seed(3)
    config = peft.LoraConfig(r=8, lora_alpha=16, rank_pattern={r".*\.down_proj": 4}, target_parameters=PARAMETERS)
    adapted = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
    for module in adapted.modules():  # B drawn non-zero (PEFT starts it at zero)
        if type(module).__name__ == "ParamWrapper":
            torch.nn.init.normal_(module.lora_B["default"].weight, std=0.02)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert_same_step(*grouped_then_looped(monkeypatch, model, adapted, ids, kernel="torch"), rel=2e-2)  # bf16


@pytest.mark.parametrize("targets", TARGETS)
@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_eval_disable_and_merge_under_lora_on_the_fused_parameters(tmp_path_factory, tmp_path, monkeypatch, targets):
    """moe_infer cannot index wrapped experts: eval runs them grouped, equal to PEFT's forward and to the merged
    model (which evaluates through moe_infer, expert by expert); disable_adapter() gives the base model."""
    ckpt = patched_checkpoint(tmp_path_factory, "v3")
    base = build_model(ckpt, seed=4).eval()
    adapted = wrap(copy.deepcopy(base), targets, seed=5).eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 9))
    with torch.no_grad():
        with monkeypatch.context() as patch:
            no_loop(patch, adapted.get_base_model())
            grouped = adapted(input_ids=ids).logits
            with adapted.disable_adapter():
                disabled = adapted(input_ids=ids).logits
        expected_base = base(input_ids=ids).logits
        with monkeypatch.context() as patch:
            runtime_env(patch, "MOE_REWRITE_BACKEND", "loop")
            looped = adapted(input_ids=ids).logits
    assert rel_err(grouped, looped) < REL and rel_err(grouped, expected_base) > 1e-3
    assert rel_err(disabled, expected_base) < REL
    merged = adapted.merge_and_unload()
    assert wrapped_parameters(merged) == [[]] * len(moe_blocks(merged))
    with torch.no_grad():
        assert rel_err(merged(input_ids=ids).logits, grouped) < REL
    merged.save_pretrained(tmp_path / "merged")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "merged" / "model.safetensors")
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in saved and not any("lora" in k for k in saved)


def write_per_expert_adapter(directory, model, seed):
    """An adapter in the standard per-expert format (the keys PEFT writes for the original file), drawn at random, and
    the model with those adapters merged by hand: W_e + alpha / r * B_e A_e for every expert's projections."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors, merged = {}, copy.deepcopy(model)
    for name, experts in merged.named_modules():
        if type(experts).__name__ != "_MoeRewriteFusedExperts":
            continue
        inter = experts.down_proj.shape[2]
        with torch.no_grad():
            for e in range(len(experts)):
                for projection, weight in (
                    ("gate_proj", experts.gate_up_proj[e, :inter]),
                    ("up_proj", experts.gate_up_proj[e, inter:]),
                    ("down_proj", experts.down_proj[e]),
                ):
                    a = torch.randn(RANK, weight.shape[1], generator=generator) * 0.1
                    b = torch.randn(weight.shape[0], RANK, generator=generator) * 0.1
                    key = f"base_model.model.{name}.{e}.{projection}"
                    tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
                    weight += ALPHA / RANK * b @ a
    directory.mkdir()
    save_file(tensors, directory / "adapter_model.safetensors")
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ROUTED)
    config.save_pretrained(directory)
    return merged


def test_a_per_expert_adapter_loads_onto_the_default_output(tmp_path_factory, tmp_path):
    """An adapter trained on the original file (per-expert keys) gives the default output the same model as merging
    it by hand (on transformers 5.x PEFT converts it onto the fused parameters as it loads)."""
    model = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=6).eval()
    expected = write_per_expert_adapter(tmp_path / "adapter", model, seed=7)
    loaded = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    if V5:
        assert wrapped_parameters(loaded) == [["down_proj", "gate_up_proj"]] * len(moe_blocks(model))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, expected(input_ids=ids).logits) < REL


@pytest.mark.slow
def test_adapters_on_the_fused_parameters_round_trip_and_refuse_per_expert_modules(tmp_path_factory, tmp_path):
    """An adapter saved from the wrapped parameters reloads onto a default output as the same model; a
    --no-fuse-experts output has no fused parameters to put it on, and loading it there is an error."""
    ckpt = patched_checkpoint(tmp_path_factory, "v3")
    trained = wrap(build_model(ckpt, seed=8), "target_parameters", seed=9).eval()
    trained.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(PARAMETERS)
    ids = torch.randint(0, trained.config.vocab_size, (2, 9))
    loaded = peft.PeftModel.from_pretrained(build_model(ckpt, seed=8), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, trained(input_ids=ids).logits) < REL
    per_expert = build_model(per_expert_checkpoint(tmp_path_factory, "v3"), seed=8)
    with pytest.raises(ValueError, match="target_parameters"):
        peft.PeftModel.from_pretrained(per_expert, tmp_path / "adapter")


@pytest.mark.skipif(not V5, reason="transformers 4.x: per-expert adapters load into the expert views (test_lora.py)")
def test_a_per_expert_adapter_the_wrappers_cannot_hold_is_an_error(tmp_path_factory, tmp_path):
    """On transformers 5.x PEFT wraps the fused parameters for a per-expert adapter's config: one lacking an expert's
    weights, or of another rank than its config says, fails to load instead of loading in part."""
    from safetensors.torch import load_file, save_file

    model = build_model(patched_checkpoint(tmp_path_factory, "v3"), seed=10)
    write_per_expert_adapter(tmp_path / "adapter", model, seed=11)
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if ".experts.3.up_proj." not in k}, path)
    with pytest.raises(RuntimeError, match="lacks some experts' gate_proj or up_proj"):
        peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapter")
    save_file({k: (v[:2] if "lora_A" in k else v[:, :2]).contiguous() for k, v in tensors.items()}, path)  # rank 2
    with pytest.raises(RuntimeError, match="does not fit PEFT's adapter"):
        peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapter")
