"""Prefill on the GPU: inputs longer than the step's T rows (a prompt, the re-fill of one), through the fused
weights, `flash-linear-attention`'s chunked gated-delta-rule kernel and flash attention.

The math is the reference layers' (shardd/engine/reference/), with the GDN recurrence done in chunks by fla and the
attention by PyTorch's fused SDPA (causal, aligned to the end of the cache). The same input in the same
chunks always takes this path, so a re-fill reproduces the original state. Without fla (CPU, or the
`cuda` extra not installed) `available()` is False and a FastShard prefills through the reference model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shardd.engine.fast.moe import MoeBuffers
from shardd.engine.fast.step import feed_forward
from shardd.engine.fast.weights import FusedAttention, FusedLayer
from shardd.engine.kernels import elementwise
from shardd.engine.kernels import gdn as gdn_kernels
from shardd.engine.reference.rope import apply_rotary
from shardd.engine.reference.shard import ShardModel, ShardOutput
from shardd.engine.reference.state import GDNState, KVCache, SequenceState


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
    Function, autocast), which take much of a prefill call's host time. The same kernels in the same order on the same
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
    """x [n, hidden] (embedded tokens or the previous shard's hidden) at positions pos .. pos + n - 1, eagerly.

    The residual stream is kept as the step keeps it: each branch's output is added by the next norm's kernel
    (shardd/engine/kernels/elementwise.py, the reference's rounding points) and the SwiGLU product is one kernel:
    a prefill call is launch-bound up to about a thousand tokens, and the reference's norms are several launches
    each. `chunk_rule`: the gated delta rule, called as fla's `chunk_gated_delta_rule` (default:
    `fla_rule()`; the CPU test passes the reference's recurrence, so the rest of this path is tested without a
    GPU). shardd.engine.fast.graph.PrefillGraphs replays the same stages from CUDA graphs."""
    capture = captured_layers(layers, capture_layers)
    run = PrefillPass(model, x.shape[0], x.dtype, x.device, capture)
    run.hidden.copy_(x)  # updated in place: never the caller's tensor
    run.gdn, run.kv, run.pos = state.gdn, state.kv, pos
    run_stages(model, prefill_stages(model, layers, capture, chunk_rule or fla_rule()), run)
    return pass_output(model, run, copy=False)


def run_stages(model: ShardModel, stages: list, run: "PrefillPass") -> None:
    """Every stage of `prefill_stages` in order, eagerly."""
    for stage in stages:
        if isinstance(stage, FusedLayer):
            attention_core(model, stage, run)
        else:
            for op in stage:
                op(run)


def captured_layers(layers: list[FusedLayer], capture_layers) -> tuple[int, ...]:
    """The layers of `capture_layers` this shard holds, in order (a prefill captures only its own)."""
    wanted = set(capture_layers)
    return tuple(layer.index for layer in layers if layer.index in wanted)


class PrefillPass:
    """The residual stream of one prefill of n rows: the buffers its stages read and write (static for a graph),
    and the state they update (`gdn`, `kv`, set per call)."""

    def __init__(self, model: ShardModel, n: int, dtype, device, capture: tuple[int, ...]):
        c = model.config
        self.hidden = torch.empty((n, c.hidden_size), dtype=dtype, device=device)
        self.normed = torch.empty_like(self.hidden)
        self.act = torch.empty((n, c.intermediate_size), dtype=dtype, device=device) if c.moe is None else None
        self.moe = MoeBuffers(c, n, dtype, device) if c.moe is not None else None
        self.attention_out = torch.empty_like(self.hidden)  # an attention core's output, where the next stage reads it
        self.captured = {layer: torch.empty_like(self.hidden) for layer in capture}
        self.delta = None  # the last branch's output, added to the residual stream by the next norm
        self.gdn = self.kv = None
        self.pos = 0


def prefill_stages(model: ShardModel, layers: list[FusedLayer], capture: tuple[int, ...], rule) -> list:
    """The prefill as stages in order: lists of ops (each op(run) reads and writes the PrefillPass `run`, nothing that
    depends on the position), and between them the attention layers whose core (RoPE, the KV cache at `pos`,
    the causal attention over the cache) runs eagerly. Every list ends with the branch's output consumed, so
    nothing but the PrefillPass's buffers crosses from one stage to the next."""
    eps = model.config.rms_norm_eps
    wanted = set(capture)

    def norm(weight):
        def op(run):
            elementwise.residual_rms_norm(run.hidden, run.delta, weight, eps, run.normed)
            run.delta = None
        return op

    def gdn(layer):
        def op(run):
            run.delta = _gdn(model, layer, run.normed, run.gdn[layer.index], rule)
        return op

    def mlp(layer):
        def op(run):
            run.delta = feed_forward(layer, run.normed, run.act, run.moe, None)
        return op

    def keep(layer):
        def op(run):
            torch.add(run.hidden, run.delta, out=run.captured[layer.index])
        return op

    def end(run):
        if model.owns_head:
            elementwise.residual_rms_norm(run.hidden, run.delta, model.norm, eps, run.normed)
        elif run.delta is not None:
            run.hidden += run.delta
        run.delta = None

    stages, ops = [], []
    for layer in layers:
        ops.append(norm(layer.input_layernorm))
        if isinstance(layer.mixer, FusedAttention):
            stages += [ops, layer]
            ops = []
        else:
            ops.append(gdn(layer))
        ops += [norm(layer.post_attention_layernorm), mlp(layer)]
        if layer.index in wanted:
            ops.append(keep(layer))
    ops.append(end)
    stages.append(ops)
    return stages


def attention_core(model: ShardModel, layer: FusedLayer, run: PrefillPass) -> None:
    run.attention_out.copy_(_attention(model, layer, run.normed, run.kv[layer.index], run.pos))
    run.delta = run.attention_out


def pass_output(model: ShardModel, run: PrefillPass, *, copy: bool) -> ShardOutput:
    """The call's output from `run`'s buffers (copied out of static ones: the next call reuses them)."""
    out = ShardOutput()
    if model.owns_head:
        out.logits = F.linear(run.normed, model.lm_head)
        out.ids = out.logits.argmax(dim=-1)
    else:
        out.hidden = run.hidden.clone() if copy else run.hidden
    out.captured = {layer: t.clone() if copy else t for layer, t in run.captured.items()}
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
    conv = gdn_kernels.prefill_conv(mixed, state.conv, mixer.conv_weight)  # reads the window before the rows
    advance_window(state.conv, mixed)
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


def advance_window(window: torch.Tensor, rows: torch.Tensor) -> None:
    """The conv window after `rows`: the last W rows of [window (as rows' dtype), rows], in place."""
    n, width = rows.shape[0], window.shape[0]
    if n >= width:
        window.copy_(rows[n - width:])
    else:
        window.copy_(torch.cat([window[n:].to(rows.dtype), rows]))


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
