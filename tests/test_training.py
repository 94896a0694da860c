"""trust_remote_code end to end: the patched stand-in checkpoints load, keep eval unchanged, and train with outputs and
gradients equal to an explicit per-expert reference computed here in float64."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import FORM_DIRS, build_model, model_module, per_expert_checkpoint, runtime_env  # noqa: E402
from helpers import (  # noqa: E402
    REL,
    assert_matches_reference,
    expert_params,
    fused_grads,
    moe_layer,
    reference_moe,
    rel_err,
)


def test_patched_checkpoint_loads_original_weights_strictly_and_eval_is_unchanged(patched, form):
    original = build_model(FORM_DIRS[form], seed=1)
    model = build_model(patched, seed=2)
    model.load_state_dict(original.state_dict(), strict=True)
    assert model.state_dict().keys() == original.state_dict().keys()
    original.eval(), model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits)


def test_the_rewritten_file_does_not_require_triton(patched, form):
    """transformers' check_imports refuses to load a remote-code file whose imports outside a try block are not
    installed; the generated code imports triton by name only, so a rewritten file loads where triton is absent (the
    CPU torch build, macOS)."""
    from transformers.dynamic_module_utils import get_imports

    required = set(get_imports(str(patched / "modeling_deepseek.py")))
    assert "torch" in required and "triton" not in required


def test_original_v3_cannot_train_and_patched_one_can(patched, form):
    ids = torch.randint(0, 256, (2, 12))
    original = build_model(FORM_DIRS[form]).train()
    if form == "v3":
        with pytest.raises(AssertionError):
            original(input_ids=ids, labels=ids)
    model = build_model(patched).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("shape", [(3, 7), (1, 1)], ids=["batch", "single-token"])
def test_train_output_and_gradients_match_per_expert_reference(patched, form, shape):
    model = build_model(patched, seed=int(torch.randint(0, 10**6, ())))
    moe = moe_layer(model).train()
    x = torch.randn(*shape, model.config.hidden_size, requires_grad=True)
    y = moe(x)
    reference = reference_moe(moe, x)
    assert_matches_reference(y, x, reference, lambda: {name: p.grad for name, p in expert_params(moe).items()})


def test_v2_aux_loss_gradient_reaches_the_router(tmp_path_factory):
    model = build_model(per_expert_checkpoint(tmp_path_factory, "v2"))
    moe = moe_layer(model).train()
    x = torch.randn(2, 5, model.config.hidden_size)
    aux_only = moe.gate(x)[2]
    assert aux_only is not None and aux_only.requires_grad
    (grad_aux,) = torch.autograd.grad(aux_only, moe.gate.weight)
    # y * 0 removes every path but the aux loss's: the router still gets exactly the aux-loss gradient.
    (moe(x) * 0).sum().backward()
    assert torch.count_nonzero(grad_aux) > 0
    assert rel_err(moe.gate.weight.grad, grad_aux) < REL


def test_v3_selection_in_training_equals_eval_and_bias_gets_no_gradient(tmp_path_factory):
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3")))
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.randn_like(moe.gate.e_score_correction_bias))
    x = torch.randn(4, 6, moe.config.hidden_size)
    ids_eval, w_eval = moe.eval().gate(x)
    ids_train, w_train = moe.train().gate(x)
    assert torch.equal(ids_eval, ids_train) and torch.equal(w_eval, w_train)
    moe(x).sum().backward()
    assert moe.gate.e_score_correction_bias.grad is None


@pytest.mark.parametrize("routing", ["all-to-one", "random"])
@pytest.mark.parametrize("options", [(), ("--stacking", "sequential")], ids=["stack", "sequential"])
def test_moe_train_with_given_routing(tmp_path_factory, routing, options):
    """Skewed routing: every token's first slot goes to expert 3; most experts get no token at all."""
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3", *options))).train()
    n, k, e = 9, moe.config.num_experts_per_tok, moe.config.n_routed_experts
    x = torch.randn(n, moe.config.hidden_size, requires_grad=True)
    if routing == "all-to-one":
        ids = torch.stack([torch.full((n,), 3), torch.full((n,), 5)], dim=1)[:, :k]
    else:
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    weight = torch.rand(n, k, requires_grad=True)
    y = moe.moe_train(x, ids, weight)
    assert y.dtype == torch.float32 and y.shape == x.shape

    ref = copy.deepcopy(moe).double()
    x64, w64 = x.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    ref_y = torch.zeros_like(x64)
    for i, expert in enumerate(ref.experts):
        token, slot = (ids == i).nonzero(as_tuple=True)
        ref_y = ref_y.index_add(0, token, w64[token, slot, None] * expert(x64[token]))
    assert rel_err(y, ref_y) < REL
    probe = torch.randn_like(y)
    (y * probe).sum().backward()
    (ref_y * probe.double()).sum().backward()
    assert rel_err(x.grad, x64.grad) < REL and rel_err(weight.grad, w64.grad) < REL
    used = set(ids.flatten().tolist())
    for i, (expert, ref_expert) in enumerate(zip(moe.experts, ref.experts)):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            grad = getattr(expert, proj).weight.grad
            assert grad is not None and not torch.isnan(grad).any()
            if i in used:
                assert rel_err(grad, getattr(ref_expert, proj).weight.grad) < REL
            else:
                assert torch.count_nonzero(grad) == 0


def test_backends_agree_and_env_var_overrides(tmp_path_factory, monkeypatch):
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    module = model_module(moe)
    x = torch.randn(6, moe.config.hidden_size)
    ids = torch.stack([torch.randperm(moe.config.n_routed_experts)[:2] for _ in range(6)])
    w = torch.rand(6, 2)
    results = {}
    for backend in ("auto", "torch", "loop"):
        runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", backend)
        results[backend] = moe.moe_train(x, ids, w)
    assert module._moe_rewrite_kernel(x.device, x.dtype) == "loop"
    assert rel_err(results["auto"], results["loop"]) < REL and rel_err(results["torch"], results["loop"]) < REL
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", "grouped_gemm")
    with pytest.raises(RuntimeError, match="grouped_gemm package, CUDA and bfloat16"):
        moe.moe_train(x, ids, w)
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="unknown backend 'cutlass'"):
        moe.moe_train(x, ids, w)
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", None)
    assert module._moe_rewrite_kernel(x.device, x.dtype) == "sorted"  # CPU default under "auto"


def test_loop_backend_written_into_the_file_is_used(tmp_path_factory):
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3", "--backend", "loop")))
    assert "MOE_REWRITE_BACKEND" not in os.environ
    assert model_module(moe)._moe_rewrite_kernel(torch.device("cpu"), torch.float32) == "loop"


def test_contiguous_expert_weights_are_used_without_a_copy(tmp_path_factory):
    """Experts laid out at a fixed stride in one buffer (as in an FSDP flat parameter): a view, not a stack copy."""
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    module = model_module(moe)
    experts = list(moe.experts)
    sizes = [p.numel() for p in experts[0].parameters()]
    flat = torch.cat([p.detach().reshape(-1) for e in experts for p in e.parameters()])
    offset = 0
    for e in experts:
        for p, size in zip(e.parameters(), sizes):
            p.data = flat[offset : offset + size].view_as(p)
            offset += size
    names = [n for n, _ in experts[0].named_parameters()]
    assert names == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    gate_up_w = [e.gate_proj.weight for e in experts] + [e.up_proj.weight for e in experts]
    gate_up = module._MoeRewriteExpertLinears(gate_up_w, 2).stacked(torch.float32)
    down = module._MoeRewriteExpertLinears([e.down_proj.weight for e in experts], 1).stacked(torch.float32)
    assert (
        gate_up.data_ptr() == flat.data_ptr() and down.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    )
    for i, e in enumerate(experts):
        assert torch.equal(gate_up[i], torch.cat([e.gate_proj.weight, e.up_proj.weight]))
        assert torch.equal(down[i], e.down_proj.weight)
    x = torch.randn(5, moe.config.hidden_size, requires_grad=True)
    y = moe(x)
    ref_y, ref, x64, _ = reference_moe(moe, x)
    assert rel_err(y, ref_y) < REL
    y.sum().backward()
    ref_y.sum().backward()
    assert rel_err(x.grad, x64.grad) < REL
    for e, r in zip(moe.experts, ref.experts):
        if r.down_proj.weight.grad is not None:
            assert rel_err(e.down_proj.weight.grad, r.down_proj.weight.grad) < REL


def test_expert_parallel_is_refused_clearly(patched, form):
    moe = moe_layer(build_model(patched)).train()
    moe.ep_size = 2
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        moe(torch.randn(1, 3, moe.config.hidden_size))


def test_experts_that_are_not_plain_linear_layers_run_through_the_loop(tmp_path_factory):
    """LoRA-wrapped or quantized projections must be called as modules: the grouped path would read raw weights."""

    class DoubledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    for expert in moe.experts:
        old = expert.up_proj
        expert.up_proj = DoubledLinear(old.in_features, old.out_features, bias=False)
        expert.up_proj.weight.data.copy_(old.weight)
    x = torch.randn(7, moe.config.hidden_size)
    ids = torch.stack([torch.randperm(moe.config.n_routed_experts)[:2] for _ in range(7)])
    w = torch.rand(7, 2)
    expected = torch.zeros(7, moe.config.hidden_size)
    for t in range(7):
        for j in range(2):
            expected[t] += w[t, j] * moe.experts[int(ids[t, j])](x[t : t + 1])[0]
    assert rel_err(moe.moe_train(x, ids, w), expected) < REL


def _expert_grads(moe):
    return [getattr(e, p).weight.grad.clone() for e in moe.experts for p in ("gate_proj", "up_proj", "down_proj")]


def test_direct_weight_gradients_equal_autograd_ones_and_accumulate(tmp_path_factory, monkeypatch):
    """Backward writes expert weight gradients itself (fewer autograd leaves); it must equal autograd's own path."""
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    module = model_module(moe)
    x = torch.randn(10, moe.config.hidden_size)
    ids = torch.stack([torch.randperm(moe.config.n_routed_experts)[:2] for _ in range(10)])
    w = torch.rand(10, 2)
    probe = torch.randn(10, moe.config.hidden_size)
    weights = [getattr(e, p).weight for e in moe.experts for p in ("gate_proj", "up_proj", "down_proj")]
    assert module._moe_rewrite_direct_grads(weights)
    results = {}
    for mode in ("1", "0"):
        runtime_env(monkeypatch, "MOE_REWRITE_DIRECT_GRADS", mode)
        moe.zero_grad(set_to_none=True)
        for _ in range(2):  # two micro-batches: gradients accumulate
            (moe.moe_train(x, ids, w) * probe).sum().backward()
        results[mode] = _expert_grads(moe)
    assert not module._moe_rewrite_direct_grads(weights)  # MOE_REWRITE_DIRECT_GRADS=0
    for direct, autograd in zip(results["1"], results["0"]):
        assert torch.equal(direct, autograd)
    runtime_env(monkeypatch, "MOE_REWRITE_DIRECT_GRADS", None)
    moe.zero_grad(set_to_none=True)
    (moe.moe_train(x, ids, w) * probe).sum().backward()
    for once, twice in zip(_expert_grads(moe), results["1"]):
        assert rel_err(twice, 2 * once) < REL


def test_hooked_weights_get_their_gradients_through_autograd(tmp_path_factory):
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    seen = []
    moe.experts[0].down_proj.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    ids = torch.zeros(4, 2, dtype=torch.long)
    ids[:, 1] = 1
    moe.moe_train(torch.randn(4, moe.config.hidden_size), ids, torch.rand(4, 2)).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], moe.experts[0].down_proj.weight.grad)
    assert torch.count_nonzero(seen[0]) > 0


def test_only_experts_trainable_still_get_gradients(tmp_path_factory):
    """Inputs that need no gradient: the experts must still be trained (the node keeps one autograd edge)."""
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    x = torch.randn(6, moe.config.hidden_size)
    ids = torch.stack([torch.randperm(moe.config.n_routed_experts)[:2] for _ in range(6)])
    y = moe.moe_train(x, ids, torch.rand(6, 2))
    assert y.requires_grad
    y.sum().backward()
    used = set(ids.flatten().tolist())
    for i, e in enumerate(moe.experts):
        assert (torch.count_nonzero(e.gate_proj.weight.grad) > 0) == (i in used)


def test_autocast_runs_the_experts_in_the_autocast_dtype_with_fp32_gradients(tmp_path_factory):
    """fp32 weights under torch.autocast (e.g. Trainer with bf16=True): computed like nn.Linear would, in bf16."""
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    x = torch.randn(12, moe.config.hidden_size, requires_grad=True)
    ids = torch.stack([torch.randperm(moe.config.n_routed_experts)[:2] for _ in range(12)])
    w = torch.rand(12, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe.moe_train(x, ids, w)
    ref = copy.deepcopy(moe)
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the experts called as modules: nn.Linear autocasts
        ref_y = torch.zeros(12, moe.config.hidden_size)
        for i, expert in enumerate(ref.experts):
            token, slot = (ids == i).nonzero(as_tuple=True)
            ref_y = ref_y.index_add(0, token, w[token, slot, None] * expert(x_ref[token]).float())
    assert y.dtype == torch.float32
    assert rel_err(y, ref_y) < 1e-2
    y.sum().backward()
    ref_y.sum().backward()
    assert rel_err(x.grad, x_ref.grad) < 2e-2
    for e, r in zip(moe.experts, ref.experts):
        assert e.gate_proj.weight.grad.dtype == torch.float32
        if torch.count_nonzero(r.down_proj.weight.grad) > 0:
            assert rel_err(e.down_proj.weight.grad, r.down_proj.weight.grad) < 2e-2


def test_autograd_grad_and_backward_inputs_do_not_touch_expert_grads(tmp_path_factory):
    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    x = torch.randn(6, moe.config.hidden_size, requires_grad=True)
    ids = torch.stack([torch.randperm(moe.config.n_routed_experts)[:2] for _ in range(6)])
    (gx,) = torch.autograd.grad(moe.moe_train(x, ids, torch.rand(6, 2)).sum(), x)
    assert gx is not None and all(p.grad is None for p in moe.experts.parameters())
    moe.moe_train(x, ids, torch.rand(6, 2)).sum().backward(inputs=[x])
    assert all(p.grad is None for p in moe.experts.parameters())


def test_one_wrapped_expert_sends_the_layer_through_the_loop(tmp_path_factory):
    class DoubledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    moe = moe_layer(build_model(per_expert_checkpoint(tmp_path_factory, "v3"))).train()
    old = moe.experts[3].up_proj
    moe.experts[3].up_proj = DoubledLinear(old.in_features, old.out_features, bias=False)
    moe.experts[3].up_proj.weight.data.copy_(old.weight)
    x = torch.randn(5, moe.config.hidden_size)
    ids = torch.tensor([[3, 0], [3, 1], [2, 3], [4, 5], [3, 7]])
    w = torch.rand(5, 2)
    expected = torch.stack(
        [sum(w[t, j] * moe.experts[int(ids[t, j])](x[t : t + 1])[0] for j in range(2)) for t in range(5)]
    )
    assert rel_err(moe.moe_train(x, ids, w), expected) < REL


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm needs torch >= 2.8")
@pytest.mark.parametrize("layout", ["separate", "flat", "fused"])
def test_torch_grouped_mm_kernel_matches_the_reference(tmp_path_factory, monkeypatch, layout):
    """The GPU production path, torch._grouped_mm, run on CPU in bf16: transposes, int32 offsets, empty experts; with
    the experts' own weights, the weights in one flat buffer (FSDP1), and fused experts."""
    model = build_model(per_expert_checkpoint(tmp_path_factory, "v3")).to(torch.bfloat16)
    moe = moe_layer(model).train()
    ref = copy.deepcopy(moe).double()
    if layout == "flat":
        params = [p for e in moe.experts for p in e.parameters()]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        for p in params:
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    if layout == "fused":
        moe.moe_rewrite_fuse_experts()
    monkeypatch.setattr(model_module(moe), "_moe_rewrite_kernel", lambda device, dtype: "torch")
    n = 16
    x = torch.randn(n, moe.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.stack([torch.tensor([1, 6])[torch.randperm(2)] for _ in range(n)])  # experts 0, 2-5, 7 get nothing
    w = torch.rand(n, 2)
    y = moe.moe_train(x, ids, w)
    x64 = x.detach().double().requires_grad_(True)
    ref_y = torch.zeros_like(x64)
    for i, expert in enumerate(ref.experts):
        token, slot = (ids == i).nonzero(as_tuple=True)
        ref_y = ref_y.index_add(0, token, w.double()[token, slot, None] * expert(x64[token]))
    assert rel_err(y, ref_y) < 1e-2
    probe = torch.randn(n, moe.config.hidden_size)
    (y * probe).sum().backward()
    (ref_y * probe.double()).sum().backward()
    assert rel_err(x.grad, x64.grad) < 2e-2
    grads = fused_grads(moe) if layout == "fused" else {k: p.grad for k, p in expert_params(moe).items()}
    for name, r in expert_params(ref).items():
        if not name.startswith("experts."):
            continue
        if name.split(".")[1] in ("1", "6"):
            assert rel_err(grads[name], r.grad) < 2e-2, name
        else:
            assert torch.count_nonzero(grads[name]) == 0 and not torch.isnan(grads[name]).any(), name
