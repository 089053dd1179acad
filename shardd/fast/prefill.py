"""Prefill on the GPU: inputs longer than the step's T rows (a prompt, the re-fill of one), through the fused
weights, `flash-linear-attention`'s chunked gated-delta-rule kernel and flash attention.

The math is the reference layers' (shardd/model/), with the GDN recurrence done in chunks by fla and the
attention by PyTorch's fused SDPA (causal, aligned to the end of the cache). The same input in the same
chunks always takes this path, so a re-fill reproduces the original state. Without fla (CPU, or the
`cuda` extra not installed) `available()` is False and a FastShard prefills through the reference model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shardd.fast.weights import FusedAttention, FusedLayer
from shardd.kernels import elementwise
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


_FLA_DIRECT_VERSIONS = ("0.6.",)  # fla releases whose internal forward's signature `fla_rule` was written against


@functools.lru_cache(maxsize=None)
def fla_rule(direct: bool = True):
    """fla's chunked gated delta rule, called as `chunk_gated_delta_rule` is.

    `direct`: its forward functions without the public wrapper's layers (backend dispatch, input guard, autograd
    Function, autocast), which were a third of a prefill call's host time (py-spy,
    bench/results/h200/prefill_pyspy_summary_538a901.txt). The same kernels in the same order on the same
    inputs (made contiguous as the guard makes them), so the same bits; a GPU test compares the two. Only for
    the fla releases in `_FLA_DIRECT_VERSIONS`: on any other the public function."""
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if not direct or not fla.__version__.startswith(_FLA_DIRECT_VERSIONS):
        return chunk_gated_delta_rule
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    def rule(q, k, v, *, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:
            q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
        _, core, _, final, _, _ = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state.contiguous(),
                                                               output_final_state)
        return core.to(q.dtype), final

    return rule


def prefill(model: ShardModel, layers: list[FusedLayer], state: SequenceState, pos: int, x: torch.Tensor,
            capture_layers, chunk_rule=None) -> ShardOutput:
    """x [n, hidden] (embedded tokens or the previous shard's hidden) at positions pos .. pos + n - 1.

    The residual stream is kept as the step keeps it: each branch's output is added by the next norm's kernel
    (shardd/kernels/elementwise.py, the reference's rounding points) and the SwiGLU product is one kernel: a
    prefill call is launch-bound up to ~1,000 tokens on an H200 host (110 ms of host time for 38 ms of kernels
    at 256 tokens, bench/results/h200/prefill_profile_538a901.json), and the reference's norms took ~8 launches
    each. `chunk_rule`: the gated delta rule, called as fla's `chunk_gated_delta_rule` (default:
    `fla_rule()`; the CPU test passes the reference's recurrence, so the rest of this path is tested without a
    GPU)."""
    if chunk_rule is None:
        chunk_rule = fla_rule()
    c = model.config
    eps = c.rms_norm_eps
    wanted = set(capture_layers)
    out = ShardOutput()
    hidden = x.clone()  # updated in place below: never the caller's tensor
    normed = torch.empty_like(hidden)
    act = torch.empty((hidden.shape[0], c.intermediate_size), dtype=hidden.dtype, device=hidden.device)
    delta = None  # the last branch's output, added to the residual stream by the next norm
    for layer in layers:
        elementwise.residual_rms_norm(hidden, delta, layer.input_layernorm, eps, normed)
        if isinstance(layer.mixer, FusedAttention):
            delta = _attention(model, layer, normed, state.kv[layer.index], pos)
        else:
            delta = _gdn(model, layer, normed, state.gdn[layer.index], chunk_rule)
        elementwise.residual_rms_norm(hidden, delta, layer.post_attention_layernorm, eps, normed)
        delta = F.linear(elementwise.silu_mul(F.linear(normed, layer.gate_up), act), layer.down)
        if layer.index in wanted:
            out.captured[layer.index] = hidden + delta
    if model.owns_head:
        elementwise.residual_rms_norm(hidden, delta, model.norm, eps, normed)
        out.logits = F.linear(normed, model.lm_head)
        out.ids = out.logits.argmax(dim=-1)
    else:
        if delta is not None:
            hidden += delta
        out.hidden = hidden
    return out


def _head_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """The zero-centred norm of each head's row of x [n, heads, dim] (q_norm, k_norm), one launch."""
    n, heads, dim = x.shape
    return elementwise.add_rms_norm(x.reshape(n * heads, dim), weight, eps).view(n, heads, dim)


def _gdn(model: ShardModel, layer: FusedLayer, x: torch.Tensor, state: GDNState, chunk_rule) -> torch.Tensor:
    c, mixer = model.config, layer.mixer
    n = x.shape[0]
    proj = F.linear(x, mixer.in_proj)
    mixed, z, b, a = proj.split(
        [c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads, c.linear_num_value_heads], dim=-1
    )
    window = torch.cat([state.conv.to(mixed.dtype), mixed], dim=0)  # [kernel - 1 + n, conv_dim]
    state.conv.copy_(window[n:])
    conv = F.silu(F.conv1d(window.t()[None], mixer.conv_weight[:, None, :], groups=window.shape[1])[0].t())
    query, key, value = conv.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
    g = mixer.neg_decay * F.softplus(a.float() + mixer.dt_bias)
    core, final = chunk_rule(
        query.reshape(1, n, c.linear_num_key_heads, c.linear_key_head_dim),
        key.reshape(1, n, c.linear_num_key_heads, c.linear_key_head_dim),
        value.reshape(1, n, c.linear_num_value_heads, c.linear_value_head_dim),
        g=g[None], beta=torch.sigmoid(b)[None], scale=c.linear_key_head_dim**-0.5,
        initial_state=state.recurrent[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    state.recurrent.copy_(final[0])
    # the plain norm of each head's core row, gated by silu(z): one launch (the kernel rounds core to x's dtype
    # first, as the reference's `core.to(x.dtype)`)
    out = torch.empty((n, c.linear_value_dim), dtype=x.dtype, device=x.device)
    elementwise.gated_rms_norm(core[0].contiguous(), z, mixer.norm, c.rms_norm_eps, out)
    return F.linear(out, mixer.out_proj)


def _attention(model: ShardModel, layer: FusedLayer, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    c, mixer = model.config, layer.mixer
    n, heads, kv_heads, dim = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q, k, v = F.linear(x, mixer.qkv).split([2 * heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    query, gate = q.reshape(n, heads, 2 * dim).chunk(2, dim=-1)
    query = _head_norm(query, mixer.q_norm, c.rms_norm_eps)
    key = _head_norm(k.reshape(n, kv_heads, dim), mixer.k_norm, c.rms_norm_eps)
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
