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
        n_tokens, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        # number of routed slots that land on each expert
        per_expert = torch.bincount(flat_ids, minlength=self.config.n_routed_experts)
        # slots ordered by expert id; slot s belongs to token s // k
        order = flat_ids.argsort()
        routed = x[
            order // k
        ]  # one row per (token, slot)

        if self.ep_size > 1:
            # first swap the per-expert counts so each rank knows what it receives
            incoming = per_expert.new_empty(per_expert.shape[0])
            dist.all_to_all_single(incoming, per_expert)
            send_splits = per_expert.view(self.ep_size, -1).sum(dim=1).tolist()
            recv_splits = incoming.view(self.ep_size, -1).sum(dim=1).tolist()
            received = routed.new_empty(sum(recv_splits), routed.shape[-1])
            dist.all_to_all_single(
                received,
                routed,
                output_split_sizes=recv_splits,
                input_split_sizes=send_splits,
            )
            # rows arrive grouped by sender; regroup them by local expert
            local_ids = torch.arange(self.experts_per_rank, device=x.device)
            row_owner = local_ids.repeat(self.ep_size).repeat_interleave(incoming)
            regroup = row_owner.argsort(stable=True)
            routed = received[regroup]
            per_expert = incoming.view(self.ep_size, -1).sum(dim=0)

        counts = per_expert.cpu().numpy()
        first_expert = self.ep_rank * self.experts_per_rank
        pieces = []
        offset = 0
        for local_idx, count in enumerate(counts):
            if count == 0:
                continue
            expert = self.experts[first_expert + local_idx]
            pieces.append(expert(routed[offset : offset + count]))
            offset += count
        if pieces:
            expert_out = torch.cat(pieces, dim=0)
        else:
            expert_out = routed.new_empty(0, routed.shape[-1])

        if self.ep_size > 1:
            # undo the regrouping, then return rows to the ranks that sent them
            by_sender = torch.empty_like(expert_out)
            by_sender[regroup] = expert_out
            expert_out = by_sender.new_empty(sum(send_splits), by_sender.shape[-1])
            dist.all_to_all_single(
                expert_out,
                by_sender,
                output_split_sizes=send_splits,
                input_split_sizes=recv_splits,
            )

        # back to (token, slot) order
        unsorted = torch.empty_like(expert_out)
        unsorted[order] = expert_out
        per_slot = unsorted.view(n_tokens, k, -1).to(topk_weight.dtype)
        combined = (per_slot * topk_weight.unsqueeze(-1)).sum(dim=1)
        return combined.to(unsorted.dtype)
