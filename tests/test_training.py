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
    eval_branch_with_grads,
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
    from transformers import AutoConfig, AutoModelForCausalLM

    # asked for eager, the rewritten file runs the published attention: the same bits
    config = AutoConfig.from_pretrained(patched, trust_remote_code=True)
    eager = AutoModelForCausalLM.from_config(config, trust_remote_code=True, attn_implementation="eager")
    eager.load_state_dict(original.state_dict(), strict=True)
    assert model.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    original.eval(), model.eval(), eager.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = original(input_ids=ids).logits
        assert torch.equal(eager(input_ids=ids).logits, want)
        # by default (sdpa) the same softmax computed by SDPA: equal within float32 rounding
        assert (model(input_ids=ids).logits - want).abs().max().item() <= 1e-5


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


YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


@pytest.mark.parametrize("rope", ["plain", "yarn"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_eager_attention_on_a_padded_batch_gives_finite_outputs_and_gradients(patched, form, padding, rope):
    """The stand-in's eager attention (the published computation, the reference for any faster one) in training, fp32,
    on a batch whose first sequence is padded: logits, loss and every gradient finite; every probability row sums to
    1; no real query attends to a padded key; a query whose keys are all masked (left padding) averages every key
    uniformly, as the published additive mask makes it (scores + finfo.min round to finfo.min). With no label
    predicted from a padded position, the padded tokens reach the loss only through the V2 router's aux loss: their
    embedding gets a gradient in V2 and none in V3."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {"rope_scaling": YARN} if rope == "yarn" else {}
    config = AutoConfig.from_pretrained(patched, trust_remote_code=True, **overrides)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(
        config, trust_remote_code=True, torch_dtype=torch.float32, attn_implementation="eager"
    ).train()
    attention = model.model.layers[0].self_attn
    assert type(attention).__name__ == f"DeepseekV{form[1]}Attention"
    if rope == "yarn":
        assert type(attention.rotary_emb).__name__ == f"DeepseekV{form[1]}YarnRotaryEmbedding"
        mscale = 0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1.0
        assert attention.softmax_scale == pytest.approx(attention.q_head_dim**-0.5 * mscale**2)
    seq, pad, pad_id = 10, 4, 255
    ids = torch.randint(0, pad_id, (2, seq), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    padded = slice(seq - pad, seq) if padding == "right" else slice(0, pad)
    mask[0, padded] = 0
    ids[0, padded] = pad_id  # a token id only the padding uses
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    labels = ids.masked_fill(mask == 0, -100)
    if padding == "left":
        labels[0, pad] = -100  # the first real token would be predicted from the last padded position

    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels, output_attentions=True)
    assert type(out.logits).__name__ == "_MoeRewriteNoLogits" and torch.isfinite(out.loss)  # the fused loss
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert "model.layers.0.self_attn.kv_b_proj.weight" in grads
    assert all(torch.isfinite(g).all() for g in grads.values()), [n for n, g in grads.items() if not g.isfinite().all()]

    probs = out.attentions[0]  # (batch, heads, query, key) of the first layer
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))
    real = mask[0].bool()
    assert (probs[0][:, real][..., ~real] == 0).all()  # real queries never see padded keys
    if padding == "left":  # the padded queries have no key left: the uniform average over all of them
        torch.testing.assert_close(probs[0, :, :pad], torch.full_like(probs[0, :, :pad], 1 / seq))
    else:  # the padded queries still see the real keys, and only them
        assert (probs[0][..., ~real] == 0).all()
    pad_embedding_grad = model.model.embed_tokens.weight.grad[pad_id]
    if form == "v2":
        assert pad_embedding_grad.abs().sum() > 0
    else:
        assert (pad_embedding_grad == 0).all()


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


def test_expert_parallelism_needs_fused_experts(patched, form):
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


def _fake_flash_attn(monkeypatch, module) -> None:
    """flash-attn's functions, as the file calls them, computed with torch (flash-attn needs a GPU): (batch, seq,
    heads, dim) tensors, a causal mask aligned to the last key, packed sequences with cumulative lengths."""

    def attend(q, k, v, softmax_scale, causal):  # (seq, heads, dim) each
        scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
        if causal:
            blocked = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(k.shape[0] - q.shape[0] + 1)
            scores = scores.masked_fill(blocked, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        assert dropout_p == 0.0
        return torch.stack([attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        assert kwargs["dropout_p"] == 0.0
        pieces = [
            attend(q[cq0:cq1], k[ck0:ck1], v[ck0:ck1], kwargs["softmax_scale"], kwargs["causal"])
            for cq0, cq1, ck0, ck1 in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:])
        ]
        return torch.cat(pieces)

    def unpad_input(hidden, mask):
        indices = torch.nonzero(mask.flatten()).flatten()
        lengths = mask.sum(-1, dtype=torch.int32)
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return hidden.reshape(-1, *hidden.shape[2:])[indices], indices, cu, int(lengths.max()), lengths

    def pad_input(hidden, indices, batch, seqlen):
        out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
        out[indices] = hidden
        return out.view(batch, seqlen, *hidden.shape[1:])

    fakes = {
        "flash_attn_func": flash_attn_func,
        "flash_attn_varlen_func": flash_attn_varlen_func,
        "index_first_axis": lambda x, indices: x[indices],
        "unpad_input": unpad_input,
        "pad_input": pad_input,
    }
    for name, fake in fakes.items():
        monkeypatch.setattr(module, name, fake, raising=False)


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_flash_attention_class_gives_the_eager_numbers(patched, form, padding, monkeypatch):
    """The file's flash-attention-2 class (v padded to the q/k head size, the 2-D mask, packed sequences) gives the
    eager class's outputs on every real query, for a prompt and then a cached one-token step; flash-attn itself is
    replaced by a torch computation of what it computes."""
    from transformers import DynamicCache

    model = build_model(patched, seed=7)
    module = model_module(model)
    _fake_flash_attn(monkeypatch, module)
    eager = model.model.layers[0].self_attn.eval()
    flash = getattr(module, f"DeepseekV{form[1]}FlashAttention2")(model.config, layer_idx=0).eval()
    flash.load_state_dict(eager.state_dict())
    assert module.ATTENTION_CLASSES["flash_attention_2"] is type(flash)

    batch, seq = 2, 9
    mask = torch.ones(batch, seq + 1, dtype=torch.long)
    if padding == "right":
        mask[0, seq - 3 : seq] = 0
    elif padding == "left":
        mask[0, :3] = 0
    hidden = torch.randn(batch, seq + 1, model.config.hidden_size, generator=torch.Generator().manual_seed(8))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = {"eager": DynamicCache(), "flash": DynamicCache()}
    with torch.no_grad():
        for start, stop in ((0, seq), (seq, seq + 1)):  # the prompt, then one cached step
            step_mask = mask[:, :stop]
            four_d = module._prepare_4d_causal_attention_mask(
                step_mask, (batch, stop - start), hidden[:, start:stop], start
            )
            two_d = step_mask if padding != "none" else None
            outs = {
                name: attn(
                    hidden[:, start:stop],
                    attention_mask=four_d if name == "eager" else two_d,
                    position_ids=positions[:, start:stop],
                    past_key_value=caches[name],
                    use_cache=True,
                )[0]
                for name, attn in (("eager", eager), ("flash", flash))
            }
            real = mask[:, start:stop].bool()
            torch.testing.assert_close(outs["flash"][real], outs["eager"][real], rtol=1e-5, atol=1e-6)


def _published_and_rewritten(patched, form):
    """The published stand-in (eager, its only choice) and the rewritten one (sdpa, the default load) with the same
    weights; V3's router bias, left uninitialised as published, set to small values."""
    original = build_model(FORM_DIRS[form], seed=1)
    with torch.no_grad():
        for name, p in original.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(6)) * 0.1)
    model = build_model(patched, seed=2)
    model.load_state_dict(original.state_dict(), strict=True)
    assert model.config._attn_implementation == "sdpa" and original.config._attn_implementation == "eager"
    return original, model


def _masks_seen(monkeypatch, model) -> list:
    """What each layer's SDPA call gets as its mask, in call order: None, or the 4-D mask's shape."""
    module = model_module(model)
    seen, sdpa = [], module._moe_rewrite_attention

    def spy(query, key, value, mask, scale, dropout_p):
        seen.append(None if mask is None else tuple(mask.shape))
        return sdpa(query, key, value, mask, scale, dropout_p)

    monkeypatch.setattr(module, "_moe_rewrite_attention", spy)
    return seen


@pytest.mark.parametrize("padding", ["no mask", "all ones", "right", "left"])
def test_the_sdpa_model_equals_the_published_file_with_and_without_padding(patched, form, padding, monkeypatch):
    """No mask or one of all ones: every layer's SDPA call gets None (its causal kernel); padding: the file's 4-D
    mask. Either way the published file's eval logits (at unpadded positions), training loss and every gradient (V3:
    its eval branch run with gradients) within 1e-5; the padded tokens reach V2's router, and its aux loss."""
    original, model = _published_and_rewritten(patched, form)
    seen = _masks_seen(monkeypatch, model)
    seq, pad, pad_id = 10, 4, 255
    ids = torch.randint(0, pad_id, (2, seq), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    inputs = {"input_ids": ids} if padding == "no mask" else {"input_ids": ids, "attention_mask": mask}
    labels = ids.clone()
    if padding in ("right", "left"):
        padded = slice(seq - pad, seq) if padding == "right" else slice(0, pad)
        mask[0, padded], ids[0, padded] = 0, pad_id
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        labels = ids.masked_fill(mask == 0, -100)
        if padding == "left":
            labels[0, pad] = -100
    layers = model.config.num_hidden_layers
    causal_only = padding in ("no mask", "all ones")
    with torch.no_grad():
        want = original.eval()(**inputs).logits
        got = model.eval()(**inputs).logits
    assert seen == ([None] * layers if causal_only else [(2, 1, seq, seq)] * layers)
    assert (got - want)[mask.bool()].abs().max().item() <= 1e-5

    model.train()
    if form == "v3":
        eval_branch_with_grads(original)
    else:
        original.train()
    results = []
    for m in (model, original):
        loss = m(**inputs, labels=labels).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (loss, grads), (want_loss, want_grads) = results
    assert abs(loss - want_loss) <= 1e-5
    assert grads.keys() == want_grads.keys() and "model.layers.0.self_attn.kv_b_proj.weight" in grads
    for name, grad in want_grads.items():
        assert (grads[name] - grad).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("padding", ["none", "left"])
def test_greedy_generation_with_the_cache_equals_the_published_file(patched, form, padding, monkeypatch):
    """Without padding the prompt and every decoding step (one query over the cache) get no mask; with a left-padded
    row, the file's 4-D mask throughout; the same tokens either way as the published attention and mask. The reference
    is the rewritten file loaded with attn_implementation="eager" (bit for bit the published file in eval, the first
    test above): the published stand-in itself cannot generate on transformers >= 4.47 (the compat rewrite's job)."""
    from transformers import AutoModelForCausalLM

    _, model = _published_and_rewritten(patched, form)
    original = AutoModelForCausalLM.from_config(model.config, trust_remote_code=True, attn_implementation="eager")
    original.load_state_dict(model.state_dict())
    assert original.config._attn_implementation == "eager" and model.config._attn_implementation == "sdpa"
    seen = _masks_seen(monkeypatch, model)
    ids = torch.randint(1, 255, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[0, :2], ids[0, :2] = 0, 0
    options = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    want = original.eval().generate(ids, **options)
    got = model.eval().generate(ids, **options)
    assert got.shape == (2, 11) and torch.equal(got, want)
    assert len(seen) == 5 * model.config.num_hidden_layers
    assert all(s is None for s in seen) if padding == "none" else all(s is not None for s in seen)
