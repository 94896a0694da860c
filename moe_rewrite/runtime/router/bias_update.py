"""Methods moe-rewrite adds to the MoE class for `--bias-update RATE` (V3 form): aux-loss-free load balancing
(DeepSeek-V3 report, section 2.1.2).
"""

import torch

from ..kernels.dispatch import _moe_rewrite_options


class MoE:
    def moe_rewrite_count_load(self, topk_ids):
        """Count this step's routed tokens per expert, for moe_rewrite_update_bias."""
        # Recomputation under gradient checkpointing runs inside backward: those tokens were counted in forward
        # (torch._C._current_graph_task_id is private; torch has no public "inside backward" query).
        if torch._C._current_graph_task_id() != -1:
            return
        bias = self.gate.e_score_correction_bias
        if bias.requires_grad and bias.is_leaf:
            bias.requires_grad_(False)  # moved by moe_rewrite_update_bias only: no gradient, no optimizer update
        load = getattr(self, "_moe_rewrite_load", None)
        if load is None:
            load = torch.zeros(bias.shape[0], dtype=torch.float32, device=bias.device)
            self.register_buffer("_moe_rewrite_load", load, persistent=False)
        load.index_add_(0, topk_ids.reshape(-1), torch.ones(topk_ids.numel(), dtype=load.dtype, device=load.device))

    def moe_rewrite_update_bias(self):
        """Once per optimizer step: e_score_correction_bias += RATE * sign(mean load - load), loads summed over
        data-parallel ranks so that every rank applies the same update; then the counts restart from zero.

        The bias is updated in an fp32 copy (a bf16 bias would round small steps away) and copied into the parameter,
        through its shards under FSDP2.
        """
        bias = self.gate.e_score_correction_bias
        full = bias.full_tensor() if hasattr(bias, "full_tensor") else bias  # FSDP2 shards it as a DTensor
        if full.dim() != 1 or full.numel() != self.config.n_routed_experts:
            raise RuntimeError(
                "moe-rewrite: e_score_correction_bias is sharded in a way --bias-update cannot update (FSDP1 flat "
                "parameters, ZeRO-3); keep the gates' biases out of sharding (FSDP1 ignored_states) or use FSDP2"
            )
        load = getattr(self, "_moe_rewrite_load", None)
        if load is None:  # no tokens reached this layer on this rank; the all-reduce still needs its zeros
            load = torch.zeros(full.shape, dtype=torch.float32, device=full.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load)
        master = getattr(self, "_moe_rewrite_bias", None)
        if master is None:
            master = full.detach().float().clone()
            self.register_buffer("_moe_rewrite_bias", master, persistent=False)
        master.add_(torch.sign(load.mean() - load), alpha=_moe_rewrite_options["bias_update"])
        with torch.no_grad():
            if hasattr(bias, "full_tensor"):
                from torch.distributed.tensor import distribute_tensor

                bias.copy_(distribute_tensor(master.to(bias.dtype), bias.device_mesh, bias.placements))
            else:
                bias.copy_(master)
        load.zero_()
