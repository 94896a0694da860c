"""Every private torch / transformers / accelerate surface the generated code relies on, with the behaviour it relies
on: if a release changes one, a test here fails (the reason each is used stands beside it in moe_rewrite/runtime/).

Public replacements were taken where they exist (nn.Module.register_load_state_dict_pre_hook); what is left has none.
"""

from __future__ import annotations

import re
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")

from conftest import ROOT  # noqa: E402

RUNTIME = ROOT / "moe_rewrite" / "runtime"


def test_the_private_surfaces_in_the_runtime_are_the_ones_tested_here():
    """A new private name in the generated code needs its own test below (and a reason beside it)."""
    code = "\n".join(p.read_text() for p in sorted(RUNTIME.rglob("*.py")))
    used = set(re.findall(r"(?:torch\._C\.|torch\.|\.)(_[a-z][a-z_]+)\b", code))
    used |= set(re.findall(r"[\"'](_[a-z][a-z_]+)[\"']", code))  # by name: getattr(m, "_hf_hook", None)
    # ours: our prefix, and what the runtime defines itself (the compat stand-ins' methods and attributes)
    defined = set(re.findall(r"def (_[a-z][a-z_]+)\(", code)) | set(re.findall(r"self\.(_[a-z][a-z_]+) =", code))
    ours = {name for name in used if name.startswith("_moe_rewrite") or name in defined}
    tested = {
        "_grouped_mm",
        "_will_engine_execute_node",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
        "_foreach_add_",
        "_modules",
        "_parameters",
        "_current_graph_task_id",
        "_buffers",
        "_non_persistent_buffers_set",
        "_from_config",
        "_is_fsdp_managed_module",
        "_is_hf_initialized",
        "_hf_hook",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_pre_hooks",
        "_attn_implementation",
        # read behind hasattr() by the LlamaFlashAttention2 stand-in, as 4.46's class reads it (absent: the
        # weights' dtype, as there); only on the flash path, which needs flash-attn
        "_pre_quantization_dtype",
        "_keys_to_ignore_on_load_unexpected",
        "_no_split_modules",
        "_composable",  # torch.distributed._composable.fsdp.fully_shard: FSDP2 before torch 2.6 exported it
        "_make_subclass",
        "_disabled_torch_function_impl",
        "_did_swap_in_out_features",
        # DDP's constructor reads the first (the model's property refuses DDP under expert parallelism); the second
        # sets it (the property's setter keeps that working without expert parallelism)
        "_ddp_params_and_buffers_to_ignore",
        "_set_params_and_buffers_to_ignore_for_model",
        # the fused loss's label check and the fused RoPE's position check: a device-side assert without a host sync
        "_assert_async",
        # the fused RoPE checks a position_ids tensor once, again only after an in-place change (its version moves)
        "_version",
    }
    assert used - ours <= tested, f"untested private names in moe_rewrite/runtime/: {sorted(used - ours - tested)}"


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm needs torch >= 2.8")
def test_grouped_mm_multiplies_each_expert_slice_by_its_own_weight():
    """grouped_linear.py: torch's only grouped GEMM (transformers' grouped_mm experts use it too)."""
    a, b = torch.randn(7, 4), torch.randn(3, 5, 4)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 gets no rows
    out = torch._grouped_mm(a, b.transpose(1, 2), offs=offsets)
    expected = torch.cat([a[:2] @ b[0].t(), a[2:7] @ b[2].t()])
    assert torch.allclose(out, expected, atol=1e-5)


def test_will_engine_execute_node_tells_backward_from_autograd_grad():
    """per_expert.py: direct gradients are written only by a backward that accumulates into this weight."""
    weight, x = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    node = torch.autograd.graph.get_gradient_edge(weight).node
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            return x * weight

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch._C._will_engine_execute_node(node))
            return grad, grad

    Probe.apply(x, weight).sum().backward()
    torch.autograd.grad(Probe.apply(x, weight).sum(), [x])
    assert seen == [True, False]


def test_tensor_hook_attributes_show_registered_hooks():
    """per_expert.py: weights with tensor hooks get their gradients through autograd."""
    weight = torch.nn.Parameter(torch.randn(2))
    assert not weight._backward_hooks and getattr(weight, "_post_accumulate_grad_hooks", None) is None
    weight.register_hook(lambda grad: grad)
    assert weight._backward_hooks
    other = torch.nn.Parameter(torch.randn(2))
    other.register_post_accumulate_grad_hook(lambda p: None)
    assert other._post_accumulate_grad_hooks is not None


def test_module_hook_dicts_show_registered_forward_hooks():
    """expert_linears.py: an expert with forward hooks (DeepSpeed, accelerate, a user's) is not what the grouped GEMMs
    compute, so it is never fused; the hooks show in these two dicts, empty until one is registered."""
    module = torch.nn.Linear(2, 2)
    assert not module._forward_hooks and not module._forward_pre_hooks
    module.register_forward_hook(lambda mod, args, out: out)
    module.register_forward_pre_hook(lambda mod, args: None)
    assert len(module._forward_hooks) == 1 and len(module._forward_pre_hooks) == 1


def test_module_hook_dicts_show_registered_backward_hooks():
    """lm_loss.py: an lm_head with a backward hook (full or pre) would not see the fused loss's gradient, which skips
    lm_head's module call, so the published loss runs; the hooks show in these two dicts, empty until registered."""
    module = torch.nn.Linear(2, 2)
    assert not module._backward_hooks and not module._backward_pre_hooks
    module.register_full_backward_hook(lambda mod, grad_in, grad_out: None)
    module.register_full_backward_pre_hook(lambda mod, grad_out: None)
    assert len(module._backward_hooks) == 1 and len(module._backward_pre_hooks) == 1


def test_the_config_names_the_attention_implementation_in_attn_implementation():
    """attention.py: the Model's mask is left out only where the config asks for "sdpa"; transformers keeps the choice
    (from_config's attn_implementation, the class default) in config._attn_implementation on every supported release."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    )
    for implementation in ("eager", "sdpa"):
        model = LlamaForCausalLM._from_config(config, attn_implementation=implementation)
        assert model.config._attn_implementation == implementation


def test_foreach_add_adds_in_place():
    """per_expert.py: one multi-tensor add accumulates every expert's gradient (torch's optimizers use it so)."""
    a, b = [torch.ones(2), torch.zeros(3)], [torch.full((2,), 2.0), torch.ones(3)]
    torch._foreach_add_(a, b)
    assert torch.equal(a[0], torch.full((2,), 3.0)) and torch.equal(a[1], torch.ones(3))


def test_module_dicts_hold_submodules_and_parameters():
    """fused_experts.py: plain dict lookups instead of nn.Module.__getattr__ (a microsecond each, 6 * E per step)."""
    mlp = torch.nn.Sequential()
    mlp.gate_proj = torch.nn.Linear(2, 3, bias=False)
    assert mlp._modules["gate_proj"] is mlp.gate_proj
    assert mlp.gate_proj._parameters["weight"] is mlp.gate_proj.weight


def test_current_graph_task_id_is_set_only_inside_backward():
    """bias_update.py: tokens recomputed by gradient checkpointing (inside backward) are not counted twice."""
    inside = []
    x = torch.randn(2, requires_grad=True)
    x.register_hook(lambda grad: inside.append(torch._C._current_graph_task_id()) or grad)
    assert torch._C._current_graph_task_id() == -1
    (x * 2).sum().backward()
    assert inside and inside[0] != -1


def test_non_persistent_buffers_are_listed_by_name():
    """init_weights.py: transformers 5.x leaves non-persistent buffers unset; they are found and refilled by name."""
    module = torch.nn.Module()
    module.register_buffer("inv_freq", torch.ones(2), persistent=False)
    module.register_buffer("kept", torch.ones(2))
    assert module._non_persistent_buffers_set == {"inv_freq"}
    assert module._buffers["inv_freq"] is module.inv_freq


def _probe_model(model_type, layer="linear"):
    """A PretrainedConfig and PreTrainedModel pair of `model_type` holding one nn.Linear named `layer`, to probe what
    transformers does with a model class."""
    transformers = pytest.importorskip("transformers")

    class Config(transformers.PretrainedConfig):
        pass

    Config.model_type = model_type

    class Model(transformers.PreTrainedModel):
        config_class = Config

        def __init__(self, config):
            super().__init__(config)
            self.add_module(layer, torch.nn.Linear(2, 2))
            self.post_init()

    return Config, Model


def test_pretrained_model_builds_from_config_through_from_config():
    """fused_loading.py: AutoModel.from_config calls the model class's _from_config, which the file overrides."""
    transformers = pytest.importorskip("transformers")
    calls = []
    Config, Probe = _probe_model("moe-rewrite-probe")

    class Model(Probe):
        @classmethod
        def _from_config(cls, config, **kwargs):
            calls.append(cls)
            return super()._from_config(config, **kwargs)

    transformers.AutoModel.register(Config, Model)
    assert isinstance(transformers.AutoModel.from_config(Config()), Model) and calls == [Model]


def test_from_pretrained_skips_unexpected_keys_the_model_names_in_post_init(tmp_path):
    """fused_loading.py: under expert parallelism post_init names the other ranks' experts' keys in
    _keys_to_ignore_on_load_unexpected (on the class, which 4.x reads, and the model, which 5.x reads) and
    from_pretrained then neither loads nor reports them."""
    Config, Probe = _probe_model("moe-rewrite-probe-unexpected")

    class Model(Probe):
        def post_init(self):
            super().post_init()
            pattern = r"(^|\.)experts\.(?!(?:0|1)\.)\d+\."
            for owner in (type(self), self):
                patterns = owner._keys_to_ignore_on_load_unexpected
                if isinstance(patterns, set):
                    owner._keys_to_ignore_on_load_unexpected = patterns | {pattern}
                else:
                    owner._keys_to_ignore_on_load_unexpected = [*(patterns or []), pattern]

    from safetensors.torch import save_file

    Model(Config()).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = {"linear.weight": torch.zeros(2, 2), "linear.bias": torch.zeros(2), "experts.3.w": torch.zeros(1)}
    save_file({**state, "other.5.w": torch.zeros(1)}, weights, metadata={"format": "pt"})
    _, info = Model.from_pretrained(tmp_path, output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == ["other.5.w"]


def test_pretrained_models_name_their_decoder_layers_in_no_split_modules(tmp_path_factory):
    """expert_parallel_model.py: moe_rewrite_fully_shard makes each module whose class _no_split_modules names an
    FSDP2 unit: the stand-ins (like the published files) name their decoder layers there."""
    from conftest import build_model, patched_checkpoint

    model = build_model(patched_checkpoint(tmp_path_factory, "v3", "--expert-parallel"))
    names = set(model._no_split_modules)
    assert {type(m).__name__ for m in model.model.layers} <= names


def test_fsdp2_is_importable_where_torch_before_2_6_exported_it():
    """expert_parallel_model.py: torch 2.4 and 2.5 export fully_shard from torch.distributed._composable.fsdp only;
    later releases keep that module beside torch.distributed.fsdp."""
    composable = pytest.importorskip("torch.distributed._composable.fsdp")
    assert callable(composable.fully_shard)


def test_accelerate_marks_dispatched_modules_with_hf_hook():
    """fused_experts.py: experts that accelerate dispatched (device_map) are not fused; it marks them `_hf_hook`."""
    hooks = pytest.importorskip("accelerate.hooks")
    module = torch.nn.Linear(2, 2)
    hooks.add_hook_to_module(module, hooks.ModelHook())
    assert hasattr(module, "_hf_hook")


def test_ddp_reads_the_parameters_to_ignore_through_hasattr_in_its_constructor():
    """expert_parallel_model.py: the model's `_ddp_params_and_buffers_to_ignore` property refuses
    DistributedDataParallel under expert parallelism. DDP's __init__ reads it with hasattr() before it broadcasts
    anything, so an error other than AttributeError reaches the caller; AttributeError means none to ignore, and
    _set_params_and_buffers_to_ignore_for_model sets it (through the property's setter)."""
    dist = pytest.importorskip("torch.distributed")
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")

    class Refused(LookupError):
        pass

    class Guarded(torch.nn.Linear):
        refuse = False

        @property
        def _ddp_params_and_buffers_to_ignore(self):
            if self.refuse:
                raise Refused("refused")
            if "ignored" not in self.__dict__:
                raise AttributeError("_ddp_params_and_buffers_to_ignore")
            return self.__dict__["ignored"]

        @_ddp_params_and_buffers_to_ignore.setter
        def _ddp_params_and_buffers_to_ignore(self, value):
            self.__dict__["ignored"] = value

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            module = Guarded(2, 2)
            module.refuse = True
            broadcasts = []
            real_broadcast = dist.broadcast
            dist.broadcast = lambda *args, **kwargs: broadcasts.append(1) or real_broadcast(*args, **kwargs)
            try:
                with pytest.raises(Refused):
                    DistributedDataParallel(module)
            finally:
                dist.broadcast = real_broadcast
            module.refuse = False
            assert DistributedDataParallel(module).parameters_to_ignore == set()
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["bias"])
            assert DistributedDataParallel(module).parameters_to_ignore == {"bias"}
        finally:
            dist.destroy_process_group()


def test_fsdp_marks_the_modules_it_manages():
    """fused_experts.py: experts are not fused under FSDP; fully_shard (FSDP2) and FullyShardedDataParallel mark
    every module they manage `_is_fsdp_managed_module`."""
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
            assert not getattr(plain[0], "_is_fsdp_managed_module", False)
            sharded = torch.nn.Sequential(torch.nn.Linear(2, 2))
            fsdp.fully_shard(sharded)
            wrapped = torch.nn.Sequential(torch.nn.Linear(2, 2))
            with warnings.catch_warnings():  # world size 1: FSDP switches to NO_SHARD and says so
                warnings.simplefilter("ignore")
                fsdp.FullyShardedDataParallel(wrapped, device_id=torch.device("cpu"))
            assert all(getattr(m, "_is_fsdp_managed_module", False) for m in (*sharded.modules(), *wrapped.modules()))
        finally:
            dist.destroy_process_group()


def test_transformers_5_marks_the_parameters_it_loaded():
    """init_guards.py: transformers 5.x marks each parameter it loaded from the checkpoint `_is_hf_initialized`, not
    those the checkpoint lacks; 4.x marks no parameter (so _init_weights runs there as before)."""
    transformers = pytest.importorskip("transformers")
    Config, Saved = _probe_model("moe-rewrite-probe-loaded", layer="loaded")

    class Loaded(Saved):
        def __init__(self, config):
            super().__init__(config)
            self.missing = torch.nn.Linear(2, 2)
            self.post_init()

    with tempfile.TemporaryDirectory() as tmp:
        Saved(Config()).save_pretrained(tmp)
        model = Loaded.from_pretrained(tmp)
    marked = {name: getattr(p, "_is_hf_initialized", False) for name, p in model.named_parameters()}
    v5 = int(transformers.__version__.split(".")[0]) >= 5
    assert marked == {"loaded.weight": v5, "loaded.bias": v5, "missing.weight": False, "missing.bias": False}


def test_a_tensor_subclass_with_torch_function_disabled_computes_as_a_plain_tensor():
    """fp8_experts.py's _MoeRewriteDequantized (torch.Tensor._make_subclass, __torch_function__ =
    torch._C._disabled_torch_function_impl): an FP8 expert view's weight is used as a plain tensor (F.linear, autograd
    through the input, results plain tensors), while its own `data` property refuses PEFT's merges."""

    class Guarded(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @property
        def data(self):
            raise RuntimeError("refused")

    weight = torch.randn(3, 4)
    guarded = torch.Tensor._make_subclass(Guarded, weight)
    x = torch.randn(2, 4, requires_grad=True)
    y = torch.nn.functional.linear(x, guarded)
    assert type(y) is torch.Tensor and torch.equal(y, x @ weight.t())
    y.sum().backward()
    assert torch.equal(x.grad, weight.sum(0).expand(2, 4))
    with pytest.raises(RuntimeError, match="refused"):
        guarded.data += 1


def test_peft_param_wrappers_say_how_they_read_their_parameter():
    """parameter_lora.py's _moe_rewrite_delta_factors recomputes PEFT's get_delta_factors (whose result PEFT casts to
    the parameter's dtype, FP8 codes' for FP8 experts) from lora_A, lora_B and _did_swap_in_out_features: on a float32
    (E, out, in) parameter, where nothing is cast, the two agree."""
    peft = pytest.importorskip("peft")
    from helpers import tiny_moe

    from moe_rewrite.runtime.experts import parameter_lora

    holder = torch.nn.Module()
    holder.experts = tiny_moe("fused", experts=3, hidden=8, inter=6).float().experts
    config = peft.LoraConfig(r=2, target_parameters=["experts.gate_up_proj"], init_lora_weights=False)
    peft.inject_adapter_in_model(config, holder)
    wrapper = holder.experts
    assert isinstance(wrapper._did_swap_in_out_features, bool)
    lhs, rhs, _ = wrapper.get_delta_factors("default")
    ours = parameter_lora._moe_rewrite_delta_factors(wrapper, "default")
    assert torch.equal(ours[0], lhs) and torch.equal(ours[1], rhs)


def test_assert_async_raises_where_its_condition_is_false_and_not_otherwise():
    """torch._assert_async(cond): the checks of out-of-range labels (lm_loss.py) and positions (triton_rope.py), a
    device-side assert on CUDA without a host sync; on the CPU it raises at once."""
    torch._assert_async(torch.tensor(True))
    with pytest.raises(RuntimeError):
        torch._assert_async(torch.tensor(False))


def test_a_tensors_version_moves_with_in_place_changes_only():
    """Tensor._version: triton_rope.py checks a position_ids tensor again only when it changed in place; tensors made
    under inference_mode have none (it asks is_inference() first)."""
    ids = torch.arange(8)
    before = ids._version
    _ = ids + 1
    assert ids._version == before
    ids.add_(1)
    assert ids._version > before
    with torch.inference_mode():
        frozen = torch.arange(4)
    assert frozen.is_inference()
    with pytest.raises(RuntimeError):
        _ = frozen._version
