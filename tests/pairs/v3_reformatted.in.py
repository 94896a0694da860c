# A V3-form MoE as another publisher might reformat it: other wrapping, quotes, comments and names.
import torch
from torch import nn
from transformers.activations import ACT2FN


class Expert(nn.Module):

    def __init__(self, config, intermediate_size = None):
        super(Expert, self).__init__()
        hidden = config.hidden_size
        self.gate_proj = nn.Linear(hidden, intermediate_size, bias = False)
        self.up_proj   = nn.Linear(hidden, intermediate_size, bias = False)
        self.down_proj = nn.Linear(intermediate_size, hidden, bias = False)
        self.act_fn = ACT2FN[ config.hidden_act ]

    def forward(self, x):
        h = self.up_proj(x) * self.act_fn(self.gate_proj(x))
        out = self.down_proj(h)
        return out


class Router(nn.Module):
    def forward(self, x):
        scores = x.float().sigmoid()
        if self.topk_method == 'noaux_tc':
            # Inference only in the original release.
            assert (not self.training)
            ids = scores.topk(self.top_k, dim=-1)[1]
        return ids, scores.gather(1, ids)


class DeepseekV3MoE(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.experts = nn.ModuleList(
            [Expert(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.n_routed_experts)]
        )
        self.gate = Router(config)   # the router

    def forward(self, x):
        residual, shape = x, x.shape
        (ids, weights) = self.gate(x)
        x = x.view(-1, x.shape[-1])
        if not self.training:  # eval
            out = (
                self.moe_infer(x, ids, weights)  # sorted experts
                .view(*shape)
            )
        out = out + self.shared_experts(residual)
        return out

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        return x
