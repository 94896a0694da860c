"""The MoE core, generated for every rewritten MoE layer (render.CORE_SECTIONS, with the kernels): tokens routed to
their experts, the grouped GEMMs, the expert output, moe_train, and the expert-parallel exchange it calls. It reads
the experts only through the MoE layer's moe_rewrite_expert_weights() (experts/ provides it). Imports kernels/.

Sections (moe_rewrite/runtime/__init__.py SECTION_LIST, in its order):

    route: the route: rows sorted by expert, and the gather, un-sort and weighted combine along it
    grouped_mm: the grouped GEMM's products on the chosen kernel (FP8: W8A16 or W8A8; compiled: a custom op)
    grouped_linear: the grouped GEMM with autograd over weight sources, and the gather of x's rows
    expert_output: act_fn(gate) * up, the down GEMM and the weighted combine as one autograd node
    backends: the expert MLPs outside the grouped GEMMs: SonicMoE's kernels and the per-expert loop
    moe_train: MoE.moe_train: the routed experts in training mode, LoRA adapters' GEMMs included
    expert_parallel: expert parallelism (ep_size > 1): rows to the ranks holding their experts and back, all-to-all
"""
