"""The code moe-rewrite generates, as a Python package: one module per section, grouped by concern into sub-packages.
Tests import these modules directly; a rewritten file holds a copy of the sections it needs and imports nothing from
moe-rewrite (moe_rewrite/render.py renders them).

SECTION_LIST below is the one list of sections: each one's name (its file's stem, unique over the packages: what the
codemods ask for), its package, what it does in one sentence, in the order the generated block holds them.
render.SECTIONS, render.CORE_SECTIONS, the sub-packages' docstrings and the CLI's section lists derive from it, and
tests/test_runtime_layout.py checks that it and the files agree.

The packages, in layering order (PACKAGES): a package's sections import only sections of its own package or of the
packages before it.

    kernels    the kernel choice (dispatch: settings, options, which kernels run where) and the Triton kernels
    moe        the MoE core every rewritten MoE layer gets: route, grouped GEMMs, expert output, moe_train, and the
               expert-parallel exchange it calls
    parallel   the model's side of expert parallelism: groups, FSDP2 on two meshes, checkpoints gathered from ranks
    experts    the expert layouts behind the core's seam: per-expert linears, fused experts, FP8 experts, PEFT's
               LoRA on them, their checkpoints and loading
    router     router training: the aux loss, aux-loss-free bias updates, AddAuxiliaryLoss without an aux loss
    model      model-level fixes: SDPA attention, the chunked LM loss, layer checkpointing, _init_weights guards
    compat     transformers compatibility: stand-ins for removed APIs
"""

from __future__ import annotations

from typing import NamedTuple

PACKAGES = ("kernels", "moe", "parallel", "experts", "router", "model", "compat")  # the layering order


class Entry(NamedTuple):
    """One runtime section: runtime/{package}/{name}.py."""

    name: str
    package: str
    does: str  # one sentence
    core: bool = False  # every rewritten MoE layer gets it (render.CORE_SECTIONS)
    fallback: bool = False  # an import fallback: compat.py puts it where the file's import fails, not in the block
    feature: str | None = None  # generated only with this feature (render.FEATURES), e.g. "fp8-experts"


SECTION_LIST = (
    Entry(
        "dispatch",
        "kernels",
        "the kernel choice: grouped-GEMM kernel and Triton kernels per device and dtype, once per process",
        core=True,
    ),
    Entry(
        "route",
        "moe",
        "the route: rows sorted by expert, and the gather, un-sort and weighted combine along it",
        core=True,
    ),
    Entry(
        "grouped_mm",
        "moe",
        "the grouped GEMM's products on the chosen kernel (FP8: W8A16 or W8A8; compiled: a custom op)",
        core=True,
    ),
    Entry(
        "grouped_linear",
        "moe",
        "the grouped GEMM with autograd over weight sources, and the gather of x's rows",
        core=True,
    ),
    Entry(
        "expert_output",
        "moe",
        "act_fn(gate) * up, the down GEMM and the weighted combine as one autograd node",
        core=True,
    ),
    Entry(
        "backends",
        "moe",
        "the expert MLPs outside the grouped GEMMs: SonicMoE's kernels and the per-expert loop",
        core=True,
    ),
    Entry(
        "moe_train",
        "moe",
        "MoE.moe_train: the routed experts in training mode, LoRA adapters' GEMMs included",
        core=True,
    ),
    Entry(
        "expert_parallel",
        "moe",
        "expert parallelism (ep_size > 1): rows to the ranks holding their experts and back, all-to-all",
        core=True,
    ),
    Entry("triton_block", "kernels", "the column block of the row-wise Triton kernels", core=True),
    Entry("triton_route", "kernels", "the route in one Triton launch", core=True),
    Entry("triton_gather", "kernels", "the gather of each token's row to its top-k places in Triton", core=True),
    Entry("triton_swiglu", "kernels", "SwiGLU and its backward in Triton", core=True),
    Entry(
        "triton_sum_rows",
        "kernels",
        "the weighted un-sort and sum of each token's rows, and its backward, in Triton",
        core=True,
    ),
    Entry("triton_gemm", "kernels", "a Triton grouped GEMM for few rows per expert on sm90", core=True),
    Entry(
        "expert_linears",
        "experts",
        "weight sources over per-expert nn.Linear weights and the LoRA adapters PEFT puts on experts",
    ),
    Entry(
        "parameter_lora",
        "experts",
        "PEFT's LoRA on the fused expert parameters (target_parameters) and eval mode under it",
    ),
    Entry(
        "fp8_experts",
        "experts",
        "FP8 block-quantized checkpoints: FP8Linear layers found, the others dequantized on loading",
        feature="fp8-experts",
    ),
    Entry(
        "fused_views",
        "experts",
        "expert i of the fused experts as a module of nn.Linear views of the fused parameters",
    ),
    Entry("fused_experts", "experts", "the routed experts fused into two parameters"),
    Entry("fusing", "experts", "MoE.moe_rewrite_fuse_experts, and the fused layout's moe_rewrite_expert_weights"),
    Entry("fused_checkpoint", "experts", "per-expert checkpoint keys into fused experts and back (save_pretrained)"),
    Entry(
        "expert_parallel_model",
        "parallel",
        "the model under expert parallelism: its groups, FSDP2 on two meshes, gradients",
        feature="expert-parallel",
    ),
    Entry(
        "expert_parallel_checkpoint",
        "parallel",
        "whole checkpoints and adapters gathered from expert-parallel or FSDP2 ranks",
    ),
    Entry("fused_loading", "experts", "from_pretrained and from_config fuse every MoE layer's experts"),
    Entry("per_expert", "experts", "the grouped-GEMM core over per-expert nn.Linear layers (--no-fuse-experts)"),
    Entry("aux_loss", "router", "the sequence-wise balance loss (--aux-loss)"),
    Entry(
        "bias_update",
        "router",
        "aux-loss-free balancing, bias += RATE * sign(mean load - load) (--bias-update)",
    ),
    Entry(
        "no_aux_loss",
        "router",
        "AddAuxiliaryLoss where aux_loss_alpha = 0 gives no aux loss: trained without it, said once",
    ),
    Entry(
        "packed_attention",
        "model",
        "packed documents' kernels: SDPA per document, varlen_attn, FlexAttention with a block mask",
    ),
    Entry(
        "packing",
        "model",
        "packed documents (restarting position ids, cu_seq_lens_*) each attending to itself; num_items_in_batch",
    ),
    Entry(
        "attention",
        "model",
        "the attention core through torch's scaled_dot_product_attention, its backend chosen once per shape",
    ),
    Entry(
        "lm_loss",
        "model",
        "the causal-LM loss in chunks, without float32 logits over the vocabulary, in training with labels",
    ),
    Entry(
        "triton_cross_entropy",
        "kernels",
        "the fused loss's cross-entropy rows (logsumexp, loss, gradient in place) in Triton",
    ),
    Entry(
        "triton_rmsnorm",
        "kernels",
        "RMSNorm and its backward in Triton where they apply (CUDA); the published norm elsewhere",
    ),
    Entry(
        "triton_rope",
        "kernels",
        "RoPE and its backward in Triton where they apply (CUDA); the published RoPE elsewhere",
    ),
    Entry("checkpoint_layer", "model", "gradient_checkpointing_enable() checkpoints the decoder layers"),
    Entry("rope_tables", "model", "the RoPE modules' table rebuilds kept out of torch.compile's graphs"),
    Entry("compat_cache", "compat", "Cache methods that later transformers releases removed"),
    Entry("compat_rope_scaling", "compat", "config.rope_scaling as the file expects it on transformers 5.x"),
    Entry("compat_generation", "compat", "generation position ids sliced as transformers 4.x passed them"),
    Entry(
        "init_guards",
        "model",
        "_init_weights keeps loaded weights and rebuilds non-persistent buffers on transformers 5.x",
    ),
    # Import fallbacks (not in the block): compat.py puts each in the `except ImportError:` of the file's import.
    Entry(
        "compat_fx_available",
        "compat",
        "is_torch_fx_available, which transformers 5.0 removed",
        fallback=True,
    ),
    Entry(
        "compat_causal_mask",
        "compat",
        "_prepare_4d_causal_attention_mask, which transformers 5.x removed",
        fallback=True,
    ),
    Entry(
        "compat_attn_mask_converter",
        "compat",
        "AttentionMaskConverter, which transformers 5.x removed with its module",
        fallback=True,
    ),
    Entry(
        "compat_attention_mask",
        "compat",
        "_prepare_4d_attention_mask, which transformers 5.x removed with its module",
        fallback=True,
    ),
    Entry(
        "compat_sdpa_causal_mask",
        "compat",
        "_prepare_4d_causal_attention_mask_for_sdpa, which transformers 5.x removed with its module",
        fallback=True,
    ),
    Entry(
        "compat_llama_attention",
        "compat",
        "LlamaAttention and LlamaFlashAttention2 as transformers 4.46/4.47 had them",
        fallback=True,
    ),
)
BY_NAME = {entry.name: entry for entry in SECTION_LIST}
