"""RMS norms: Qwen3.5's zero-centred `(1 + w)` on the residual stream, plain `w` (Qwen3's, the DFlash drafter's),
and plain `w` gated by silu(z) in GDN. All normalise in float32 the one way `normalize` does."""

import torch
import torch.nn.functional as F


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: the checkpoint stores `w`, the scale is `1 + w` (computed in float32)."""
    return (normalize(x, eps) * (1.0 + weight.float())).type_as(x)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm: normalise in float32, cast back, scale by `w` itself."""
    return weight * normalize(x, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: the plain norm, multiplied by silu(gate) in float32."""
    return (plain_rms_norm(x, weight, eps) * F.silu(gate.float())).to(x.dtype)
