"""One module per rewrite: moe_forward (the MoE training path) and gate (the router in training mode)."""
