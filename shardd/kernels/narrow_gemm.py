"""out[:, :N] = x @ w.T for a narrow matrix (a few dozen output columns: the GDN `a` and `b` projections a
checkpoint leaves unquantized beside an FP8 in_proj), straight into a column slice of a wider output.

cuBLAS runs such a matrix at 16 rows as a split-K GEMM and a reduction (~6.6 us of two kernels on an H200), and
the fused projection then needed a torch.cat of its parts: one program per 16 output columns here, the K loop in
one program (no split, no reduction), float32 accumulation rounded once to x's dtype; the tiling is fixed (16-row
tiles, a function of N and K only), so a row's bits do not depend on the other rows or their number.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 16, 128
MAX_N = 256  # wider matrices are cuBLAS's (their GEMMs are bandwidth-bound, and split across many programs)


@triton.jit
def _narrow_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride, K_TILES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, K_TILES):  # a constant count (one compile per K): the interpreter loops to it too
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * w_stride + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    tl.store(out_ptr + offs_m[:, None] * out_stride + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


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
        _narrow_gemm_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))](
            x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), K_TILES=triton.cdiv(k, BLOCK_K),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return out
