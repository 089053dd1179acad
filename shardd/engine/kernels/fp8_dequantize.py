"""FP8 e4m3fn weights to real values: a byte's exact value in integer ops, the float32 reference `dequantize_fp8`,
and the one-pass kernel that gives its bits in a dtype (`dequantized`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardd.engine.kernels import interpreted


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
