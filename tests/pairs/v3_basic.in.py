# A minimal V3-form MoE, written for moe-rewrite's tests.
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


class DeepseekV3MLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def forward(self, hidden_states):
        scores = F.linear(hidden_states.float(), self.weight.float()).sigmoid()
        if self.topk_method == "noaux_tc":
            assert not self.training
            choice = scores + self.e_score_correction_bias.unsqueeze(0)
            topk_idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            topk_weight = scores.gather(1, topk_idx)
        else:
            raise NotImplementedError(self.topk_method)
        return topk_idx, topk_weight * self.routed_scaling_factor


class DeepseekV3MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList(
            [DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.n_routed_experts)]
        )
        self.config = config
        self.gate = MoEGate(config)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if not self.training:
            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        if self.config.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        return x
