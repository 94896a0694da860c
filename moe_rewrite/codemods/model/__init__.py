"""The whole-model rewrites: the attention core and its mask, the causal-LM loss, RMSNorm, RoPE (each the published
statements kept in the else of a marked branch, branch.py), gradient checkpointing and _init_weights."""
