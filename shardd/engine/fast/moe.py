"""The sparse feed-forward block of a Qwen3.5 MoE layer in the fast step and prefill (the reference is
shardd/engine/reference/moe.py): one GEMM for the router, the shared expert's gate and its gate|up; routing on the
device (softmax, top k, normalisation, shardd/engine/kernels/moe_route.py); the routed experts and the sum with the
gated shared expert in shardd/engine/kernels/moe.py. No host sync and fixed shapes: it runs inside the step's CUDA graph.

The routed experts are bf16 / float32, or FP8 (block-scaled or per output channel, one layout for a layer's
experts): stacked as their bytes with their scales (shardd.engine.kernels.moe.ExpertScales), dequantized in the
kernels' registers. An FP8 shared expert stays FP8: the router|shared projection is then a StackedLinear of the
unquantized router and gate and the FP8 gate|up (shardd.weights.quant.fuse_rows)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model_config import ModelConfig
from shardd.engine.kernels import elementwise
from shardd.engine.kernels import moe as moe_kernels
from shardd.engine.kernels import moe_route
from shardd.engine.reference.moe import SparseMoeBlock
from shardd.weights.quant import Fp8Linear, fuse_rows


@dataclass
class FusedMoe:
    # [E + 1 + 2 * shared_width, hidden]: the router | the shared expert's sigmoid gate | its gate_proj | its up_proj
    # (a StackedLinear of those parts when the shared expert is FP8 and they do not fuse into one matrix)
    router_and_shared: torch.Tensor
    experts_gate_up: torch.Tensor    # [E, 2 * width, hidden]: each expert's gate | up (x's dtype, or FP8 bytes)
    experts_down: torch.Tensor       # [E, hidden, width]
    shared_down: torch.Tensor        # [hidden, shared_width]
    top_k: int
    norm_topk_prob: bool
    experts_scales: moe_kernels.ExpertScales | None = None  # FP8 experts: their scales and layout

    @property
    def num_experts(self) -> int:
        return self.experts_gate_up.shape[0]


def fuse_moe(block: SparseMoeBlock, layer: int) -> FusedMoe:
    """The block (of layer `layer`) with its weights fused and its experts stacked; the block's attributes then view
    them (no second copy). ValueError naming the layer where its experts mix layouts or carry FP8 scales the kernels
    do not read."""
    fp8 = _fp8_experts(block, layer)
    shared = block.shared_expert
    router_and_shared, views = fuse_rows([block.gate, block.shared_expert_gate, shared.gate_proj, shared.up_proj])
    block.gate, block.shared_expert_gate, shared.gate_proj, shared.up_proj = views
    width = block.experts[0].gate_proj.shape[0]
    if not fp8:
        gate_up = _stacked([[e.gate_proj, e.up_proj] for e in block.experts])
        down = _stacked([[e.down_proj] for e in block.experts])
        for index, expert in enumerate(block.experts):
            expert.gate_proj, expert.up_proj, expert.down_proj = \
                gate_up[index, :width], gate_up[index, width:], down[index]
        scales = None
    else:
        kernel = block.experts[0].gate_proj.kernel
        gate_up = _stacked([[e.gate_proj.weight, e.up_proj.weight] for e in block.experts])
        down = _stacked([[e.down_proj.weight] for e in block.experts])
        scales = moe_kernels.ExpertScales(
            torch.stack([torch.cat([_scale_rows(e.gate_proj), _scale_rows(e.up_proj)]) for e in block.experts]),
            torch.stack([_scale_rows(e.down_proj) for e in block.experts]), block.experts[0].gate_proj.block)
        for index, expert in enumerate(block.experts):
            expert.gate_proj, expert.up_proj, expert.down_proj = scales.linears(gate_up, down, index, kernel)
    if gate_up.is_cuda:  # copied experts' old memory back to the device: the next layer's copy needs it
        torch.cuda.empty_cache()
    return FusedMoe(router_and_shared, gate_up, down, shared.down_proj, block.top_k, block.norm_topk_prob, scales)


def _fp8_experts(block: SparseMoeBlock, layer: int) -> bool:
    """Whether the block's routed experts are FP8: every matrix in one layout (all in the model's dtype, or all FP8
    with the same block, or all per output channel), each FP8 scale of that layout's shape."""
    matrices = {f"experts.{e}.{name}": getattr(expert, name) for e, expert in enumerate(block.experts)
                for name in ("gate_proj", "up_proj", "down_proj")}
    layouts = Counter(_layout(m) for m in matrices.values())
    if len(layouts) > 1:
        mix = ", ".join(f"{count} {layout}" for layout, count in layouts.most_common())
        raise ValueError(f"layer {layer}'s routed experts mix layouts ({mix} matrices): the fast engine stacks a "
                         f"layer's experts in one layout")
    if not isinstance(block.experts[0].gate_proj, Fp8Linear):
        return False
    for name, matrix in matrices.items():
        n, k = matrix.shape
        if matrix.block is None:
            if matrix.scale.numel() != n:
                raise ValueError(f"layer {layer} {name}: an FP8 scale of shape {list(matrix.scale.shape)} is not one "
                                 f"per output channel ({n}); the fast engine runs FP8 experts with block scales or "
                                 f"per-channel scales")
            continue
        block_n, block_k = matrix.block
        expected = (math.ceil(n / block_n), math.ceil(k / block_k))
        if tuple(matrix.scale.shape) != expected or block_k % 16:
            raise ValueError(f"layer {layer} {name}: {block_n}x{block_k} block scales of shape "
                             f"{list(matrix.scale.shape)} for a {n}x{k} matrix; the fast engine reads block scales "
                             f"{list(expected)} with a block's K a multiple of 16")
    return True


def _layout(matrix) -> str:
    if isinstance(matrix, Fp8Linear):
        return "FP8 per-channel" if matrix.block is None else f"FP8 {matrix.block[0]}x{matrix.block[1]}-block"
    return str(matrix.dtype).removeprefix("torch.")


def _scale_rows(matrix: Fp8Linear) -> torch.Tensor:
    """An FP8 matrix's scale with one row per block of rows (per-channel: [N, 1]), as ExpertScales stacks them."""
    return matrix.scale if matrix.block is not None else matrix.scale.reshape(-1, 1)


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
                                      moe.experts_down, proj[:, e:e + 1], shared, buffers.experts, buffers.out,
                                      moe.experts_scales)
