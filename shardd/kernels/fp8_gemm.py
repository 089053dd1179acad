"""Weight-only FP8 GEMM for the step: y = x @ dequantize(w).T with the FP8 bytes read once and dequantized
in registers, bf16 activations, float32 accumulation, the output rounded once to x's dtype (as the bf16
cuBLAS path rounds).

Two scale layouts (what the checkpoints carry):
- block-wise `fp8` (`weight_block_size: [128, 128]`): float32 `scale[ceil(N/128), ceil(K/128)]`,
  w_real[n, k] = w[n, k] * scale[n // 128, k // 128], partial blocks at the edges;
- per-output-channel (compressed-tensors): float32 `scale[N]` or `[N, 1]`.

A row's bits never depend on the other rows or on how many there are: the rows are cut into tiles of
BLOCK_M = 16 whatever M, the tile shape (and the split of K, when there is one) is a function of (N, K)
only, and a split-K's partial sums are added in the fixed split order. The block scale multiplies each
K tile's float32 partial product (the FP8 value itself is exact in bf16), the channel scale the sum.

Two ways to turn the bytes into bf16 before the bf16 MMA (neither uses FP8 tensor cores, which would
need FP8 activations):
- `native` (sm_89 and later): Triton's float8e4nv load and conversion;
- `ampere` (sm_80/86, which have no FP8 type): the bytes are loaded as uint8 and rebuilt as bf16 by bit
  manipulation, four at a time in PTX (`prmt`, `and`/`shr`/`or`, one `fma.rn.bf16x2` by 2^120, all sm_80
  instructions), or in plain Triton integer ops (`bits`: the interpreter's version, and a fallback).
  `fp8_linear(..., ampere=True)` forces it on any GPU, which is how an H200 tests it.

Above LARGE_M rows (a prefill) the matrix is dequantized to bf16 a chunk of output rows at a time and
multiplied by torch.matmul; row independence is not promised there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

BLOCK_M = 16          # rows per tile, whatever M: a row's MMA never sees a different tile shape
LARGE_M = 128         # more rows than this take the dequantize-then-matmul path
CHUNK_ELEMENTS = 1 << 23  # weight elements dequantized at once on the large-M path (32 MiB in float32)
AMPERE_CONVERT = "asm"    # how the Ampere path rebuilds bf16 on a GPU: "asm" (PTX, 4 bytes a time) or "bits"
# How the sm_89+ path does: Triton's conversion (e4m3x2 -> f16x2, then one f16 -> bf16 per value), or "asm" if
# scripts/bench_fp8_gemm.py finds the Ampere path's bit shuffle faster there too
HOPPER_CONVERT = "native"
_CONVERTS = {"native": 0, "asm": 1, "bits": 2}


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one matrix; chosen from (N, K) and the scale layout only."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 4
    swap: bool = False  # acc[BLOCK_N, BLOCK_M] = w @ x.T (the weight tile as the MMA's M side)


# Fixed per 27B shape (N, K, blockwise): the lines scripts/bench_fp8_gemm.py's sweep prints on an H200 go here
# (none measured yet); a shape not listed takes `_rule`. The shapes: GDN in_proj qkv|z|b|a 16480x5120,
# out_proj and o_proj 5120x6144, attention q|k|v 14336x5120, MLP gate|up 34816x5120, down 5120x17408.
TILE_TABLE: dict[tuple[int, int, bool], TileConfig] = {}


def _rule(n: int, k: int, blockwise: bool) -> TileConfig:
    """Enough programs to fill a GPU at one row tile: wide N tiles, and a split of K when N alone is short."""
    block_k = 128 if blockwise else 256
    block_n = 64
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split_k = 1
    while n_tiles * split_k < 256 and k_tiles // (split_k * 2) >= 8:
        split_k *= 2
    return TileConfig(block_n=block_n, block_k=block_k, split_k=split_k)


def tile_config(n: int, k: int, blockwise: bool) -> TileConfig:
    return TILE_TABLE.get((n, k, blockwise)) or _rule(n, k, blockwise)


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
    """uint8 e4m3fn bytes -> bf16, four per 32-bit register: each byte moved to the top of a 16-bit lane,
    its exponent and mantissa shifted into bf16's fields, then one bf16x2 fma by 2^120 (exact; subnormals
    kept) re-biases the exponent. sm_80 instructions only."""
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
def _dequantized_tile(w, CONVERT: tl.constexpr, dtype: tl.constexpr):
    if CONVERT == 0:
        return w.to(dtype)
    elif CONVERT == 1:
        return _fp8_bytes_to_bf16_asm(w).to(dtype)
    else:
        return _fp8_bits_to_float(w).to(dtype)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M: the same code computes each row
def _fp8_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, x_stride, out_stride, scale_stride_n, scale_stride_k, scale_block_n, k_tiles, partial_rows,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    BLOCKWISE: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, CONVERT: tl.constexpr, SWAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: the row tiles of one weight tile run together and share it in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    scale_row = scale_ptr + (offs_n // scale_block_n) * scale_stride_n
    w_rows = w_ptr + offs_n.to(tl.int64) * K
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # a fixed count per split (a constant: the interpreter loops only to those); the last split's tiles past K load nothing
    for i in range(0, TILES_PER_SPLIT):
        tile = pid_k * TILES_PER_SPLIT + i
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if SWAP:
            w = tl.load(w_rows[:, None] + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + offs_m[None, :] * x_stride + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            w = _dequantized_tile(w, CONVERT, dtype)
            if BLOCKWISE:
                part = tl.dot(w, x, input_precision=PRECISION)
            else:
                part = tl.dot(w, x, acc, input_precision=PRECISION)
        else:
            w = tl.load(w_rows[None, :] + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = _dequantized_tile(w, CONVERT, dtype)
            if BLOCKWISE:
                part = tl.dot(x, w, input_precision=PRECISION)
            else:
                part = tl.dot(x, w, acc, input_precision=PRECISION)
        if BLOCKWISE:  # one scale per (row block, K tile): BLOCK_K divides SCALE_BLOCK_K
            s = tl.load(scale_row + (tile * BLOCK_K // SCALE_BLOCK_K) * scale_stride_k, mask=n_mask & (tile < k_tiles), other=0.0)
            if SWAP:
                acc += part * s[:, None]
            else:
                acc += part * s[None, :]
        else:  # the channel scale multiplies the sum: the MMA accumulates in place
            acc = part
    if not BLOCKWISE:
        s = tl.load(scale_row, mask=n_mask, other=0.0)
        if SWAP:
            acc = acc * s[:, None]
        else:
            acc = acc * s[None, :]

    if SWAP:
        rows = offs_m[None, :]
        cols = offs_n[:, None]
        mask = m_mask[None, :] & n_mask[:, None]
    else:
        rows = offs_m[:, None]
        cols = offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + rows * out_stride + cols
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # every split stores its float32 partial; the last to arrive adds them in split order 0, 1, ...
        # (so the sum never depends on which finished first) and resets the tile's counter for the next launch
        partials = partial_ptr + rows * N + cols
        tl.store(partials + pid_k * partial_rows * N, acc, mask=mask)
        tl.debug_barrier()
        counter = counter_ptr + pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.load(partials, mask=mask, other=0.0, cache_modifier=".cg")
            for split in tl.static_range(1, SPLIT_K):
                total += tl.load(partials + split * partial_rows * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
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
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
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


def _large_m(x, weight, scale2d, block, out):
    """Prefill: dequantize a chunk of output rows to x's dtype and let torch.matmul multiply it."""
    n, k = weight.shape
    row_unit = block[0] if block is not None else 1
    rows = max(row_unit, CHUNK_ELEMENTS // k // row_unit * row_unit)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        if block is None:
            part_scale = scale2d[start:stop]
        else:
            part_scale = scale2d[start // block[0] : math.ceil(stop / block[0])]
        w = dequantize_fp8(weight[start:stop], part_scale, block).to(x.dtype)
        out[:, start:stop] = x @ w.t()
    return out


def fp8_gemm(x, weight, scale, block, config: TileConfig, *, convert: str, out=None) -> torch.Tensor:
    """One launch with a given tile config and conversion ("native", "asm", "bits"); fp8_linear picks both.
    Tests and the benchmark's sweep call it directly."""
    scale2d, scale_block_n, scale_block_k, blockwise = _check(x, weight, scale, block)
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"fp8_linear: out must be [{m}, {n}] {x.dtype} with unit column stride")
    if blockwise and scale_block_k % config.block_k:
        raise ValueError(f"fp8_linear: tile block_k {config.block_k} must divide the scale block {scale_block_k}")
    if m == 0:
        return out
    if x.device.type != "cuda" and not _interpreted():
        raise ValueError("fp8_linear: the kernel runs on a CUDA device (or under TRITON_INTERPRET=1); a CPU model dequantizes at load")
    if weight.device != x.device or scale.device != x.device:
        raise ValueError(f"fp8_linear: x, weight and scale must be on one device, got {x.device}, {weight.device}, {scale.device}")
    if not weight.is_contiguous():
        raise ValueError("fp8_linear: weight must be contiguous (rows of K bytes)")
    w = weight if convert == "native" else weight.view(torch.uint8)
    m_tiles = triton.cdiv(m, BLOCK_M)
    n_tiles = triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, config.block_k)
    tiles_per_split = triton.cdiv(k_tiles, config.split_k)
    if config.split_k > 1:
        partials = torch.empty(config.split_k, m_tiles * BLOCK_M, n, dtype=torch.float32, device=x.device)
        counters = _counters(x.device, m_tiles * n_tiles)
    else:
        partials, counters = out, out  # never touched
    _fp8_gemm_kernel[(m_tiles, n_tiles, config.split_k)](
        x, w, scale2d, out, partials, counters,
        m, n, k, x.stride(0), out.stride(0), scale2d.stride(0), scale2d.stride(1), scale_block_n, k_tiles,
        m_tiles * BLOCK_M,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k, TILES_PER_SPLIT=tiles_per_split,
        BLOCKWISE=blockwise, SCALE_BLOCK_K=scale_block_k if blockwise else 1, CONVERT=_CONVERTS[convert],
        SWAP=config.swap, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.warps, num_stages=config.stages,
    )
    return out


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def ampere_default(device: torch.device) -> bool:
    """Whether a device lacks FP8 conversion (before sm_89): the Ampere path then, the native one otherwise."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) < (8, 9)


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
    if ampere is None:
        ampere = ampere_default(x.device)
    convert = ("bits" if _interpreted() else AMPERE_CONVERT) if ampere else HOPPER_CONVERT
    config = tile_config(weight.shape[0], weight.shape[1], block is not None)
    if block is not None and int(block[1]) % config.block_k:  # a K tile never straddles two scale blocks
        block_k = math.gcd(config.block_k, int(block[1]))
        if block_k < 16:
            raise ValueError(f"fp8_linear: a scale block {tuple(block)} needs K tiles of a multiple of 16 that divides {block[1]}")
        config = replace(config, block_k=block_k)
    return fp8_gemm(x, weight, scale, block, config, convert=convert, out=out)
