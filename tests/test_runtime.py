"""The generated runtime as Python modules (moe_rewrite/runtime/), before any file is rewritten: each part against an
explicit per-expert float64 reference, gradients included. The rewritten files run the same code (test_training.py)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from conftest import forget_runtime_settings, runtime_env  # noqa: E402
from helpers import Expert, reference, routing, tiny_moe  # noqa: E402

from moe_rewrite.runtime.experts import expert_linears, fused_checkpoint, fused_experts, fused_views  # noqa: E402
from moe_rewrite.runtime.kernels import dispatch  # noqa: E402
from moe_rewrite.runtime.moe import backends, expert_output, grouped_linear, moe_train, route  # noqa: E402

ACT = torch.nn.functional.silu


def expert_params(moe):
    if isinstance(moe.experts, fused_experts._MoeRewriteFusedExperts):
        return [moe.experts.gate_up_proj, moe.experts.down_proj]
    return [p for e in moe.experts for p in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_moe_train_equals_the_per_expert_reference_with_gradients(layout, tokens):
    moe = tiny_moe(layout)
    x = torch.randn(tokens, 8, dtype=torch.float64, requires_grad=True)
    ids, w = routing(tokens, 6, 2)
    w.requires_grad_(True)
    leaves = [x, w, *expert_params(moe)]

    def grads_of(y):  # backward(), as training runs it (the per-expert layout writes weight gradients itself)
        for leaf in leaves:
            leaf.grad = None
        (y * probe).sum().backward()
        return [leaf.grad for leaf in leaves]

    y = moe.moe_train(x, ids, w)
    probe = torch.randn_like(y)
    grads = grads_of(y)
    expected = reference(moe.experts, x, ids, w)
    expected_grads = grads_of(expected)
    assert torch.allclose(y, expected, atol=1e-12)
    for got, want in zip(grads, expected_grads):  # the reference leaves unused experts' gradients None
        assert torch.allclose(got, torch.zeros_like(got) if want is None else want, atol=1e-12)
    if layout == "fused":  # empty experts get exact zeros
        assert torch.count_nonzero(grads[2][-2:]) == 0 and torch.count_nonzero(grads[3][-2:]) == 0


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
def test_out_dtype_is_the_promoted_result_cast_once(layout, weights_dtype):
    """moe_train(..., out_dtype=x.dtype), as the V3 form's training branch calls it, gives what the promoted result
    cast to x's dtype gives, forward and every gradient (bf16 tokens; the routing weights fp32 as DeepSeek's gate
    returns them, or bf16)."""
    moe = tiny_moe(layout).to(torch.bfloat16)
    torch.manual_seed(3)
    x = torch.randn(9, 8, dtype=torch.bfloat16, requires_grad=True)
    ids, w = routing(9, 6, 2)
    w = w.to(weights_dtype).requires_grad_(True)
    leaves = [x, w, *expert_params(moe)]
    results = []
    for out_dtype in (None, torch.bfloat16):
        for leaf in leaves:
            leaf.grad = None
        y = moe.moe_train(x, ids, w, out_dtype=out_dtype)
        assert y.dtype == (out_dtype or torch.promote_types(torch.bfloat16, weights_dtype))
        y = y.to(torch.bfloat16)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y] + [leaf.grad for leaf in leaves])
    for cast, direct in zip(*results):
        assert torch.equal(cast, direct)


@pytest.mark.parametrize("experts", [6, 300, 40_000])  # the sort's key: uint8, int16, int32
def test_route_sorts_the_rows_by_expert_stably(experts):
    """The routing before the GEMMs: the rows in expert order, each expert's rows in token order (a stable sort),
    each row's token, the inverse permutation, and the cumulative row counts per expert, empty experts included."""
    tokens, k = 50, 4
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    ids[::7, 0] = experts - 1  # some experts get many rows, most none
    offsets, routed = route._moe_rewrite_route(ids, experts, with_positions=True)
    order, tokens_of_rows, positions = routed.order, routed.tokens, routed.positions
    flat = ids.reshape(-1)
    want = sorted(range(flat.numel()), key=lambda j: (int(flat[j]), j))
    assert order.tolist() == want
    assert torch.equal(tokens_of_rows, order // k) and torch.equal(order[positions], torch.arange(flat.numel()))
    counts = torch.bincount(flat, minlength=experts)
    assert offsets.dtype == torch.int32 and torch.equal(offsets, counts.cumsum(0).to(torch.int32))
    assert route._moe_rewrite_route(ids, experts, with_positions=False)[1].positions is None  # only Triton reads it


@pytest.mark.parametrize("kernel", ["sorted", "torch"])
def test_grouped_linear_passes_gradcheck(kernel):
    if kernel == "torch" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm needs torch >= 2.8")
    if kernel == "torch":  # torch._grouped_mm: bf16 / fp32 only, 16-byte strides; compared with float64 instead
        x, weight = torch.randn(7, 8, requires_grad=True), torch.randn(3, 12, 8, requires_grad=True)
    else:
        x, weight = (
            torch.randn(7, 4, dtype=torch.float64, requires_grad=True),
            torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True),
        )
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)

    def linear(x, weight):
        return grouped_linear._moe_rewrite_linear(
            x, offsets, kernel, True, grouped_linear._MoeRewriteExpertWeight(weight)
        )

    if kernel == "sorted":
        assert torch.autograd.gradcheck(linear, (x, weight))
    else:
        y = linear(x, weight)
        x64, w64 = x.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
        ref = torch.cat([x64[:2] @ w64[0].t(), x64[2:] @ w64[2].t()])
        probe = torch.randn_like(ref)
        got = torch.autograd.grad((y * probe.float()).sum(), [x, weight])
        want = torch.autograd.grad((ref * probe).sum(), [x64, w64])
        assert torch.allclose(y.double(), ref, atol=1e-4)
        for g, r in zip(got, want):
            assert torch.allclose(g.double(), r, atol=1e-4)
        assert torch.count_nonzero(got[1][1]) == 0


@pytest.mark.parametrize("kernel", ["sorted", "torch"])
@pytest.mark.parametrize("keep_stacked", [True, False])
@pytest.mark.parametrize("act", [torch.nn.SiLU(), torch.nn.GELU()], ids=["silu", "gelu"])  # aten's / autograd's
def test_expert_output_node_passes_gradcheck(kernel, keep_stacked, act):
    """The node after the gate/up GEMM (act * up, down GEMM, un-sort, weighted sum; it recomputes in backward and
    takes the routing weights' gradient from the down input gradient): every input's gradient, an empty expert's
    weight gradient exactly zero."""
    if kernel == "torch" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm needs torch >= 2.8")
    dtype = torch.float64 if kernel == "sorted" else torch.float32  # torch._grouped_mm: bf16 / fp32 only
    tokens, k, inter, hidden = 5, 2, 4, 8
    ids = torch.tensor([[0, 2], [2, 0], [3, 2], [0, 3], [2, 3]])  # expert 1 gets no rows
    offsets, routed = route._moe_rewrite_route(ids, 4, with_positions=False)
    order = routed.order
    assert torch.equal(order, ids.reshape(-1).argsort(stable=True))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [3, 3, 7, 10]
    gate_up = torch.randn(tokens * k, 2 * inter, dtype=dtype, requires_grad=True)
    weight = torch.rand(tokens, k, dtype=dtype, requires_grad=True)
    down = torch.randn(4, hidden, inter, dtype=dtype, requires_grad=True)

    def node(gate_up, weight, down):
        source = grouped_linear._MoeRewriteExpertWeight(down)
        return expert_output._MoeRewriteExpertOutput.apply(
            gate_up, weight, routed, offsets, kernel, keep_stacked, act, None, source, down
        )

    def composed(gate_up, weight, down):  # per row: its expert's down(act(gate) * up), then the weighted sum
        gate, up = gate_up.chunk(2, dim=-1)
        expert_of_row = ids.reshape(-1)[order]
        rows = torch.stack([down[e] @ h for e, h in zip(expert_of_row.tolist(), act(gate) * up)])
        unsorted = torch.empty_like(rows).index_copy(0, order, rows)
        return (unsorted.view(tokens, k, hidden) * weight.unsqueeze(-1)).sum(dim=1)

    if kernel == "sorted":
        assert torch.autograd.gradcheck(node, (gate_up, weight, down))
    y = node(gate_up, weight, down)
    inputs64 = [t.detach().double().requires_grad_(True) for t in (gate_up, weight, down)]
    ref = composed(*inputs64)
    probe = torch.randn_like(ref)
    got = torch.autograd.grad((y * probe.to(dtype)).sum(), [gate_up, weight, down])
    want = torch.autograd.grad((ref * probe).sum(), inputs64)
    assert torch.allclose(y.double(), ref, atol=1e-5)
    for g, r in zip(got, want):
        assert g.dtype == dtype and torch.allclose(g.double(), r, atol=1e-5)
    assert torch.count_nonzero(got[2][1]) == 0


@pytest.mark.parametrize("keep_stacked", [True, False])
@pytest.mark.parametrize("compute", [torch.float64, torch.float32], ids=["same-dtype", "cast"])
def test_gathered_linear_passes_gradcheck(keep_stacked, compute):
    """The first GEMM on gathered rows, keeping x instead of the rows: x's gradient summed over each token's rows
    (through the cast to the compute dtype and back), the weight's, an empty expert's exactly zero."""
    tokens, k, hidden, out = 5, 2, 4, 6
    ids = torch.tensor([[0, 2], [2, 0], [3, 2], [0, 3], [2, 3]])  # expert 1 gets no rows
    offsets, routed = route._moe_rewrite_route(ids, 4, with_positions=False)
    order = routed.order
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, out, hidden, dtype=torch.float64, requires_grad=True)

    def node(x, weight):
        source = grouped_linear._MoeRewriteExpertWeight(weight)
        gather = grouped_linear._MoeRewriteGatherPlan(routed, k, compute, None)
        return grouped_linear._moe_rewrite_linear(x, offsets, "sorted", keep_stacked, source, gather=gather)

    if compute == torch.float64:
        assert torch.autograd.gradcheck(node, (x, weight))
    y = node(x, weight)
    expert_of_row = ids.reshape(-1)[order]
    ref = torch.stack([weight[e] @ x[i // k] for e, i in zip(expert_of_row.tolist(), order.tolist())])
    probe = torch.randn_like(ref)
    got = torch.autograd.grad((y.double() * probe).sum(), [x, weight])
    want = torch.autograd.grad((ref * probe).sum(), [x, weight])
    assert y.dtype == compute and torch.allclose(y.double(), ref, atol=1e-5)
    for g, r in zip(got, want):
        assert g.dtype == torch.float64 and torch.allclose(g, r, atol=1e-5)
    assert torch.count_nonzero(got[1][1]) == 0


def test_per_expert_weights_in_one_buffer_are_viewed_not_copied():
    moe = tiny_moe("per_expert")
    params = expert_params(moe)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    gate_w, up_w, down_w = expert_linears._moe_rewrite_linear_weights(moe.experts)
    stacked = expert_linears._MoeRewriteExpertLinears(gate_w + up_w, 2).stacked(torch.float64)
    assert stacked.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    for i, e in enumerate(moe.experts):
        assert torch.equal(stacked[i], torch.cat([e.gate_proj.weight, e.up_proj.weight]))
    copied = expert_linears._MoeRewriteExpertLinears(down_w[::-1], 1).stacked(torch.float64)  # not at a fixed stride
    assert copied.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


def test_kernel_choice_and_settings_are_read_once_per_process(monkeypatch):
    forget_runtime_settings()
    monkeypatch.setenv("MOE_REWRITE_BACKEND", "loop")
    cpu = torch.device("cpu")
    assert dispatch._moe_rewrite_kernel(cpu, torch.float32) == "loop"
    monkeypatch.setenv("MOE_REWRITE_BACKEND", "torch")  # too late: this process has chosen
    assert dispatch._moe_rewrite_kernel(cpu, torch.float32) == "loop"
    assert dispatch._moe_rewrite_kernel(cpu, torch.float64) == "loop"  # the setting was read once too
    forget_runtime_settings()
    assert dispatch._moe_rewrite_kernel(cpu, torch.float32) == "sorted"  # "torch" falls back off sm90
    forget_runtime_settings()


def test_sonicmoe_backend_is_refused_where_it_cannot_run_and_gives_way_to_the_grouped_gemms(monkeypatch):
    """Asked for on a machine without an sm90 GPU and sonic-moe: one clear error. Where SonicMoE would run, the core
    still runs its own GEMMs for what SonicMoE cannot reproduce (tests/test_cuda_kernels.py runs SonicMoE itself)."""
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", "sonicmoe")
    with pytest.raises(RuntimeError, match="'sonicmoe' needs the sonic-moe package, an sm90 GPU"):
        dispatch._moe_rewrite_kernel(torch.device("cpu"), torch.bfloat16)
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", None)
    moe = tiny_moe("fused", hidden=16, inter=8)
    moe.experts.act_fn = torch.nn.SiLU()
    x = torch.randn(3, 16, dtype=torch.float64)
    ids, w = routing(3, 6, 2)
    mine = moe.moe_rewrite_expert_weights()
    gate_up, down, act, adapters = mine.gate_up, mine.down, mine.act_fn, mine.adapters
    lora = grouped_linear._MoeRewriteExpertWeight(torch.zeros(6, 2, 16))
    mlp = grouped_linear._MoeRewriteExpertMLP
    gelu = torch.nn.GELU()
    for weights in [
        mlp(gate_up, down, act, {"gate_up_proj": ((lora, lora, 1.0, torch.nn.Identity()),)}),  # an adapter
        mlp(gate_up, down, gelu, adapters),  # another activation
        mlp(expert_linears._MoeRewriteExpertLinears([torch.zeros(8, 16)] * 12, 2), down, act, adapters),  # per-expert
        mlp(grouped_linear._MoeRewriteExpertWeight(torch.zeros(6, 14, 16)), down, act, adapters),  # rows not aligned
    ]:
        assert backends._moe_rewrite_sonicmoe_experts(x, ids, w, weights, torch.bfloat16) is None
    # what SonicMoE cannot run goes through torch._grouped_mm (the kernel where "sonicmoe" is chosen)
    moe.float().experts.act_fn = gelu
    x, w = x.float(), w.float()
    weights = moe.moe_rewrite_expert_weights()
    y = moe_train._moe_rewrite_grouped_experts(x, ids, w, weights, 6, "sonicmoe", torch.float32, None)
    assert torch.allclose(y, reference(moe.experts, x, ids, w), atol=1e-5)


def test_fused_checkpoint_keys_round_trip():
    moe = tiny_moe("per_expert")
    per_expert_state = {f"experts.{k}": v for k, v in moe.experts.state_dict().items()}
    fused = tiny_moe("fused")
    fused.load_state_dict(per_expert_state)  # the pre-hook merges the per-expert keys
    x = torch.randn(5, 8, dtype=torch.float64)
    ids, w = routing(5, 6, 2)
    assert torch.allclose(fused.moe_train(x, ids, w), moe.moe_train(x, ids, w), atol=1e-12)
    unfused = fused_checkpoint._moe_rewrite_unfuse_state_dict(None, fused)
    assert unfused.keys() == per_expert_state.keys()
    assert all(torch.equal(unfused[k], v) for k, v in per_expert_state.items())
    assert fused_checkpoint._moe_rewrite_unfuse_state_dict(None, moe) is None  # nothing fused: saved as it is


def test_the_per_step_check_of_the_expert_views_agrees_with_the_full_one(monkeypatch):
    """The fused experts' quick per-step check (every view and projection as made: no adapters to look for) says yes
    only where the full check over the 3 * E projections finds no adapter either, so both read the same weights; any
    change to the views (PEFT's layer or the user's module in a projection's place, a submodule added, a projection's
    class changed or deleted, a view replaced) falls back to the full check, and its numbers are the loop's."""
    moe = tiny_moe("fused")
    experts = moe.experts
    quick = type(experts)._moe_rewrite_own_projections

    def both():
        got = moe.moe_rewrite_expert_weights()
        with monkeypatch.context() as m:
            m.setattr(type(experts), "_moe_rewrite_own_projections", lambda self: False)
            full = moe.moe_rewrite_expert_weights()
        assert (got is None) == (full is None) and (got is None or got.adapters == full.adapters == {})
        return quick(experts), got is not None

    class Doubled(fused_views._MoeRewriteExpertProjection):
        def forward(self, x):
            return 2 * super().forward(x)

    x, (ids, w) = torch.randn(4, 8, dtype=torch.float64), routing(4, 6, 2)
    assert both() == (True, True)
    original = experts[3].up_proj
    mutations = [
        ("a module in a projection's place", lambda: setattr(experts[3], "up_proj", torch.nn.Linear(8, 5).double())),
        ("a submodule added", lambda: original.add_module("base_layer", torch.nn.Linear(8, 5).double())),
        ("the class changed", lambda: setattr(original, "__class__", Doubled)),
        ("a projection deleted", lambda: delattr(experts[3], "up_proj")),
        ("a view replaced", lambda: experts.add_module("3", Expert(8, 5).double())),
    ]
    for why, mutate in mutations:
        mutate()
        assert both() == (False, False), why
        if why != "a projection deleted":  # the loop runs what the views now hold
            assert torch.allclose(moe.moe_train(x, ids, w), reference(list(experts), x, ids, w), atol=1e-12), why
        # back as made (as PEFT's merge_and_unload puts the base layer back): the quick check holds again
        original.__class__ = fused_views._MoeRewriteExpertProjection
        original._modules.clear()
        view = experts.__dict__["_moe_rewrite_made"].views[3]
        experts.add_module("3", view)
        view.up_proj = original
        assert both() == (True, True), why
    copied = copy.deepcopy(moe)  # a copy checks its own views
    made = [e.__dict__["_moe_rewrite_made"].flat for e in (copied.experts, experts)]
    assert quick(copied.experts) and not any(a is b for a, b in zip(*made))
    copied.experts[0].gate_proj = torch.nn.Linear(8, 5).double()
    assert not quick(copied.experts) and quick(experts)


def test_modules_wrapping_the_fused_experts_run_as_modules():
    """A module holding the fused experts as base_layer that is not PEFT's LoRA on their parameters (another tuner's
    wrapper) is not read as the fused weights: it runs as a module, its forward ending in the experts' own (a loop
    over the expert views), in training and in eval (moe_rewrite_infer: moe_infer cannot index it)."""
    moe = tiny_moe("fused")

    class Wrapper(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, *args):
            return 2 * self.base_layer(*args)

    views = list(moe.experts)
    moe.experts = Wrapper(moe.experts)
    assert moe.moe_rewrite_expert_weights() is None
    x, (ids, w) = torch.randn(3, 8, dtype=torch.float64), routing(3, 6, 2)
    expected = 2 * reference(views, x, ids, w)
    assert torch.allclose(moe.moe_train(x, ids, w), expected, atol=1e-12)
    moe.moe_infer = None  # not called: it would index the wrapper
    assert torch.allclose(moe.moe_rewrite_infer(x, ids, w), expected, atol=1e-12)
