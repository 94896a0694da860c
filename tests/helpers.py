"""Helpers shared by the test modules that build MoE layers: references to compare them with, and LoRA steps; and
the rows of bench/e2e/native.py (test modules import these from here, never from each other)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import ROOT, V3_DIR, model_module, run_cli, runtime_env  # noqa: E402

from moe_rewrite.runtime.experts import fusing, parameter_lora, per_expert  # noqa: E402
from moe_rewrite.runtime.moe import moe_train  # noqa: E402

REL = 1e-5


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class SigmoidCopied(torch.overrides.TorchFunctionMode):
    """Kimi's published router adds its bias in place to a view of the sigmoid's output, which autograd keeps for its
    backward: under this mode the output is copied first (the same values), so that the published eval path can run
    backward as the training reference."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.sigmoid, torch.sigmoid):
            result = result.clone()
        return result


def eval_branch_with_grads(model) -> None:
    """The published V3 file's training reference (its MoE refuses training): each MoE layer takes its eval branch,
    with moe_infer recording gradients."""
    import types

    for module in model.modules():
        if hasattr(module, "moe_infer"):
            module.eval()
            # published with @torch.no_grad(), which keeps the function as __wrapped__
            moe_infer = type(module).moe_infer
            module.moe_infer = types.MethodType(getattr(moe_infer, "__wrapped__", moe_infer), module)


def moe_layer(model):
    layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "moe_train")]
    assert layers, "no rewritten MoE layer in the model"
    return layers[0]


def reference_moe(moe, x, topk_ids=None, topk_weight=None):
    """The MoE layer computed token by token, expert by expert, in float64 from a copy of its parameters.

    Returns (output, the float64 copy, x64, aux loss or None) so gradients can be taken on the copy.
    """
    ref = copy.deepcopy(moe).double()
    x64 = x.detach().double().requires_grad_(True)
    flat = x64.reshape(-1, x64.shape[-1])
    aux = None
    if topk_ids is None:
        routed = ref.gate(x64)
        topk_ids, topk_weight = routed[0], routed[1]
        aux = routed[2] if len(routed) == 3 else None
    topk_weight = topk_weight.double()
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros_like(flat[t])
        for j in range(topk_ids.shape[1]):
            e = ref.experts[int(topk_ids[t, j])]
            h = e.act_fn(flat[t] @ e.gate_proj.weight.t()) * (flat[t] @ e.up_proj.weight.t())
            acc = acc + topk_weight[t, j] * (h @ e.down_proj.weight.t())
        rows.append(acc)
    out = torch.stack(rows).view_as(x64)
    if ref.config.n_shared_experts is not None:
        out = out + ref.shared_experts(x64)
    return out, ref, x64, aux


def expert_params(moe):
    named = {"gate.weight": moe.gate.weight}
    for i, e in enumerate(moe.experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            named[f"experts.{i}.{proj}.weight"] = getattr(e, proj).weight
    for proj in ("gate_proj", "up_proj", "down_proj"):
        named[f"shared_experts.{proj}.weight"] = getattr(moe.shared_experts, proj).weight
    return named


def assert_matches_reference(y, x, reference, grads_of) -> None:
    """Output y of the layer for x, then its gradients after backward through a random probe, against
    reference = reference_moe(...); grads_of() maps every name of expert_params() to the layer's gradient."""
    ref_y, ref, x64, aux = reference
    assert rel_err(y, ref_y) < REL
    probe = torch.randn_like(y)
    (y * probe).sum().backward()
    ref_loss = (ref_y * probe.double()).sum()
    if aux is not None:  # V2: AddAuxiliaryLoss feeds a gradient of 1 to the aux loss
        ref_loss = ref_loss + aux
    ref_loss.backward()
    assert rel_err(x.grad, x64.grad) < REL
    grads = grads_of()
    for name, r in expert_params(ref).items():
        assert not torch.isnan(grads[name]).any(), name
        if r.grad is None:  # an expert with no tokens: zero gradient, like the loop's
            assert torch.count_nonzero(grads[name]) == 0, name
        else:
            assert rel_err(grads[name], r.grad) < REL, name


def fused_grads(moe) -> dict:
    """Fused experts' gradients under the per-expert names of expert_params()."""
    experts = moe.experts
    inter = experts.down_proj.shape[2]
    grads = {}
    for i in range(len(experts)):
        grads[f"experts.{i}.gate_proj.weight"] = experts.gate_up_proj.grad[i, :inter]
        grads[f"experts.{i}.up_proj.weight"] = experts.gate_up_proj.grad[i, inter:]
        grads[f"experts.{i}.down_proj.weight"] = experts.down_proj.grad[i]
    return grads


ACT = torch.nn.functional.silu


class Expert(torch.nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.act_fn = ACT

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def tiny_moe(layout, experts=6, hidden=8, inter=5):
    """A MoE layer made of the runtime's own MoE-class methods: moe_train (the core) and the seam of `layout`."""
    seam = per_expert.MoE if layout == "per_expert" else fusing.MoE

    class TinyMoE(moe_train.MoE, parameter_lora.MoE, seam, torch.nn.Module):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.ep_size = 1
            self.experts = torch.nn.ModuleList(Expert(hidden, inter) for _ in range(experts))

    moe = TinyMoE().double()
    if layout == "fused":
        moe.moe_rewrite_fuse_experts()
    return moe


def reference(experts, x, ids, w):
    """Token by token, expert by expert: sum_j w[t, j] * expert_{ids[t, j]}(x[t])."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] = out[t] + w[t, j] * experts[int(ids[t, j])](x[t : t + 1])[0]
    return out


def routing(tokens, experts, k):
    ids = torch.stack([torch.randperm(experts - 2)[:k] for _ in range(tokens)])  # the last two experts get nothing
    return ids, torch.rand(tokens, k, dtype=torch.float64)


PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]


def lora(model, targets=PROJECTIONS, seed=0, **options):
    """The model with LoRA adapters on `targets`, their B weights drawn non-zero so that they change the output."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False, **options)
    return peft.get_peft_model(model, config)


def step(model, ids):
    """One training step's loss and every gradient (LoRA weights, the router's, the embeddings')."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(got, want, rel=REL):
    assert rel_err(got[0], want[0]) < rel
    assert got[1].keys() == want[1].keys() and any("lora_B" in k for k in got[1])
    for name, grad in want[1].items():
        assert rel_err(got[1][name], grad) < rel, name


def no_loop(monkeypatch, model):
    """The per-expert loop fails if it runs: the adapted experts must go through the grouped GEMMs."""

    def loop(*args):
        raise AssertionError("the per-expert loop ran")

    monkeypatch.setattr(model_module(model), "_moe_rewrite_loop", loop)


def grouped_then_looped(monkeypatch, model, adapted, ids, kernel=None):
    """One step through the grouped GEMMs (the loop fails if it runs; `kernel` forces one), then the same step
    through the loop, which runs PEFT's own modules expert by expert."""
    with monkeypatch.context() as patch:
        no_loop(patch, model)
        if kernel is not None:
            patch.setattr(model_module(model), "_moe_rewrite_kernel", lambda device, dtype: kernel)
        grouped = step(adapted, ids)
    runtime_env(monkeypatch, "MOE_REWRITE_BACKEND", "loop")
    return grouped, step(adapted, ids)


def rewritten_v3(out: Path, *options: str) -> Path:
    """The V3 stand-in rewritten by the CLI into `out` with `options`."""
    code, _, err = run_cli(V3_DIR, "--out", out, *options)
    assert code == 0, err
    return out


def native_row(args: str, out: Path) -> dict:
    """The row bench/e2e/native.py writes to `out`, run as a script with `args` (space-separated) on the CPU; a row
    that records an error fails the test with the script's stderr."""
    command = [sys.executable, "bench/e2e/native.py", *args.split(), "--out", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    row = json.loads(out.read_text())
    assert "error" not in row, run.stderr[-3000:]
    return row
