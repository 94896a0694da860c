"""The model's side of expert parallelism (the layers' exchange is moe/expert_parallel.py): the groups, FSDP2 on two
meshes, gradients without FSDP, whole checkpoints and adapters gathered from the ranks. Imports moe/.

Sections (moe_rewrite/runtime/__init__.py SECTION_LIST, in its order):

    expert_parallel_model: the model under expert parallelism: its groups, FSDP2 on two meshes, gradients
    expert_parallel_checkpoint: whole checkpoints and adapters gathered from expert-parallel or FSDP2 ranks
"""
