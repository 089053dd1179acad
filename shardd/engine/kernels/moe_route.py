"""A MoE layer's routing over a step's rows, one launch (the reference is shardd/engine/reference/moe.py's `route`):
the router's logits softmaxed in float32, the top k experts, their probabilities renormalised over the k when the
config says so, rounded to the logits' dtype. Each row's experts come out in ascending order, the order the
reference adds their outputs in. A padding row (its segment -1 in the step's control) gets expert `num_experts`
in every slot: it runs no expert (shardd/engine/kernels/moe.py).

One program per row, so a row's routing never depends on the other rows. Among equal probabilities the lowest
expert index wins (torch.topk leaves ties unspecified).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardd.engine.reference.moe import route


@triton.jit
def _route_kernel(logits_ptr, experts_ptr, weights_ptr, row_segment_ptr, logits_stride, NUM_EXPERTS: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK: tl.constexpr, NORMALISE: tl.constexpr, HAS_ROWS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < NUM_EXPERTS
    logits = tl.load(logits_ptr + row * logits_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, axis=0))
    probs = exp / tl.sum(exp, axis=0)
    remaining = tl.where(inside, probs, -1.0)
    chosen = cols < 0
    total = 0.0
    for _ in tl.static_range(TOP_K):  # the most probable left, the lowest index among equals
        best = tl.max(remaining, axis=0)
        pick = tl.min(tl.where(remaining == best, cols, BLOCK), axis=0)
        chosen = chosen | (cols == pick)
        remaining = tl.where(cols == pick, -1.0, remaining)
        total += best
    weights = probs
    if NORMALISE:
        weights = probs / total
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # ascending expert order
    expert = cols
    if HAS_ROWS:
        expert = tl.where(tl.load(row_segment_ptr + row) < 0, NUM_EXPERTS, cols)
    tl.store(experts_ptr + row * TOP_K + slot, expert, mask=chosen)
    tl.store(weights_ptr + row * TOP_K + slot, weights.to(weights_ptr.dtype.element_ty), mask=chosen)


def route_rows(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, row_segment: torch.Tensor | None,
               experts: torch.Tensor, weights: torch.Tensor) -> None:
    """logits [R, E] (may be a column slice) -> experts [R, k] int32 (ascending; E for a padding row) and weights
    [R, k] in the logits' dtype. row_segment [R] int32: each row's segment, -1 for padding (None: every row real)."""
    rows, num_experts = logits.shape
    _route_kernel[(rows,)](logits, experts, weights, row_segment if row_segment is not None else experts,
                           logits.stride(0), NUM_EXPERTS=num_experts, TOP_K=top_k,
                           BLOCK=triton.next_power_of_2(num_experts), NORMALISE=norm_topk_prob,
                           HAS_ROWS=row_segment is not None)


def route_rows_reference(logits, top_k: int, norm_topk_prob: bool, row_segment) -> tuple[torch.Tensor, torch.Tensor]:
    """route_rows through the reference's `route`, each row's experts then sorted ascending."""
    experts, weights = route(logits, top_k, norm_topk_prob)
    experts, order = experts.sort(dim=-1)
    weights = weights.gather(-1, order)
    if row_segment is not None:
        experts = torch.where(row_segment[:, None] < 0, logits.shape[1], experts)
    return experts.to(torch.int32), weights
