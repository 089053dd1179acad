"""Quantized linear weights: one object per FP8 linear holding its bytes and scales, quantizing and dequantizing.
Which checkpoints are FP8 and how their scales are laid out is common.quantization's (torch-free).

dequantized weight = float32(weight) * scale (the scale broadcast over its block or row), as transformers and vLLM
compute it. The CPU reference path dequantizes at load; the GPU step keeps `Fp8Linear`s and runs them through the
weight-only FP8 GEMM (`shardd/engine/kernels/fp8_gemm.py`), chosen once when the object is built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.quantization import FP8_BLOCK, FP8_CHANNEL, LAYOUTS, Fp8Scheme, scale_shape  # noqa: F401


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max


# ---- scales and dequantization ----------------------------------------------------------------------

def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K]: weight * its scale (per block, partial at the edges; or per row, or one per tensor).
    The same function as shardd/engine/kernels/fp8_gemm.py's `dequantize_fp8`, kept here so the CPU never needs Triton."""
    w = weight.to(torch.float32)
    n, k = w.shape
    scale = scale.to(device=w.device, dtype=torch.float32)
    if block is None:
        return w * scale.reshape(-1, 1) if scale.numel() > 1 else w * scale.reshape(())
    bn, bk = block
    expanded = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w * expanded


def quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale) of a float weight [N, K], as llm-compressor / DeepSeek's tools write
    them: scale = amax / 448 per 128x128 block (fp8-block) or per output row (fp8-channel)."""
    w = weight.to(torch.float32)
    n, k = w.shape
    if layout == FP8_CHANNEL:
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if layout != FP8_BLOCK:
        raise ValueError(f"unknown FP8 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    bn, bk = 128, 128
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = F.pad(w, (0, cols * bk - k, 0, rows * bn - n))
    amax = padded.abs().reshape(rows, bn, cols, bk).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
    expanded = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


# ---- one quantized linear ---------------------------------------------------------------------------

def _kernel(device: torch.device):
    """The GEMM for FP8 weights on `device`, chosen once: the Triton weight-only kernel where it is installed and
    the device is a GPU, else dequantize-then-matmul (correct everywhere, as slow as a bf16 GEMM plus a dequant)."""
    if device.type == "cuda":
        try:
            from shardd.engine.kernels.fp8_gemm import fp8_linear
            return fp8_linear
        except ImportError:
            pass
    return dequantize_linear


def dequantize_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    return F.linear(x, dequantize(weight, scale, block).to(x.dtype))


class Fp8Linear:
    """One FP8 linear: weight [N, K] float8_e4m3fn, its float32 scale, and the kernel that multiplies by it.

    `F.linear(x, fp8_linear)` works (through `__torch_function__`), so the model code and the fast step call it
    exactly as they call a bf16 matrix."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, kernel=None):
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"an Fp8Linear holds a 2-D float8_e4m3fn weight, got {weight.dtype} {list(weight.shape)}")
        self.weight, self.block = weight, block
        self.scale = scale.to(torch.float32)
        self.kernel = kernel or _kernel(weight.device)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.kernel(x, self.weight, self.scale, self.block)
        rows = x.reshape(-1, x.shape[-1])
        return self.kernel(rows, self.weight, self.scale, self.block).reshape(*x.shape[:-1], self.shape[0])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear and len(args) >= 2 and isinstance(args[1], Fp8Linear):
            bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
            if bias is not None:
                raise NotImplementedError("FP8 linears of Qwen3.5 have no bias")
            return args[1](args[0])
        return NotImplemented

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.block).to(dtype)

    def rows(self, start: int, stop: int) -> "Fp8Linear":
        """Rows [start, stop) as a view (a block-scaled matrix splits only at a block boundary, or its end)."""
        if self.block is None:
            return Fp8Linear(self.weight[start:stop], self.scale.reshape(-1, 1)[start:stop], None, self.kernel)
        bn = self.block[0]
        if start % bn:
            raise ValueError(f"a block-scaled FP8 matrix splits at multiples of {bn} rows, not at {start}")
        return Fp8Linear(self.weight[start:stop], self.scale[start // bn : math.ceil(stop / bn)], self.block, self.kernel)


def fuses_exactly(parts: list[Fp8Linear]) -> bool:
    """Whether these FP8 matrices concatenate along the output dim into one with the same scales: per-channel
    always; per-block when every part but the last has a multiple of the block's rows (else one block would mix
    two parts' scales)."""
    blocks = {p.block for p in parts}
    if len(blocks) != 1:
        return False
    block = blocks.pop()
    return block is None or all(p.shape[0] % block[0] == 0 for p in parts[:-1])


def cat_rows(parts: list[Fp8Linear]) -> Fp8Linear:
    """One FP8 matrix of `parts` stacked along the output dim (fuses_exactly(parts) must hold)."""
    block = parts[0].block
    weight = torch.cat([p.weight for p in parts], dim=0)
    if block is None:
        scale = torch.cat([p.scale.reshape(-1, 1) for p in parts], dim=0)
    else:
        scale = torch.cat([p.scale for p in parts], dim=0)
    return Fp8Linear(weight, scale, block, parts[0].kernel)


class StackedLinear:
    """Several matrices applied to one input, outputs concatenated: the fused form of parts that cannot share one
    matrix (a block-scaled part whose rows are not a multiple of 128, or FP8 beside an unquantized part).
    Exact: each part is computed as on its own."""

    def __init__(self, groups: list):
        self.groups = groups  # Fp8Linear or torch.Tensor, each one or more fused parts

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(g.shape[0] for g in self.groups), self.groups[0].shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear and len(args) >= 2 and isinstance(args[1], StackedLinear):
            return args[1](args[0])
        return NotImplemented

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The groups' outputs side by side. On a GPU each group writes its own columns of one output (the FP8
        kernel and the narrow bf16 kernel take an output view): no torch.cat of the parts, and a narrow bf16 part
        (the GDN `a` a checkpoint leaves unquantized) in one small kernel instead of cuBLAS's split-K pair."""
        if x.dim() != 2 or not all(_writes_into(g, x) for g in self.groups):
            return torch.cat([F.linear(x, g) for g in self.groups], dim=-1)
        from shardd.engine.kernels.narrow_gemm import narrow_linear

        out = torch.empty(x.shape[0], self.shape[0], dtype=x.dtype, device=x.device)
        start = 0
        for group in self.groups:
            stop = start + group.shape[0]
            if isinstance(group, Fp8Linear):
                group.kernel(x, group.weight, group.scale, group.block, out=out[:, start:stop])
            else:
                narrow_linear(x, group, out[:, start:stop])
            start = stop
        return out


def _writes_into(group, x: torch.Tensor) -> bool:
    """Whether a StackedLinear group computes x's product into a view of the output: an FP8 matrix with the
    Triton kernel, or a narrow unquantized matrix of x's dtype and device (shardd.engine.kernels.narrow_gemm), where the
    kernels run (a GPU, or Triton's interpreter)."""
    from shardd.engine.kernels import interpreted

    if x.device.type != "cuda" and not interpreted():
        return False
    if isinstance(group, Fp8Linear):
        return group.kernel is not dequantize_linear
    from shardd.engine.kernels.narrow_gemm import MAX_N

    return (isinstance(group, torch.Tensor) and group.device == x.device and group.dtype == x.dtype
            and group.dim() == 2 and group.shape[0] <= MAX_N and group.stride(1) == 1)


def is_quantized(matrix) -> bool:
    return isinstance(matrix, (Fp8Linear, StackedLinear))


def fuse_rows(parts: list) -> tuple[object, list]:
    """(the fused matrix, a view of each part in it) for matrices stacked along the output dim: one bf16 tensor
    (torch.cat) when none is FP8, one Fp8Linear when the FP8 parts fuse exactly, else a StackedLinear of the
    longest runs that do."""
    if not any(isinstance(p, Fp8Linear) for p in parts):
        fused = torch.cat(parts, dim=0)
        views, start = [], 0
        for p in parts:
            views.append(fused[start : start + p.shape[0]])
            start += p.shape[0]
        return fused, views
    if all(isinstance(p, Fp8Linear) for p in parts) and fuses_exactly(parts):
        fused = cat_rows(parts)
        views, start = [], 0
        for p in parts:
            views.append(fused.rows(start, start + p.shape[0]))
            start += p.shape[0]
        return fused, views
    groups: list[list] = []
    for p in parts:  # greedy runs: FP8 parts that fuse exactly with the run so far
        run = groups[-1] if groups else None
        if run and isinstance(p, Fp8Linear) and all(isinstance(q, Fp8Linear) for q in run) and fuses_exactly(run + [p]):
            run.append(p)
        else:
            groups.append([p])
    fused_groups, views = [], []
    for run in groups:
        fused, run_views = fuse_rows(run)
        fused_groups.append(fused)
        views.extend(run_views)
    return StackedLinear(fused_groups), views
