"""Prefill on the GPU: inputs longer than the step's T rows (a prompt, the re-fill of one), through the fused
weights, `flash-linear-attention`'s chunked gated-delta-rule kernel and flash attention.

The math is the reference layers' (shardd/model/), with the GDN recurrence done in chunks by fla and the
attention by PyTorch's fused SDPA (causal, aligned to the end of the cache). The same input in the same
chunks always takes this path, so a re-fill reproduces the original state. Without fla (CPU, or the
`cuda` extra not installed) `available()` is False and a FastShard prefills through the reference model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardd.fast.weights import FusedAttention, FusedLayer
from shardd.model.norm import gated_rms_norm, rms_norm
from shardd.model.rope import apply_rotary
from shardd.model.shard import ShardModel, ShardOutput
from shardd.model.state import GDNState, KVCache, SequenceState


def available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def prefill(model: ShardModel, layers: list[FusedLayer], state: SequenceState, pos: int, x: torch.Tensor,
            capture_layers) -> ShardOutput:
    """x [n, hidden] (embedded tokens or the previous shard's hidden) at positions pos .. pos + n - 1."""
    c = model.config
    wanted = set(capture_layers)
    out = ShardOutput()
    for layer in layers:
        mixed = rms_norm(x, layer.input_layernorm, c.rms_norm_eps)
        if isinstance(layer.mixer, FusedAttention):
            x = x + _attention(model, layer, mixed, state.kv[layer.index], pos)
        else:
            x = x + _gdn(model, layer, mixed, state.gdn[layer.index])
        gate, up = F.linear(rms_norm(x, layer.post_attention_layernorm, c.rms_norm_eps), layer.gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.down)
        if layer.index in wanted:
            out.captured[layer.index] = x
    if model.owns_head:
        out.logits = F.linear(rms_norm(x, model.norm, c.rms_norm_eps), model.lm_head)
        out.ids = out.logits.argmax(dim=-1)
    else:
        out.hidden = x
    return out


def _gdn(model: ShardModel, layer: FusedLayer, x: torch.Tensor, state: GDNState) -> torch.Tensor:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    c, mixer = model.config, layer.mixer
    n = x.shape[0]
    mixed, z, b, a = F.linear(x, mixer.in_proj).split(
        [c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads, c.linear_num_value_heads], dim=-1
    )
    window = torch.cat([state.conv.to(mixed.dtype), mixed], dim=0)  # [kernel - 1 + n, conv_dim]
    state.conv.copy_(window[n:])
    conv = F.silu(F.conv1d(window.t()[None], mixer.conv_weight[:, None, :], groups=window.shape[1])[0].t())
    query, key, value = conv.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
    g = mixer.neg_decay * F.softplus(a.float() + mixer.dt_bias)
    core, final = chunk_gated_delta_rule(
        query.reshape(1, n, c.linear_num_key_heads, c.linear_key_head_dim),
        key.reshape(1, n, c.linear_num_key_heads, c.linear_key_head_dim),
        value.reshape(1, n, c.linear_num_value_heads, c.linear_value_head_dim),
        g=g[None], beta=torch.sigmoid(b)[None], scale=c.linear_key_head_dim**-0.5,
        initial_state=state.recurrent[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    state.recurrent.copy_(final[0])
    core = core[0].to(x.dtype)  # [n, v_heads, v_dim]
    out = gated_rms_norm(core, z.view(n, c.linear_num_value_heads, c.linear_value_head_dim), mixer.norm, c.rms_norm_eps)
    return F.linear(out.reshape(n, c.linear_value_dim), mixer.out_proj)


def _attention(model: ShardModel, layer: FusedLayer, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    c, mixer = model.config, layer.mixer
    n, heads, kv_heads, dim = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q, k, v = F.linear(x, mixer.qkv).split([2 * heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    query, gate = q.reshape(n, heads, 2 * dim).chunk(2, dim=-1)
    query = rms_norm(query, mixer.q_norm, c.rms_norm_eps)
    key = rms_norm(k.reshape(n, kv_heads, dim), mixer.k_norm, c.rms_norm_eps)
    cos, sin = model.rope.cos_sin(torch.arange(start, start + n, device=x.device), x.dtype)
    query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
    end = start + n
    cache.key[:, start:end] = key.transpose(0, 1)
    cache.value[:, start:end] = v.reshape(n, kv_heads, dim).transpose(0, 1)
    group = heads // kv_heads  # each kv head serves consecutive query heads
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        cache.key[:, :end].repeat_interleave(group, dim=0)[None],
        cache.value[:, :end].repeat_interleave(group, dim=0)[None],
        attn_mask=causal_lower_right(n, end), scale=dim**-0.5,
    )
    out = out[0].transpose(0, 1).reshape(n, heads * dim)
    return F.linear(out * torch.sigmoid(gate.reshape(n, heads * dim)), mixer.o_proj)
