"""The sparse feed-forward block of Qwen3.5 MoE (transformers' Qwen3_5MoeSparseMoeBlock): a softmax router picks
the top k of `num_experts` SwiGLU experts per token and weights them by their probabilities; a shared expert, scaled
by a sigmoid gate, runs on every token."""

import torch
import torch.nn.functional as F

from common.model_config import MoeConfig
from shardd.engine.reference.mlp import MLP


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits [n, num_experts] -> each token's top k experts [n, k] (most probable first) and their
    weights [n, k] in the logits' dtype; probabilities in float32."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(logits.dtype)


class SparseMoeBlock:
    def __init__(self, moe: MoeConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = weights[f"{prefix}.gate.weight"]  # the router [num_experts, hidden]
        self.experts = [MLP(weights, f"{prefix}.experts.{e}") for e in range(moe.num_experts)]
        self.shared_expert = MLP(weights, f"{prefix}.shared_expert")
        self.shared_expert_gate = weights[f"{prefix}.shared_expert_gate.weight"]  # [1, hidden]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [n, k] and their weights [n, k] (in x's dtype)."""
        return route(F.linear(x, self.gate), self.top_k, self.norm_topk_prob)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        # each expert once, over the tokens that chose it
        for expert in torch.unique(experts).tolist():
            token, slot = torch.where(experts == expert)
            routed = self.experts[expert](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, routed)
        return out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
