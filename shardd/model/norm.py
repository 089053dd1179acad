"""RMS norms of Qwen3.5: zero-centred `(1 + w)` on the residual stream, plain `w` gated by silu(z) in GDN."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: the checkpoint stores `w`, the scale is `1 + w` (computed in float32)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: normalise in float32, scale by `w` (not zero-centred), multiply by silu(gate)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)
