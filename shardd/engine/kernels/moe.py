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

FP8 experts (`ExpertScales`: 128x128 block scales as the `-FP8` checkpoints store them, or one scale per output
channel) are read as their bytes and dequantized in registers, as shardd/engine/kernels/fp8_gemm.py does: a block
scale multiplies each K tile's float32 product (the K tiles never straddle a block), a channel scale the sum, and
the result is rounded where a bf16 expert's is. The gate's and up's scales are kept apart, so a scale block never
spans the two even where an expert is narrower than a block.

`routed_experts_reference` is the same computation as a readable loop over rows and slots; `expert_order_reference`
the sort with torch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from shardd.engine.kernels.fp8_gemm import _CONVERTS, _dequantized_tile, conversion
from shardd.weights.quant import Fp8Linear

BLOCK_M = 16  # pairs of one expert a program multiplies at once (tl.dot's least rows)
GATE_UP_BLOCK_N = 32  # an expert is narrow (I = 512): more programs stream a decode step's few experts
BLOCK_N = 64
BLOCK_K = 64
GATE_UP_WARPS = DOWN_WARPS = 4  # scripts/tune_kernels.py --parts moe sweeps these launch shapes
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
def _tile_product(acc, x, w, scale_rows, k0, n_mask, scale_stride_k, PRECISION: tl.constexpr, FP8: tl.constexpr,
                  BLOCKWISE: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, CONVERT: tl.constexpr):
    # acc + x @ w for one K tile of the weight [BLOCK_K, BLOCK_N]: as loaded, or FP8 bytes dequantized in registers
    # with the K tile's block scale on its float32 product (a channel scale multiplies the sum: _channel_scaled)
    if FP8:
        w = _dequantized_tile(w, CONVERT, x.dtype)
        if BLOCKWISE:
            s = tl.load(scale_rows + (k0 // SCALE_BLOCK_K) * scale_stride_k, mask=n_mask, other=0.0)
            acc += tl.dot(x, w, input_precision=PRECISION) * s[None, :]
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _channel_scaled(acc, scale_rows, n_mask, FP8: tl.constexpr, BLOCKWISE: tl.constexpr):
    if FP8:
        if not BLOCKWISE:
            acc = acc * tl.load(scale_rows, mask=n_mask, other=0.0)[None, :]
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, act_ptr, sorted_expert_ptr, pair_ptr, run_start_ptr, P, NUM_EXPERTS, TOP_K,
                    H: tl.constexpr, I: tl.constexpr, x_stride, w_ptr, scale_ptr, scale_stride_e, scale_stride_n,
                    scale_stride_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, FP8: tl.constexpr, BLOCKWISE: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
                    SCALE_BLOCK_K: tl.constexpr, CONVERT: tl.constexpr):
    # act[pair, n] = silu(x[row] @ gate[e, n]) * (x[row] @ up[e, n]), rounded where the reference's SwiGLU rounds
    j = tl.program_id(0)
    expert, leads, pair = _run_of(sorted_expert_ptr, pair_ptr, run_start_ptr, j, P, NUM_EXPERTS, BLOCK_M)
    if leads:
        row = tl.where(pair >= 0, pair // TOP_K, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        w = w_ptr + expert.to(tl.int64) * 2 * I * H  # gate_up [E, 2I, H]: gate rows 0 .. I-1, up rows I .. 2I-1
        # FP8: the scale rows of the gate's rows, then of the up's (ExpertScales.gate_up; SCALE_BLOCK_N 1 per channel)
        gate_scale = scale_ptr + expert.to(tl.int64) * scale_stride_e + (offs_n // SCALE_BLOCK_N) * scale_stride_n
        up_scale = gate_scale + (I + SCALE_BLOCK_N - 1) // SCALE_BLOCK_N * scale_stride_n
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row[:, None] * x_stride + offs_k[None, :],
                        mask=(pair[:, None] >= 0) & (offs_k[None, :] < H), other=0.0)
            mask_w = (offs_n[None, :] < I) & (offs_k[:, None] < H)
            gate = tl.load(w + offs_n[None, :] * H + offs_k[:, None], mask=mask_w, other=0.0)
            up = tl.load(w + (I + offs_n[None, :]) * H + offs_k[:, None], mask=mask_w, other=0.0)
            acc_gate = _tile_product(acc_gate, x, gate, gate_scale, k0, n_mask, scale_stride_k, PRECISION, FP8,
                                     BLOCKWISE, SCALE_BLOCK_K, CONVERT)
            acc_up = _tile_product(acc_up, x, up, up_scale, k0, n_mask, scale_stride_k, PRECISION, FP8, BLOCKWISE,
                                   SCALE_BLOCK_K, CONVERT)
        acc_gate = _channel_scaled(acc_gate, gate_scale, n_mask, FP8, BLOCKWISE)
        acc_up = _channel_scaled(acc_up, up_scale, n_mask, FP8, BLOCKWISE)
        dtype = act_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        act = (activated * acc_up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(act_ptr + pair[:, None] * I + offs_n[None, :], act, mask=(pair[:, None] >= 0) & (offs_n[None, :] < I))


@triton.jit
def _down_kernel(act_ptr, routing_ptr, out_ptr, sorted_expert_ptr, pair_ptr, run_start_ptr, P, NUM_EXPERTS,
                 H: tl.constexpr, I: tl.constexpr, w_ptr, scale_ptr, scale_stride_e, scale_stride_n, scale_stride_k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 FP8: tl.constexpr, BLOCKWISE: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                 CONVERT: tl.constexpr):
    # out[pair, n] = (act[pair] @ down[e, n]) * routing[pair], each rounded as the reference's `expert(x) * weight`
    j = tl.program_id(0)
    expert, leads, pair = _run_of(sorted_expert_ptr, pair_ptr, run_start_ptr, j, P, NUM_EXPERTS, BLOCK_M)
    if leads:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w = w_ptr + expert.to(tl.int64) * H * I  # down [E, H, I]
        scale_rows = scale_ptr + expert.to(tl.int64) * scale_stride_e + (offs_n // SCALE_BLOCK_N) * scale_stride_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            act = tl.load(act_ptr + pair[:, None] * I + offs_k[None, :],
                          mask=(pair[:, None] >= 0) & (offs_k[None, :] < I), other=0.0)
            down = tl.load(w + offs_n[None, :] * I + offs_k[:, None],
                           mask=(offs_n[None, :] < H) & (offs_k[:, None] < I), other=0.0)
            acc = _tile_product(acc, act, down, scale_rows, k0, n_mask, scale_stride_k, PRECISION, FP8, BLOCKWISE,
                                SCALE_BLOCK_K, CONVERT)
        acc = _channel_scaled(acc, scale_rows, n_mask, FP8, BLOCKWISE)
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


@dataclass(frozen=True)
class ExpertScales:
    """The float32 scales of a layer's stacked FP8 experts (gate_up [E, 2I, H] and down [E, H, I] float8_e4m3fn),
    in one layout for every expert. `block` (bn, bk): gate_up [E, 2 * ceil(I / bn), ceil(H / bk)] (the gate's row
    blocks, then the up's) and down [E, ceil(H / bn), ceil(I / bk)]; None (per output channel): gate_up [E, 2I, 1]
    and down [E, H, 1]. An expert's slice of each is the scale its Fp8Linear holds (shardd.weights.quant)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int] | None

    def linears(self, gate_up: torch.Tensor, down: torch.Tensor, expert: int, kernel=None) -> tuple[Fp8Linear, ...]:
        """Expert `expert`'s gate_proj, up_proj and down_proj as Fp8Linears viewing the stacked bytes and scales."""
        width, gate_rows = down.shape[2], self.gate_up.shape[1] // 2
        return (Fp8Linear(gate_up[expert, :width], self.gate_up[expert, :gate_rows], self.block, kernel),
                Fp8Linear(gate_up[expert, width:], self.gate_up[expert, gate_rows:], self.block, kernel),
                Fp8Linear(down[expert], self.down[expert], self.block, kernel))


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
                   out: torch.Tensor, scales: ExpertScales | None = None) -> torch.Tensor:
    """out [R, H] = for each row, the sum in slot order of routing[row, s] * expert experts[row, s](x[row]), plus
    sigmoid(shared_gate[row]) * shared[row]. x [R, H]; experts [R, k] (integers; E: a padding row, which runs no
    expert and gets an unspecified output) and routing [R, k] (x's dtype); gate_up [E, 2I, H] (gate | up),
    down [E, H, I], in x's dtype or float8_e4m3fn with their `scales`; shared_gate [R, 1] and shared [R, H] may be
    column slices."""
    rows, hidden = x.shape
    num_experts, width = gate_up.shape[0], down.shape[2]
    top_k = experts.shape[1]
    pairs = rows * top_k
    if x.stride(1) != 1:
        x = x.contiguous()
    expert_order(experts, num_experts, scratch)
    sorted_expert, pair, run_start = scratch.sorted_expert, scratch.pair, scratch.run_start
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    gate_up_scale, down_scale, block = (None, None, None) if scales is None else \
        (scales.gate_up, scales.down, scales.block)
    _gate_up_kernel[(pairs, triton.cdiv(width, GATE_UP_BLOCK_N))](
        x, scratch.act, sorted_expert, pair, run_start, pairs, num_experts, top_k, hidden, width, x.stride(0),
        **_weight_operands(gate_up, gate_up_scale, block, x.device),
        BLOCK_M=BLOCK_M, BLOCK_N=GATE_UP_BLOCK_N, PRECISION=precision, num_warps=GATE_UP_WARPS)
    _down_kernel[(pairs, triton.cdiv(hidden, BLOCK_N))](
        scratch.act, routing.reshape(-1), scratch.pair_out, sorted_expert, pair, run_start, pairs, num_experts,
        hidden, width, **_weight_operands(down, down_scale, block, x.device),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=precision, num_warps=DOWN_WARPS)
    _combine_kernel[(rows, triton.cdiv(hidden, COMBINE_BLOCK))](
        scratch.pair_out, shared_gate, shared, out, hidden, shared_gate.stride(0), shared.stride(0), TOP_K=top_k,
        BLOCK=COMBINE_BLOCK)
    return out


def _weight_operands(weight: torch.Tensor, scale: torch.Tensor | None, block, device) -> dict:
    """How a kernel reads one stacked weight: the tensor in x's dtype (scale None), or its FP8 bytes (as the
    conversion loads them) with their [E, rows, cols] scale (`block`: ExpertScales.block), in K tiles of BLOCK_K
    or of a divisor of a narrower block's K (a tile never straddles two blocks)."""
    if scale is None:  # no scale: any pointer, never read
        return dict(w_ptr=weight, scale_ptr=weight, scale_stride_e=0, scale_stride_n=0, scale_stride_k=0,
                    BLOCK_K=BLOCK_K, FP8=False, BLOCKWISE=False, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1, CONVERT=0)
    convert = conversion(device)
    block_n, block_k = block or (1, 1)
    return dict(w_ptr=weight if convert == "native" else weight.view(torch.uint8), scale_ptr=scale,
                scale_stride_e=scale.stride(0), scale_stride_n=scale.stride(1), scale_stride_k=scale.stride(2),
                BLOCK_K=BLOCK_K if block is None else math.gcd(BLOCK_K, block_k), FP8=True,
                BLOCKWISE=block is not None, SCALE_BLOCK_N=block_n, SCALE_BLOCK_K=block_k,
                CONVERT=_CONVERTS[convert])


def routed_experts_reference(x, experts, routing, gate_up, down, shared_gate, shared,
                             scales: ExpertScales | None = None) -> torch.Tensor:
    """routed_experts as a loop over rows and slots, with the reference MoE block's rounding points
    (shardd/engine/reference/moe.py); FP8 experts dequantized to x's dtype (shardd.weights.quant.dequantize), as the
    reference engine loads them on the CPU; padding rows are zero."""
    out = torch.zeros_like(x)
    num_experts, width = gate_up.shape[0], down.shape[2]
    for row in range(x.shape[0]):
        if (experts[row] == num_experts).any():
            continue
        total = torch.zeros_like(x[row])
        for slot in range(experts.shape[1]):
            expert = int(experts[row, slot])
            if scales is None:
                gate_w, up_w, down_w = gate_up[expert, :width], gate_up[expert, width:], down[expert]
            else:
                gate_w, up_w, down_w = (m.dequantized(x.dtype) for m in scales.linears(gate_up, down, expert))
            gate, up = F.linear(x[row], gate_w), F.linear(x[row], up_w)
            total = total + F.linear(F.silu(gate) * up, down_w) * routing[row, slot]
        out[row] = total + torch.sigmoid(shared_gate[row]) * shared[row]
    return out
