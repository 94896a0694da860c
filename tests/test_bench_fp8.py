"""bench/bench_fp8.py's parts that run without a GPU (issue #49's owed rows): the K-major input gradient its
fp8-kmajor and transpose rows put in place of the generated code's, against a float64 reference of FP8 compute's
arithmetic, and the parent process that runs each config in a child and merges their records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import ROOT  # noqa: E402
from fp8 import dequantize_blockwise, quantize_blockwise, quantize_rows  # noqa: E402
from helpers import native_row, rewritten_v3  # noqa: E402

from moe_rewrite.runtime.moe import grouped_mm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_fp8  # noqa: E402

COUNTS = [5, 0, 7]  # rows per expert, one expert without rows
OUT, IN = 256, 384  # 2 x 3 scale blocks: a transposition of the wrong axes would not fit


def _fp8_weights():
    torch.manual_seed(0)
    weight = torch.randn(len(COUNTS), OUT, IN) * torch.logspace(-2, 1, len(COUNTS)).view(-1, 1, 1)
    return quantize_blockwise(weight)


def _output_grad():
    torch.manual_seed(1)
    scale = torch.logspace(-3, 2, sum(COUNTS)).unsqueeze(1)  # rows far apart in size: each its own row scales
    return (torch.randn(sum(COUNTS), OUT) * scale).to(torch.bfloat16)


def _offsets():
    return torch.tensor(COUNTS).cumsum(0).to(torch.int32)


def _reference_dgrad(grad, codes, scales):
    """FP8 compute's input gradient in float64: the output gradient's rows quantized per 1 x 128 tile along `out`
    (tests/fp8.py's float64 reference), times each expert's dequantized weight (rows, out) @ (out, in)."""
    row_codes, row_scales = quantize_rows(grad)
    rows = (row_codes.double().view(-1, OUT // 128, 128) * row_scales.double().unsqueeze(-1)).view(-1, OUT)
    weights = dequantize_blockwise(codes, scales, torch.float64)
    parts = rows.split(COUNTS)
    return torch.cat([part @ weight for part, weight in zip(parts, weights)])


@pytest.mark.parametrize("cached", [True, False], ids=["kmajor", "transpose"])
def test_the_kmajor_input_gradient_is_fp8_computes_input_gradient(cached):
    """In place of the runtime's _moe_rewrite_gmm, the input gradient of FP8 experts runs as the forward W8A8 product
    on the transposed codes and scales: within bf16's rounding of the float64 reference, equal to the runtime's own
    W8A8 input gradient (the same real numbers, other sums), the copy kept only where cached, and the module's
    function given back on exit."""
    codes, scales = _fp8_weights()
    grad, offsets = _output_grad(), _offsets()
    original = grouped_mm._moe_rewrite_gmm
    with bench_fp8.KMajorDgrad(grouped_mm, cached=cached) as dgrad:
        assert grouped_mm._moe_rewrite_gmm is dgrad
        got = grouped_mm._moe_rewrite_gmm("torch", grad, codes, offsets, "dgrad", scales)
        kept = dgrad.gb() * 2**30
    assert grouped_mm._moe_rewrite_gmm is original and not dgrad.copies
    assert kept == (codes.numel() + scales.numel() * 4 if cached else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (sum(COUNTS), IN)
    want = _reference_dgrad(grad, codes, scales)
    error = (got.double() - want).abs()
    row_size = want.abs().amax(1, keepdim=True)
    assert (error <= want.abs() * 2.0**-8 + row_size * 1e-6).all()  # bf16's half step; float32 sums
    runtime = grouped_mm._moe_rewrite_fp8_gmm(None, grad, codes, offsets, "dgrad", scales)
    torch.testing.assert_close(got, runtime, rtol=2.0**-7, atol=0)
    # W8A16 (the runtime's default input gradient) is another arithmetic: the rows are not quantized there
    w8a16 = grouped_mm._moe_rewrite_gmm(
        "sorted", grad, dequantize_blockwise(codes, scales, grad.dtype), offsets, "dgrad"
    )
    assert not torch.allclose(got.float(), w8a16.float(), rtol=2.0**-6, atol=0)


def test_other_products_run_as_the_runtime_runs_them():
    """The forward and weight-gradient products, and products of bf16 weights, go to the runtime's function."""
    codes, scales = _fp8_weights()
    torch.manual_seed(2)
    rows, offsets = torch.randn(sum(COUNTS), IN).to(torch.bfloat16), _offsets()
    bf16 = dequantize_blockwise(codes, scales, torch.bfloat16)
    grad = _output_grad()
    with bench_fp8.KMajorDgrad(grouped_mm, cached=True) as dgrad:
        calls = [
            ("sorted", rows, codes, offsets, "fwd", scales),
            ("sorted", grad, bf16, offsets, "dgrad", None),
            ("sorted", grad, rows, offsets, "wgrad", None),
        ]
        got = [grouped_mm._moe_rewrite_gmm(*call) for call in calls]
        assert not dgrad.copies
    for call, result in zip(calls, got):
        assert torch.equal(result, grouped_mm._moe_rewrite_gmm(*call))


def _child_record(label, rows, device="NVIDIA H100 80GB HBM3"):
    return dict(device=device, torch="2.11", command=f"child {label}", notes=[f"{label} note"], rows=rows)


def test_each_config_runs_in_a_child_and_the_parent_merges_their_records(tmp_path, monkeypatch, capsys):
    """One child process per config with the user's options and its own --configs and --label; the parent's record
    holds every child's rows and notes, the children's device and versions, a note where a child died (its rows
    written before kept), and the table gives each row's speed over the bf16 row's and the K-major copy's memory."""
    v3 = [
        dict(config="v3", tokens=4096, impl="moe-rewrite-lora[bf16]", ms=26.0, peak_gb=2.2, expert_gb=21.0),
        dict(
            config="v3",
            tokens=4096,
            impl="moe-rewrite-lora[fp8,compute,kmajor]",
            ms=20.0,
            peak_gb=2.2,
            expert_gb=21.0,
            expert_vs_bf16=1.0,
            kmajor_gb=10.5,
            kmajor_make_ms=9.5,
        ),
    ]
    k2 = [dict(config="k2", tokens=4096, impl="moe-rewrite-lora[bf16]", ms=None, note="OutOfMemoryError: ...")]
    commands = []

    def child(command):
        commands.append(command)
        label = command[-1]
        name = label.rsplit(".", 1)[1]
        (tmp_path / f"{label}.json").write_text(json.dumps(_child_record(label, v3 if name == "v3" else k2)))
        return type("Done", (), {"returncode": 0 if name == "v3" else -9})()

    monkeypatch.setattr(bench_fp8.subprocess, "run", child)
    argv = ["--configs", "v3,k2", "--rows", "bf16,fp8-kmajor", "--reps", "5", "--label", "lab", "--out", str(tmp_path)]
    bench_fp8.main(argv)
    for command, name in zip(commands, ["v3", "k2"], strict=True):
        assert command[2:] == [*argv, "--child", "--configs", name, "--label", f"lab.{name}"]
    record = json.loads((tmp_path / "lab.json").read_text())
    assert record["rows"] == v3 + k2
    assert record["notes"] == ["lab.v3 note", "lab.k2 note", "k2: the child process exited with -9, after 1 rows"]
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["command"] != "child lab.k2"
    table = capsys.readouterr().out
    kmajor_line = next(line for line in table.splitlines() if "kmajor]" in line)
    assert "1.30x" in kmajor_line and "expert_vs_bf16 1.0" in kmajor_line and "kmajor_make_ms 9.5" in kmajor_line
    assert "(OutOfMemoryError: ...)" in table


def test_unknown_rows_and_configs_are_refused(tmp_path):
    for argv in (["--rows", "bf16,kmajor"], ["--configs", "v4"]):
        with pytest.raises(SystemExit) as stop:
            bench_fp8.main([*argv, "--out", str(tmp_path)])
        assert stop.value.code == 2


def _native_e2e():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "e2e"))
    import native

    return native


def test_the_e2e_fp8_checkpoint_holds_deepseeks_codes_and_scales():
    """bench/e2e/native.py --fp8's checkpoint tensors: every nn.Linear but lm_head as float8_e4m3fn codes and float32
    block scales, transformers 5.x's fused expert tensors expert by expert under the per-expert names, each within
    e4m3's rounding of the weight it stands for; lm_head, the router and e_score_correction_bias (float32) as they
    were."""
    native = _native_e2e()
    experts, inter, hidden = 3, 128, 256
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(hidden, 64, bias=False)
    model.q_proj = torch.nn.Linear(hidden, 200, bias=False)  # a partial block
    model.mlp = torch.nn.Module()
    model.mlp.gate = torch.nn.Module()
    model.mlp.gate.weight = torch.nn.Parameter(torch.randn(experts, hidden))
    model.mlp.gate.register_buffer("e_score_correction_bias", torch.randn(experts).bfloat16())
    model.mlp.experts = torch.nn.Module()
    model.mlp.experts.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden))
    model.mlp.experts.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inter))
    model = model.bfloat16()
    tensors = native.fp8_tensors(model)
    state = model.state_dict()
    projections = {"gate_proj": (0, slice(0, inter)), "up_proj": (0, slice(inter, None)), "down_proj": (1, slice(None))}
    wanted = {"q_proj": state["q_proj.weight"]}
    for e in range(experts):
        for name, (which, rows) in projections.items():
            fused = state[("mlp.experts.gate_up_proj", "mlp.experts.down_proj")[which]]
            wanted[f"mlp.experts.{e}.{name}"] = fused[e, rows]
    assert set(tensors) == {"lm_head.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"} | {
        f"{m}.{leaf}" for m in wanted for leaf in ("weight", "weight_scale_inv")
    }
    for module, weight in wanted.items():
        codes, scales = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"]
        assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32 and codes.shape == weight.shape
        back = dequantize_blockwise(codes, scales, torch.float64)
        block_scale = (
            scales.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: weight.shape[0], : weight.shape[1]]
        )
        assert ((back - weight.double()).abs() <= weight.double().abs() / 16 + block_scale * 2.0**-9).all()
    for key in ("lm_head.weight", "mlp.gate.weight"):
        assert tensors[key].dtype == torch.bfloat16 and torch.equal(tensors[key], state[key])
    bias = tensors["mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, state["mlp.gate.e_score_correction_bias"].float())


@pytest.mark.slow
def test_the_e2e_fp8_rows_run_on_the_cpu_at_tiny_sizes(tmp_path):
    """bench/e2e/native.py --fp8 w8a16 and compute on the V3 fixture rewritten with --fp8-compute, tiny sizes on the
    CPU: the routed experts load FP8 (their codes and scales are the row's experts_gb), both modes train with LoRA
    from the same first loss within FP8 compute's rounding, and the report compares them where it can."""
    import subprocess

    code = rewritten_v3(tmp_path / "fp8-code", "--fp8-compute")
    rows = {}
    for mode in ("w8a16", "compute"):
        args = f"--impl fp8-{mode} --ckpt {code} --fp8 {mode} --fp8-dir {tmp_path / 'weights'} --mode lora --tiny"
        args += " --batch 1 --seq 64 --steps 2 --warmup 1"
        rows[mode] = native_row(args, tmp_path / f"native_fp8-{mode}_lora_1x64.json")
    assert {mode: row["fp8"] for mode, row in rows.items()} == {"w8a16": "w8a16", "compute": "compute"}
    # one MoE layer: 8 experts' gate_up (256 x 256) and down (256 x 128) codes, 2 x 2 and 2 x 1 float32 scales
    assert rows["w8a16"]["experts_gb"] == rows["compute"]["experts_gb"] == float(f"{8 * (98304 + 6 * 4) / 1e9:.4g}")
    first = [row["losses"][0] for row in rows.values()]
    assert first[0] != first[1] and abs(first[0] - first[1]) <= 1e-2 * abs(first[0])
    report = subprocess.run(
        [sys.executable, "bench/e2e/native_report.py", *map(str, tmp_path.glob("native_*.json"))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in report.stdout.splitlines() if line.startswith("fp8-")]
    assert len(lines) == 2 and all(line.rstrip().endswith("-") for line in lines)  # no moe-rewrite row to compare
