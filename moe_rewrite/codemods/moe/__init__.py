"""The MoE layer's rewrites: its class and form found and given a training branch (moe_forward), its experts proven
(expert_mlp, moe_infer_body), the router's training guard (gate), the aux loss (no_aux_loss), expert parallelism
(expert_parallel) and the expert layout (expert_layout)."""
