"""PEFT's LoRA on the fused experts' parameters: LoraConfig(target_parameters=["experts.gate_up_proj",
"experts.down_proj"]), and what peft >= 0.18 makes of target_modules naming gate_proj / up_proj / down_proj on
transformers 5.x for model_type deepseek_v2/v3 (one adapter on gate_up_proj of rank 2r, one on down_proj). PEFT wraps
the experts module in one ParamWrapper per parameter; the grouped-GEMM core reads each wrapper's adapter as two grouped
GEMMs of its rank, as it reads the per-expert ones (expert_linears.py). Always generated.
"""

import torch

from ..moe.expert_parallel import _moe_rewrite_fsdp2_unit, _moe_rewrite_unwrap
from ..moe.grouped_linear import _MoeRewriteExpertWeight
from .expert_linears import MOE_REWRITE_PROJECTIONS


def _moe_rewrite_parameter_lora(wrapper):
    """One ParamWrapper's LoRA adapters as the core reads them (as expert_linears.py's _moe_rewrite_lora): a tuple of
    (A, B, scaling, dropout), A and B weight sources over
    (E, r, in) and (E, out, r) views of PEFT's lora_A (r * E, in) and lora_B (out, r * E) weights, taken from PEFT's
    own get_delta_factors (whose product, times scaling, is the delta PEFT adds to the parameter in its forward), so
    the core adds exactly that delta's contribution without forming it. () when the wrapper adds nothing (adapters
    disabled, or merged into the parameter); None when the grouped GEMMs cannot reproduce its forward (several active
    adapters, disabled adapters that are merged: PEFT unmerges them in its forward; a PEFT without get_delta_factors).
    """
    merged, disabled = wrapper.merged, wrapper.disable_adapters
    if disabled or merged:
        return None if disabled and merged else ()
    lora_a = wrapper._modules["lora_A"]._modules
    names = [name for name in wrapper.active_adapters if name in lora_a]
    if not names:
        return ()
    dropout = wrapper._modules["lora_dropout"]._modules.get(names[0])
    if len(names) != 1 or not hasattr(wrapper, "get_delta_factors") or type(dropout) is not torch.nn.Identity:
        return None
    lhs, rhs, scaling = wrapper.get_delta_factors(names[0])  # delta = scaling * lhs @ rhs: (E, out, r) @ (E, r, in)
    # generated with: fp8-experts
    if lhs.dtype == torch.float8_e4m3fn:  # cast to the parameter's dtype: FP8 experts' codes', which round them
        lhs, rhs = _moe_rewrite_delta_factors(wrapper, names[0])
    # torch._grouped_mm reads each expert's matrix with unit stride in one of its dims; PEFT's lora_B view has the
    # expert as its fastest dim, so it is copied (out * r * E elements, with autograd).
    return ((_MoeRewriteExpertWeight(rhs.contiguous()), _MoeRewriteExpertWeight(lhs.contiguous()), scaling, dropout),)


# generated with: fp8-experts
def _moe_rewrite_delta_factors(wrapper, name):
    """PEFT's get_delta_factors(name) before it casts them to the parameter's dtype (FP8 experts' float8 codes): lora_A
    (r * E, in) read as (E, r, in), lora_B (out, r * E) as (E, out, r), in the order PEFT multiplies them (swapped
    where PEFT read the parameter as (E, in, out); its _did_swap_in_out_features says which, as get_delta_factors reads
    it). tests/test_fp8.py checks the gradients against the same adapters on real numbers."""
    weight_a, weight_b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
    weight_a = weight_a.reshape(wrapper.num_experts, -1, weight_a.shape[-1])
    weight_b = weight_b.reshape(weight_b.shape[0], -1, wrapper.num_experts).permute(2, 0, 1)
    if wrapper._did_swap_in_out_features:
        return weight_b, weight_a
    return weight_a.transpose(-2, -1), weight_b.transpose(-2, -1)


def _moe_rewrite_parameter_adapters(wrappers):
    """{parameter name: _moe_rewrite_parameter_lora(...)} for the adapters of `wrappers` (_moe_rewrite_unwrap's; {}
    when none adds anything), or None when the loop must run them through PEFT's forward (a parameter wrapped twice
    included)."""
    adapters = {}
    names = [wrapper.__dict__["parameter_name"] for wrapper in wrappers]
    if len(set(names)) != len(names) or not set(names) <= {"gate_up_proj", "down_proj"}:
        return None
    for name, wrapper in zip(names, wrappers):
        loras = _moe_rewrite_parameter_lora(wrapper)
        if loras is None:
            return None
        if loras:
            adapters[name] = loras
    return adapters


def _moe_rewrite_load_expert_lora(moe, state_dict, prefix, *args):
    """load_state_dict pre-hook of the MoE layer (moe_rewrite_fuse_experts registers it): LoRA weights in the standard
    per-expert format (experts.{i}.gate_proj.lora_A.{adapter}.weight, what PEFT writes for the original file) that
    arrive where PEFT wrapped the fused parameters instead become the wrappers' weights, as peft converts them for
    transformers' own models (not for remote code, whose expert adapters would silently not load): down_proj's A and
    B stacked over the experts, gate_up_proj's rank-2r adapter holding gate_proj's and up_proj's (A stacked, B
    block-diagonal). What the wrappers cannot hold is an error, never a partial load."""
    head = prefix + "experts."
    keys = [k for k in state_dict if k.startswith(head) and ".lora_" in k and k[len(head) :].split(".")[0].isdigit()]
    experts, wrappers = _moe_rewrite_unwrap(moe._modules["experts"])
    if not keys or not wrappers or "lora_A" in experts[0]._modules[MOE_REWRITE_PROJECTIONS[2]]._modules:
        return  # nothing per-expert, or the expert views hold LoRA layers of their own that take these keys
    # PEFT names the adapter in the keys it finds modules for; the others keep the file's name, without one: they
    # belong to the adapter being loaded, the one PEFT added last.
    newest = list(wrappers[0]._modules["lora_A"]._modules)[-1:] or [""]
    parts = {}  # adapter -> {(expert, projection, "lora_A" | "lora_B"): tensor}
    for key in keys:
        fields = key[len(head) :].split(".")
        if len(fields) == 4:
            fields.insert(3, newest[0])
        index, projection, lora, adapter, weight = (fields + [""] * 5)[:5]
        if weight != "weight" or lora not in ("lora_A", "lora_B") or projection not in MOE_REWRITE_PROJECTIONS:
            raise RuntimeError(f"moe-rewrite: cannot load {key} onto the fused experts PEFT wrapped")
        parts.setdefault(adapter, {})[int(index), projection, lora] = state_dict.pop(key)
    count = len(experts)
    for depth, wrapper in enumerate(wrappers):
        name, target = wrapper.__dict__["parameter_name"], head + "base_layer." * depth
        projections = MOE_REWRITE_PROJECTIONS[:2] if name == "gate_up_proj" else MOE_REWRITE_PROJECTIONS[2:]
        for adapter, found in parts.items():
            a = [found.pop((i, p, "lora_A"), None) for i in range(count) for p in projections]
            b = [found.pop((i, p, "lora_B"), None) for i in range(count) for p in projections]
            if any(t is None for t in a + b):
                raise RuntimeError(
                    f"moe-rewrite: the {adapter!r} adapter lacks some experts' {' or '.join(projections)}"
                )
            merged = {
                "lora_A": torch.cat(a),  # (len(projections) * r * E, in): expert e's rows together
                # (len(projections) * out, len(projections) * r * E): expert e's columns are e, e + E, ...
                "lora_B": torch.stack(
                    [torch.block_diag(*b[i : i + len(projections)]) for i in range(0, len(b), len(projections))], -1
                ).flatten(1),
            }
            for lora, value in merged.items():
                layer = wrapper._modules[lora]._modules.get(adapter)
                if layer is None or layer.weight.shape != value.shape:
                    expected = "no such adapter" if layer is None else f"expected {tuple(layer.weight.shape)}"
                    raise RuntimeError(
                        f"moe-rewrite: the per-expert {adapter!r} adapter does not fit PEFT's adapter on {name} "
                        f"({lora} {tuple(value.shape)}, {expected})"
                    )
                state_dict[f"{target}{lora}.{adapter}.weight"] = value
    left = [key for found in parts.values() for key in found]
    if left:
        raise RuntimeError(f"moe-rewrite: per-expert LoRA weights {left[0]} ... have no PEFT adapter to load into")


class MoE:
    def moe_rewrite_infer(self, x, topk_ids, topk_weight):
        """Eval mode's routed experts: the file's own moe_infer, expert by expert, unless the experts cannot be indexed
        as moe_infer does (PEFT's wrappers around the fused experts, see _moe_rewrite_unwrap); then moe_train runs
        them with their adapters, without gradients as moe_infer, and returns x's dtype as moe_infer does. The V1 form
        passes flat ids and (tokens * top_k, 1) weights (moe-rewrite proved them views of the (tokens, top_k) ones);
        moe_train takes them per token. Under expert parallelism moe_train runs them too (moe_infer's own exchange
        needs ep_size == world size and even splits on gloo), where FSDP2 shards the experts on their own
        (moe_rewrite_fully_shard: FSDP2 gathers them around their moe_rewrite_run), for FP8 experts (moe_infer
        would dequantize them one by one), and under torch.compile (moe_infer's loop reads the token counts on the
        host and calls each expert's own module: a graph per expert, past dynamo's recompile limit)."""
        own_unit = _moe_rewrite_fsdp2_unit(self.experts)
        fp8 = getattr(_moe_rewrite_unwrap(self.experts)[0], "moe_rewrite_fp8", lambda: False)()
        indexable = hasattr(type(self.experts), "__getitem__") and getattr(self, "ep_size", 1) <= 1
        if indexable and not (own_unit or fp8 or torch.compiler.is_compiling()):
            return self.moe_infer(x, topk_ids, topk_weight)
        tokens = x.shape[0]
        with torch.no_grad():
            return self.moe_train(x, topk_ids.view(tokens, -1), topk_weight.view(tokens, -1), out_dtype=x.dtype)
