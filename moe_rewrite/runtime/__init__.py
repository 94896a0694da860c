"""The code moe-rewrite generates, as a Python package: one module per section (moe_rewrite/render.py lists them
with what each does, and renders them). Tests import these modules directly; a rewritten file holds a copy of the
sections it needs and imports nothing from moe-rewrite.

    the core, in reading order (render.CORE_SECTIONS):
    dispatch           kernel choice: the grouped-GEMM kernel ("torch", "grouped_gemm", "sorted", ...) and the Triton
                       kernels per device and dtype, the settings and caches, all decided once per process
    route              the route (rows sorted by expert) and the steps along it: gather, un-sort, weighted combine
    grouped_linear     the grouped GEMM as an autograd Function over weight sources ((E, out, in) weights), the
                       gathered first GEMM
    expert_output      act_fn(gate) * up, the down GEMM and the weighted combine as one node; SwiGLU and the combine
                       as nodes of their own for adapters on the down projection
    backends           SonicMoE's fused kernels and the per-expert loop fallback
    moe_train          MoE.moe_train and the path through the above, LoRA adapters' GEMMs included
    expert_parallel    ep_size > 1: rows to the ranks holding their experts and back (all-to-all with autograd),
                       the default groups
    triton_*           Triton kernels with their launchers, one family per file (route, gather, swiglu, sum_rows,
                       gemm; triton_block: their column block) for the memory-bound steps and a grouped GEMM for few
                       rows per expert on sm90
    fp8_experts        FP8 block-quantized checkpoints (DeepSeek-V3's as shipped): transformers' FP8Linear layers
                       recognised, the experts fused with their codes and scales, the other layers dequantized on
                       loading; Model.moe_rewrite_dequantize_experts
    fused_views        expert i of the fused experts as nn.Linear views of the fused parameters (experts[i])
    fused_experts      the experts as two parameters (FP8 ones with their scales), run through the core
    fusing             MoE.moe_rewrite_fuse_experts and the seam,
                       MoE.moe_rewrite_expert_weights() -> _MoeRewriteExpertMLP
    fused_checkpoint   per-expert checkpoint keys into fused experts and back; Model.save_pretrained
    expert_parallel_model  the model under expert parallelism: its group, FSDP2 on two meshes
                       (Model.moe_rewrite_fully_shard), gradients without FSDP
    expert_parallel_checkpoint  whole checkpoints and adapters gathered from the ranks' shares (save_pretrained,
                       Model.moe_rewrite_gathered_state_dict, Model.moe_rewrite_save_adapters)
    fused_loading      Model.from_pretrained / _from_config / post_init fuse on loading (the default); under expert
                       parallelism the other ranks' expert keys are skipped silently
    per_expert         --no-fuse-experts: the seam over per-expert nn.Linear layers
    no_aux_loss        the published AddAuxiliaryLoss where aux_loss_alpha = 0 gives None: a clear error, or no aux
                       loss (config.moe_rewrite_train_without_aux_loss)
    aux_loss, bias_update, checkpoint_layer, init_guards, compat_*: the options and transformers compatibility
"""
