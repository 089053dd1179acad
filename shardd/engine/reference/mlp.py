"""SwiGLU feed-forward block."""

import torch
import torch.nn.functional as F


class MLP:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str):
        self.gate_proj = weights[f"{prefix}.gate_proj.weight"]
        self.up_proj = weights[f"{prefix}.up_proj.weight"]
        self.down_proj = weights[f"{prefix}.down_proj.weight"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)
