"""The code moe-rewrite generates, as a Python package: one module per section (moe_rewrite/render.py lists them
with what each does, and renders them). Tests import these modules directly; a rewritten file holds a copy of the
sections it needs and imports nothing from moe-rewrite.

    grouped_gemm       the core: kernel choice, grouped GEMMs, autograd Functions over (E, out, in) weights (the
                       gathered first GEMM, the down GEMM with the weighted combine, the adapters' GEMMs), the
                       per-expert loop fallback; MoE.moe_train
    triton_kernels     Triton kernels for the core's memory-bound steps (the route, the gathers, SwiGLU and its
                       backward, weighted un-sort) and a grouped GEMM for few rows per expert on sm90
    fused_experts      the experts as two parameters; MoE.moe_rewrite_fuse_experts and the seam,
                       MoE.moe_rewrite_expert_weights() -> (gate_up, down, act_fn)
    fused_checkpoint   per-expert checkpoint keys into fused experts and back; Model.save_pretrained
    fused_loading      Model.from_pretrained / _from_config / post_init fuse on loading (the default)
    per_expert         --no-fuse-experts: the seam over per-expert nn.Linear layers
    aux_loss, bias_update, checkpointing, init_weights, compat_*: the options and transformers compatibility
"""
