"""The expert layouts behind the core's seam: per-expert nn.Linear weights and their LoRA layers, PEFT's LoRA on the
fused parameters, FP8 experts, the fused module, fusing, checkpoints and loading, --no-fuse-experts. Imports kernels/,
moe/ and parallel/ (save_pretrained gathers expert-parallel checkpoints).

Sections (moe_rewrite/runtime/__init__.py SECTION_LIST, in its order):

    expert_linears: weight sources over per-expert nn.Linear weights and the LoRA adapters PEFT puts on experts
    parameter_lora: PEFT's LoRA on the fused expert parameters (target_parameters) and eval mode under it
    fp8_experts: FP8 block-quantized checkpoints: FP8Linear layers found, the others dequantized on loading
    fused_views: expert i of the fused experts as a module of nn.Linear views of the fused parameters
    fused_experts: the routed experts fused into two parameters
    fusing: MoE.moe_rewrite_fuse_experts, and the fused layout's moe_rewrite_expert_weights
    fused_checkpoint: per-expert checkpoint keys into fused experts and back (save_pretrained)
    fused_loading: from_pretrained and from_config fuse every MoE layer's experts
    per_expert: the grouped-GEMM core over per-expert nn.Linear layers (--no-fuse-experts)
"""
