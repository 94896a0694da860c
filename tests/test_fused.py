"""Fused experts (moe_rewrite_fuse_experts / moe_rewrite.training.fuse_experts): the routed experts held in two
parameters train, evaluate, save and load exactly like the per-expert nn.Linear layers they replace."""

from __future__ import annotations

import copy
import os
import shutil
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import (  # noqa: E402
    build_model,
    model_module,
    patched_checkpoint,
    per_expert_checkpoint,
    run_ranks,
    runtime_env,
    same_bits,
)
from helpers import REL, assert_matches_reference, fused_grads, moe_layer, reference_moe, rel_err  # noqa: E402

from moe_rewrite.training import fuse_experts  # noqa: E402


@pytest.mark.parametrize("shape", [(3, 7), (1, 1)], ids=["batch", "single-token"])
def test_fused_experts_train_like_the_per_expert_reference(patched, form, shape):
    model = build_model(patched, seed=int(torch.randint(0, 10**6, ())))
    moe = moe_layer(model).train()
    x = torch.randn(*shape, model.config.hidden_size, requires_grad=True)
    reference = reference_moe(moe, x)  # from the per-expert layers, before fusing
    assert fuse_experts(model) == sum(hasattr(layer.mlp, "moe_train") for layer in model.model.layers)
    assert type(moe.experts).__name__ == "_MoeRewriteFusedExperts"
    assert [n for n, _ in moe.experts.named_parameters()] == ["gate_up_proj", "down_proj"]
    assert_matches_reference(
        moe(x), x, reference, lambda: {name: p.grad for name, p in moe.named_parameters()} | fused_grads(moe)
    )


def test_fused_model_evaluates_trains_and_saves_like_the_original(patched, form, tmp_path):
    original = build_model(patched, seed=3)
    model = copy.deepcopy(original)
    layers = sum(1 for m in model.modules() if hasattr(m, "moe_rewrite_fuse_experts"))
    assert fuse_experts(model) == layers > 0
    fused = {name: p for name, p in model.named_parameters()}
    assert fuse_experts(model) == layers  # a second call changes nothing: the same parameters, the same values
    assert {name: p for name, p in model.named_parameters()} == fused
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    original.eval(), model.eval()
    with torch.no_grad():  # eval runs moe_infer, which calls the fused experts one by one
        assert rel_err(model(input_ids=ids).logits, original(input_ids=ids).logits) < REL
    original.train(), model.train()
    assert rel_err(model(input_ids=ids, labels=ids).loss, original(input_ids=ids, labels=ids).loss) < REL
    # state_dict() names the parameters as they are (what FSDP and torch.distributed.checkpoint expect) ...
    state = model.state_dict()
    assert set(dict(model.named_parameters())) <= set(state)
    assert any(key.endswith("experts.gate_up_proj") for key in state)
    assert not any(".experts.0." in key for key in state)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert get_model_state_dict(model).keys() == state.keys()
    # ... while save_pretrained writes the checkpoint's own per-expert tensors, each its own (no shared storage),
    # also from a state dict passed in (FSDP's full state dict has the fused names).
    from safetensors.torch import load_file

    reference = original.state_dict()
    for where, args, kwargs in (
        ("own", (), {}),
        ("passed", (), {"state_dict": state}),
        ("by-position", (True, state), {}),
    ):
        model.save_pretrained(tmp_path / where, *args, **kwargs)
        saved = load_file(tmp_path / where / "model.safetensors")
        assert saved.keys() == reference.keys()
        for key, value in reference.items():
            assert same_bits(saved[key], value), key
    reloaded = build_model(patched, seed=4).eval()
    reloaded.load_state_dict(saved, strict=True)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, original.eval()(input_ids=ids).logits)
    # Either layout loads into a fused model: per-expert keys strictly, all at once or a few at a time (shards).
    moe = moe_layer(model)
    for shards in (1, 3):
        fresh = build_model(patched, seed=5 + shards)
        fuse_experts(fresh)
        keys = list(reference)
        for shard in range(shards):
            result = fresh.load_state_dict({k: reference[k] for k in keys[shard::shards]}, strict=shards == 1)
            assert not result.unexpected_keys
        fresh_moe = moe_layer(fresh)
        assert torch.equal(fresh_moe.experts.gate_up_proj, moe.experts.gate_up_proj)
        assert torch.equal(fresh_moe.experts.down_proj, moe.experts.down_proj)
    fresh_moe.experts.load_state_dict(
        {"gate_up_proj": moe.experts.gate_up_proj * 2, "down_proj": moe.experts.down_proj}
    )
    assert torch.equal(fresh_moe.experts.gate_up_proj, moe.experts.gate_up_proj * 2)
    # A checkpoint that lacks some experts is refused by a strict load, not left half loaded.
    incomplete = {k: v for k, v in reference.items() if ".experts.1." not in k}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*experts\.1\.gate_proj\.weight"):
        fresh.load_state_dict(incomplete)
    # Checkpoints written another way keep the fused names; unfuse_state_dict gives the per-expert layout.
    from moe_rewrite.training import unfuse_state_dict

    converted = unfuse_state_dict(model, model.state_dict())
    assert converted.keys() == reference.keys() and all(torch.equal(converted[k], v) for k, v in reference.items())
    bad = dict(reference)
    name = next(k for k in bad if k.endswith("experts.1.up_proj.weight"))
    bad[name] = bad[name][:, :-1]
    with pytest.raises(RuntimeError, match="has shape"):
        fresh.load_state_dict(bad)


@pytest.mark.slow
def test_sharded_checkpoint_loads_into_a_fused_model(tmp_path_factory, tmp_path):
    """transformers' load_sharded_checkpoint (Trainer's resume) loads shard after shard into fused experts."""
    from transformers.modeling_utils import load_sharded_checkpoint

    ckpt = per_expert_checkpoint(tmp_path_factory, "v3")
    original = build_model(ckpt, seed=8)
    original.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    model = build_model(ckpt, seed=9)
    fuse_experts(model)
    load_sharded_checkpoint(model, tmp_path, strict=False)
    moe, moe_ref = moe_layer(model), moe_layer(original)
    for i, e in enumerate(moe_ref.experts):
        inter = e.gate_proj.weight.shape[0]
        assert torch.equal(moe.experts.gate_up_proj[i, :inter], e.gate_proj.weight)
        assert torch.equal(moe.experts.gate_up_proj[i, inter:], e.up_proj.weight)
        assert torch.equal(moe.experts.down_proj[i], e.down_proj.weight)
    assert torch.equal(model.lm_head.weight, original.lm_head.weight)


def test_meta_device_models_are_not_fused(tmp_path_factory):
    ckpt = patched_checkpoint(tmp_path_factory, "v3")
    with torch.device("meta"), pytest.warns(UserWarning, match="meta device"):
        model = build_model(ckpt)
    assert isinstance(moe_layer(model).experts, torch.nn.ModuleList)


def test_fused_experts_index_like_a_module_list(tmp_path_factory):
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3")))
    per_expert = list(copy.deepcopy(moe.experts))
    experts = moe.moe_rewrite_fuse_experts()
    assert experts is moe.experts and len(experts) == len(per_expert)
    x = torch.randn(4, moe.config.hidden_size)
    for fused, original in zip(list(experts), per_expert):
        assert rel_err(fused(x), original(x)) < REL
    assert rel_err(experts[-1](x), per_expert[-1](x)) < REL
    with pytest.raises(IndexError):
        experts[len(per_expert)]


def test_fused_experts_with_the_loop_and_autocast(tmp_path_factory, monkeypatch):
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    reference = copy.deepcopy(moe)
    moe.moe_rewrite_fuse_experts()
    x = torch.randn(12, moe.config.hidden_size)
    ids = torch.stack([torch.randperm(moe.config.n_routed_experts)[:2] for _ in range(12)])
    w = torch.rand(12, 2)
    expected = reference.moe_train(x, ids, w)
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", "loop")
    assert rel_err(moe.moe_train(x, ids, w), expected) < REL
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = moe.moe_train(x, ids, w), reference.moe_train(x, ids, w)
    assert y.dtype == torch.float32 and rel_err(y, y_ref) < 1e-2
    y.sum().backward()
    assert moe.experts.gate_up_proj.grad.dtype == torch.float32  # fp32 master weights keep fp32 gradients


def test_fusing_what_cannot_be_fused_is_refused(tmp_path_factory):
    class DoubledLinear(torch.nn.Linear):
        pass

    model = build_model(per_expert_checkpoint(tmp_path_factory, "v3"))
    moe = moe_layer(model)
    old = moe.experts[2].up_proj
    moe.experts[2].up_proj = DoubledLinear(old.in_features, old.out_features, bias=False)
    with pytest.raises(RuntimeError, match="plain, whole, bias-free nn.Linear"):
        moe.moe_rewrite_fuse_experts()
    moe.experts[2].up_proj = old
    moe.experts[1].down_proj.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="requires_grad"):
        moe.moe_rewrite_fuse_experts()
    with pytest.raises(ValueError, match="moe_rewrite_fuse_experts"):
        fuse_experts(torch.nn.Linear(2, 2))


def _fsdp2_worker(rank, ckpt, out_dir):
    from torch.distributed.fsdp import fully_shard

    model = build_model(ckpt, seed=11).train()
    fuse_experts(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    moe = moe_layer(model)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(300 + rank))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in moe.experts.named_parameters()}
    # A full per-expert checkpoint loads into the sharded fused parameters (torch.distributed.checkpoint's API).
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    per_expert = build_model(ckpt, seed=12).state_dict()
    set_model_state_dict(model, per_expert, options=StateDictOptions(full_state_dict=True))
    loaded_down = moe.experts.down_proj.full_tensor().detach().clone()
    try:
        moe.moe_rewrite_fuse_experts()  # already fused: nothing to do
        type(moe).moe_rewrite_fuse_experts(moe_layer(build_model(ckpt)))  # a plain one still fuses
        refused = ""
        other = build_model(ckpt)
        fully_shard(other)
        moe_layer(other).moe_rewrite_fuse_experts()
    except RuntimeError as error:
        refused = str(error)
    torch.save(
        {"loss": loss.detach(), "grads": grads, "refused": refused, "loaded_down": loaded_down},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.slow
def test_fused_experts_under_fsdp2_match_one_process(tmp_path_factory, tmp_path):
    ckpt = per_expert_checkpoint(tmp_path_factory, "v3")
    run_ranks(_fsdp2_worker, tmp_path, ckpt)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all("before wrapping" in r["refused"] for r in results)
    model = build_model(ckpt, seed=11).train()  # one process, per-expert layers: the mean of the two ranks' losses
    losses = [
        model(input_ids=ids, labels=ids).loss
        for ids in (torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(300 + r)) for r in range(2))
    ]
    ((losses[0] + losses[1]) / 2).backward()
    for r in range(2):
        assert rel_err(results[r]["loss"], losses[r]) < REL
    expected = {
        "gate_up_proj": torch.stack(
            [torch.cat([e.gate_proj.weight.grad, e.up_proj.weight.grad]) for e in moe_layer(model).experts]
        ),
        "down_proj": torch.stack([e.down_proj.weight.grad for e in moe_layer(model).experts]),
    }
    for name, grad in expected.items():
        assert rel_err(results[0]["grads"][name], grad) < REL, name
        assert torch.equal(results[0]["grads"][name], results[1]["grads"][name]), name
    other = moe_layer(build_model(ckpt, seed=12))
    expected_down = torch.stack([e.down_proj.weight for e in other.experts]).detach()
    assert all(torch.equal(r["loaded_down"], expected_down) for r in results)


def test_default_rewrite_loads_every_model_fused(tmp_path_factory, form, monkeypatch):
    """By default from_pretrained and from_config give fused experts, with the checkpoint's weights and keys."""
    from conftest import FORM_DIRS
    from transformers import AutoModelForCausalLM

    out = patched_checkpoint(tmp_path_factory, form)
    original = build_model(FORM_DIRS[form], seed=6).eval()
    original.save_pretrained(out)  # the stand-in's weights next to the patched code
    # defined, called by from_pretrained, post_init, _from_config (a second call in from_pretrained, after FP8 layers
    # are dequantized, only where FP8 experts are generated)
    assert (out / "modeling_deepseek.py").read_text().count("_moe_rewrite_fuse_model(") == 4
    model, info = AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, torch_dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "moe_train")]
    assert moes and all(type(moe.experts).__name__ == "_MoeRewriteFusedExperts" for moe in moes)
    assert not any(".experts.0." in key for key in model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert rel_err(model.eval()(input_ids=ids).logits, original(input_ids=ids).logits) < REL
    assert type(moe_layer(build_model(out)).experts).__name__ == "_MoeRewriteFusedExperts"  # from_config
    # A checkpoint written from state_dict() (fused names) is refused, not loaded with random experts.
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    with pytest.raises(RuntimeError, match="holds fused expert weights .*unfuse_state_dict"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, torch_dtype=torch.float32)
    monkeypatch.setenv("MOE_REWRITE_FUSE_EXPERTS", "0")
    assert type(moe_layer(build_model(out)).experts).__name__ == "ModuleList"


def test_frozen_fused_experts_train_without_a_warning(tmp_path_factory):
    """Frozen experts are a choice (attention-only LoRA, PEFT's frozen base): nothing is skipped, nothing to say."""
    import warnings

    model = build_model(patched_checkpoint(tmp_path_factory, "v3")).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_fused_loading_keeps_layers_it_cannot_fuse_with_a_warning(tmp_path_factory, monkeypatch):
    out = patched_checkpoint(tmp_path_factory, "v3")
    monkeypatch.setenv("MOE_REWRITE_FUSE_EXPERTS", "0")
    model = build_model(out)
    monkeypatch.delenv("MOE_REWRITE_FUSE_EXPERTS")
    moe = moe_layer(model)
    moe.experts[0].gate_proj = torch.nn.Identity()  # stands in for a quantized or adapter-wrapped projection
    with pytest.warns(UserWarning, match="1 MoE layers keep per-expert weights .*plain, whole, bias-free nn.Linear"):
        model_module(model)._moe_rewrite_fuse_model(model)
    assert isinstance(moe.experts, torch.nn.ModuleList)


@pytest.mark.slow
def test_generated_loading_methods_are_removed_from_every_model_base_class(tmp_path_factory):
    """A file rewritten with the defaults (fused loading), then with --no-fuse-experts, keeps no override that calls a
    removed helper; fused loading into a file with two model base classes would be ambiguous: the defaults choose
    per-expert layers for it, and asking for fused experts is refused."""
    from moe_rewrite.options import RewriteOptions
    from moe_rewrite.rewrite import RewriteError, rewrite_source

    fused = (patched_checkpoint(tmp_path_factory, "v3") / "modeling_deepseek.py").read_text()
    two_bases = fused + "\n\nclass OtherPreTrainedModel(PreTrainedModel):\n    pass\n"
    with pytest.raises(RewriteError, match="one PreTrainedModel subclass, found 2; rewrite with --no-fuse-experts"):
        rewrite_source(two_bases, RewriteOptions(fuse_experts=True))
    chosen = rewrite_source(two_bases, RewriteOptions())
    assert chosen.options == RewriteOptions(
        fuse_experts=False, fp8_experts=False, fp8_compute=False, expert_parallel=False
    )
    assert chosen.chosen == (
        "experts: per-expert nn.Linear, as with --no-fuse-experts (fused-experts loading needs one PreTrainedModel "
        "subclass, found 2)",
    )
    plain = rewrite_source(two_bases, RewriteOptions(fuse_experts=False)).text
    assert chosen.text == plain
    assert "_moe_rewrite_fuse_model" not in plain and "def save_pretrained" not in plain
    assert "class OtherPreTrainedModel(PreTrainedModel)" in plain


def _ddp_worker(rank, ckpt, out_dir):
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(ckpt, seed=13).train()
    fuse_experts(model)  # before wrapping: DDP registers its gradient hooks on the fused parameters
    for layer in model.model.layers:  # the V3 router's bias gets no gradient (see README, DDP)
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
            layer.mlp.gate.e_score_correction_bias.requires_grad_(False)
    ddp = DistributedDataParallel(model)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(400 + rank))
    ddp(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in moe_layer(model).experts.named_parameters()}
    torch.save(grads, os.path.join(out_dir, f"ddp{rank}.pt"))


@pytest.mark.slow
def test_fused_experts_under_ddp_get_averaged_gradients(tmp_path_factory, tmp_path):
    ckpt = per_expert_checkpoint(tmp_path_factory, "v3")
    run_ranks(_ddp_worker, tmp_path, ckpt)
    results = [torch.load(tmp_path / f"ddp{r}.pt") for r in range(2)]
    model = build_model(ckpt, seed=13).train()
    fuse_experts(model)
    losses = [
        model(input_ids=ids, labels=ids).loss
        for ids in (torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(400 + r)) for r in range(2))
    ]
    ((losses[0] + losses[1]) / 2).backward()
    for name, p in moe_layer(model).experts.named_parameters():
        assert torch.equal(results[0][name], results[1][name]), name
        assert rel_err(results[0][name], p.grad) < REL, name


# Experts the grouped GEMMs would compute differently stay unfused and run through the per-expert loop, which calls
# the modules themselves; fusing never drops a parameter.
class _ScaledExpert(torch.nn.Module):
    """Another class than experts[0], with a forward of its own: twice the MLP."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = (
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
            mlp.act_fn,
        )

    def forward(self, x):
        return 2.0 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _biased(experts):
    old = experts[1].up_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.uniform_(0.5, 1.0)
    experts[1].up_proj = new


def _extra_parameter(experts):  # not used by the forward: fusing would drop it from the state dict
    experts[0].register_parameter("scale", torch.nn.Parameter(torch.ones(3)))


GUARDED = {
    "biased_projection": (_biased, "expert 1 holds up_proj.bias"),
    "another_class": (lambda e: e.__setitem__(2, _ScaledExpert(e[2])), "expert 2 is a _ScaledExpert"),
    "another_activation": (lambda e: setattr(e[3], "act_fn", torch.nn.GELU()), "expert 3's act_fn differs"),
    "extra_parameter": (_extra_parameter, "expert 0 holds scale"),
    "buffer_in_a_projection": (
        lambda e: e[4].down_proj.register_buffer("mask", torch.ones(1)),
        "expert 4 holds down_proj.mask",
    ),
}


@pytest.fixture(scope="module")
def default_v3(tmp_path_factory):
    """One default rewrite (fused loading) shared by the guard's tests."""
    return patched_checkpoint(tmp_path_factory, "v3")


def _unfused(ckpt, monkeypatch):
    runtime_env(monkeypatch, "MOE_REWRITE_FUSE_EXPERTS", "0")
    model = build_model(ckpt, seed=3)
    runtime_env(monkeypatch, "MOE_REWRITE_FUSE_EXPERTS", None)
    return model


@pytest.mark.parametrize("edit", GUARDED, ids=list(GUARDED))
def test_experts_the_grouped_gemms_would_compute_differently_are_never_fused(default_v3, monkeypatch, edit):
    from helpers import reference, routing

    model = _unfused(default_v3, monkeypatch)
    moe = moe_layer(model).train()
    change, reason = GUARDED[edit]
    change(moe.experts)
    keys = set(model.state_dict())
    with pytest.warns(UserWarning, match=f"1 MoE layers keep per-expert weights .*{reason}"):
        model_module(model)._moe_rewrite_fuse_model(model)
    assert type(moe.experts) is torch.nn.ModuleList and set(model.state_dict()) == keys  # nothing dropped
    with pytest.raises(RuntimeError, match=reason):
        fuse_experts(model)
    own = copy.deepcopy(moe.experts)
    x = torch.randn(10, moe.config.hidden_size, requires_grad=True)
    ids, w = routing(10, len(moe.experts), 2)
    w = w.float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loop's warning, said once per process
        y = moe.moe_train(x, ids, w)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = reference(own, x_ref, ids, w)
    assert rel_err(y, y_ref) < REL
    probe = torch.randn_like(y)
    (y * probe).sum().backward()
    (y_ref * probe).sum().backward()
    assert rel_err(x.grad, x_ref.grad) < REL
    grads = dict(own.named_parameters())
    for name, p in moe.experts.named_parameters():
        if grads[name].grad is None:
            assert p.grad is None or torch.count_nonzero(p.grad) == 0, name
        else:
            assert rel_err(p.grad, grads[name].grad) < REL, name


@pytest.mark.parametrize("container", ["module_dict", "none_expert"])
def test_from_pretrained_keeps_a_module_dict_or_a_none_expert_unfused(default_v3, tmp_path, monkeypatch, container):
    """Experts in an nn.ModuleDict, or a None expert with ep_size == 1 (hand-edited files moe-rewrite refuses, made
    here by patching the MoE class): from_pretrained loads them as they are, with a warning, and training runs the
    per-expert loop (a token routed to the None expert is an error naming it, as the file's own loop fails)."""
    from transformers import AutoModelForCausalLM

    model = build_model(default_v3, seed=4)
    model.save_pretrained(tmp_path / "weights")
    ckpt = tmp_path / f"ckpt_{container}"
    shutil.copytree(default_v3, ckpt)
    shutil.copy(tmp_path / "weights" / "model.safetensors", ckpt / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, torch_dtype=torch.float32)
    moe_class = type(moe_layer(loaded))
    init = moe_class.__init__

    def edited(self, config):
        init(self, config)
        if container == "module_dict":
            self.experts = torch.nn.ModuleDict({str(i): e for i, e in enumerate(self.experts)})
        else:
            self.experts[len(self.experts) - 1] = None

    monkeypatch.setattr(moe_class, "__init__", edited)
    reason = "not an nn.ModuleList" if container == "module_dict" else "expert 7 is None"
    with pytest.warns(UserWarning, match=f"MoE layers keep per-expert weights .*{reason}"):
        edited_model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True, torch_dtype=torch.float32)
    moe = moe_layer(edited_model).train()
    assert type(moe.experts) is (torch.nn.ModuleDict if container == "module_dict" else torch.nn.ModuleList)
    x = torch.randn(6, moe.config.hidden_size)
    ids = torch.randint(0, len(moe.experts) - 1, (6, 2))  # never the last expert
    w = torch.rand(6, 2)
    from helpers import reference

    experts = list(moe.experts.values()) if container == "module_dict" else list(moe.experts)
    with pytest.warns(UserWarning, match=reason):
        y = moe.moe_train(x, ids, w)
    assert rel_err(y, reference(experts, x, ids, w)) < REL
    if container == "none_expert":
        with pytest.raises(RuntimeError, match="tokens are routed to expert 7, which is None"):
            moe.moe_train(x, torch.full((6, 2), 7), w)


@pytest.mark.parametrize("edit", ["biased_projection", "another_class", "another_activation"])
def test_per_expert_layout_runs_experts_it_cannot_compute_through_the_loop(patched, form, edit):
    """--no-fuse-experts: the grouped GEMMs read the per-expert layers' weights at every step; experts they would
    compute differently run through the loop instead (V3 and V2)."""
    from helpers import reference, routing

    moe = moe_layer(build_model(patched, seed=3)).train()
    GUARDED[edit][0](moe.experts)
    own = copy.deepcopy(moe.experts)
    x = torch.randn(10, moe.config.hidden_size)
    ids, w = routing(10, len(moe.experts), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = moe.moe_train(x, ids, w.float())
    assert rel_err(y, reference(own, x, ids, w.float())) < REL
