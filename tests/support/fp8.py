"""FP8 experts for the MoE tests: a synthetic model's routed and shared experts quantized as `--quantize` quantizes
them (shardd.weights.quant.quantize), kept as FP8 linears or dequantized as the reference engine loads them on the
CPU."""

from __future__ import annotations

import torch

from common.quantization import FP8_BLOCK
from shardd.weights import quant


def is_expert_matrix(name: str) -> bool:
    """A routed or shared expert's gate_proj, up_proj or down_proj (not the router, not the shared expert's gate)."""
    return ".mlp.experts." in name or ".mlp.shared_expert." in name


def fp8_experts(weights: dict[str, torch.Tensor], layout: str, *, dequantized: bool = False) -> dict:
    """`weights` with every expert matrix FP8 in `layout`: an Fp8Linear on the weight's device, or (`dequantized`)
    the matrix it stands for in the weight's dtype."""
    block = (128, 128) if layout == FP8_BLOCK else None
    out = dict(weights)
    for name, weight in weights.items():
        if is_expert_matrix(name):
            data, scale = quant.quantize(weight, layout)
            out[name] = quant.dequantize(data, scale, block).to(weight.dtype) if dequantized else \
                quant.Fp8Linear(data, scale, block)
    return out
