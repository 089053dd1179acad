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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from shardd.engine.kernels import interpreted

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


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one matrix; chosen from (N, K) and the scale layout only."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 4
    swap: bool = False  # acc[BLOCK_N, BLOCK_M] = w @ x.T (the weight tile as the MMA's M side)
    # Programmatic dependent launch (sm_90+; ignored below): the programs are scheduled while the previous kernel
    # drains and wait for it (griddepcontrol.wait) before their first memory access, hiding the launch gap. The
    # arithmetic is the same; the sweep measures whether it pays (it also needs the launch kept in the CUDA graph).
    pdl: bool = False
    # With pdl: the first `prefetch` K tiles of each program's weights are prefetched into L2 before the wait (the
    # weights do not depend on the kernel before; only x does), so the early programs read them during its tail.
    prefetch: int = 0


# Fixed per 27B shape (N, K, blockwise): the configs scripts/bench_fp8_gemm.py's sweep finds fastest at 16 rows
# (with HOPPER_CONVERT "asm"); out_proj takes the sweep's second, split 4, about as fast at 16 rows and faster at
# 64. A shape not listed takes `_rule`. The shapes: GDN in_proj qkv|z|b|a 16480x5120 and
# its FP8 part when the checkpoint keeps in_proj_a (qkv|z|b, 16432) or in_proj_b and in_proj_a (qkv|z, 16384) in
# bf16 (shardd.weights.quant.fuse_rows runs those as a second GEMM), out_proj and o_proj 5120x6144, attention q|k|v
# 14336x5120, MLP gate|up 34816x5120, down 5120x17408.
_GDN_IN_PROJ = TileConfig(block_n=32, block_k=256, split_k=1, warps=2, stages=3)
TILE_TABLE: dict[tuple[int, int, bool], TileConfig] = {
    (16480, 5120, True): _GDN_IN_PROJ,
    (16432, 5120, True): _GDN_IN_PROJ,
    (16384, 5120, True): _GDN_IN_PROJ,
    (5120, 6144, True): TileConfig(block_n=32, block_k=128, split_k=4, warps=2, stages=3, swap=True),
    (14336, 5120, True): TileConfig(block_n=64, block_k=128, split_k=2, warps=4, stages=3),
    (34816, 5120, True): TileConfig(block_n=32, block_k=128, split_k=2, warps=2, stages=4, swap=True),
    (5120, 17408, True): TileConfig(block_n=32, block_k=256, split_k=4, warps=4, stages=3),
}


def _rule(n: int, k: int, blockwise: bool) -> TileConfig:
    """Enough programs to fill a GPU (132 SMs on an H100 or H200) ~3 deep: 32-wide N tiles, and a split of K when N
    alone is short (each split keeps at least 8 K tiles)."""
    block_k = 128 if blockwise else 256
    block_n = 32
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split_k = 1
    while n_tiles * split_k < 400 and k_tiles // (split_k * 2) >= 8:
        split_k *= 2
    return TileConfig(block_n=block_n, block_k=block_k, split_k=split_k)


TILES_ENV = "SHARDD_FP8_TILES"  # a JSON file of tuned configs that replace TILE_TABLE's (one GPU's own sweep)


def load_tiles(path: str) -> dict[tuple[int, int, bool], TileConfig]:
    """A tiles file: {"16480x5120": {"block_n": 32, ...}, ...} (blockwise scales), the form scripts/bench_fp8_gemm.py
    --write-tiles writes from its sweep. Unknown fields or bad values are refused by name."""
    import json

    with open(path) as f:
        data = json.load(f)
    fields = set(TileConfig.__dataclass_fields__)
    table = {}
    for key, entry in data.items():
        try:
            n, k = (int(v) for v in key.split("x"))
        except ValueError:
            raise ValueError(f"{path}: key {key!r} is not NxK") from None
        unknown = set(entry) - fields
        if unknown:
            raise ValueError(f"{path}: {key}: unknown TileConfig fields {sorted(unknown)}")
        table[(n, k, True)] = TileConfig(**entry)
    return table


_TUNED: dict | None = None


def tile_config(n: int, k: int, blockwise: bool) -> TileConfig:
    """The launch shape of an [N, K] matrix: $SHARDD_FP8_TILES's entry, else TILE_TABLE's, else the rule."""
    global _TUNED
    if _TUNED is None:
        import os

        path = os.environ.get(TILES_ENV)
        _TUNED = load_tiles(path) if path else {}
    return _TUNED.get((n, k, blockwise)) or TILE_TABLE.get((n, k, blockwise)) or _rule(n, k, blockwise)


def tiles_identity() -> str:
    """Which tile table the launches read: "built-in", or the sha256 (first 16 hex) of $SHARDD_FP8_TILES's file. A
    tile changes how a dot product is split, so a token's bits (HELLO's `numerics`)."""
    import hashlib
    import os

    path = os.environ.get(TILES_ENV)
    if not path:
        return "built-in"
    with open(path, "rb") as tiles:
        return hashlib.sha256(tiles.read()).hexdigest()[:16]


@triton.jit
def _fp8_bits_to_float(u):
    """uint8 e4m3fn bytes -> float32 values, exactly, in integer ops only (no FP8 type needed).
    (The NaN byte 0x7f reads as 480: checkpoints hold no NaN.)"""
    b = u.to(tl.int32)
    magnitude_bits = b & 0x7F
    normal = (magnitude_bits << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120: exponent bias 127 - 7
    subnormal = (b & 0x7).to(tl.float32) * 0.001953125  # 2^-9
    magnitude = tl.where(magnitude_bits < 8, subnormal, normal)
    return tl.where((b & 0x80) != 0, -magnitude, magnitude)


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


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The plain PyTorch reference: float32 [N, K] = weight * its scale (per block, or per output channel)."""
    n, k = weight.shape
    if block is None:
        return weight.float() * scale.float().reshape(n, 1)
    block_n, block_k = block
    expanded = scale.float().repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    return weight.float() * expanded


@triton.jit
def _dequantize_kernel(w_ptr, scale_ptr, out_ptr, N, K, scale_stride_n, scale_stride_k, scale_block_n,
                       BLOCKWISE: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, ROUND_BF16: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] (x's dtype) = float32(weight byte) * float32 scale, rounded once to out's dtype: the
    operations of `dequantize_fp8(...).to(dtype)` (an exact FP8 -> float32, one float32 product, one rounding),
    in one pass that reads each FP8 byte once and writes the result once."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    u = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask, other=0)
    if BLOCKWISE:
        s = tl.load(scale_ptr + (offs_n[:, None] // scale_block_n) * scale_stride_n
                    + (offs_k[None, :] // SCALE_BLOCK_K) * scale_stride_k, mask=mask, other=0.0)
    else:
        s = tl.load(scale_ptr + offs_n[:, None] * scale_stride_n, mask=offs_n[:, None] < N, other=0.0)
    w = _fp8_bits_to_float(u) * s.to(tl.float32)
    if ROUND_BF16:  # to nearest, ties to even, in integer ops: then the conversion is exact on a GPU and in the
        bits = w.to(tl.int32, bitcast=True)  # interpreter alike (which truncates); no NaN or inf comes here
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        w = bits.to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantized(weight: torch.Tensor, scale2d: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_fp8(weight, scale, block).to(dtype)`, bit for bit, by `_dequantize_kernel` (the weight's
    device, or the interpreter): 3 bytes of memory traffic a weight, where the PyTorch expression moves float32
    copies of the weight, of its expanded scale and of their product (an FP8 prefill's time went there)."""
    if weight.device.type != "cuda" and not interpreted():  # a CPU caller (no kernel here): the same values
        return dequantize_fp8(weight, scale2d, block).to(dtype)
    weight = weight.contiguous()
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if n == 0 or k == 0:
        return out
    blockwise = block is not None
    scale_block_n, scale_block_k = (int(block[0]), int(block[1])) if blockwise else (1, 1)
    block_n, block_k = 32, 128
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.view(torch.uint8), scale2d, out, n, k, scale2d.stride(0), scale2d.stride(1) if scale2d.dim() > 1 else 0,
        scale_block_n, BLOCKWISE=blockwise, SCALE_BLOCK_K=scale_block_k, ROUND_BF16=dtype == torch.bfloat16,
        BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )
    return out


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


@dataclass(frozen=True)
class Geometry:
    """How one launch cuts K: loads of `block_k` (a K tile never straddles two scale blocks), `unroll` of them an
    iteration, `tiles_per_split` iterations per split of K (the last split's tiles past K read zeros)."""

    block_k: int
    unroll: int
    k_tiles: int
    tiles_per_split: int
    split_k: int

    @property
    def padded_k_tiles(self) -> int:  # what the splits walk over: the packed layout's K tiles
        return self.tiles_per_split * self.unroll * self.split_k


def geometry(config: TileConfig, k: int, scale_block_k: int | None) -> Geometry:
    """scale_block_k: the block scale's K extent (None for a per-channel scale)."""
    block_k, unroll = config.block_k, 1
    if scale_block_k is not None:
        if scale_block_k % block_k and block_k % scale_block_k:
            raise ValueError(f"fp8_linear: tile block_k {block_k} must divide the scale block {scale_block_k} or be a multiple of it")
        if block_k > scale_block_k:  # a K tile per scale block, several loaded per iteration
            block_k, unroll = scale_block_k, block_k // scale_block_k
    k_tiles = triton.cdiv(k, block_k)
    tiles_per_split = triton.cdiv(triton.cdiv(k_tiles, unroll), config.split_k)
    return Geometry(block_k, unroll, k_tiles, tiles_per_split, config.split_k)


@dataclass(frozen=True)
class PackedWeight:
    """An FP8 weight [N, K] laid out for one TileConfig: contiguous [block_n, block_k] byte tiles, each N tile's
    K tiles in order ([n_tiles, padded_k_tiles, block_n, block_k] uint8), zero-padded at the edges, so that a
    program reads one contiguous run of memory and its loads need no mask. Same values, same arithmetic as the
    row-major weight (a zero byte is +0.0, and the padding meets zeroed x columns or is never stored)."""

    data: torch.Tensor
    shape: tuple[int, int]
    config: TileConfig
    scale_block_k: int | None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def pack_weight(weight: torch.Tensor, config: TileConfig, block) -> PackedWeight:
    """The row-major float8_e4m3fn weight [N, K] as a PackedWeight for `config` (block: the scale's block, None
    for per-channel)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"pack_weight: a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    scale_block_k = None if block is None else int(block[1])
    geo = geometry(config, k, scale_block_k)
    n_tiles = triton.cdiv(n, config.block_n)
    padded = torch.zeros(n_tiles * config.block_n, geo.padded_k_tiles * geo.block_k, dtype=torch.uint8, device=weight.device)
    padded[:n, :k] = weight.view(torch.uint8)
    data = padded.view(n_tiles, config.block_n, geo.padded_k_tiles, geo.block_k).permute(0, 2, 1, 3).contiguous()
    return PackedWeight(data, (n, k), config, scale_block_k)


def unpack_weight(packed: PackedWeight) -> torch.Tensor:
    """The row-major float8_e4m3fn weight [N, K] back (tests, the large-M path)."""
    n, k = packed.shape
    n_tiles, k_tiles, block_n, block_k = packed.data.shape
    rows = packed.data.permute(0, 2, 1, 3).reshape(n_tiles * block_n, k_tiles * block_k)
    return rows[:n, :k].contiguous().view(torch.float8_e4m3fn)


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
