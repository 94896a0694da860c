"""Fused experts: a layer's routed experts held in two parameters, (E, 2 * intermediate, hidden) gate_up_proj and
(E, hidden, intermediate) down_proj, which the grouped-GEMM core reads as they are. Always generated; checkpoint keys
are converted by fused_checkpoint.py.
"""

import torch

from .fused_checkpoint import _moe_rewrite_merge_experts, _moe_rewrite_stack_experts
from .grouped_gemm import _MoeRewriteExpertWeight


class _MoeRewriteFusedExperts(torch.nn.Module):
    """The routed experts as two parameters, made by the MoE layer's moe_rewrite_fuse_experts():
    gate_up_proj (E, 2 * intermediate, hidden) holds every expert's gate_proj then up_proj weight, down_proj
    (E, hidden, intermediate) every expert's down_proj weight.

    The grouped GEMMs read them as they are (no stacking copy per step), and a layer has 2 expert parameters instead of
    3 * E: FSDP, DDP and the optimizer handle each parameter separately, at a host cost per parameter and step.
    experts[i] is a callable view of expert i (moe_infer calls the experts one by one in eval mode). state_dict() uses
    the parameters' own names, as FSDP and torch.distributed.checkpoint expect; load_state_dict also takes the
    checkpoint's per-expert keys (experts.{i}.gate_proj.weight, ...), and the model's save_pretrained writes them.
    """

    def __init__(self, act_fn, gate_w, up_w, down_w):
        super().__init__()
        self.act_fn = act_fn
        gate_up, down = _moe_rewrite_stack_experts(gate_w, up_w, down_w)
        self.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=gate_w[0].requires_grad)
        self.down_proj = torch.nn.Parameter(down, requires_grad=gate_w[0].requires_grad)
        self.register_load_state_dict_pre_hook(_moe_rewrite_merge_experts)

    def __len__(self):
        return self.gate_up_proj.shape[0]

    def __getitem__(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"expert {index} out of range for {len(self)} experts")
        return _MoeRewriteFusedExpert(self, index % len(self))

    def __iter__(self):
        return (_MoeRewriteFusedExpert(self, i) for i in range(len(self)))

    def extra_repr(self):
        experts, double_inter, hidden = self.gate_up_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={double_inter // 2}"

    def moe_rewrite_weights(self):
        """(gate_up, down, act_fn) for the grouped-GEMM core: the two parameters as weight sources."""
        if torch.is_grad_enabled() and not self.gate_up_proj.requires_grad:
            _moe_rewrite_warn_frozen()
        return _MoeRewriteExpertWeight(self.gate_up_proj), _MoeRewriteExpertWeight(self.down_proj), self.act_fn


class _MoeRewriteFusedExpert:
    """Expert `index` of fused experts, called like the expert MLP it replaced: down(act(gate(x)) * up(x))."""

    def __init__(self, experts, index):
        self.experts, self.index = experts, index

    def __call__(self, x):
        experts = self.experts
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[self.index]).chunk(2, dim=-1)
        return torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[self.index])


def _moe_rewrite_linear_weights(experts):
    """The per-expert layers' gate, up and down weights as three lists; None when an expert must be called as a module:
    projections that are not plain nn.Linear layers (LoRA adapters, quantized layers), or weights that are not there in
    full (DeepSpeed ZeRO-3 gathers them in the module's own forward hook).
    """
    names = ("gate_proj", "up_proj", "down_proj")
    # nn.Module's own dicts (_modules, _parameters), not getattr: nn.Module.__getattr__ costs about a microsecond per
    # lookup, 6 * E lookups per layer and step. FSDP without use_orig_params sets the weight as a plain attribute.
    modules = [[e._modules.get(name) for e in experts] for name in names]
    if any(type(m) is not torch.nn.Linear for part in modules for m in part):
        return None
    weights = tuple(
        [m._parameters["weight"] if "weight" in m._parameters else m.weight for m in part] for part in modules
    )
    first, last = modules[0][0], modules[2][-1]
    if weights[0][0].shape != (first.out_features, first.in_features):
        return None
    if weights[2][-1].shape != (last.out_features, last.in_features):
        return None
    return weights


def _moe_rewrite_warn_frozen():
    """Fused experts are trained frozen: say so (once per process, by the warnings module's own filter), as LoRA
    (PEFT's target_modules) silently skips them."""
    import warnings

    warnings.warn(
        "moe-rewrite: the fused routed experts are frozen; LoRA adapters cannot target fused experts. To adapt them, "
        "rewrite with --no-fuse-experts or load with MOE_REWRITE_FUSE_EXPERTS=0",
        stacklevel=5,
    )


def _moe_rewrite_warn_unfused():
    """Experts that could be fused but are not run through the per-expert loop: say so, once per process."""
    import warnings

    warnings.warn(
        "moe-rewrite: these routed experts are not fused, so they train through the slow per-expert loop; fuse them "
        "with moe_rewrite.training.fuse_experts(model), or rewrite with --no-fuse-experts to train them as they are",
        stacklevel=4,
    )


class MoE:
    def moe_rewrite_expert_weights(self):
        """The experts' weights for the grouped-GEMM core, (gate_up, down, act_fn), or None: the per-expert loop runs
        (experts that are not fused: wrapped by LoRA, quantized, or loaded with MOE_REWRITE_FUSE_EXPERTS=0)."""
        experts = self.experts
        if isinstance(experts, _MoeRewriteFusedExperts):
            return experts.moe_rewrite_weights()
        if _moe_rewrite_linear_weights(experts) is not None:
            _moe_rewrite_warn_unfused()
        return None

    def moe_rewrite_fuse_experts(self, allow_meta=False):
        """Hold the routed experts' weights in two parameters instead of 3 * E nn.Linear weights (see
        _MoeRewriteFusedExperts): faster training, most of all under FSDP.

        Call it once the weights are loaded and before the model is wrapped (FSDP, DDP, DeepSpeed) or handed to an
        optimizer; moe_rewrite.training.fuse_experts(model) does it for every layer. Returns the fused experts; calling
        it again does nothing. Outputs and gradients stay the same; save_pretrained still writes per-expert keys.
        `allow_meta`: fuse meta-device weights too, for a loader that fills the fused parameters.
        """
        experts = self.experts
        if isinstance(experts, _MoeRewriteFusedExperts):
            return experts
        if self.ep_size > 1:
            raise NotImplementedError("moe-rewrite: fused experts do not support expert parallelism (ep_size > 1) yet")
        weights = _moe_rewrite_linear_weights(experts)
        if weights is None:
            raise RuntimeError(
                "moe-rewrite: only experts made of plain, whole nn.Linear layers can be fused (not LoRA adapters, "
                "quantized layers or DeepSpeed ZeRO-3 partitions)"
            )
        flat = [w for part in weights for w in part]
        if getattr(self, "_is_fsdp_managed_module", False) or any(type(w) is not torch.nn.Parameter for w in flat):
            raise RuntimeError("moe-rewrite: fuse the experts before wrapping the model (FSDP, DDP, DeepSpeed)")
        # accelerate's dispatch (device_map) marks the modules it moves or offloads with `_hf_hook` (its own,
        # undocumented attribute: accelerate has no public "is this module dispatched" query).
        if any(hasattr(m, "_hf_hook") for m in experts.modules()):
            raise RuntimeError("moe-rewrite: experts dispatched or offloaded by accelerate (device_map) are not fused")
        if not allow_meta and any(w.is_meta for w in flat):
            raise RuntimeError("moe-rewrite: the expert weights are on the meta device; fuse them once they are loaded")
        if len({(w.dtype, w.device, w.requires_grad) for w in flat}) != 1:
            raise RuntimeError("moe-rewrite: fusing needs every expert weight in one dtype, device and requires_grad")
        self.experts = _MoeRewriteFusedExperts(experts[0].act_fn, *weights)
        return self.experts
