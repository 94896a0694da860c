"""Weight sources over E experts' own nn.Linear weights: the per-expert layout's base weights (--no-fuse-experts) and
the LoRA adapters that PEFT puts on expert projections in either layout. Always generated.
"""

import torch

from ..kernels.dispatch import _moe_rewrite_setting

# The experts' gate, up and down projections' names: moe-rewrite writes the file's own here (Kimi's experts name them
# w1, w3, w2), read from the expert MLP's forward. The LoRA adapters and fused parameters keep these roles' names.
MOE_REWRITE_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _moe_rewrite_linear_weights(experts, adapted=False):
    """The per-expert layers' gate, up and down weights as three lists; None when an expert must be called as a module:
    projections that are not plain, bias-free nn.Linear layers (quantized layers; LoRA adapters unless `adapted`,
    when the adapted layers' base weights count), or weights that are not there in full (DeepSpeed ZeRO-3 gathers
    them in the module's own forward hook).
    """
    # nn.Module's own dicts (_modules, _parameters), not getattr: nn.Module.__getattr__ costs about a microsecond per
    # lookup, 6 * E lookups per layer and step. FSDP without use_orig_params sets the weight as a plain attribute.
    modules = _moe_rewrite_projections(experts)
    if adapted:  # PEFT's LoRA layers hold the original layer as base_layer
        modules = [[m._modules.get("base_layer", m) if m is not None else None for m in part] for part in modules]
    # one pass: this runs for every layer and step of the per-expert layout
    if any(type(m) is not torch.nn.Linear or m._parameters.get("bias") is not None for part in modules for m in part):
        return None  # the GEMMs add no bias
    weights = tuple(
        [m._parameters["weight"] if "weight" in m._parameters else m.weight for m in part] for part in modules
    )
    first, last = modules[0][0], modules[2][-1]
    if weights[0][0].shape != (first.out_features, first.in_features):
        return None
    if weights[2][-1].shape != (last.out_features, last.in_features):
        return None
    return weights


def _moe_rewrite_experts_differ(experts):
    """Why the grouped GEMMs cannot compute these routed experts as the modules themselves do, or None when they can:
    every expert computes down(act_fn(gate(x)) * up(x)) with experts[0]'s act_fn. A reason: a container other than
    an nn.ModuleList, a None expert, an expert of another class than experts[0], or with its own forward, forward
    hooks, parameters, buffers or submodules besides the three projections and act_fn, or another act_fn. The
    projections themselves are checked where their weights are read (_moe_rewrite_linear_weights, and the fuse).

    Checked once per list of expert modules (kept on the container): each step then costs one list comparison."""
    if not isinstance(experts, torch.nn.ModuleList):
        return f"the experts are a {type(experts).__name__}, not an nn.ModuleList"
    modules = list(experts._modules.values())
    checked = experts.__dict__.get("_moe_rewrite_checked")
    if checked is not None and checked[0] == modules:
        return checked[1]
    reason = _moe_rewrite_expert_difference(modules)
    experts.__dict__["_moe_rewrite_checked"] = (modules, reason)
    return reason


def _moe_rewrite_expert_difference(modules):
    if not modules:
        return "there are no experts"
    first = modules[0]
    if first is None:
        return "expert 0 is None"
    act_fn = getattr(first, "act_fn", None)
    for i, expert in enumerate(modules):
        if expert is None:
            return f"expert {i} is None"
        if type(expert) is not type(first):
            return f"expert {i} is a {type(expert).__name__}, expert 0 a {type(first).__name__}"
        if "forward" in expert.__dict__ or expert._forward_hooks or expert._forward_pre_hooks:
            return f"expert {i} has a forward of its own or forward hooks"
        extra = [*expert._parameters, *expert._buffers, *(set(expert._modules) - {*MOE_REWRITE_PROJECTIONS, "act_fn"})]
        if extra:
            return f"expert {i} holds {', '.join(sorted(extra))} besides its three projections and act_fn"
        if not _moe_rewrite_same_act(getattr(expert, "act_fn", None), act_fn):
            return f"expert {i}'s act_fn differs from expert 0's"
    return None


def _moe_rewrite_same_act(a, b):
    """Whether two activations compute the same: one object, or modules of one class with the same settings and no
    parameters, buffers or submodules."""
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, torch.nn.Module) or a._parameters or a._buffers or a._modules:
        return False
    settings = [{k: v for k, v in vars(m).items() if not k.startswith("_")} for m in (a, b)]
    return settings[0] == settings[1]


class _MoeRewriteExpertLinears:
    """The weight source of E experts' nn.Linear weights for one projection, or `parts` of them concatenated along the
    output dim (gate and up: parts=2); `weights` lists part 0 of every expert, then part 1.

    stacked(dtype) is one (E, parts * out, in) tensor: a view when the weights already lie at a fixed stride in one
    buffer (an FSDP flat parameter) in that dtype, else a copy. With direct gradients (see
    _moe_rewrite_direct_grads) autograd connects one weight only and grads() writes every expert's .grad itself.
    """

    scale = None  # not block-quantized

    def __init__(self, weights, parts):
        self.weights, self.parts = tuple(weights), parts
        rows, cols = self.weights[0].shape
        self.shape = (len(self.weights) // parts, parts * rows, cols)
        self.direct = _moe_rewrite_direct_grads(self.weights)
        trainable = [w for w in self.weights if w.requires_grad]
        self.tensors = tuple(trainable[:1] if self.direct else self.weights)

    def stacked(self, dtype):
        weights, parts = self.weights, self.parts
        experts = len(weights) // parts
        first = weights[0]
        rows, cols = first.shape
        if torch.compiler.is_compiling():  # storage offsets break the graph: the stack, which the compiler plans
            return (
                torch.stack([weights[p * experts + e] for e in range(experts) for p in range(parts)])
                .view(experts, parts * rows, cols)
                .to(dtype)
            )
        base = first.storage_offset()
        stride = weights[1].storage_offset() - base if experts > 1 else 0
        if (
            stride >= parts * rows * cols
            and (stride * first.element_size()) % 16 == 0
            and all(
                w.is_contiguous()
                and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and w.storage_offset() == base + (i % experts) * stride + (i // experts) * rows * cols
                for i, w in enumerate(weights)
            )
        ):
            return first.as_strided((experts, parts * rows, cols), (stride, cols, 1), base).to(dtype)
        # Interleaved as (expert, part), one stack lays them out exactly as (E, parts * out, in).
        interleaved = [weights[p * experts + e] for e in range(experts) for p in range(parts)]
        return torch.stack(interleaved).view(experts, parts * rows, cols).to(dtype)

    def grads(self, compute):
        if self.direct:
            # Only when this backward accumulates into parameters (not autograd.grad, not backward(inputs=...)).
            # torch._C._will_engine_execute_node is private; torch has no public way to ask
            # (tests/test_private_apis.py checks the behaviour relied on).
            node = torch.autograd.graph.get_gradient_edge(self.tensors[0]).node
            if torch._C._will_engine_execute_node(node):
                _moe_rewrite_accumulate(self.weights, self.per_weight(compute()))
            return (None,) * len(self.tensors)
        return tuple(self.per_weight(compute()))

    def per_weight(self, grad_w):
        """Each weight's gradient, in the weights' own dtype (fp32 weights under autocast get fp32 gradients)."""
        grad_w = grad_w.to(self.weights[0].dtype)
        per_part = grad_w.view(len(self.weights) // self.parts, self.parts, -1, grad_w.shape[-1]).unbind(1)
        return [g for part in per_part for g in part.unbind(0)]


def _moe_rewrite_direct_grads(weights):
    """Whether backward may write the experts' weight gradients itself rather than hand them to autograd.

    Each autograd leaf costs several microseconds of host time per step (one engine node per expert weight: 384 for
    128 experts, about 2.5 ms on an H200 host, more than the layer's GPU time; see moe-rewrite's bench/NOTES.md).
    Only for plain leaf tensors without hooks and outside torch.distributed, whose wrappers (DDP, FSDP, DeepSpeed)
    hook gradient accumulation. Tensor hooks are read from the tensors' own `_backward_hooks` and
    `_post_accumulate_grad_hooks` (private; torch has no public query). torch.autograd.grad asking for an expert weight
    needs MOE_REWRITE_DIRECT_GRADS=0. As with any .grad, gradients accumulate.
    """
    if _moe_rewrite_setting("MOE_REWRITE_DIRECT_GRADS", "1") == "0" or torch.compiler.is_compiling():
        return False  # under torch.compile: autograd's (the engine's nodes are not traceable; the graph has one)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    return all(
        w.is_leaf and not w._backward_hooks and getattr(w, "_post_accumulate_grad_hooks", None) is None for w in weights
    )


def _moe_rewrite_accumulate(weights, grads):
    """w.grad = g, or w.grad += g (one multi-tensor add, torch._foreach_add_ as torch's optimizers use it) where a
    gradient is already there."""
    existing, added = [], []
    for w, g in zip(weights, grads):
        if not w.requires_grad:
            continue
        if w.grad is None:
            w.grad = g
        else:
            existing.append(w.grad)
            added.append(g)
    if existing:
        torch._foreach_add_(existing, added)


def _moe_rewrite_lora(projections):
    """The LoRA adapters PEFT put on one projection of every expert (`projections`: E modules), as the core reads them:
    a tuple of (A, B, scaling, dropout), A and B weight sources over the experts' lora_A / lora_B weights; () when no
    adapter adds anything (no expert's projection is adapted, or the adapters are disabled or merged: PEFT's forward
    runs the base layer alone, which holds W + BA once merged). None when the grouped GEMMs cannot reproduce the
    modules' own forward, and the per-expert loop runs them: adapters other than LoRA, some experts adapted and others
    not, several active adapters, DoRA and other variants, LoRA biases, different scalings or dropouts, layers in
    different states, adapters disabled and merged at once (PEFT's forward unmerges them then).
    """
    # Submodules through nn.Module's own _modules dict (PEFT's lora_A / lora_B / lora_dropout ModuleDicts): this runs
    # for 3 * E layers per MoE layer and step, and nn.Module.__getattr__ costs about a microsecond per lookup.
    wrapped = ["base_layer" in p._modules for p in projections]
    if not any(wrapped):
        return ()
    if not all(wrapped) or not all("lora_A" in p._modules for p in projections):  # other tuners: their own forward
        return None
    first = projections[0]
    state = (first.disable_adapters, first.merged)
    if any((p.disable_adapters, p.merged) != state for p in projections) or all(state):
        return None
    if any(state):
        return ()
    adapters = list(first.active_adapters)
    if len(adapters) != 1 or adapters[0] not in first._modules["lora_A"]._modules:
        return None
    name = adapters[0]
    scaling, dropout = first.scaling[name], first._modules["lora_dropout"]._modules[name]
    rate = dropout.__dict__.get("p")  # nn.Dropout's rate; nn.Identity (no dropout) has none
    a_weights, b_weights = [], []
    for p in projections:
        modules = p._modules
        a = modules["lora_A"]._modules.get(name)
        b = modules["lora_B"]._modules.get(name)
        drop = modules["lora_dropout"]._modules.get(name)
        if a is None or list(p.active_adapters) != adapters:
            return None
        if name in p.__dict__.get("lora_variant", ()) or p.use_dora.get(name) or b._parameters.get("bias") is not None:
            return None
        if p.scaling[name] != scaling or type(drop) is not type(dropout) or drop.__dict__.get("p") != rate:
            return None
        a_weights.append(a._parameters["weight"])
        b_weights.append(b._parameters["weight"])
    return ((_MoeRewriteExpertLinears(a_weights, 1), _MoeRewriteExpertLinears(b_weights, 1), scaling, dropout),)


def _moe_rewrite_projections(experts):
    """The experts' gate, up and down projection modules: three lists of E (nn.Module's own dict, see above)."""
    return [[e._modules.get(name) for e in experts] for name in MOE_REWRITE_PROJECTIONS]


def _moe_rewrite_adapters(projections):
    """{"gate_proj" | "up_proj" | "down_proj": _moe_rewrite_lora(...)} for the adapted ones of `projections`
    (_moe_rewrite_projections; {} when none is), keyed by role whatever the file calls them, or None when the loop must
    run them."""
    adapters = {}
    for name, column in zip(("gate_proj", "up_proj", "down_proj"), projections):
        loras = _moe_rewrite_lora(column)
        if loras is None:
            return None
        if loras:
            adapters[name] = loras
    return adapters
