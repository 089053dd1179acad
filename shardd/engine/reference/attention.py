"""Gated full attention: q_proj yields query and a sigmoid output gate; q/k RMSNorm; partial RoPE; GQA."""

import torch
import torch.nn.functional as F

from common.model_config import ModelConfig
from shardd.engine.reference.norm import rms_norm
from shardd.engine.reference.rope import RotaryEmbedding, apply_rotary
from shardd.engine.reference.state import KVCache


class GatedAttention:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.q_proj = weights[f"{prefix}.q_proj.weight"]
        self.k_proj = weights[f"{prefix}.k_proj.weight"]
        self.v_proj = weights[f"{prefix}.v_proj.weight"]
        self.o_proj = weights[f"{prefix}.o_proj.weight"]
        self.q_norm = weights[f"{prefix}.q_norm.weight"]
        self.k_norm = weights[f"{prefix}.k_norm.weight"]

    def __call__(self, x: torch.Tensor, cache: KVCache, start: int, rope: RotaryEmbedding) -> torch.Tensor:
        n = x.shape[0]
        # q_proj -> [n, heads, 2 * head_dim]: per head, the query then the gate
        query, gate = F.linear(x, self.q_proj).view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(n, self.num_heads * self.head_dim)
        query = rms_norm(query, self.q_norm, self.eps)
        key = rms_norm(F.linear(x, self.k_proj).view(n, self.num_kv_heads, self.head_dim), self.k_norm, self.eps)
        value = F.linear(x, self.v_proj).view(n, self.num_kv_heads, self.head_dim)

        positions = torch.arange(start, start + n, device=x.device)
        cos, sin = rope.cos_sin(positions, x.dtype)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

        end = start + n
        cache.key[:, start:end] = key.transpose(0, 1)
        cache.value[:, start:end] = value.transpose(0, 1)
        mask = None
        if n > 1:  # causal over the new rows; every cached row before `start` is visible
            mask = torch.arange(end, device=x.device)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],  # [1, heads, n, head_dim]
            cache.key[None, :, :end],
            cache.value[None, :, :end],
            attn_mask=mask,
            scale=self.head_dim**-0.5,
            enable_gqa=True,
        )
        out = out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
        return F.linear(out * torch.sigmoid(gate), self.o_proj)
