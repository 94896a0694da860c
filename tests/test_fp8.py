"""FP8 block-quantized experts (DeepSeek-V3, R1, Kimi-K2 checkpoints as shipped: float8_e4m3fn codes and a float32
scale per 128 x 128 block): fused with their codes and scales, they compute what the per-expert loop computes on the
dequantized weights (outputs, input and routing-weight gradients, LoRA gradients), with no weight gradient; they load
from per-expert keys, save dequantized, and refuse merges into their codes. The model level (from_pretrained of an
FP8 stand-in checkpoint through transformers' own FP8 quantizer) is further down."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import patched_checkpoint, runtime_env  # noqa: E402
from fp8 import HIDDEN, INTER, dequantize_blockwise, fp8_moe, fp8_standin, quantize_blockwise  # noqa: E402
from helpers import assert_same_step, lora, reference, rel_err, routing, step, tiny_moe  # noqa: E402

from moe_rewrite.runtime.experts import fused_checkpoint  # noqa: E402
from moe_rewrite.runtime.moe import grouped_mm  # noqa: E402

EXPERTS, TOP_K = 6, 2


def test_fp8_experts_fuse_with_their_codes_and_scales_and_stay_frozen():
    moe, ref = fp8_moe()
    first = moe.experts[1].up_proj
    experts = moe.moe_rewrite_fuse_experts()
    assert experts.moe_rewrite_fp8() and "fp8" in repr(experts)
    params = dict(experts.named_parameters())
    assert list(params) == ["gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"]
    assert params["gate_up_proj"].dtype == params["down_proj"].dtype == torch.float8_e4m3fn
    assert params["gate_up_proj"].shape == (EXPERTS, 2 * INTER, HIDDEN)
    assert params["gate_up_proj_scale_inv"].shape == (EXPERTS, 2 * INTER // 128, HIDDEN // 128)
    assert params["down_proj_scale_inv"].shape == (EXPERTS, HIDDEN // 128, INTER // 128)
    assert not any(p.requires_grad for p in params.values())
    # the codes and scales as they were, bit for bit (gate then up in gate_up_proj)
    codes = params["gate_up_proj"][1, INTER:].view(torch.uint8)
    assert torch.equal(codes, first.weight.view(torch.uint8))
    assert torch.equal(params["gate_up_proj_scale_inv"][1, INTER // 128 :], first.weight_scale_inv)
    # the views are the dequantized weights
    experts.dequantized_dtype = torch.float64
    assert torch.equal(moe.experts[4].down_proj.weight, ref[4].down_proj.weight)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fp8_experts_train_like_the_loop_over_the_dequantized_weights(dtype):
    """Output, x's gradient and the routing weights' gradient against the per-expert loop in float64 over the
    dequantized weights; experts 4 and 5 get no token; no weight gradient is computed (they are frozen)."""
    moe, ref = fp8_moe()
    moe.moe_rewrite_fuse_experts()
    tokens = 13
    x = torch.randn(tokens, HIDDEN, dtype=dtype).requires_grad_(True)
    ids, w = routing(tokens, EXPERTS, TOP_K)
    w = w.to(dtype).requires_grad_(True)
    y = moe.moe_train(x, ids, w)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = reference(ref, x64, ids, w64)
    probe = torch.randn_like(want)
    (y * probe.to(dtype)).sum().backward()
    (want * probe).sum().backward()
    # the routing weights' gradient sums its products in float32 whatever the dtype (expert_output.py)
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for got, expected in ((y, want), (x.grad, x64.grad), (w.grad, w64.grad)):
        assert (got.double() - expected).norm() <= tol * expected.norm()
    assert all(p.grad is None for p in moe.experts.parameters())


def test_fp8_experts_through_the_loop_backend_equal_the_grouped_gemms(monkeypatch):
    """MOE_REWRITE_BACKEND=loop runs the experts one by one through their views, which dequantize."""
    moe, _ = fp8_moe()
    moe.moe_rewrite_fuse_experts().dequantized_dtype = torch.float64
    x = torch.randn(9, HIDDEN, dtype=torch.float64)
    ids, w = routing(9, EXPERTS, TOP_K)
    grouped = moe.moe_train(x, ids, w)
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", "loop")
    assert torch.allclose(moe.moe_train(x, ids, w), grouped, rtol=1e-12, atol=1e-12)


def test_dequantize_matches_the_reference_and_handles_partial_blocks():
    for shape in ((256, 384), (200, 130), (3, 2, 128, 256)):
        w = torch.randn(shape)
        flat = w.reshape(-1, *shape[-2:])
        parts = [quantize_blockwise(m) for m in flat]
        codes = torch.stack([q for q, _ in parts]).view(*shape)
        scales = torch.stack([s for _, s in parts]).view(*shape[:-2], *parts[0][1].shape)
        want = torch.stack([dequantize_blockwise(q, s) for q, s in parts]).view(shape)
        assert torch.equal(grouped_mm._moe_rewrite_dequantize(codes, scales, torch.float32), want)


def test_fp8_experts_load_per_expert_keys_and_save_dequantized():
    """The checkpoint's per-expert keys (weight codes and weight_scale_inv) load into the fused parameters;
    save_pretrained's state dict has per-expert weights dequantized to the model's dtype and no scales; keys of real
    numbers are refused (they would be cast to FP8 codes without their scales)."""
    moe, ref = fp8_moe()
    source, _ = fp8_moe()
    state = {}
    for i, expert in enumerate(source.experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            layer = getattr(expert, name)
            state[f"experts.{i}.{name}.weight"] = layer.weight.detach().clone()
            state[f"experts.{i}.{name}.weight_scale_inv"] = layer.weight_scale_inv.detach().clone()
    experts = moe.moe_rewrite_fuse_experts()
    result = moe.load_state_dict(dict(state), strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if k.startswith("experts.")]
    for i, expert in enumerate(source.experts):
        assert torch.equal(experts.down_proj[i].view(torch.uint8), expert.down_proj.weight.view(torch.uint8))
        assert torch.equal(experts.gate_up_proj_scale_inv[i, : INTER // 128], expert.gate_proj.weight_scale_inv)

    class Model(torch.nn.Module):  # save_pretrained's conversion reads the model's dtype from its embeddings
        def __init__(self):
            super().__init__()
            self.embed, self.mlp = torch.nn.Embedding(4, HIDDEN, dtype=torch.bfloat16), moe

        def get_input_embeddings(self):
            return self.embed

    with pytest.warns(UserWarning, match="FP8 experts are saved dequantized"):
        saved = fused_checkpoint._moe_rewrite_unfuse_state_dict(None, Model())
    assert not [k for k in saved if "scale_inv" in k or k.endswith("_proj")]
    gate = saved["mlp.experts.2.gate_proj.weight"]
    assert gate.dtype == torch.bfloat16 and gate.shape == (INTER, HIDDEN)
    layer = source.experts[2].gate_proj
    assert torch.equal(gate, dequantize_blockwise(layer.weight, layer.weight_scale_inv, torch.bfloat16))
    real = {k: v.float() for k, v in state.items() if k.endswith(".weight")}
    with pytest.raises(RuntimeError, match="FP8 block-quantized codes"):
        moe.load_state_dict(real, strict=False)


def test_fp8_experts_cannot_be_merged_into_and_dequantize_on_request():
    """PEFT merges an adapter by adding to its base layer's weight.data: FP8 views refuse it (the sum would be lost,
    or written into codes without their scales); moe_rewrite_dequantize makes them trainable real numbers."""
    moe, ref = fp8_moe()
    experts = moe.moe_rewrite_fuse_experts()
    experts.dequantized_dtype = torch.float64
    with pytest.raises(RuntimeError, match="cannot be merged into FP8"):
        moe.experts[0].gate_proj.weight.data += 1
    experts.moe_rewrite_dequantize()
    assert not experts.moe_rewrite_fp8() and [n for n, _ in experts.named_parameters()] == ["gate_up_proj", "down_proj"]
    assert experts.gate_up_proj.dtype == torch.float64 and experts.gate_up_proj.requires_grad
    assert torch.equal(moe.experts[3].up_proj.weight, ref[3].up_proj.weight)


def test_fp8_experts_keep_their_codes_and_scales_through_dtype_casts():
    """model.to(dtype) / .double() / .bfloat16() move FP8 experts' codes and scales without casting them (a cast would
    double their memory and round the scales); the views dequantize to the dtype asked for."""
    moe, ref = fp8_moe()
    experts = moe.moe_rewrite_fuse_experts()
    codes, scales = experts.gate_up_proj.detach().clone(), experts.down_proj_scale_inv.detach().clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.double()):
        cast(moe)
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale_inv.dtype == torch.float32
        assert torch.equal(experts.gate_up_proj.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(experts.down_proj_scale_inv, scales)
    assert experts.dequantized_dtype == torch.float64
    assert torch.equal(moe.experts[1].down_proj.weight, ref[1].down_proj.weight)


def test_fp8_codes_do_not_load_into_experts_that_are_not_fp8():
    """The checkpoint's FP8 codes and scales into fused experts of real numbers would be taken as numbers (up to 448):
    refused, nothing loaded."""
    fp8_source, _ = fp8_moe()
    plain = tiny_moe("fused", experts=6, hidden=HIDDEN, inter=INTER)
    before = plain.experts.gate_up_proj.detach().clone()
    state = {}
    for i, expert in enumerate(fp8_source.experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[f"experts.{i}.{name}.weight"] = getattr(expert, name).weight.detach()
            state[f"experts.{i}.{name}.weight_scale_inv"] = getattr(expert, name).weight_scale_inv.detach()
    with pytest.raises(RuntimeError, match="holds FP8 block-quantized codes"):
        plain.load_state_dict(state, strict=False)
    assert torch.equal(plain.experts.gate_up_proj, before)


def test_fsdp2_mixed_precision_leaves_fp8_experts_as_they_are():
    """moe_rewrite_fully_shard's experts units: a MixedPrecisionPolicy's param_dtype is dropped for FP8 experts (FSDP2
    would gather the codes and scales cast to it), kept for the others."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moe_rewrite.runtime.parallel import expert_parallel_model

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    moe, _ = fp8_moe()
    fp8 = expert_parallel_model._moe_rewrite_experts_shard_kwargs(moe.moe_rewrite_fuse_experts(), {"mp_policy": policy})
    assert fp8["mp_policy"].param_dtype is None and fp8["mp_policy"].reduce_dtype == torch.float32
    plain = tiny_moe("fused").experts
    assert expert_parallel_model._moe_rewrite_experts_shard_kwargs(plain, {"mp_policy": policy})["mp_policy"] is policy


@pytest.mark.parametrize(
    "edit,reason",
    [
        (lambda moe: setattr(moe.experts[2], "up_proj", torch.nn.Linear(HIDDEN, INTER, bias=False)), "others are not"),
        (None, "whole"),
    ],
    ids=["mixed", "partial-blocks"],
)
def test_fp8_experts_that_cannot_be_fused_with_their_scales_are_refused(edit, reason):
    moe, _ = fp8_moe() if edit else fp8_moe(inter=96)
    if edit:
        edit(moe)
    with pytest.raises(RuntimeError, match=f"cannot be fused: .*{reason}"):
        moe.moe_rewrite_fuse_experts()


# The model: from_pretrained of an FP8 stand-in checkpoint (tests/fp8.py) through transformers' own FP8 quantizer,
# which refuses the CPU (its kernels are CUDA's) in validate_environment only: that check is bypassed here, the
# loading itself is transformers' (FP8Linear layers holding the checkpoint's codes and scales).


@pytest.fixture(scope="module")
def fp8_model_files(tmp_path_factory):
    """(the FP8 stand-in checkpoint of the rewrite with FP8 experts and expert parallelism, the rewrite's directory),
    written once."""
    code = patched_checkpoint(tmp_path_factory, "v3", "--fp8-experts", "--expert-parallel")
    return fp8_standin(tmp_path_factory, code)[1], code


def load_fp8(monkeypatch, directory, dtype=torch.float32, **config):
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, torch_dtype=dtype, **config)


def dequantized_reference(directory, code, dtype=torch.float32):
    """The stand-in checkpoint as real numbers: every FP8 weight times its block scales (tests/fp8.py's reference),
    loaded into the same rewrite, built from its config without the quantization_config."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    state = load_file(directory / "model.safetensors")
    for key in [k for k in state if k.endswith(".weight_scale_inv")]:
        weight = key[: -len("_scale_inv")]
        state[weight] = dequantize_blockwise(state[weight], state.pop(key), dtype)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, torch_dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    return model


def copy_adapters(source, target):
    """target's LoRA weights := source's. PEFT makes an adapter in its parameter's dtype, then upcasts FP8 ones to
    float32: adapters on the FP8 parameters (target_parameters) start rounded to FP8 values, the reference's not."""
    weights = {name: p for name, p in source.named_parameters() if "lora_" in name}
    result = target.load_state_dict(weights, strict=False)
    assert weights and not result.unexpected_keys


def test_an_fp8_checkpoint_loads_with_fp8_experts_and_real_numbers_elsewhere(monkeypatch, fp8_model_files):
    directory, _ = fp8_model_files
    model = load_fp8(monkeypatch, directory, torch.bfloat16)
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "moe_train")]
    assert moes and all(moe.experts.moe_rewrite_fp8() for moe in moes)
    experts = moes[0].experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.dequantized_dtype == torch.bfloat16
    assert experts.gate_up_proj_scale_inv.dtype == torch.float32  # transformers 4.x loads them in bf16
    linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "experts." not in name]
    assert linears and {type(m) for m in linears} == {torch.nn.Linear}
    assert {m.weight.dtype for m in linears} == {torch.bfloat16} and all(m.weight.requires_grad for m in linears)
    # no longer a quantized model: Trainer trains it, save_pretrained writes no quantization_config
    assert not model.is_quantized and model.hf_quantizer is None
    assert not hasattr(model.config, "quantization_config")


def test_a_rewrite_without_fp8_experts_refuses_an_fp8_checkpoint(monkeypatch, fp8_model_files, tmp_path_factory):
    """The FP8 stand-in with a rewrite that holds no FP8 code (rewritten from a config without FP8): one clear
    error before anything loads, naming the option that generates it."""
    directory, _ = fp8_model_files
    plain = patched_checkpoint(tmp_path_factory, "v3")
    checkpoint = tmp_path_factory.mktemp("fp8") / "fp8_plain_code"
    shutil.copytree(directory, checkpoint)
    shutil.copyfile(plain / "modeling_deepseek.py", checkpoint / "modeling_deepseek.py")
    assert "_moe_rewrite_fp8_loading" not in (checkpoint / "modeling_deepseek.py").read_text()
    with pytest.raises(ValueError, match="rewritten without FP8 experts: .* or with --fp8-experts"):
        load_fp8(monkeypatch, checkpoint)

    # the user's own quantization_config (one that dequantizes, say) goes on to transformers' loading
    import transformers

    class Reached(Exception):
        pass

    def reached(cls, *args, **kwargs):
        raise Reached(kwargs.get("quantization_config"))

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(reached))
    with pytest.raises(Reached, match="mine"):
        load_fp8(monkeypatch, checkpoint, quantization_config="mine")


def test_from_pretrained_reads_the_config_it_loads_with(fp8_model_files, tmp_path):
    """Whether a checkpoint is FP8 is read from the config from_pretrained loads: the one passed, the path passed as
    config, else the checkpoint's; where none can be read here (no path, a missing directory), transformers' own
    loading says what is wrong, as before."""
    from conftest import build_model, model_module
    from transformers import AutoConfig

    directory, code = fp8_model_files
    modeling = model_module(build_model(code))
    read = modeling._moe_rewrite_loading_config
    cls = modeling.DeepseekV3ForCausalLM
    assert modeling._moe_rewrite_fp8_checkpoint(read(cls, directory, {}))
    assert modeling._moe_rewrite_fp8_checkpoint(read(cls, None, {"config": str(directory)}))
    assert not modeling._moe_rewrite_fp8_checkpoint(read(cls, directory, {"config": str(code)}))
    config = AutoConfig.from_pretrained(code, trust_remote_code=True)
    assert read(cls, directory, {"config": config}) is config
    assert read(cls, None, {}) is None
    assert read(cls, tmp_path / "missing", {"local_files_only": True}) is None


@pytest.mark.slow  # over 10 s on CI's 2 cores: `make test-fast` leaves it out
def test_an_fp8_model_trains_evaluates_and_saves_like_its_dequantized_reference(monkeypatch, fp8_model_files, tmp_path):
    """Loaded in float32 (transformers casts the scales to it, exactly): the training step's loss and every gradient
    (LoRA adapters on every expert projection and on the dense and shared MLPs, through the views), eval logits,
    against the checkpoint dequantized by the reference and run through the per-expert loop; saved, it reloads as
    real numbers with the same logits."""
    directory, code = fp8_model_files
    model = load_fp8(monkeypatch, directory).train()  # from_pretrained gives eval mode
    reference = dequantized_reference(directory, code)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    adapted, adapted_reference = lora(model), lora(reference)
    copy_adapters(adapted, adapted_reference)
    got = step(adapted, ids)
    # transformers 4.x: adapters on the experts' views (experts.0.gate_proj); on 5.x peft turns these targets into
    # adapters on the fused parameters (experts.lora_B)
    assert any(".experts." in name and "lora_B" in name for name in got[1])
    with monkeypatch.context() as patch:
        runtime_env(patch, "MOE_REWRITE_BACKEND", "loop")
        want = step(adapted_reference, ids)
    assert_same_step(got, want, rel=1e-5)
    model, reference = load_fp8(monkeypatch, directory), dequantized_reference(directory, code).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert rel_err(logits, reference(input_ids=ids).logits) < 1e-5
    with pytest.warns(UserWarning, match="FP8 experts are saved dequantized"):
        model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in (tmp_path / "saved" / "config.json").read_text()
    reloaded = load_fp8(monkeypatch, tmp_path / "saved")
    assert not reloaded.model.layers[1].mlp.experts.moe_rewrite_fp8()
    with torch.no_grad():
        assert rel_err(reloaded(input_ids=ids).logits, logits) < 1e-6


def test_lora_on_the_fused_fp8_parameters_trains_like_on_real_numbers(monkeypatch, fp8_model_files):
    """PEFT's target_parameters (ParamWrappers on gate_up_proj and down_proj; transformers 5.x users' route): the
    grouped GEMMs read the adapters themselves (PEFT's own forward would add them to the FP8 codes); the same
    adapters on the dequantized reference's fused parameters give the same step. Merging into FP8 codes is refused."""
    directory, code = fp8_model_files
    model, reference = load_fp8(monkeypatch, directory).train(), dequantized_reference(directory, code)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    targets = {"targets": [], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
    adapted, adapted_reference = lora(model, **targets), lora(reference, **targets)
    copy_adapters(adapted, adapted_reference)
    got = step(adapted, ids)
    assert any("experts.lora_B" in name for name in got[1])
    assert_same_step(got, step(adapted_reference, ids), rel=1e-5)
    with pytest.raises(RuntimeError, match="Float8|FP8"):
        adapted.merge_and_unload()


def _fp8_ep_worker(rank, directory, out_dir):
    """One of 2 gloo ranks: the FP8 checkpoint loaded with ep_size 2 (each rank fuses its 2 of the 4 experts with
    their codes and scales), one training step on this rank's batch, gradients all-reduced; saved from both ranks."""
    import json

    import torch.distributed as dist

    monkeypatch = pytest.MonkeyPatch()
    try:
        model = load_fp8(monkeypatch, directory, ep_size=2).train()
        reference = load_fp8(monkeypatch, directory).train()
    finally:
        monkeypatch.undo()
    experts = model.model.layers[1].mlp.experts
    ids = torch.randint(0, model.config.vocab_size, (2, 2, 7), generator=torch.Generator().manual_seed(5))
    for r in range(2):  # the reference: every rank's batch in one process, per-rank backward, gradients averaged
        (reference(input_ids=ids[r], labels=ids[r]).loss / 2).backward()
    loss = model(input_ids=ids[rank], labels=ids[rank]).loss
    loss.backward()
    model.moe_rewrite_all_reduce_gradients()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    worst, zeros = 0.0, True  # parameters one process gives no gradient get zeros from the all-reduce
    for name, p in model.named_parameters():
        if ref_grads[name] is None:
            zeros = zeros and (p.grad is None or not p.grad.any())
        else:
            worst = max(worst, rel_err(p.grad, ref_grads[name]))
    model.save_pretrained(Path(out_dir) / "saved", is_main_process=rank == 0)
    dist.barrier()
    if rank == 0:
        result = {"held": [experts.first_expert, len(experts), experts.moe_rewrite_fp8()], "grad_error": worst}
        result["zeros"] = zeros
        (Path(out_dir) / "result.json").write_text(json.dumps(result))


@pytest.mark.slow  # git repositories and pre-commit runs, or processes on gloo: over 10 s
def test_fp8_experts_under_expert_parallelism_train_and_save_as_one_process(fp8_model_files, tmp_path, monkeypatch):
    """Expert parallelism over 2 gloo processes: each rank holds FP8 experts 0-1 or 2-3; every gradient (the
    dequantized layers', the router's, the embeddings') within 1e-5 of one process; the saved checkpoint (gathered
    codes and scales, written dequantized) evaluates as the FP8 model does in one process."""
    import json

    from conftest import run_ranks

    directory, _ = fp8_model_files
    run_ranks(_fp8_ep_worker, tmp_path, directory)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["held"] == [0, 2, True] and result["grad_error"] < 1e-5 and result["zeros"]
    model, saved = load_fp8(monkeypatch, directory), load_fp8(monkeypatch, tmp_path / "saved", ep_size=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        assert rel_err(saved(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-6
