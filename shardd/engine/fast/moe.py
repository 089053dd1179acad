"""The sparse feed-forward block of a Qwen3.5 MoE layer in the fast step and prefill (the reference is
shardd/engine/reference/moe.py): one GEMM for the router, the shared expert's gate and its gate|up; routing on the
device (softmax, top k, normalisation, shardd/engine/kernels/moe_route.py); the routed experts and the sum with the
gated shared expert in shardd/engine/kernels/moe.py. No host sync and fixed shapes: it runs inside the step's CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model_config import ModelConfig
from common.sizes import MOE_FP8_REFUSAL
from shardd.engine.kernels import elementwise
from shardd.engine.kernels import moe as moe_kernels
from shardd.engine.kernels import moe_route
from shardd.engine.reference.moe import SparseMoeBlock


@dataclass
class FusedMoe:
    # [E + 1 + 2 * shared_width, hidden]: the router | the shared expert's sigmoid gate | its gate_proj | its up_proj
    router_and_shared: torch.Tensor
    experts_gate_up: torch.Tensor    # [E, 2 * width, hidden]: each expert's gate | up
    experts_down: torch.Tensor       # [E, hidden, width]
    shared_down: torch.Tensor        # [hidden, shared_width]
    top_k: int
    norm_topk_prob: bool

    @property
    def num_experts(self) -> int:
        return self.experts_gate_up.shape[0]


def fuse_moe(block: SparseMoeBlock) -> FusedMoe:
    """The block's weights fused and its experts stacked; the block's attributes then view them (no second copy)."""
    shared = block.shared_expert
    parts = [block.gate, block.shared_expert_gate, shared.gate_proj, shared.up_proj]
    if any(not isinstance(p, torch.Tensor) for e in block.experts for p in (e.gate_proj, e.up_proj, e.down_proj)) or \
            any(not isinstance(p, torch.Tensor) for p in [*parts, shared.down_proj]):
        raise ValueError(MOE_FP8_REFUSAL)
    router_and_shared = torch.cat(parts)
    sizes = [p.shape[0] for p in parts]
    block.gate, block.shared_expert_gate, shared.gate_proj, shared.up_proj = router_and_shared.split(sizes)
    width = block.experts[0].gate_proj.shape[0]
    gate_up = _stacked([[e.gate_proj, e.up_proj] for e in block.experts])
    down = _stacked([[e.down_proj] for e in block.experts])
    for index, expert in enumerate(block.experts):
        expert.gate_proj, expert.up_proj, expert.down_proj = gate_up[index, :width], gate_up[index, width:], down[index]
    if gate_up.is_cuda:  # copied experts' old memory back to the device: the next layer's copy needs it
        torch.cuda.empty_cache()
    return FusedMoe(router_and_shared, gate_up, down, shared.down_proj, block.top_k, block.norm_topk_prob)


def _stacked(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """[E, rows, K]: expert e's parts stacked along rows: the tensor they already view when a checkpoint stored them
    fused in this layout (transformers' `gate_up_proj`, `down_proj`), else a copy."""
    base = parts[0][0]._base
    if base is not None and base.is_contiguous() and base.shape[0] == len(parts) and all(
            p._base is base and p.data_ptr() == base[e].data_ptr() + sum(q.nbytes for q in row[:i])
            for e, row in enumerate(parts) for i, p in enumerate(row)) and \
            sum(p.shape[0] for p in parts[0]) == base.shape[1]:
        return base
    first = parts[0]
    stacked = torch.empty((len(parts), sum(p.shape[0] for p in first), first[0].shape[1]), dtype=first[0].dtype,
                          device=first[0].device)
    for e, row in enumerate(parts):
        torch.cat(row, out=stacked[e])
    return stacked


class MoeBuffers:
    """The static scratch of the block over `rows` rows."""

    def __init__(self, config: ModelConfig, rows: int, dtype, device):
        moe = config.moe
        self.experts_chosen = torch.zeros((rows, moe.num_experts_per_tok), dtype=torch.int32, device=device)
        self.routing = torch.zeros((rows, moe.num_experts_per_tok), dtype=dtype, device=device)
        self.shared_act = torch.zeros((rows, moe.shared_expert_intermediate_size), dtype=dtype, device=device)
        self.experts = moe_kernels.ExpertScratch(rows, moe.num_experts_per_tok, config.hidden_size,
                                                 moe.moe_intermediate_size, dtype, device)
        self.out = torch.zeros((rows, config.hidden_size), dtype=dtype, device=device)


def sparse_mlp(moe: FusedMoe, x: torch.Tensor, row_segment: torch.Tensor | None, buffers: MoeBuffers) -> torch.Tensor:
    """x [R, hidden] -> the block's output [R, hidden] (buffers.out); rows whose `row_segment` is -1 (padding) read
    no expert (None: every row is real)."""
    proj = F.linear(x, moe.router_and_shared)
    e = moe.num_experts
    moe_route.route_rows(proj[:, :e], moe.top_k, moe.norm_topk_prob, row_segment, buffers.experts_chosen,
                         buffers.routing)
    shared = F.linear(elementwise.silu_mul(proj[:, e + 1:], buffers.shared_act), moe.shared_down)
    return moe_kernels.routed_experts(x, buffers.experts_chosen, buffers.routing, moe.experts_gate_up,
                                      moe.experts_down, proj[:, e:e + 1], shared, buffers.experts, buffers.out)
