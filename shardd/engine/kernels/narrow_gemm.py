"""out[:, :N] = x @ w.T for a narrow matrix (a few dozen output columns: the GDN `a` and `b` projections a
checkpoint leaves unquantized beside an FP8 in_proj), straight into a column slice of a wider output.

cuBLAS runs such a matrix at 16 rows as a split-K GEMM and a reduction of two kernels, and the fused projection
then needed a torch.cat of its parts. Here too a split of K and a reduction, but of a fixed
shape: one program per (16 output columns, 16-row tile, 4 K tiles of 128), each storing its float32 partial, then
one program per 16 columns adding the partials in split order and rounding once to x's dtype; the tiling is a
function of N and K only, so a row's bits do not depend on the other rows or their number. (The whole K loop in
one program per 16 columns puts too few bytes in flight: 3 programs for the GDN `a`.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardd.engine.kernels.fp8_gemm import _reduce_row_tile, _tile_ptrs  # the split-K partials' layout and sum

BLOCK_M, BLOCK_N, BLOCK_K = 16, 16, 128
MAX_N = 256  # wider matrices are cuBLAS's (their GEMMs are bandwidth-bound, and split across many programs)
TILES_PER_SPLIT = 4  # K tiles a program walks: K is cut into ceil(K_TILES / 4) splits (a function of K only)


def splits(k: int) -> int:
    return triton.cdiv(triton.cdiv(k, BLOCK_K), TILES_PER_SPLIT)


@triton.jit
def _narrow_partial_kernel(x_ptr, w_ptr, partial_ptr, M, N, K, x_stride, w_stride, partial_rows,
                           TILES_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # one program per (16 columns, 16 rows, K split): its float32 partial product into partial[split]
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, TILES_PER_SPLIT):  # a constant count: the interpreter loops to it too
        offs_k = (split * TILES_PER_SPLIT + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * w_stride + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    ptrs, mask = _tile_ptrs(partial_ptr + split * partial_rows * N, tl.program_id(1), N, offs_n, M, N, BLOCK_M, False)
    tl.store(ptrs, acc, mask=mask)


@triton.jit
def _narrow_reduce_kernel(partial_ptr, out_ptr, M, N, out_stride, partial_rows, SPLITS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the FP8 kernel's split-K reduction: the partials added in split order 0, 1, ..., rounded once into out
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _reduce_row_tile(tl.program_id(1), out_ptr, partial_ptr, M, N, out_stride, partial_rows, offs_n, BLOCK_M, SPLITS,
                     False)


def narrow_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (a [M, N] view with unit column stride, e.g. columns of a wider output) = x [M, K] @ weight [N, K].T."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or out.shape != (m, n) or out.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"narrow_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)} "
                         "(unit column strides)")
    if x.stride(1) != 1:
        x = x.contiguous()
    if m and n:
        split_count, m_tiles = splits(k), triton.cdiv(m, BLOCK_M)
        rows = m_tiles * BLOCK_M
        partial = torch.empty(split_count, rows, n, dtype=torch.float32, device=x.device)
        _narrow_partial_kernel[(triton.cdiv(n, BLOCK_N), m_tiles, split_count)](
            x, weight, partial, m, n, k, x.stride(0), weight.stride(0), rows, TILES_PER_SPLIT=TILES_PER_SPLIT,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
        _narrow_reduce_kernel[(triton.cdiv(n, BLOCK_N), m_tiles)](
            partial, out, m, n, out.stride(0), rows, SPLITS=split_count, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            num_warps=1)
    return out
