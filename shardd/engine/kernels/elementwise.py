"""Row-wise norms and the SwiGLU product, with the reference's rounding points (shardd/engine/reference/norm.py, mlp.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, sum_ptr, out_ptr, w_ptr, width, x_stride, delta_stride, sum_stride, out_stride, eps,
    HAS_DELTA: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the activation dtype as `x + delta` is
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * delta_stride + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / width + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if ZERO_CENTRED:
        tl.store(out_ptr + row * out_stride + cols, (x32 * rstd * (1.0 + w)).to(dtype), mask=mask)
    else:  # Qwen3's plain norm (plain_rms_norm): normalised and rounded, then scaled by w
        tl.store(out_ptr + row * out_stride + cols, ((x32 * rstd).to(dtype).to(tl.float32) * w).to(dtype), mask=mask)


def add_rms_norm(x, weight, eps, *, delta=None, sum_out=None, out=None, zero_centred=True):
    """rows of x [R, W] (plus `delta`, written to `sum_out`) -> RMS-normalised rows in `out`.

    zero_centred: scale by (1 + w) (Qwen3.5's residual-stream and q/k norms) instead of w (Qwen3's, the
    DFlash drafter's: the normalised row rounded to the dtype first, as plain_rms_norm does)."""
    rows, width = x.shape
    out = torch.empty_like(x) if out is None else out
    if delta is not None:
        assert sum_out is not None
    _add_rms_norm_kernel[(rows,)](
        x, delta if delta is not None else x, sum_out if sum_out is not None else x, out, weight, width,
        x.stride(0), (delta if delta is not None else x).stride(0), (sum_out if sum_out is not None else x).stride(0),
        out.stride(0), eps, HAS_DELTA=delta is not None, ZERO_CENTRED=zero_centred, BLOCK=triton.next_power_of_2(width),
    )
    return out


def residual_rms_norm(hidden, delta, weight, eps, out, *, zero_centred=True):
    """The residual stream's step between two branches, one launch: hidden += delta in place (rounded as the
    reference's residual add; nothing to add before the first branch: delta None), out = rms_norm(hidden)."""
    return add_rms_norm(hidden, weight, eps, delta=delta, sum_out=hidden, out=out, zero_centred=zero_centred)


@triton.jit
def _gated_rms_norm_kernel(core_ptr, z_ptr, w_ptr, out_ptr, heads, width, z_stride, eps, BLOCK: tl.constexpr):
    # one (token, head) row: core [T, heads, width] float32, z [T, heads * width] (a strided view)
    row = tl.program_id(0)
    t = row // heads
    head = row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    x = tl.load(core_ptr + row * width + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    scaled = (tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * normed).to(dtype).to(tl.float32)
    z = tl.load(z_ptr + t * z_stride + head * width + cols, mask=mask, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    tl.store(out_ptr + row * width + cols, (scaled * gate).to(dtype), mask=mask)


def gated_rms_norm(core, z, weight, eps, out):
    """GDN output norm: core [T, H, V] float32, z [T, H * V] (may be a column slice) -> out [T, H * V]."""
    tokens, heads, width = core.shape
    _gated_rms_norm_kernel[(tokens * heads,)](
        core, z, weight, out, heads, width, z.stride(0), eps, BLOCK=triton.next_power_of_2(width)
    )
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (activated * up).to(dtype), mask=mask)


def silu_mul(gate_up, out):
    """gate_up [T, 2I] (gate | up) -> out [T, I] = silu(gate) * up."""
    rows, width = out.shape
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), BLOCK=block)
    return out
