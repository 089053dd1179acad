"""Fused weight matrices, built once after loading. The reference layers keep working on views into them,
so fusing costs no extra memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardd.engine.fast.moe import FusedMoe, fuse_moe
from shardd.engine.reference.moe import SparseMoeBlock
from shardd.engine.reference.shard import ShardModel
from shardd.weights.quant import fuse_rows


@dataclass
class FusedGDN:
    in_proj: torch.Tensor      # [conv_dim + value_dim + 2 * v_heads, hidden]: qkv | z | b | a
    conv_weight: torch.Tensor  # [conv_dim, kernel]
    neg_decay: torch.Tensor    # [v_heads] float32, -exp(A_log)
    dt_bias: torch.Tensor
    norm: torch.Tensor
    out_proj: torch.Tensor


@dataclass
class FusedAttention:
    qkv: torch.Tensor  # [2 * heads * head_dim + 2 * kv_heads * head_dim, hidden]: q (query | gate per head) | k | v
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor


@dataclass
class FusedLayer:
    index: int
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    mixer: FusedGDN | FusedAttention
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden] (None: a sparse layer)
    down: torch.Tensor | None
    moe: FusedMoe | None = None  # the sparse block of a MoE layer


def _fuse(owner, names: list[str]) -> torch.Tensor:
    """Concatenate owner's matrices along the output dim and point the owner's attributes at views of it.
    FP8 parts keep their bytes and scales (shardd.weights.quant.fuse_rows: one Fp8Linear where the scales fuse exactly)."""
    fused, views = fuse_rows([getattr(owner, name) for name in names])
    for name, view in zip(names, views):
        setattr(owner, name, view)
    return fused


def fuse_layers(model: ShardModel) -> list[FusedLayer]:
    fused = []
    for layer in model.layers:
        if layer.is_gdn:
            gdn = layer.linear_attn
            mixer = FusedGDN(
                in_proj=_fuse(gdn, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]),
                conv_weight=gdn.conv_weight.reshape(gdn.conv_weight.shape[0], -1).contiguous(),
                neg_decay=gdn.neg_decay_rate.float().contiguous(),
                dt_bias=gdn.dt_bias,
                norm=gdn.norm,
                out_proj=gdn.out_proj,
            )
        else:
            attn = layer.self_attn
            mixer = FusedAttention(
                qkv=_fuse(attn, ["q_proj", "k_proj", "v_proj"]), q_norm=attn.q_norm, k_norm=attn.k_norm, o_proj=attn.o_proj
            )
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if isinstance(layer.mlp, SparseMoeBlock):
            fused.append(FusedLayer(layer.index, *norms, mixer, None, None, fuse_moe(layer.mlp, layer.index)))
        else:
            fused.append(FusedLayer(layer.index, *norms, mixer, _fuse(layer.mlp, ["gate_proj", "up_proj"]),
                                    layer.mlp.down_proj))
    return fused
