"""The routed experts of a MoE layer over a step's rows: each (row, chosen expert) pair's SwiGLU expert, weighted by
its routing weight, the k weighted outputs of a row added in its slot order, plus the gated shared expert's output.

Each selected expert's weights are read once for all the pairs routed to it: the pairs are sorted by expert
(`expert_order`, one launch of fixed shape), and a program per (sorted pair, output tile) runs only where a run of up
to BLOCK_M pairs of one expert starts, multiplying those pairs' rows by the expert's tile. Row-independent by
construction: a pair's output element is reduced over K by one program in one fixed order of K tiles, whichever
pairs share its tile, and a row's k outputs are added by a separate pass in slot order, so a row's bits never depend
on which other rows chose the same expert or how many rows the step holds (given, as for the step's fixed-shape
GEMMs, that a tile multiply gives a row the same bits at any place in the tile). Pairs of padding rows (expert
`num_experts`, as shardd/engine/kernels/moe_route.py routes them) sort past every expert and never run: a decode
step reads only its real rows' experts.

`routed_experts_reference` is the same computation as a readable loop over rows and slots; `expert_order_reference`
the sort with torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # pairs of one expert a program multiplies at once (tl.dot's least rows)
GATE_UP_BLOCK_N = 32  # an expert is narrow (I = 512): more programs stream a decode step's few experts
BLOCK_N = 64
BLOCK_K = 64
COMBINE_BLOCK = 1024
SORT_BLOCK = 32  # pairs a program of the sort places


@triton.jit
def _sort_pairs_kernel(experts_ptr, sorted_expert_ptr, pair_ptr, run_start_ptr, NUM_EXPERTS: tl.constexpr,
                       PAIRS: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    # a stable sort by counting: pair i goes after every pair of a smaller expert and every earlier pair of its own
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    expert = tl.load(experts_ptr + offs_i, mask=offs_i < PAIRS, other=0)
    smaller = tl.zeros([BLOCK_I], dtype=tl.int32)
    earlier = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, PAIRS, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        other = tl.load(experts_ptr + offs_j, mask=offs_j < PAIRS, other=NUM_EXPERTS + 1)  # past every pair
        smaller += tl.sum((other[None, :] < expert[:, None]).to(tl.int32), axis=1)
        earlier += tl.sum(((other[None, :] == expert[:, None]) & (offs_j[None, :] < offs_i[:, None])).to(tl.int32),
                          axis=1)
    at = smaller + earlier
    mask = offs_i < PAIRS
    tl.store(sorted_expert_ptr + at, expert, mask=mask)
    tl.store(pair_ptr + at, offs_i, mask=mask)
    tl.store(run_start_ptr + at, smaller, mask=mask)


def expert_order(experts: torch.Tensor, num_experts: int, scratch: "ExpertScratch") -> None:
    """The step's (row, slot) pairs sorted by expert, stably, into scratch: `sorted_expert` (each sorted pair's
    expert), `pair` (its index p = row * k + slot) and `run_start` (the sorted index where its expert's pairs
    start). One launch of fixed shape, no host sync: graph-capturable."""
    pairs = experts.numel()
    _sort_pairs_kernel[(triton.cdiv(pairs, SORT_BLOCK),)](
        experts, scratch.sorted_expert, scratch.pair, scratch.run_start, NUM_EXPERTS=num_experts, PAIRS=pairs, BLOCK_I=SORT_BLOCK,
        BLOCK_J=min(triton.next_power_of_2(pairs), 256))


def expert_order_reference(experts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """expert_order with torch's stable sort: (sorted_expert, pair, run_start)."""
    sorted_expert, pair = torch.sort(experts.reshape(-1), stable=True)
    return sorted_expert, pair, torch.searchsorted(sorted_expert, sorted_expert)


@triton.jit
def _run_of(sorted_expert_ptr, pair_ptr, run_start_ptr, j, P, NUM_EXPERTS, BLOCK_M: tl.constexpr):
    # the sorted pair j's expert, whether j leads a run of BLOCK_M pairs of it, and the run's pair indices (-1: none)
    expert = tl.load(sorted_expert_ptr + j)
    leads = (expert < NUM_EXPERTS) & ((j - tl.load(run_start_ptr + j)) % BLOCK_M == 0)
    offs = j + tl.arange(0, BLOCK_M)
    inside = offs < P
    same = inside & (tl.load(sorted_expert_ptr + offs, mask=inside, other=-1) == expert)
    pair = tl.load(pair_ptr + offs, mask=same, other=-1)
    return expert, leads, pair


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_expert_ptr, pair_ptr, run_start_ptr, P, NUM_EXPERTS, TOP_K,
                    H: tl.constexpr, I: tl.constexpr, x_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    # act[pair, n] = silu(x[row] @ gate[e, n]) * (x[row] @ up[e, n]), rounded where the reference's SwiGLU rounds
    j = tl.program_id(0)
    expert, leads, pair = _run_of(sorted_expert_ptr, pair_ptr, run_start_ptr, j, P, NUM_EXPERTS, BLOCK_M)
    if leads:
        row = tl.where(pair >= 0, pair // TOP_K, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w = w_ptr + expert.to(tl.int64) * 2 * I * H  # gate_up [E, 2I, H]: gate rows 0 .. I-1, up rows I .. 2I-1
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row[:, None] * x_stride + offs_k[None, :],
                        mask=(pair[:, None] >= 0) & (offs_k[None, :] < H), other=0.0)
            mask_w = (offs_n[None, :] < I) & (offs_k[:, None] < H)
            gate = tl.load(w + offs_n[None, :] * H + offs_k[:, None], mask=mask_w, other=0.0)
            up = tl.load(w + (I + offs_n[None, :]) * H + offs_k[:, None], mask=mask_w, other=0.0)
            acc_gate = tl.dot(x, gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(x, up, acc_up, input_precision=PRECISION)
        dtype = act_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        act = (activated * acc_up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(act_ptr + pair[:, None] * I + offs_n[None, :], act, mask=(pair[:, None] >= 0) & (offs_n[None, :] < I))


@triton.jit
def _down_kernel(act_ptr, w_ptr, routing_ptr, out_ptr, sorted_expert_ptr, pair_ptr, run_start_ptr, P, NUM_EXPERTS,
                 H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # out[pair, n] = (act[pair] @ down[e, n]) * routing[pair], each rounded as the reference's `expert(x) * weight`
    j = tl.program_id(0)
    expert, leads, pair = _run_of(sorted_expert_ptr, pair_ptr, run_start_ptr, j, P, NUM_EXPERTS, BLOCK_M)
    if leads:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w = w_ptr + expert.to(tl.int64) * H * I  # down [E, H, I]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            act = tl.load(act_ptr + pair[:, None] * I + offs_k[None, :],
                          mask=(pair[:, None] >= 0) & (offs_k[None, :] < I), other=0.0)
            down = tl.load(w + offs_n[None, :] * I + offs_k[:, None],
                           mask=(offs_n[None, :] < H) & (offs_k[:, None] < I), other=0.0)
            acc = tl.dot(act, down, acc, input_precision=PRECISION)
        dtype = out_ptr.dtype.element_ty
        routing = tl.load(routing_ptr + pair, mask=pair >= 0, other=0.0).to(tl.float32)
        out = (acc.to(dtype).to(tl.float32) * routing[:, None]).to(dtype)
        tl.store(out_ptr + pair[:, None] * H + offs_n[None, :], out, mask=(pair[:, None] >= 0) & (offs_n[None, :] < H))


@triton.jit
def _combine_kernel(pair_out_ptr, shared_gate_ptr, shared_ptr, out_ptr, H, shared_gate_stride, shared_stride,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # a row's k weighted expert outputs added in slot order, then sigmoid(gate) * shared expert, each add rounded
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.load(pair_out_ptr + row * TOP_K * H + cols, mask=mask, other=0.0).to(tl.float32)
    for slot in tl.static_range(1, TOP_K):
        routed = tl.load(pair_out_ptr + (row * TOP_K + slot) * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc = (acc + routed).to(dtype).to(tl.float32)
    gate = tl.load(shared_gate_ptr + row * shared_gate_stride).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    shared = tl.load(shared_ptr + row * shared_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (acc + (gate * shared).to(dtype).to(tl.float32)).to(dtype), mask=mask)


class ExpertScratch:
    """What the routed experts of `rows` rows write between their kernels (static: a CUDA graph replays on it)."""

    def __init__(self, rows: int, top_k: int, hidden: int, width: int, dtype, device):
        pairs = rows * top_k
        self.sorted_expert, self.pair, self.run_start = (torch.zeros(pairs, dtype=torch.int32, device=device)
                                                         for _ in range(3))
        self.act = torch.zeros((pairs, width), dtype=dtype, device=device)  # each pair's SwiGLU product
        self.pair_out = torch.zeros((rows * top_k, hidden), dtype=dtype, device=device)  # each pair's weighted output


def routed_experts(x: torch.Tensor, experts: torch.Tensor, routing: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, shared_gate: torch.Tensor, shared: torch.Tensor, scratch: ExpertScratch,
                   out: torch.Tensor) -> torch.Tensor:
    """out [R, H] = for each row, the sum in slot order of routing[row, s] * expert experts[row, s](x[row]), plus
    sigmoid(shared_gate[row]) * shared[row]. x [R, H]; experts [R, k] (integers; E: a padding row, which runs no
    expert and gets an unspecified output) and routing [R, k] (x's dtype); gate_up [E, 2I, H] (gate | up),
    down [E, H, I]; shared_gate [R, 1] and shared [R, H] may be column slices."""
    rows, hidden = x.shape
    num_experts, width = gate_up.shape[0], down.shape[2]
    top_k = experts.shape[1]
    pairs = rows * top_k
    if x.stride(1) != 1:
        x = x.contiguous()
    expert_order(experts, num_experts, scratch)
    sorted_expert, pair, run_start = scratch.sorted_expert, scratch.pair, scratch.run_start
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _gate_up_kernel[(pairs, triton.cdiv(width, GATE_UP_BLOCK_N))](
        x, gate_up, scratch.act, sorted_expert, pair, run_start, pairs, num_experts, top_k, hidden, width, x.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision, num_warps=4)
    _down_kernel[(pairs, triton.cdiv(hidden, BLOCK_N))](
        scratch.act, down, routing.reshape(-1), scratch.pair_out, sorted_expert, pair, run_start, pairs, num_experts,
        hidden, width, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision, num_warps=4)
    _combine_kernel[(rows, triton.cdiv(hidden, COMBINE_BLOCK))](
        scratch.pair_out, shared_gate, shared, out, hidden, shared_gate.stride(0), shared.stride(0), TOP_K=top_k,
        BLOCK=COMBINE_BLOCK)
    return out


def routed_experts_reference(x, experts, routing, gate_up, down, shared_gate, shared) -> torch.Tensor:
    """routed_experts as a loop over rows and slots, with the reference MoE block's rounding points
    (shardd/engine/reference/moe.py); padding rows are zero."""
    out = torch.zeros_like(x)
    num_experts, width = gate_up.shape[0], down.shape[2]
    for row in range(x.shape[0]):
        if (experts[row] == num_experts).any():
            continue
        total = torch.zeros_like(x[row])
        for slot in range(experts.shape[1]):
            expert = int(experts[row, slot])
            gate, up = F.linear(x[row], gate_up[expert, :width]), F.linear(x[row], gate_up[expert, width:])
            total = total + F.linear(F.silu(gate) * up, down[expert]) * routing[row, slot]
        out[row] = total + torch.sigmoid(shared_gate[row]) * shared[row]
    return out
