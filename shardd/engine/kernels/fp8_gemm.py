"""Weight-only FP8 GEMM for the step: y = x @ dequantize(w).T with the FP8 bytes read once and dequantized
in registers, bf16 activations, float32 accumulation, the output rounded once to x's dtype (as the bf16
cuBLAS path rounds).

Two scale layouts (what the checkpoints carry):
- block-wise `fp8` (`weight_block_size: [128, 128]`): float32 `scale[ceil(N/128), ceil(K/128)]`,
  w_real[n, k] = w[n, k] * scale[n // 128, k // 128], partial blocks at the edges;
- per-output-channel (compressed-tensors): float32 `scale[N]` or `[N, 1]`.

A row's bits never depend on the other rows or on how many there are: the rows are cut into tiles of
BLOCK_M = 16 whatever M, the tile shape (and the split of K, when there is one) is a function of (N, K)
only, and a split-K's partial sums are added in the fixed split order. One program computes every 16-row
tile of the call (up to LARGE_M rows) from one read and one conversion of each weight tile, each row tile
with its own accumulator and its own dot of the same shape: 64 rows cost the weight bytes once, and a row's
arithmetic is the same as in a 16-row call. The block scale multiplies each K tile's float32 partial
product (the FP8 value itself is exact in bf16), the channel scale the sum.

Two ways to turn the bytes into bf16 before the bf16 MMA (neither uses FP8 tensor cores, which would
need FP8 activations):
- `native` (sm_89 and later): Triton's float8e4nv load and conversion;
- `ampere`/`asm` (needs no FP8 type; sm_80/86, and the faster one on Hopper too): the bytes are loaded as
  uint8 and rebuilt as bf16 by bit manipulation, four at a time in PTX (`prmt`, `and`, `shl`, one
  `fma.rn.bf16x2` by 2^120, all sm_80 instructions), or in plain Triton integer ops (`bits`: the
  interpreter's version, and a fallback). `fp8_linear(..., ampere=True)` forces it on any GPU.

Above LARGE_M rows (a prefill) the matrix is dequantized to bf16 a chunk of output rows at a time and
multiplied by torch.matmul; row independence is not promised there.

Beside it: the launch shapes (fp8_tiles.py), the packed weight layout (fp8_packing.py) and dequantization
(fp8_dequantize.py); their names are importable from here too.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from shardd.engine.kernels import interpreted
from shardd.engine.kernels.fp8_dequantize import _fp8_bits_to_float, dequantized
from shardd.engine.kernels.fp8_packing import Geometry, PackedWeight, geometry
from shardd.engine.kernels.fp8_tiles import TILE_TABLE, TILES_ENV, TileConfig, _rule, load_tiles

# the rest of those modules' public names, importable from here too (tests, scripts, shardd.engine.select)
from shardd.engine.kernels.fp8_dequantize import dequantize_fp8  # noqa: F401
from shardd.engine.kernels.fp8_packing import pack_weight, unpack_weight  # noqa: F401
from shardd.engine.kernels.fp8_tiles import tiles_identity  # noqa: F401

BLOCK_M = 16          # rows per tile, whatever M: a row's MMA never sees a different tile shape
LARGE_M = 128         # more rows than this take the dequantize-then-matmul path
MAX_ROW_TILES = LARGE_M // BLOCK_M  # row tiles one program computes from one read of each weight tile
CHUNK_ELEMENTS = 1 << 23  # weight elements dequantized at once on the large-M path (32 MiB in float32)
AMPERE_CONVERT = "asm"    # how the Ampere path rebuilds bf16 on a GPU: "asm" (PTX, 4 bytes a time) or "bits"
# The sm_89+ path: the asm bit shuffle is faster than Triton's conversion ("native": e4m3x2 -> f16x2, then one
# f16 -> bf16 per value)
HOPPER_CONVERT = "asm"
# "asm_v1": the first asm shuffle (4 integer ops a pair instead of 2), kept for the benchmark's comparison
_CONVERTS = {"native": 0, "asm": 1, "bits": 2, "asm_v1": 3}
SMEM_BUDGET = 200 * 1024  # shared memory a program's pipeline may take: stages are cut to fit (never the tile)

_TUNED: dict | None = None


def tile_config(n: int, k: int, blockwise: bool) -> TileConfig:
    """The launch shape of an [N, K] matrix: $SHARDD_FP8_TILES's entry, else TILE_TABLE's, else the rule."""
    global _TUNED
    if _TUNED is None:
        import os

        path = os.environ.get(TILES_ENV)
        _TUNED = load_tiles(path) if path else {}
    return _TUNED.get((n, k, blockwise)) or TILE_TABLE.get((n, k, blockwise)) or _rule(n, k, blockwise)


@triton.jit
def _fp8_bytes_to_bf16_asm(u):
    """uint8 e4m3fn bytes -> bf16, four per 32-bit register, two integer ops a pair of values: one `prmt` puts
    each byte in the low half of a 16-bit lane with its sign bit replicated over the high half, one `and` keeps
    the sign as bit 11 and exponent|mantissa in bits 0-6; a shift by 4 (ptxas may put it on the FMA pipe) moves
    them into bf16's fields and one bf16x2 fma by 2^120 re-biases the exponent (exact; subnormals kept).
    sm_80 instructions only."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, bias, negzero;
        mov.b32 bias, 0x7B807B80;
        mov.b32 negzero, 0x80008000;
        prmt.b32 lo, $2, 0, 0x9180;
        prmt.b32 hi, $2, 0, 0xB3A2;
        and.b32 lo, lo, 0x087F087F;
        and.b32 hi, hi, 0x087F087F;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        fma.rn.bf16x2 $0, lo, bias, negzero;
        fma.rn.bf16x2 $1, hi, bias, negzero;
        }
        """,
        constraints="=r,=r,r",
        args=[u],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _fp8_bytes_to_bf16_asm_v1(u):
    """The first Ampere conversion (kept for the benchmark's comparison): the byte moved to the top of a 16-bit
    lane, sign and exponent|mantissa masked apart, shifted, or-ed (4 integer ops a pair), the same fma."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, sign, bias, negzero;
        mov.b32 bias, 0x7B807B80;
        mov.b32 negzero, 0x80008000;
        prmt.b32 lo, 0, $2, 0x5040;
        prmt.b32 hi, 0, $2, 0x7060;
        and.b32 sign, lo, 0x80008000;
        and.b32 lo, lo, 0x7F007F00;
        shr.b32 lo, lo, 4;
        or.b32 lo, lo, sign;
        and.b32 sign, hi, 0x80008000;
        and.b32 hi, hi, 0x7F007F00;
        shr.b32 hi, hi, 4;
        or.b32 hi, hi, sign;
        fma.rn.bf16x2 $0, lo, bias, negzero;
        fma.rn.bf16x2 $1, hi, bias, negzero;
        }
        """,
        constraints="=r,=r,r",
        args=[u],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _prefetch_l2(ptrs, mask):
    """prefetch.global.L2 of each address whose mask is set (sm_80+; no value comes back)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def _dequantized_tile(w, CONVERT: tl.constexpr, dtype: tl.constexpr):
    if CONVERT == 0:
        return w.to(dtype)
    elif CONVERT == 1:
        return _fp8_bytes_to_bf16_asm(w).to(dtype)
    elif CONVERT == 3:
        return _fp8_bytes_to_bf16_asm_v1(w).to(dtype)
    else:
        return _fp8_bits_to_float(w).to(dtype)


@triton.jit
def _row_tile_step(acc, x_ptr, r, M, x_stride, offs_k, k_mask, w, s,
                   BLOCK_M: tl.constexpr, BLOCKWISE: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """One K tile of one 16-row tile: the same operations for every row tile, whatever their number."""
    offs_m = r * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    if SWAP:
        x = tl.load(x_ptr + offs_m[None, :] * x_stride + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        if BLOCKWISE:
            acc += tl.dot(w, x, input_precision=PRECISION) * s
        else:
            acc = tl.dot(w, x, acc, input_precision=PRECISION)
    else:
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if BLOCKWISE:
            acc += tl.dot(x, w, input_precision=PRECISION) * s
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        return tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _tile_ptrs(base, r, row_stride, offs_n, M, N, BLOCK_M: tl.constexpr, SWAP: tl.constexpr):
    offs_m = r * BLOCK_M + tl.arange(0, BLOCK_M)
    if SWAP:
        return base + offs_m[None, :] * row_stride + offs_n[:, None], (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        return base + offs_m[:, None] * row_stride + offs_n[None, :], (offs_m[:, None] < M) & (offs_n[None, :] < N)


@triton.jit
def _finish_row_tile(acc, r, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k, channel_scale,
                     BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, BLOCKWISE: tl.constexpr, SWAP: tl.constexpr):
    """Without split-K: scale (channel) and store; with it: store this split's float32 partial."""
    if not BLOCKWISE:
        acc = acc * channel_scale
    if SPLIT_K == 1:
        ptrs, mask = _tile_ptrs(out_ptr, r, out_stride, offs_n, M, N, BLOCK_M, SWAP)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ptrs, mask = _tile_ptrs(partial_ptr + pid_k * partial_rows * N, r, N, offs_n, M, N, BLOCK_M, SWAP)
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _reduce_row_tile(r, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n,
                     BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr):
    """The last split to arrive adds the partials in split order 0, 1, ... (never in arrival order)."""
    ptrs, mask = _tile_ptrs(partial_ptr, r, N, offs_n, M, N, BLOCK_M, SWAP)
    total = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, SPLIT_K):
        total += tl.load(ptrs + split * partial_rows * N, mask=mask, other=0.0, cache_modifier=".cg")
    out_ptrs, _ = _tile_ptrs(out_ptr, r, out_stride, offs_n, M, N, BLOCK_M, SWAP)
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel per row-tile count: the same code computes each row
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, x_stride, out_stride, scale_stride_n, scale_stride_k, scale_block_n, k_tiles, partial_rows,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, SPLIT_K: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr, ROW_TILES: tl.constexpr, GROUPED: tl.constexpr, BLOCKWISE: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr, SCALE_UNIFORM: tl.constexpr, CONVERT: tl.constexpr, SWAP: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr, PACKED: tl.constexpr, PREFETCH: tl.constexpr,
):
    # One program per (N tile, K split, group of ROW_TILES row tiles: one group up to LARGE_M rows) computes its
    # 16-row tiles (unrolled: each its own accumulator and its own dot of the same shape) from one load and one
    # conversion of each weight tile. UNROLL K tiles of BLOCK_K (one scale each) are loaded per iteration: more
    # bytes in flight without changing any row's arithmetic.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if GROUPED:  # more than MAX_ROW_TILES row tiles: this program's first
        t0 = tl.program_id(2) * ROW_TILES
    else:  # a constant keeps the row addressing out of the loop
        t0 = 0
    dtype = x_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if PACKED:  # the weight as contiguous [BLOCK_N, BLOCK_K] tiles, an N tile's K tiles in order, zero-padded
        w_tiles = w_ptr + pid_n.to(tl.int64) * (TILES_PER_SPLIT * UNROLL * SPLIT_K * BLOCK_N * BLOCK_K)
        tile_offs = tl.arange(0, BLOCK_N) * BLOCK_K
    else:
        w_rows = w_ptr + offs_n.to(tl.int64) * K
    if PDL:  # launched early (programmatic dependent launch): nothing is read or written before the previous kernel
        # ends, except prefetches of this program's first weight tiles into L2 (a hint: no value depends on it)
        if PREFETCH > 0:  # 128-byte lines: in all (packed), or per row (row-major)
            first = pid_k * TILES_PER_SPLIT * UNROLL
            if PACKED:
                offs = first * (BLOCK_N * BLOCK_K) + tl.arange(0, PREFETCH) * 128
                _prefetch_l2(w_tiles + offs, offs < TILES_PER_SPLIT * UNROLL * SPLIT_K * BLOCK_N * BLOCK_K)
            else:
                cols = first * BLOCK_K + tl.arange(0, PREFETCH) * 128
                _prefetch_l2(w_rows[:, None] + cols[None, :], n_mask[:, None] & (cols[None, :] < K))
        gdc_wait()
    if SCALE_UNIFORM:  # the N tile lies in one scale block: one scalar per K tile
        scale_row = scale_ptr + (pid_n * BLOCK_N // scale_block_n) * scale_stride_n
    else:
        scale_row = scale_ptr + (offs_n // scale_block_n) * scale_stride_n
    acc0 = _zeros(BLOCK_M, BLOCK_N, SWAP)
    acc1 = _zeros(BLOCK_M, BLOCK_N, SWAP)
    acc2 = _zeros(BLOCK_M, BLOCK_N, SWAP)
    acc3 = _zeros(BLOCK_M, BLOCK_N, SWAP)
    acc4 = _zeros(BLOCK_M, BLOCK_N, SWAP)
    acc5 = _zeros(BLOCK_M, BLOCK_N, SWAP)
    acc6 = _zeros(BLOCK_M, BLOCK_N, SWAP)
    acc7 = _zeros(BLOCK_M, BLOCK_N, SWAP)
    # a fixed count per split (a constant: the interpreter loops only to those); the last split's tiles past K load nothing
    for i in range(0, TILES_PER_SPLIT):
        for j in tl.static_range(UNROLL):
            tile = (pid_k * TILES_PER_SPLIT + i) * UNROLL + j
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            if PACKED:  # one contiguous run of BLOCK_N * BLOCK_K bytes, no mask (the padding is zeros)
                w_tile = w_tiles + tile * (BLOCK_N * BLOCK_K)
                if SWAP:
                    w = tl.load(w_tile + tile_offs[:, None] + tl.arange(0, BLOCK_K)[None, :])
                else:
                    w = tl.load(w_tile + tile_offs[None, :] + tl.arange(0, BLOCK_K)[:, None])
            elif SWAP:
                w = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            else:
                w = tl.load(w_rows[None, :] + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            w = _dequantized_tile(w, CONVERT, dtype)
            s = 1.0
            if BLOCKWISE:  # one scale per (row block, K tile): BLOCK_K divides SCALE_BLOCK_K
                scale_ptrs = scale_row + (tile * BLOCK_K // SCALE_BLOCK_K) * scale_stride_k
                if SCALE_UNIFORM:
                    s = tl.load(scale_ptrs, mask=tile < k_tiles, other=0.0)
                else:
                    s = tl.load(scale_ptrs, mask=n_mask & (tile < k_tiles), other=0.0)
                    if SWAP:
                        s = s[:, None]
                    else:
                        s = s[None, :]
            acc0 = _row_tile_step(acc0, x_ptr, t0 + 0, M, x_stride, offs_k, k_mask, w, s, BLOCK_M, BLOCKWISE, SWAP, PRECISION)
            if ROW_TILES > 1:
                acc1 = _row_tile_step(acc1, x_ptr, t0 + 1, M, x_stride, offs_k, k_mask, w, s, BLOCK_M, BLOCKWISE, SWAP, PRECISION)
            if ROW_TILES > 2:
                acc2 = _row_tile_step(acc2, x_ptr, t0 + 2, M, x_stride, offs_k, k_mask, w, s, BLOCK_M, BLOCKWISE, SWAP, PRECISION)
            if ROW_TILES > 3:
                acc3 = _row_tile_step(acc3, x_ptr, t0 + 3, M, x_stride, offs_k, k_mask, w, s, BLOCK_M, BLOCKWISE, SWAP, PRECISION)
            if ROW_TILES > 4:
                acc4 = _row_tile_step(acc4, x_ptr, t0 + 4, M, x_stride, offs_k, k_mask, w, s, BLOCK_M, BLOCKWISE, SWAP, PRECISION)
            if ROW_TILES > 5:
                acc5 = _row_tile_step(acc5, x_ptr, t0 + 5, M, x_stride, offs_k, k_mask, w, s, BLOCK_M, BLOCKWISE, SWAP, PRECISION)
            if ROW_TILES > 6:
                acc6 = _row_tile_step(acc6, x_ptr, t0 + 6, M, x_stride, offs_k, k_mask, w, s, BLOCK_M, BLOCKWISE, SWAP, PRECISION)
            if ROW_TILES > 7:
                acc7 = _row_tile_step(acc7, x_ptr, t0 + 7, M, x_stride, offs_k, k_mask, w, s, BLOCK_M, BLOCKWISE, SWAP, PRECISION)

    channel_scale = 1.0
    if not BLOCKWISE:  # the channel scale multiplies the sum
        channel_scale = tl.load(scale_row, mask=n_mask, other=0.0)
        if SWAP:
            channel_scale = channel_scale[:, None]
        else:
            channel_scale = channel_scale[None, :]
    _finish_row_tile(acc0, t0 + 0, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k,
                     channel_scale, BLOCK_M, SPLIT_K, BLOCKWISE, SWAP)
    if ROW_TILES > 1:
        _finish_row_tile(acc1, t0 + 1, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k,
                         channel_scale, BLOCK_M, SPLIT_K, BLOCKWISE, SWAP)
    if ROW_TILES > 2:
        _finish_row_tile(acc2, t0 + 2, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k,
                         channel_scale, BLOCK_M, SPLIT_K, BLOCKWISE, SWAP)
    if ROW_TILES > 3:
        _finish_row_tile(acc3, t0 + 3, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k,
                         channel_scale, BLOCK_M, SPLIT_K, BLOCKWISE, SWAP)
    if ROW_TILES > 4:
        _finish_row_tile(acc4, t0 + 4, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k,
                         channel_scale, BLOCK_M, SPLIT_K, BLOCKWISE, SWAP)
    if ROW_TILES > 5:
        _finish_row_tile(acc5, t0 + 5, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k,
                         channel_scale, BLOCK_M, SPLIT_K, BLOCKWISE, SWAP)
    if ROW_TILES > 6:
        _finish_row_tile(acc6, t0 + 6, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k,
                         channel_scale, BLOCK_M, SPLIT_K, BLOCKWISE, SWAP)
    if ROW_TILES > 7:
        _finish_row_tile(acc7, t0 + 7, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, pid_k,
                         channel_scale, BLOCK_M, SPLIT_K, BLOCKWISE, SWAP)
    if SPLIT_K > 1:
        # every split stored its float32 partials; the last to arrive adds them and resets the tile's counter
        # for the next launch
        tl.debug_barrier()
        counter = counter_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            _reduce_row_tile(t0 + 0, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLIT_K, SWAP)
            if ROW_TILES > 1:
                _reduce_row_tile(t0 + 1, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLIT_K, SWAP)
            if ROW_TILES > 2:
                _reduce_row_tile(t0 + 2, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLIT_K, SWAP)
            if ROW_TILES > 3:
                _reduce_row_tile(t0 + 3, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLIT_K, SWAP)
            if ROW_TILES > 4:
                _reduce_row_tile(t0 + 4, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLIT_K, SWAP)
            if ROW_TILES > 5:
                _reduce_row_tile(t0 + 5, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLIT_K, SWAP)
            if ROW_TILES > 6:
                _reduce_row_tile(t0 + 6, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLIT_K, SWAP)
            if ROW_TILES > 7:
                _reduce_row_tile(t0 + 7, out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLIT_K, SWAP)
            tl.atomic_xchg(counter, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
COUNTER_SLOTS = 1 << 16  # (row tile, N tile) pairs a split-K launch may use; each launch leaves them zero


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    if needed > COUNTER_SLOTS:
        raise ValueError(f"fp8_linear: {needed} split-K tiles exceed the {COUNTER_SLOTS} counters")
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8_linear: run a split-K shape once before capturing a CUDA graph (its counters are allocated then)")
        counters = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return counters


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> tuple[torch.Tensor, int, int, bool]:
    """Validate the operands; returns the scale as a 2-D float32 view, its row block, its column block and
    whether it is blockwise."""
    if not isinstance(weight, PackedWeight) and (weight.dtype != torch.float8_e4m3fn or weight.dim() != 2):
        raise ValueError(f"fp8_linear: weight must be a 2-D float8_e4m3fn matrix, got {weight.dtype} {tuple(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} (x is [M, K], weight [N, K])")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_linear: x must be bf16, fp16 or float32, got {x.dtype}")
    n, k = weight.shape
    if scale.dtype != torch.float32:
        raise ValueError(f"fp8_linear: scale must be float32, got {scale.dtype}")
    if block is None:
        if tuple(scale.shape) not in ((n,), (n, 1)):
            raise ValueError(f"fp8_linear: a per-channel scale is [{n}] or [{n}, 1], got {tuple(scale.shape)}")
        return scale.reshape(n, 1), 1, k, False
    block_n, block_k = (int(b) for b in block)
    if block_n <= 0 or block_k <= 0:
        raise ValueError(f"fp8_linear: block {block} must be positive")
    expected = (math.ceil(n / block_n), math.ceil(k / block_k))
    if tuple(scale.shape) != expected:
        raise ValueError(f"fp8_linear: a {block_n}x{block_k} block scale of a {n}x{k} weight is {list(expected)}, got {list(scale.shape)}")
    return scale, block_n, block_k, True


def _large_m(x, weight, scale2d, block, out):
    """Prefill: dequantize a chunk of output rows to x's dtype (`dequantized`) and let torch.matmul multiply it."""
    n, k = weight.shape
    row_unit = block[0] if block is not None else 1
    rows = max(row_unit, CHUNK_ELEMENTS // k // row_unit * row_unit)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        if block is None:
            part_scale = scale2d[start:stop]
        else:
            part_scale = scale2d[start // block[0] : math.ceil(stop / block[0])]
        w = dequantized(weight[start:stop], part_scale, block, x.dtype)
        out[:, start:stop] = x @ w.t()
    return out


def fp8_gemm(x, weight, scale, block, config: TileConfig, *, convert: str, out=None) -> torch.Tensor:
    """One launch with a given tile config and conversion ("native", "asm", "bits", "asm_v1"); fp8_linear picks both.
    `weight` is the row-major FP8 matrix or a PackedWeight (packed for this very config). Tests and the benchmark's
    sweep call it directly."""
    packed = weight if isinstance(weight, PackedWeight) else None
    if packed is not None:
        if packed.config != config:
            raise ValueError(f"fp8_linear: a weight packed for {packed.config} runs with that config, not {config}")
        if convert == "native":
            raise ValueError("fp8_linear: a packed weight runs with the integer conversions (asm, bits), not native")
    scale2d, scale_block_n, scale_block_k, blockwise = _check(x, packed or weight, scale, block)
    m, k = x.shape
    n = (packed or weight).shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"fp8_linear: out must be [{m}, {n}] {x.dtype} with unit column stride")
    geo = geometry(config, k, scale_block_k if blockwise else None)
    if packed is not None and packed.scale_block_k != (scale_block_k if blockwise else None):
        raise ValueError("fp8_linear: the weight was packed for another scale layout")
    if m == 0:
        return out
    if x.device.type != "cuda" and not interpreted():
        raise ValueError("fp8_linear: the kernel runs on a CUDA device (or under TRITON_INTERPRET=1); a CPU model dequantizes at load")
    w = packed.data if packed is not None else weight
    if w.device != x.device or scale.device != x.device:
        raise ValueError(f"fp8_linear: x, weight and scale must be on one device, got {x.device}, {w.device}, {scale.device}")
    if not w.is_contiguous():
        raise ValueError("fp8_linear: weight must be contiguous (rows of K bytes)")
    if convert != "native":
        w = w.view(torch.uint8)
    pdl = config.pdl and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    m_tiles = triton.cdiv(m, BLOCK_M)
    row_tiles = min(m_tiles, MAX_ROW_TILES)  # per program; more rows take more programs, each its own weight read
    groups = triton.cdiv(m_tiles, row_tiles)
    n_tiles = triton.cdiv(n, config.block_n)
    if config.split_k > 1:
        partials = torch.empty(config.split_k, groups * row_tiles * BLOCK_M, n, dtype=torch.float32, device=x.device)
        counters = _counters(x.device, groups * n_tiles)
    else:
        partials, counters = out, out  # never touched
    _fp8_gemm_kernel[(n_tiles, config.split_k, groups)](
        x, w, scale2d, out, partials, counters,
        m, n, k, x.stride(0), out.stride(0), scale2d.stride(0), scale2d.stride(1), scale_block_n, geo.k_tiles,
        groups * row_tiles * BLOCK_M,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=geo.block_k, UNROLL=geo.unroll, SPLIT_K=config.split_k,
        TILES_PER_SPLIT=geo.tiles_per_split, ROW_TILES=row_tiles, GROUPED=groups > 1,
        BLOCKWISE=blockwise, SCALE_BLOCK_K=scale_block_k if blockwise else 1,
        SCALE_UNIFORM=blockwise and scale_block_n % config.block_n == 0, CONVERT=_CONVERTS[convert],
        SWAP=config.swap, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl, PACKED=packed is not None,
        PREFETCH=_prefetch_lines(config, geo, packed is not None) if pdl else 0,
        num_warps=config.warps, num_stages=_stages(config, geo.block_k * geo.unroll, row_tiles, x.element_size()),
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def _prefetch_lines(config: TileConfig, geo: Geometry, packed: bool) -> int:
    """The 128-byte lines of config.prefetch K tiles (at most a split's): in all when packed, else per row; a power
    of two (0: none)."""
    tiles = min(config.prefetch, geo.tiles_per_split * geo.unroll)
    if tiles <= 0:
        return 0
    return triton.next_power_of_2(triton.cdiv(tiles * geo.block_k * (config.block_n if packed else 1), 128))


def _stages(config: TileConfig, block_k: int, row_tiles: int, x_bytes: int) -> int:
    """The config's pipeline depth, cut (to 2 at least) where its weight and x tiles would pass SMEM_BUDGET."""
    per_stage = config.block_n * block_k + row_tiles * BLOCK_M * block_k * x_bytes
    return max(2, min(config.stages, SMEM_BUDGET // per_stage))


def ampere_default(device: torch.device) -> bool:
    """Whether a device lacks FP8 conversion (before sm_89): the Ampere path then, the native one otherwise."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) < (8, 9)


def conversion(device: torch.device, ampere: bool | None = None) -> str:
    """How a kernel on `device` turns FP8 bytes into its activations' dtype (a key of _CONVERTS): AMPERE_CONVERT
    or HOPPER_CONVERT (ampere=None picks by the device), "bits" under the interpreter."""
    if ampere is None:
        ampere = ampere_default(device)
    convert = AMPERE_CONVERT if ampere else HOPPER_CONVERT
    if interpreted() and convert.startswith("asm"):  # the interpreter runs no PTX: the same bits in Triton ops
        convert = "bits"
    return convert


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block, *, ampere: bool | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16; float32 in CPU tests) @ dequantize(weight [N, K] float8_e4m3fn, scale, block).T -> [M, N]
    in x's dtype. block=(128, 128): scale [ceil(N/128), ceil(K/128)]; block=None: per-channel scale [N] or [N, 1].
    ampere=True forces the path that needs no FP8 instruction (sm_80/86); None picks by the device."""
    if x.dim() == 2 and x.shape[0] > LARGE_M:
        scale2d, _, _, _ = _check(x, weight, scale, block)
        if out is None:
            out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        elif out.shape != (x.shape[0], weight.shape[0]) or out.dtype != x.dtype:
            raise ValueError(f"fp8_linear: out must be [{x.shape[0]}, {weight.shape[0]}] {x.dtype}")
        return _large_m(x, weight, scale2d, None if block is None else tuple(block), out)
    convert = conversion(x.device, ampere)
    config = tile_config(weight.shape[0], weight.shape[1], block is not None)
    # a K tile never straddles two scale blocks
    if block is not None and int(block[1]) % config.block_k and config.block_k % int(block[1]):
        block_k = math.gcd(config.block_k, int(block[1]))
        if block_k < 16:
            raise ValueError(f"fp8_linear: a scale block {tuple(block)} needs K tiles of a multiple of 16 that divides {block[1]}")
        config = replace(config, block_k=block_k)
    return fp8_gemm(x, weight, scale, block, config, convert=convert, out=out)
