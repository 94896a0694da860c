"""The Triton kernels of runtime/kernels/triton_*.py against float64 references, alone and inside moe_train (output
and the gradients of x, the routing weights and both fused parameters). On the CPU they run in Triton's interpreter
(TRITON_INTERPRET=1, small sizes, a few column blocks per row); where there is a CUDA GPU, compiled, at Moonlight's
row widths.
tests/test_cuda_kernels.py compares the whole bf16 GPU path, Triton kernels on and off, with the loop.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")  # in the test extra: CI has it

from conftest import patch_runtime, runtime_env  # noqa: E402
from helpers import reference, routing, tiny_moe  # noqa: E402

from moe_rewrite.runtime.kernels import (  # noqa: E402
    dispatch,
    triton_cross_entropy,
    triton_gather,
    triton_gemm,
    triton_rmsnorm,
    triton_rope,
    triton_route,
    triton_sum_rows,
    triton_swiglu,
)
from moe_rewrite.runtime.model import lm_loss  # noqa: E402
from moe_rewrite.runtime.moe import expert_output, grouped_linear, grouped_mm, moe_train, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # conftest has Triton interpret without a GPU


@pytest.fixture
def kernels(monkeypatch):
    """(device, kernels); on the CPU with 16-column blocks (and 16-row route blocks), so that the small rows take
    several blocks and a ragged last one."""
    if DEVICE == "cpu":
        patch_runtime(monkeypatch, "MOE_REWRITE_TRITON_BLOCK", 16)
        patch_runtime(monkeypatch, "MOE_REWRITE_ROUTE_BLOCK", 16)
        patch_runtime(monkeypatch, "MOE_REWRITE_GEMM_TILE", (16, 32, 16, 4, 1))
        patch_runtime(monkeypatch, "MOE_REWRITE_FP8_GEMM_TILE", (16, 32, 16, 4, 1))
        small = (16, 32, 32, 4, 1)  # 32 deep: four promotions per scale block
        patch_runtime(monkeypatch, "MOE_REWRITE_FP8_COMPUTE_TILES", {"fwd": small, "dgrad": small})
    return DEVICE, dispatch._moe_rewrite_build_triton()


def sizes(device):
    """(rows, inter, hidden): rows of 2.5 blocks on the CPU, Moonlight's intermediate and hidden sizes on a GPU."""
    return (24, 40, 40) if device == "cpu" else (3000, 1408, 2048)


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_swiglu_and_its_backward_equal_float64(kernels):
    device, kernels = kernels
    rows, inter, _ = sizes(device)
    gate_up = torch.randn(rows, 2 * inter, device=device)
    grad_h, row_weight = torch.randn(rows, inter, device=device), torch.rand(rows, device=device)
    assert torch.allclose(triton_swiglu._moe_rewrite_swiglu(kernels, gate_up).double(), silu_mul(gate_up.double()))

    exact = gate_up.double().requires_grad_(True)
    hidden = silu_mul(exact)
    (want_grad,) = torch.autograd.grad(hidden, exact, grad_h.double() * row_weight.double()[:, None])
    for weighted in (False, True):
        overwritten = grad_h.clone()
        got_grad, per_row = triton_swiglu._moe_rewrite_swiglu_backward(
            kernels, gate_up, overwritten, row_weight, weighted
        )
        assert torch.allclose(got_grad.double(), want_grad, atol=1e-5)
        assert torch.allclose(per_row.double(), (grad_h.double() * hidden).sum(-1), atol=1e-4)
        want_h = hidden * row_weight.double()[:, None] if weighted else grad_h.double()
        assert torch.allclose(overwritten.double(), want_h.detach(), atol=1e-5)


def test_sum_rows_unsorts_and_weights_each_tokens_rows(kernels):
    device, kernels = kernels
    _, _, hidden = sizes(device)
    tokens, top_k = 7, 3
    rows = torch.randn(tokens * top_k, hidden, device=device)
    order = torch.randperm(tokens * top_k, device=device)
    positions = route._moe_rewrite_positions(order)
    assert torch.equal(order[positions], torch.arange(tokens * top_k, device=device))
    unsorted = torch.empty_like(rows).index_copy_(0, order, rows).view(tokens, top_k, hidden).double()
    weight = torch.rand(tokens, top_k, device=device)
    got = triton_sum_rows._moe_rewrite_sum_rows(kernels, rows, positions, top_k, weight, torch.float32)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), (unsorted * weight.double()[..., None]).sum(1), atol=1e-5)
    got = triton_sum_rows._moe_rewrite_sum_rows(kernels, rows.bfloat16(), positions, top_k)
    rounded = torch.empty_like(rows).index_copy_(0, order, rows.bfloat16().float()).view(tokens, top_k, hidden)
    want = rounded.sum(1)  # summed in float32, one rounding to bf16
    assert got.dtype == torch.bfloat16
    if device == "cuda":
        assert torch.equal(got, want.bfloat16())
    else:  # the interpreter rounds float32 to bf16 toward zero (compiled kernels to nearest): within one bf16 step
        assert torch.allclose(got.float(), want, rtol=2**-7, atol=0)


def test_sum_rows_backward_equals_float64(kernels):
    """The weighted sum's backward for rows in expert order: each row's gradient (its token's gradient times its
    routing weight, in the asked dtype) and each routing weight's gradient <dy, row> in float32, or none without the
    rows (the weights need no gradient)."""
    device, kernels = kernels
    _, _, hidden = sizes(device)
    tokens, top_k = 7, 3
    order = torch.randperm(tokens * top_k, device=device)
    token_of_row = order // top_k
    rows = torch.randn(tokens * top_k, hidden, device=device)
    grad = torch.randn(tokens, hidden, device=device)
    row_weight = torch.rand(tokens * top_k, device=device)
    backward = triton_sum_rows._moe_rewrite_sum_rows_backward
    grad_rows, per_row = backward(kernels, grad, rows, token_of_row, row_weight, torch.float32)
    token_grad = grad.double()[token_of_row]
    assert grad_rows.dtype == torch.float32 and per_row.dtype == torch.float32
    assert torch.allclose(grad_rows.double(), token_grad * row_weight.double()[:, None], atol=1e-6)
    assert torch.allclose(per_row.double(), (token_grad * rows.double()).sum(-1), atol=1e-4)
    without_rows, none = backward(kernels, grad, None, token_of_row, row_weight, torch.float32)
    assert none is None and torch.equal(without_rows, grad_rows)
    grad_rows, _ = backward(kernels, grad.bfloat16(), None, token_of_row, row_weight, torch.bfloat16)
    want = grad.bfloat16().double()[token_of_row] * row_weight.double()[:, None]
    assert grad_rows.dtype == torch.bfloat16 and torch.allclose(grad_rows.double(), want, rtol=2**-7, atol=0)


@pytest.mark.parametrize("tokens,top_k,pad", [(1, 2, 0), (7, 3, 5), (40, 6, 0), (0, 2, 0)])
def test_gather_rows_gives_index_select_of_the_padded_tokens(kernels, tokens, top_k, pad):
    """Each token's row copied to its top_k places in expert order, and token 0's to the padding rows after them,
    cast to the rows' dtype: bit for bit torch's index_select (a single token, several column blocks with a ragged
    last one, padding, no tokens); with the routing weights, each row's weight as _moe_rewrite_row_weights gives it
    (zero for padding rows)."""
    device, kernels = kernels
    _, _, hidden = sizes(device)
    torch.manual_seed(tokens + pad)
    x = torch.randn(tokens, hidden, device=device)
    order = torch.randperm(tokens * top_k, device=device)
    positions = route._moe_rewrite_positions(order)
    token_of_row = torch.cat([order // top_k, order.new_zeros(pad)])
    gather = triton_gather._moe_rewrite_gather_rows
    for dtype in (torch.float32, torch.bfloat16):
        out = gather(kernels, x, positions, token_of_row.numel(), dtype)
        want = x.index_select(0, token_of_row).to(dtype)
        assert out.dtype == dtype
        if device == "cpu" and dtype == torch.bfloat16:  # the interpreter rounds to bf16 toward zero (see above)
            assert torch.allclose(out.float(), want.float(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(out, want)
    rows = x.bfloat16().index_select(0, token_of_row)
    for weight_dtype in (torch.float32, torch.bfloat16):
        topk_weight = torch.rand(tokens, top_k, device=device).to(weight_dtype)
        out, row_weight = gather(kernels, x.bfloat16(), positions, token_of_row.numel(), torch.bfloat16, topk_weight)
        want_weight = route._moe_rewrite_row_weights(topk_weight, order, token_of_row)
        assert torch.equal(out, rows) and row_weight.dtype == weight_dtype and torch.equal(row_weight, want_weight)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tokens,experts,top_k,skew",
    [(1, 6, 2, False), (0, 4, 2, False), (37, 8, 3, True), (50, 64, 6, False), (29, 256, 8, True)]
    + ([(4096, 256, 8, False), (8192, 64, 6, True)] if DEVICE == "cuda" else []),  # V3's and Moonlight's on a GPU
)
def test_the_route_kernel_gives_the_torch_route(monkeypatch, kernels, tokens, experts, top_k, skew):
    """The route in one launch equals the torch ops' (a stable sort by expert, its inverse, each row's token and the
    cumulative counts) for a single token, no tokens, rows over several route blocks with a ragged last one, empty
    experts, and skewed routing (most rows to one expert); with padding tokens too (token 0 after the rows': fewer
    than one per program, and more than a block per program). In the CPU's interpreter the block is 64 rows, not
    4096: the same loops over blocks, with 64 times fewer padding rows to write."""
    device, kernels = kernels
    if device == "cpu":
        monkeypatch.setattr(triton_route, "MOE_REWRITE_ROUTE_BLOCK", 64)
    torch.manual_seed(tokens + experts)
    ids = torch.rand(tokens, experts).argsort(dim=1)[:, :top_k]  # top_k distinct experts per token
    if skew:
        ids[:, 0] = experts // 2
        ids[ids >= experts - 2] = experts // 2 + 1  # the last two experts get nothing
    for padding in (0, 3, 2 * experts * triton_route.MOE_REWRITE_ROUTE_BLOCK + 5):
        want_offsets, want = route._moe_rewrite_route(ids, experts, True, padding=padding)
        poisoned = torch.full((tokens * top_k + padding,), -1, dtype=torch.int64, device=device)
        del poisoned  # the allocator hands its block to the route: unwritten padding would show as -1
        got_offsets, got = route._moe_rewrite_route(ids.to(device), experts, True, kernels, padding)
        assert got_offsets.dtype == torch.int32 and torch.equal(got_offsets.cpu(), want_offsets)
        for name in ["order", "tokens", "positions"]:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b), name
        assert want.tokens.numel() == tokens * top_k + padding and not want.tokens[tokens * top_k :].any()


@pytest.mark.parametrize("mode", ["fwd", "dgrad"])
@pytest.mark.parametrize(
    "counts,n",
    [
        ([0, 7, 40, 3, 0], 64),  # empty experts first and last, an expert over several row tiles, a ragged tile
        ([1], 40),  # one row; a ragged column strip
        ([0, 0, 0], 32),  # no rows
        ([5] * 3 + [0] * 2 + [33] * 2, 96),  # 7 experts (not a power of two)
    ],
)
def test_the_grouped_gemm_kernel_gives_each_experts_product(kernels, mode, counts, n):
    """The Triton grouped GEMM against the per-expert products in float64, in float32 on the CPU (the interpreter's
    dot) and bf16 on a GPU; rows past the last offset (padding) are left as they were (unwritten)."""
    device, kernels = kernels
    torch.manual_seed(len(counts) + n)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k = 48 if device == "cpu" else 256
    if device == "cuda":
        n *= 8
    experts, rows, pad = len(counts), sum(counts), 3
    offsets = torch.tensor(counts).cumsum(0).to(device, torch.int32)
    a = torch.randn(rows + pad, k, device=device, dtype=dtype)
    b = torch.randn(experts, *((n, k) if mode == "fwd" else (k, n)), device=device, dtype=dtype)  # a @ b[e]^T, a @ b[e]
    got = triton_gemm._moe_rewrite_grouped_mm(kernels, a, b, offsets, mode)
    assert got.shape == (rows + pad, n) and got.dtype == dtype
    start = 0
    for e, count in enumerate(counts):
        w = b[e].double()
        want = a[start : start + count].double() @ (w.t() if mode == "fwd" else w)
        rtol = 1e-2 if device == "cuda" else 1e-5
        assert torch.allclose(got[start : start + count].double(), want, atol=1e-4, rtol=rtol), e
        start += count


@pytest.mark.parametrize("mode", ["fwd", "dgrad"])
def test_the_grouped_gemm_kernel_reads_fp8_codes_with_their_block_scales(kernels, mode):
    """FP8 block-quantized experts (float8_e4m3fn codes, a float32 scale per 128 x 128 block): the kernel multiplies
    each weight tile by its scales and gives each expert's product with the weights dequantized to the rows' dtype, in
    float64; empty experts, a ragged row tile, a product narrower than the scale blocks on the CPU's small tile."""
    from fp8 import quantize_blockwise

    device, kernels = kernels
    torch.manual_seed(7)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    counts = [0, 7, 40, 3, 0] if device == "cpu" else [0, 70, 400, 3, 0]
    out, inner = (256, 384) if device == "cpu" else (1024, 2048)
    parts = [quantize_blockwise(torch.randn(out, inner) * 0.05) for _ in counts]
    codes = torch.stack([q for q, _ in parts]).to(device)
    scales = torch.stack([s for _, s in parts]).to(device)
    real = grouped_mm._moe_rewrite_dequantize(codes, scales, dtype).double()
    offsets = torch.tensor(counts).cumsum(0).to(device, torch.int32)
    a = torch.randn(sum(counts), inner if mode == "fwd" else out, device=device, dtype=dtype)
    got = triton_gemm._moe_rewrite_grouped_mm(kernels, a, codes, offsets, mode, scales)
    assert got.shape == (sum(counts), out if mode == "fwd" else inner) and got.dtype == dtype
    start = 0
    for e, count in enumerate(counts):
        want = a[start : start + count].double() @ (real[e].t() if mode == "fwd" else real[e])
        rtol = 1e-2 if device == "cuda" else 1e-5
        assert torch.allclose(got[start : start + count].double(), want, atol=1e-3, rtol=rtol), e
        start += count


@pytest.mark.parametrize("mode", ["fwd", "dgrad"])
def test_the_grouped_gemm_kernel_multiplies_fp8_rows_by_fp8_codes(kernels, mode):
    """FP8 compute (W8A8): rows given as FP8 codes with a scale per 1 x 128 tile (tests/fp8.py's quantize_rows) times
    FP8 experts' codes with their 128 x 128 block scales, each partial product promoted to the float32 sum with both
    scales: each expert's product of the dequantized rows and weights in float64, in the rows' dtype (float32 on the
    CPU's interpreter, bf16 on a GPU, where the FP8 tensor cores add within a block in less than float32); empty
    experts, a ragged row tile, padding rows left unwritten, dgrad reading the block scales transposed."""
    from fp8 import quantize_blockwise, quantize_rows

    device, kernels = kernels
    torch.manual_seed(8)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    counts = [0, 7, 40, 3, 0] if device == "cpu" else [0, 70, 400, 3, 0]
    out, inner = (256, 384) if device == "cpu" else (1024, 2048)
    parts = [quantize_blockwise(torch.randn(out, inner) * 0.05) for _ in counts]
    codes = torch.stack([q for q, _ in parts]).to(device)
    scales = torch.stack([s for _, s in parts]).to(device)
    real = grouped_mm._moe_rewrite_dequantize(codes, scales, torch.float64)
    offsets = torch.tensor(counts).cumsum(0).to(device, torch.int32)
    rows, pad = sum(counts), 5
    a_codes, a_scales = quantize_rows(torch.randn(rows + pad, inner if mode == "fwd" else out))
    a_codes, a_scales = a_codes.to(device), a_scales.t().contiguous().to(device)
    a_real = triton_gemm._moe_rewrite_dequantize_rows(a_codes, a_scales, torch.float64)
    got = triton_gemm._moe_rewrite_grouped_mm(kernels, a_codes, codes, offsets, mode, scales, a_scales, dtype)
    assert got.shape == (rows + pad, out if mode == "fwd" else inner) and got.dtype == dtype
    start = 0
    for e, count in enumerate(counts):
        want = a_real[start : start + count] @ (real[e].t() if mode == "fwd" else real[e])
        rtol = 1e-2 if device == "cuda" else 1e-5
        assert torch.allclose(got[start : start + count].double(), want, atol=1e-4, rtol=rtol), e
        start += count


def test_the_row_quantization_kernel_divides_each_tile_by_its_scale(kernels):
    """The Triton kernel quantizing rows per 1 x 128 tile (FP8 compute), its codes written as float32 (the clamped
    quotients before their rounding to e4m3, which Triton's interpreter does not do to nearest): the scales equal the
    torch ops', and the quotients rounded by torch give their codes; a zero tile, a ragged block of rows."""
    device, kernels = kernels
    torch.manual_seed(10)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(70, 384, device=device) * torch.logspace(-3, 3, 70, device=device)[:, None]).to(dtype)
        x[3, 128:256] = 0
        quotients = torch.empty(70, 384, device=device)
        scales = torch.empty(3, 70, device=device)
        kernels["quantize_rows"][(3, 3)](x, quotients, scales, 70, 384, BR=32)
        codes, want_scales = triton_gemm._moe_rewrite_quantize_rows(None, x)
        assert torch.equal(scales, want_scales), dtype
        assert torch.equal(quotients.to(torch.float8_e4m3fn).view(torch.uint8), codes.view(torch.uint8)), dtype


@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter does not round float32 to float8 to nearest")
def test_the_row_quantization_kernel_equals_its_torch_ops(kernels):
    """The Triton kernel quantizing rows per 1 x 128 tile (FP8 compute) gives the torch ops' codes and scales bit for
    bit (tests/test_fp8_compute.py checks those against float64): bf16 and float32 rows, a zero tile, a ragged last
    block of rows."""
    device, kernels = kernels
    torch.manual_seed(9)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(1000, 2048, device=device) * torch.logspace(-4, 4, 1000, device=device)[:, None]).to(dtype)
        x[3, 256:384] = 0
        got = triton_gemm._moe_rewrite_quantize_rows(kernels, x)
        want = triton_gemm._moe_rewrite_quantize_rows(None, x)
        assert got[1].shape == (16, 1000) and torch.equal(got[1], want[1]), dtype
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), dtype


def test_the_grouped_gemm_kernel_runs_only_where_it_was_measured_faster(monkeypatch, kernels):
    """_moe_rewrite_gmm("torch", ...) runs the Triton grouped GEMM for the forward and input-gradient products on sm90
    at no more than 160 rows per expert, one tile wide and whole tiles deep; torch._grouped_mm for the weight
    gradient, above 160 rows per expert, a ragged depth or a narrow product (the adapters'), off sm90, and with
    MOE_REWRITE_TRITON_GEMM=0. Both give the same rows."""
    device, kernels = kernels
    ran = []
    triton_product = triton_gemm._moe_rewrite_grouped_mm
    patch_runtime(monkeypatch, "_moe_rewrite_triton", lambda device, dtype: kernels)
    patch_runtime(monkeypatch, "_moe_rewrite_grouped_mm", lambda *a: ran.append(a[-1]) or triton_product(*a))
    hopper = [True]
    patch_runtime(monkeypatch, "_moe_rewrite_hopper", lambda device: hopper[0])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bn, bk = triton_gemm.MOE_REWRITE_GEMM_TILE[1:3]

    def product(rows, n, k, mode, experts=4):
        counts = torch.full((experts,), rows // experts)
        offsets = counts.cumsum(0).to(device, torch.int32)
        a = torch.randn(rows, k, device=device, dtype=dtype)  # n wide, k deep: a @ b[e]^T, a @ b[e], a^T @ b
        shape = {"fwd": (experts, n, k), "dgrad": (experts, k, n), "wgrad": (rows, n)}[mode]
        b = torch.randn(shape, device=device, dtype=dtype)
        ran.clear()
        got = grouped_mm._moe_rewrite_gmm("torch", a, b, offsets, mode)
        if ran and mode != "wgrad":
            want = grouped_mm._moe_rewrite_gmm("sorted", a, b, offsets, mode)
            assert torch.allclose(got.double(), want.double(), atol=1e-3, rtol=1e-2), mode
        return bool(ran)

    assert product(4 * 160, bn, 2 * bk, "fwd") and product(4 * 3, 2 * bn, bk, "dgrad")
    assert not product(4 * 161, bn, bk, "fwd")  # many rows per expert
    assert not product(8, bn, bk + 8, "fwd") and not product(8, bn - 8, bk, "fwd")  # ragged depth, narrow
    assert not product(8, bn, bk, "wgrad")
    hopper[0] = False
    assert not product(8, bn, bk, "fwd")
    hopper[0] = True
    monkeypatch.setitem(dispatch._moe_rewrite_settings_cache, "MOE_REWRITE_TRITON_GEMM", "0")
    assert not product(8, bn, bk, "fwd")


@pytest.mark.parametrize("adapted", [False, True])
def test_the_expert_mlp_on_the_grouped_gemm_kernel_equals_torchs(monkeypatch, kernels, adapted):
    """The core with kernel "torch" as on an sm90 GPU: its four forward and input-gradient products run the Triton
    grouped GEMM and nothing is padded; the output and every gradient equal the same core's on torch._grouped_mm
    (MOE_REWRITE_TRITON_GEMM=0) and, without adapters, the per-expert float64 reference. With LoRA on the down
    projection the adapters' rank-8 products stay torch's."""
    device, kernels = kernels
    ran, paddings = [], []
    grouped_mm, padding = triton_gemm._moe_rewrite_grouped_mm, route._moe_rewrite_padding
    patch_runtime(monkeypatch, "_moe_rewrite_triton", lambda device, dtype: kernels)
    patch_runtime(monkeypatch, "_moe_rewrite_hopper", lambda device: True)
    patch_runtime(monkeypatch, "_moe_rewrite_grouped_mm", lambda *a: ran.append(a[-1]) or grouped_mm(*a))
    patch_runtime(monkeypatch, "_moe_rewrite_padding", lambda *a: paddings.append(a) or padding(*a))
    torch.manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden, inter, tokens = (32, 32, 20) if device == "cpu" else (512, 256, 300)
    moe = tiny_moe("fused", experts=6, hidden=hidden, inter=inter)
    moe.experts.act_fn = torch.nn.SiLU()
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    ids, w = routing(tokens, 6, 2)
    probe = torch.randn(tokens, hidden, dtype=torch.float64)
    lora = [torch.randn(6, 8, inter) * 0.1, torch.randn(6, hidden, 8) * 0.1] if adapted else []

    def step(moe, x, w, lora):
        leaves = [x.detach().requires_grad_(True), w.detach().requires_grad_(True), *moe.parameters()]
        leaves += [t.detach().requires_grad_(True) for t in lora]
        source = grouped_linear._MoeRewriteExpertWeight
        adapters = {"down_proj": ((source(leaves[-2]), source(leaves[-1]), 0.5, torch.nn.Identity()),)} if lora else {}
        mlp = moe.moe_rewrite_expert_weights()
        gate_up_w, down_w, act_fn = mlp.gate_up, mlp.down, mlp.act_fn
        weights = grouped_linear._MoeRewriteExpertMLP(gate_up_w, down_w, act_fn, adapters)
        y = moe_train._moe_rewrite_grouped_experts(
            leaves[0], ids.to(x.device), leaves[1], weights, 6, "torch", x.dtype, None
        )
        grads = torch.autograd.grad((y.double() * probe.to(y.device)).sum(), leaves)
        return [t.detach().cpu().double() for t in (y, *grads)]

    args = (x.to(device, dtype), w.to(device, torch.float32), [t.to(device, dtype) for t in lora])
    got = step(moe.to(device, dtype), *args)
    assert sorted(ran) == ["dgrad", "dgrad", "fwd", "fwd"] and not paddings  # (no padding asked for)
    monkeypatch.setitem(dispatch._moe_rewrite_settings_cache, "MOE_REWRITE_TRITON_GEMM", "0")
    ran.clear()
    want = step(moe, *args)
    assert not ran
    names = ["output", "x", "routing weights", "gate_up_proj", "down_proj", "lora A", "lora B"]
    for name, a, b in zip(names[: len(got)], got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5 if device == "cpu" else 1e-2), name
    if not adapted:  # and the per-expert reference
        moe = moe.double().cpu()
        leaves = [x.detach().requires_grad_(True), w.detach().requires_grad_(True), *moe.parameters()]
        y = reference(moe.experts, leaves[0], ids, leaves[1])
        ref = [y.detach(), *torch.autograd.grad((y * probe).sum(), leaves)]
        for name, a, b in zip(names, got, ref):
            assert (a - b).norm() <= (1e-5 if device == "cpu" else 1e-2) * b.norm(), name


def test_the_first_gemm_keeps_only_the_positions_of_the_route_with_the_kernels(monkeypatch, kernels):
    """With the Triton kernels the first GEMM's node keeps x, the offsets and the route's positions for backward,
    not its order and tokens (two more index tensors at the step's peak); without them, the whole route."""
    device, kernels = kernels
    moe = tiny_moe("fused", hidden=24, inter=20).to(device, torch.float32)
    moe.experts.act_fn = torch.nn.SiLU()
    x = torch.randn(7, 24, device=device, requires_grad=True)
    ids, w = routing(7, 6, 2)
    for triton in (kernels, None):
        patch_runtime(monkeypatch, "_moe_rewrite_triton", lambda device, dtype, triton=triton: triton)
        y = moe.moe_train(x, ids.to(device), w.to(device, torch.float32))
        node = y.grad_fn
        while type(node).__name__ != "_MoeRewriteGroupedLinearBackward":
            node = next(f for f, _ in node.next_functions if f is not None and type(f).__name__ != "AccumulateGrad")
        index_tensors = [t for t in node.saved_tensors if t is not None and t.dtype == torch.int64]
        assert len(index_tensors) == (1 if triton else 2), triton  # positions; order and tokens (no positions)
        y.sum().backward()


@pytest.mark.parametrize("tokens", [1, 11])
def test_moe_train_with_the_triton_kernels_equals_the_reference(monkeypatch, kernels, tokens):
    """The core in float32 with the kernels on against the per-expert float64 reference."""
    device, kernels = kernels
    ran = []
    patch_runtime(monkeypatch, "_moe_rewrite_triton", lambda device, dtype: ran.append(device) or kernels)
    moe = tiny_moe("fused", hidden=24, inter=20)
    moe.experts.act_fn = torch.nn.SiLU()
    x = torch.randn(tokens, 24, dtype=torch.float64)
    ids, w = routing(tokens, 6, 2)
    probe = torch.randn(tokens, 24, dtype=torch.float64)

    def step(moe, x, w, run):
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        for p in moe.parameters():
            p.grad = None
        y = run(moe, x, w)
        (y.double() * probe.to(y.device)).sum().backward()
        grads = (x.grad, w.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad)
        return [t.detach().cpu().double() for t in (y, *grads)]

    want = step(moe, x, w, lambda moe, x, w: reference(moe.experts, x, ids, w))
    moe = moe.to(device, torch.float32)
    got = step(
        moe,
        x.to(device, torch.float32),
        w.to(device, torch.float32),
        lambda m, x, w: m.moe_train(x, ids.to(x.device), w),
    )
    assert ran  # the gather and the expert output node asked for the kernels
    for name, a, b in zip(["output", "x", "routing weights", "gate_up_proj", "down_proj"], got, want):
        assert torch.allclose(a, b, atol=1e-5), name
    for grad in got[3:]:  # experts 4 and 5 got no rows
        assert torch.count_nonzero(grad[4:]) == 0


def test_out_dtype_is_written_straight_from_the_float32_sums(monkeypatch, kernels):
    """moe_train(..., out_dtype=bf16), as the V3 form's training branch calls it: the un-sort and weighted sum write
    bf16 from their float32 sums (one rounding, where the promoted result cast afterwards rounds once too), and every
    gradient equals that of the promoted result cast to bf16."""
    device, kernels = kernels
    patch_runtime(monkeypatch, "_moe_rewrite_triton", lambda device, dtype: kernels)
    # bf16 on a GPU runs torch._grouped_mm, whose rows need 16-byte strides: 32 and 24 columns
    moe = tiny_moe("fused", hidden=32, inter=24).to(device, torch.bfloat16)
    moe.experts.act_fn = torch.nn.SiLU()
    x = torch.randn(11, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    ids, w = routing(11, 6, 2)
    ids, w = ids.to(device), w.to(device, torch.float32).requires_grad_(True)
    leaves = [x, w, *moe.parameters()]
    probe = torch.randn(11, 32, device=device)
    cast = moe.moe_train(x, ids, w).to(torch.bfloat16)
    direct = moe.moe_train(x, ids, w, out_dtype=torch.bfloat16)
    assert direct.dtype == torch.bfloat16
    want = torch.autograd.grad((cast.float() * probe).sum(), leaves)
    got = torch.autograd.grad((direct.float() * probe).sum(), leaves)
    if device == "cuda":
        assert torch.equal(direct, cast)
    else:  # the interpreter rounds float32 to bf16 toward zero (compiled kernels to nearest): within one bf16 step
        assert torch.allclose(direct.float(), cast.float(), rtol=2**-7, atol=0)
    for a, b in zip(got, want):  # the same bf16 output gradient reaches the node either way
        assert torch.equal(a, b)


def test_the_kernels_run_on_cuda_below_float64_unless_turned_off(monkeypatch):
    """The choice, decided once per process: CUDA rows in bf16, fp16 or fp32 get the kernels; float64 rows (the
    kernels compute in float32), other devices and MOE_REWRITE_TRITON=0 get None (torch ops). Nothing runs on a GPU
    here."""

    def rows(device, dtype):  # the rows' device and dtype
        return torch.device(device), dtype

    runtime_env(monkeypatch, "MOE_REWRITE_TRITON", None)
    kernels = dispatch._moe_rewrite_triton(*rows("cuda", torch.bfloat16))
    assert sorted(kernels) == [
        "gather_rows",
        "grouped_mm",
        "quantize_rows",
        "route",
        "sum_rows",
        "sum_rows_backward",
        "swiglu",
        "swiglu_backward",
    ]
    assert dispatch._moe_rewrite_triton(*rows("cuda", torch.float32)) is kernels  # built once
    assert dispatch._moe_rewrite_triton(*rows("cuda", torch.float64)) is None
    assert dispatch._moe_rewrite_triton(*rows("cpu", torch.bfloat16)) is None
    runtime_env(monkeypatch, "MOE_REWRITE_TRITON", "0")
    assert dispatch._moe_rewrite_triton(*rows("cuda", torch.bfloat16)) is None


@pytest.mark.parametrize("weights_grad", [True, False], ids=["router-trained", "router-frozen"])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["promoted", "bf16-out"])
def test_adapters_on_the_down_projection_get_the_swiglu_kernels_too(monkeypatch, kernels, out_dtype, weights_grad):
    """With LoRA on the down projection the core composes SwiGLU, the down GEMMs and the combine: the SwiGLU kernels
    and the weighted un-sort (autograd Functions of their own) against the same path as torch ops, outputs and every
    gradient, adapters' and routing weights' included."""
    device, kernels = kernels
    moe = tiny_moe("fused", hidden=24, inter=20).to(device, torch.float32)
    moe.experts.act_fn = torch.nn.SiLU()
    mlp = moe.moe_rewrite_expert_weights()
    gate_up_w, down_w, act = mlp.gate_up, mlp.down, mlp.act_fn
    lora_a = torch.randn(6, 4, 20, device=device, requires_grad=True)  # (E, rank, inter)
    lora_b = torch.randn(6, 24, 4, device=device, requires_grad=True)  # (E, hidden, rank)
    source = grouped_linear._MoeRewriteExpertWeight
    adapters = {"down_proj": ((source(lora_a), source(lora_b), 0.5, torch.nn.Identity()),)}
    x = torch.randn(11, 24, device=device)
    ids, w = routing(11, 6, 2)
    ids, w = ids.to(device), w.to(device, torch.float32)
    w.requires_grad_(weights_grad)  # a frozen router (LoRA): the combine keeps no rows for the weights' gradient
    leaves = [x.requires_grad_(True), *([w] if weights_grad else []), *moe.parameters(), lora_a, lora_b]
    probe = torch.randn(11, 24, device=device)

    def run(with_kernels):
        ran, saved = [], []
        swiglu, combine = expert_output._MoeRewriteSwiGLU.apply, expert_output._MoeRewriteCombine.apply
        patch_runtime(monkeypatch, "_moe_rewrite_triton", lambda device, dtype: kernels if with_kernels else None)
        monkeypatch.setattr(expert_output._MoeRewriteSwiGLU, "apply", lambda *a: ran.append("swiglu") or swiglu(*a))
        monkeypatch.setattr(expert_output._MoeRewriteCombine, "apply", lambda *a: ran.append("combine") or combine(*a))
        weights = grouped_linear._MoeRewriteExpertMLP(gate_up_w, down_w, act, adapters)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            y = moe_train._moe_rewrite_grouped_experts(x, ids, w, weights, 6, "sorted", torch.float32, out_dtype)
        grads = torch.autograd.grad((y.float() * probe).sum(), leaves)
        return ran, saved.count((22, 24)), [y, *grads]  # (22, 24): the 11 tokens' 2 expert outputs

    ran, kept_rows, got = run(True)
    ran_without, _, want = run(False)
    assert ran == ["swiglu", "combine"] and not ran_without
    assert kept_rows == (1 if weights_grad else 0)
    assert got[0].dtype == want[0].dtype == (out_dtype or torch.float32)
    # bf16 out: the kernel rounds the float32 sum once, as the cast does (toward zero in the CPU's interpreter)
    assert torch.allclose(got[0].float(), want[0].float(), atol=1e-4, rtol=1e-4 if out_dtype is None else 2**-7)
    for a, b in zip(got[1:], want[1:]):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_the_route_is_padded_only_where_the_gemm_would_take_its_small_tile():
    """torch._grouped_mm takes its small tile at rows // experts <= 128: padding lifts that to 129, only where it adds
    at most an eighth of the rows."""
    for rows, padded in [
        (8 * 128, 8 * 129),
        (8 * 115, 8 * 129),
        (8 * 129 - 1, 8 * 129),
        (8 * 114, 8 * 114),
        (8 * 129, 8 * 129),
        (256 * 128, 256 * 129),  # V3 at 4096 tokens
    ]:
        assert rows + route._moe_rewrite_padding(rows, rows // 128 if rows == 256 * 128 else 8) == padded


@pytest.mark.slow
@pytest.mark.parametrize(
    "adapted,rank,x_kernels,act",
    [
        ((), 0, True, "silu"),
        ((), 0, False, "silu"),
        ((), 0, True, "gelu"),
        (("down_proj",), 8, True, "silu"),
        (("gate_up_proj", "down_proj"), 8, True, "silu"),
        (("gate_up_proj", "down_proj"), 5, True, "silu"),
    ],
)
def test_padding_rows_change_no_number(monkeypatch, kernels, adapted, rank, x_kernels, act):
    """The padded route (as on an H100 / H200 at V3's 128 rows per expert) gives bit for bit the output and every
    gradient of the unpadded one: without adapters, x's gradient summed by the kernels or, where x's dtype has none,
    by torch, and with an activation the kernels do not run (torch ops in the output node); with LoRA on the down
    projection (the composed path and its combine node) and on both, of a rank whose rows suit torch._grouped_mm (8)
    or not (5: the adapters' GEMMs run the sorted per-expert pass)."""
    device, kernels = kernels
    if device == "cpu":  # one block per row and one route pass (the fixture's small blocks cost minutes here)
        patch_runtime(monkeypatch, "MOE_REWRITE_TRITON_BLOCK", 64)
        patch_runtime(monkeypatch, "MOE_REWRITE_ROUTE_BLOCK", 1024)
    calls = []  # per step the core asks for the rows' kernels, then for x's (the second call), then the output node

    def triton(device, dtype):
        calls.append(dtype)
        return None if len(calls) == 2 and not x_kernels else kernels

    patch_runtime(monkeypatch, "_moe_rewrite_triton", triton)
    # torch._grouped_mm (bf16 on a GPU, 16-byte aligned rows; float32 on the CPU, where torch has one too), whose
    # outputs past the last group are left unwritten: NaN here, so that a padding row read anywhere shows
    patch_runtime(monkeypatch, "_moe_rewrite_hopper", lambda device: True)
    # torch's GEMMs, whose tile the padding is for (the Triton grouped GEMM's would take these products)
    monkeypatch.setitem(dispatch._moe_rewrite_settings_cache, "MOE_REWRITE_TRITON_GEMM", "0")
    gmm = grouped_mm._moe_rewrite_gmm

    def unwritten_padding(kernel, a, b, offsets, mode, scale=None):
        out = gmm(kernel, a, b, offsets, mode, scale)
        if mode == "wgrad":
            wgrad_rows.append(b.shape[0])
        if mode != "wgrad":
            out[offsets[-1] :] = float("nan")
        return out

    patch_runtime(monkeypatch, "_moe_rewrite_gmm", unwritten_padding)
    # the kernels read a routing weight for every row they are given (padding rows included): no read past the end
    swiglu_backward, sum_rows_backward = (
        triton_swiglu._moe_rewrite_swiglu_backward,
        triton_sum_rows._moe_rewrite_sum_rows_backward,
    )

    def checked_swiglu_backward(kernels, gate_up, grad_h, row_weight, weighted):
        assert row_weight.shape == gate_up.shape[:1] == grad_h.shape[:1]
        return swiglu_backward(kernels, gate_up, grad_h, row_weight, weighted)

    def checked_sum_rows_backward(kernels, grad, rows, tokens, row_weight, dtype):
        assert row_weight.shape == tokens.shape and (rows is None or rows.shape[:1] == tokens.shape)
        return sum_rows_backward(kernels, grad, rows, tokens, row_weight, dtype)

    patch_runtime(monkeypatch, "_moe_rewrite_swiglu_backward", checked_swiglu_backward)
    patch_runtime(monkeypatch, "_moe_rewrite_sum_rows_backward", checked_sum_rows_backward)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    moe = tiny_moe("fused", experts=4, hidden=32, inter=24).to(device, dtype)
    moe.experts.act_fn = torch.nn.SiLU() if act == "silu" else torch.nn.GELU()
    mlp = moe.moe_rewrite_expert_weights()
    gate_up_w, down_w, act_fn = mlp.gate_up, mlp.down, mlp.act_fn
    source, lora = grouped_linear._MoeRewriteExpertWeight, []
    shapes = {"gate_up_proj": (32, 48), "down_proj": (24, 32)}  # (in, out)
    adapters = {}
    for name in adapted:
        a = torch.randn(4, rank, shapes[name][0], device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(4, shapes[name][1], rank, device=device, dtype=dtype, requires_grad=True)
        adapters[name] = ((source(a), source(b), 0.5, torch.nn.Identity()),)
        lora += [a, b]
    tokens = 232  # 464 rows over 4 experts (the first two: see routing): 116 each on average, padded to 516
    ids, w = routing(tokens, 4, 2)
    x = torch.randn(tokens, 32, device=device, dtype=dtype)
    probe = torch.randn(tokens, 32, device=device)
    ids, w = ids.to(device), w.to(device, torch.float32)
    padded, wgrad_rows = [], []
    padding = route._moe_rewrite_padding

    def step(pad):
        def padding_of(rows, experts):
            out = padding(rows, experts) if pad else 0
            padded.append(rows + out)
            return out

        patch_runtime(monkeypatch, "_moe_rewrite_padding", padding_of)
        calls.clear()
        wgrad_rows.clear()
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True), *moe.parameters(), *lora]
        weights = grouped_linear._MoeRewriteExpertMLP(gate_up_w, down_w, act_fn, adapters)
        y = moe_train._moe_rewrite_grouped_experts(leaves[0], ids, leaves[1], weights, 4, "torch", dtype, None)
        return [y.detach(), *torch.autograd.grad((y.float() * probe).sum(), leaves)]

    got = step(True)
    if not adapted:  # the down projection's weight gradient reads the padded rows, gate_up's x's rows without them
        assert wgrad_rows == [516, 464]
    want = step(False)
    assert padded == [516, 464]
    if not adapted and x_kernels and act == "silu":
        with torch.autograd.set_detect_anomaly(True):  # which checks every gradient row for NaN: no padding then
            step(True)
        assert padded[-1] == 464
    names = ["output", "x", "routing weights", "gate_up_proj", "down_proj", *(f"lora {i}" for i in range(len(lora)))]
    for name, a, b in zip(names[: len(got)], got, want, strict=True):
        if device == "cpu":
            assert torch.equal(a, b), name
        else:  # the GPU's two tiles may accumulate in another order
            assert a.isfinite().all() and (a.float() - b.float()).norm() < 1e-2 * b.float().norm(), name


def test_cross_entropy_rows_equal_the_torch_rows(kernels):
    """The fused loss's row kernel against its torch arithmetic (lm_loss.py), float32: the loss rows, and the gradient
    written over the logits; ignored rows (-100) give 0 and a zero gradient; a row's target in its last column block.
    On the CPU 16-column blocks over 40 columns (a ragged last block); on a GPU Moonlight's vocabulary."""
    device, _ = kernels
    kernels = triton_cross_entropy._moe_rewrite_cross_entropy_kernels()
    rows, vocab = (6, 40) if device == "cpu" else (64, 163840)
    logits = torch.randn(rows, vocab, device=device) * 4
    target = torch.randint(0, vocab, (rows,), device=device)
    target[1], target[4], target[2] = -100, -100, vocab - 1
    scale = torch.tensor([1 / 4], device=device)
    want = logits.clone()
    want_rows = lm_loss._moe_rewrite_cross_entropy_torch(want, target, scale)
    got_rows = triton_cross_entropy._moe_rewrite_cross_entropy_rows(kernels, logits, target, scale)
    assert torch.allclose(got_rows, want_rows, rtol=1e-5, atol=1e-5)
    assert got_rows[1] == 0 and got_rows[4] == 0
    assert torch.allclose(logits, want, rtol=1e-5, atol=1e-7)
    assert not logits[1].any() and not logits[4].any()


def published_rmsnorm(x, weight, eps):
    """The published RMSNorm's forward, written out."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


@pytest.mark.parametrize("width", [64, 100])
def test_rmsnorm_and_its_backward_equal_float64(width):
    """The fused RMSNorm (fp32 rows and weight) against the published formula in float64: output and the gradients
    of x and the weight, for more rows than the backward's programs (each sums several rows of the weight's gradient),
    rows with a stride of their own (a slice of wider rows), a width not a power of two; and without the weight's
    gradient (a frozen norm)."""
    rows = 37 if DEVICE == "cpu" else 3000
    wide = torch.randn(rows, width + 7, device=DEVICE)
    x = wide[:, :width]  # row stride width + 7
    weight = torch.rand(width, device=DEVICE) + 0.5
    grad = torch.randn(rows, width, device=DEVICE)
    exact = [x.double().requires_grad_(True), weight.double().requires_grad_(True)]
    want = published_rmsnorm(*exact, 1e-6)
    want_grads = torch.autograd.grad(want, exact, grad.double())
    assert triton_rmsnorm._moe_rewrite_rmsnorm_programs(x.device, rows) < rows
    for weight_grad in (True, False):
        leaves = [x.clone().requires_grad_(True), weight.clone().requires_grad_(weight_grad)]
        got = triton_rmsnorm._moe_rewrite_rmsnorm(leaves[0], leaves[1], 1e-6)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
        got.backward(grad)
        assert torch.allclose(leaves[0].grad.double(), want_grads[0], rtol=1e-5, atol=1e-5)
        if weight_grad:
            assert torch.allclose(leaves[1].grad.double(), want_grads[1], rtol=1e-5, atol=1e-4)
        else:
            assert leaves[1].grad is None


def published_rope(q, k, cos, sin, position_ids, interleaved=True):
    """The published apply_rotary_pos_emb (unsqueeze_dim 1) with its rotate_half, written out; without the
    de-interleave for `interleaved=False`."""

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
    if interleaved:
        q = q.view(*q.shape[:3], -1, 2).transpose(4, 3).reshape(q.shape)
        k = k.view(*k.shape[:3], -1, 2).transpose(4, 3).reshape(k.shape)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("dim,interleaved", [(8, True), (64, True), (8, False)])
def test_rope_and_its_backward_equal_float64(dim, interleaved):
    """The fused RoPE (fp32) against the published function in float64, outputs and the gradients of q and k: q with
    3 heads in MLA's strides (a slice of wider rows, heads and positions swapped), k with one head; position_ids of
    batch 1 (broadcast) and per batch row (offsets, a negative index counting from the table's end); more positions
    than one program takes; a table whose two halves differ."""
    batch, seq, rows = 2, triton_rope.MOE_REWRITE_ROPE_POSITIONS + 3, 40
    q = torch.randn(batch, seq, 3, dim + 6, device=DEVICE)[..., :dim].transpose(1, 2)
    k = torch.randn(batch, 1, seq, dim, device=DEVICE)
    cos, sin = torch.randn(rows, dim, device=DEVICE), torch.randn(rows, dim, device=DEVICE)
    grads = torch.randn(batch, 3, seq, dim, device=DEVICE), torch.randn(batch, 1, seq, dim, device=DEVICE)
    offsets = torch.arange(seq, device=DEVICE) + torch.tensor([[2], [20]], device=DEVICE)
    offsets[1, -1] = -1
    for position_ids in (torch.arange(seq, device=DEVICE).unsqueeze(0), offsets):
        exact = [q.double().requires_grad_(True), k.double().requires_grad_(True)]
        want = published_rope(*exact, cos.double(), sin.double(), position_ids, interleaved)
        want_grads = torch.autograd.grad(want, exact, [g.double() for g in grads])
        leaves = [q.clone().requires_grad_(True), k.clone().requires_grad_(True)]
        got = triton_rope._moe_rewrite_rope(*leaves, cos, sin, position_ids, interleaved)
        torch.autograd.backward(got, grads)
        for a, b in zip([*got, *(leaf.grad for leaf in leaves)], [*want, *want_grads]):
            assert a.dtype == torch.float32 and a.shape == b.shape
            assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["vocab", "minus-one"])
def test_the_fused_loss_refuses_a_label_out_of_the_vocabulary_before_the_kernel(monkeypatch, kernels, bad):
    """A label equal to the vocabulary size, or negative other than -100, would make the row kernel read another row's
    logit (garbage, no error): the fused loss raises the published error first. On the CPU the published IndexError
    ("Target N is out of bounds."); on a GPU (compiled) the check is a device-side assert, tested in a subprocess in
    tests/test_cuda_kernels.py. Valid labels, -100 among them, still run the kernel."""
    device, _ = kernels
    if device != "cpu":
        pytest.skip("the CUDA error is a device-side assert: tests/test_cuda_kernels.py")
    launched = []
    triton_kernels = triton_cross_entropy._moe_rewrite_cross_entropy_kernels()
    monkeypatch.setattr(lm_loss, "_moe_rewrite_cross_entropy_kernel", lambda *a: launched.append(1) or triton_kernels)
    vocab = 40
    hidden, weight = torch.randn(2, 5, 16), torch.randn(vocab, 16)
    labels = torch.randint(0, vocab, (2, 5))
    labels[0, 1] = -100
    loss, _ = lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    logits = (hidden @ weight.t())[:, :-1].reshape(-1, vocab)
    assert launched and torch.allclose(loss, torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1)))
    labels[0, 2] = vocab if bad == "vocab" else -1
    launched.clear()
    with pytest.raises(IndexError, match=f"^Target {labels[0, 2].item()} is out of bounds.$"):
        lm_loss._moe_rewrite_lm_loss(hidden, weight, labels)
    assert not launched


def test_the_fused_rope_refuses_a_position_outside_its_table(kernels):
    """Position ids at or past the table's length (or before -length) would read zeros in the kernel; the published
    `cos[position_ids]` raises. The fused RoPE raises the published IndexError before the launch (on a GPU a
    device-side assert: tests/test_cuda_kernels.py); ids counting from the table's end (-1, -rows) still rotate.
    The check runs once per position_ids tensor (every layer passes the same), again once it is changed in place."""
    device, _ = kernels
    if device != "cpu":
        pytest.skip("the CUDA error is a device-side assert: tests/test_cuda_kernels.py")
    rows, seq, dim = 12, 5, 8
    q, k = torch.randn(2, 3, seq, dim), torch.randn(2, 1, seq, dim)
    cos, sin = torch.randn(rows, dim), torch.randn(rows, dim)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [-rows, -1, 9, 10, 11]])
    got = triton_rope._moe_rewrite_rope(q, k, cos, sin, position_ids)
    for a, b in zip(got, published_rope(q, k, cos, sin, position_ids)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    for bad in (rows, rows + 30, -rows - 1):
        ids = position_ids.clone()
        ids[1, 3] = bad
        with pytest.raises(IndexError) as published_error:
            published_rope(q, k, cos, sin, ids)
        with pytest.raises(IndexError) as error:
            triton_rope._moe_rewrite_rope(q, k, cos, sin, ids)
        assert str(error.value) == str(published_error.value)
        assert str(error.value) == f"index {bad} is out of bounds for dimension 0 with size {rows}"
    triton_rope._moe_rewrite_rope(q, k, cos, sin, position_ids)  # checked, and kept as checked
    position_ids[0, 0] = rows  # in place: checked again
    with pytest.raises(IndexError, match=f"index {rows} is out of bounds"):
        triton_rope._moe_rewrite_rope(q, k, cos, sin, position_ids)
