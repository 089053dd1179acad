"""The fixed-shape step: R rows through a shard's layers, from static input buffers to static outputs.

Written once, run eagerly (tests under TRITON_INTERPRET=1, warm-up) or replayed as a CUDA graph
(graph.py). The R rows hold several sequences, each in contiguous rows (a segment); for each it reads the
slot, the number of rows n, the position, the first row and what to save from the device table `control`
(shardd/engine/kernels/segments.py), so it never syncs with the host and never slices by a Python int. The GEMMs
and the row-wise kernels see R rows whoever fills them; the attention and GDN kernels run each segment as
if its sequence were alone in the step: a token's bits do not depend on who shares its step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from protocol.layout import REPLAY_SSM
from shardd.engine.fast.moe import MoeBuffers, sparse_mlp
from shardd.engine.fast.pools import StatePools
from shardd.engine.fast.weights import FusedAttention, FusedLayer
from shardd.engine.kernels import attention as attention_kernels
from shardd.engine.kernels import elementwise
from shardd.engine.kernels import gdn as gdn_kernels
from shardd.engine.kernels import segments as seg
from shardd.engine.reference.shard import ShardModel

class StepBuffers:
    """The step's static inputs and outputs, and the scratch its kernels write: `rows` (R) rows holding at
    most `segments` sequences of at most `segment_rows` rows each."""

    def __init__(self, model: ShardModel, rows: int, max_context: int, *, segments: int = 1,
                 segment_rows: int | None = None):
        c, device, dtype = model.config, model.device, model.dtype
        self.segments = segments
        self.segment_rows = rows if segment_rows is None else segment_rows
        self.control = torch.zeros(seg.size(segments, rows), dtype=torch.int32, device=device)  # the segment table
        # replay-ssm: per segment, the re-run of the tokens its sequence's last rollback kept (n = keep; 0: none),
        # each writing its (unread) outputs at rows segment * segment_rows; the side stream it runs on
        self.replay_control = torch.zeros(seg.size(segments, 0), dtype=torch.int32, device=device)
        self.replay_out = torch.zeros((1, segments * self.segment_rows, c.linear_num_value_heads,
                                       c.linear_value_head_dim), dtype=torch.float32, device=device)
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.replays_pending = True  # whether replay_control names a re-run (read only off the GPU)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.hidden_in = torch.zeros((rows, c.hidden_size), dtype=dtype, device=device)
        self.hidden = torch.zeros((rows, c.hidden_size), dtype=dtype, device=device)  # the residual stream
        self.normed = torch.zeros((rows, c.hidden_size), dtype=dtype, device=device)
        self.core = torch.zeros((1, rows, c.linear_num_value_heads, c.linear_value_head_dim), dtype=torch.float32, device=device)
        self.gdn_out = torch.zeros((rows, c.linear_value_dim), dtype=dtype, device=device)
        self.query = torch.zeros((rows, c.num_attention_heads, c.head_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros((rows, c.num_attention_heads * c.head_dim), dtype=dtype, device=device)
        splits = attention_kernels.num_splits(max_context)
        heads = c.num_attention_heads
        self.partials = (
            torch.zeros((rows, heads, splits), dtype=torch.float32, device=device),
            torch.zeros((rows, heads, splits), dtype=torch.float32, device=device),
            torch.zeros((rows, heads, splits, c.head_dim), dtype=torch.float32, device=device),
        )
        self.act = torch.zeros((rows, c.intermediate_size), dtype=dtype, device=device) if c.moe is None else None
        self.moe = MoeBuffers(c, rows, dtype, device) if c.moe is not None else None
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.logits = torch.zeros((rows, c.vocab_size), dtype=torch.float32, device=device) if model.owns_head else None
        # cos / sin of every position a row can take (padding rows run up to max_context + rows - 1)
        positions = torch.arange(max_context + rows, device=device)
        self.cos, self.sin = (t.contiguous() for t in model.rope.cos_sin(positions, dtype))


def run_step(model: ShardModel, layers: list[FusedLayer], pools: StatePools, buffers: StepBuffers,
             captured: dict[int, torch.Tensor]) -> None:
    """One R-row step: buffers.tokens / hidden_in -> buffers.hidden (or logits and ids on the head shard);
    the output of each layer in `captured` is copied into its buffer."""
    c, b = model.config, buffers
    rows = b.tokens.shape[0]
    eps = c.rms_norm_eps
    if model.owns_embedding:
        b.hidden.copy_(F.embedding(b.tokens, model.embed_tokens))
    else:
        b.hidden.copy_(b.hidden_in)
    delta = None  # the last branch's output, added to the residual stream by the next norm
    gdn_row = {layer: row for row, layer in enumerate(pools.gdn_layers)}
    row_segment = b.control[b.segments * seg.FIELDS:]  # -1: a padding row, which reads no expert
    replayed = _replays(model, pools, b) if pools.mode == REPLAY_SSM else None
    for layer in layers:
        elementwise.residual_rms_norm(b.hidden, delta, layer.input_layernorm, eps, b.normed)
        if isinstance(layer.mixer, FusedAttention):
            delta = _attention(model, layer, pools, b, rows)
        else:
            if replayed is not None:  # this layer's state is the re-run's before the step reads or logs it
                replayed(gdn_row[layer.index])
            delta = _gdn(model, layer, gdn_row[layer.index], pools, b, rows)
        elementwise.residual_rms_norm(b.hidden, delta, layer.post_attention_layernorm, eps, b.normed)
        delta = feed_forward(layer, b.normed, b.act, b.moe, row_segment)
        if layer.index in captured:
            torch.add(b.hidden, delta, out=captured[layer.index])
    if model.owns_head:
        elementwise.residual_rms_norm(b.hidden, delta, model.norm, eps, b.normed)
        b.logits.copy_(F.linear(b.normed, model.lm_head))
        torch.argmax(b.logits, dim=-1, out=b.ids)
    else:
        b.hidden.add_(delta)
    if replayed is not None:
        replayed(None)


def feed_forward(layer: FusedLayer, x: torch.Tensor, act: torch.Tensor | None, moe: MoeBuffers | None,
                 row_segment: torch.Tensor | None) -> torch.Tensor:
    """The layer's SwiGLU MLP, or its sparse block (the experts of the rows whose `row_segment` is not -1; None:
    every row's), over x's rows."""
    if layer.moe is not None:
        return sparse_mlp(layer.moe, x, row_segment, moe)
    return F.linear(elementwise.silu_mul(F.linear(x, layer.gate_up), act), layer.down)


def _replays(model, pools: StatePools, b: StepBuffers):
    """replay-ssm: the re-run of each segment's kept tokens (`b.replay_control`, n = 0 where none is pending),
    one launch per GDN layer: the same kernel and launch shape as the step's recurrence and as `settle`'s
    re-run, so the same bits. On a GPU they go on a side stream, each layer's ahead of the step's GDN work on
    that layer (it only waits for the re-run of its own layer, which hides behind the layer's weights streaming in);
    returns `wait(row)`, which orders the step after row's re-run (`wait(None)` joins the side stream at the
    end). Without a GPU each layer's re-run runs when the step reaches it."""
    c = model.config

    def rerun(row: int) -> None:
        gdn_kernels.gdn_recurrence(
            pools.recurrence_inputs, pools.recurrent, pools.recurrent0, b.replay_out, b.replay_control,
            layer0=row, layers=1, rows=pools.rows, num_k_heads=c.linear_num_key_heads, initial=pools.recurrent0,
            segments=b.segments,
        )

    if b.side_stream is None:  # no GPU: no graph either, so a step without a pending re-run launches none
        return lambda row: None if row is None or not b.replays_pending else rerun(row)
    main, side = torch.cuda.current_stream(), b.side_stream
    side.wait_stream(main)  # the control and the previous step's logs are in
    done = []
    with torch.cuda.stream(side):
        for row in range(len(pools.gdn_layers)):
            rerun(row)
            done.append(torch.cuda.Event())
            done[-1].record(side)

    def wait(row) -> None:
        if row is None:
            main.wait_stream(side)
        else:
            main.wait_event(done[row])

    return wait


def _gdn(model, layer: FusedLayer, row: int, pools: StatePools, b: StepBuffers, rows: int) -> torch.Tensor:
    c, mixer = model.config, layer.mixer
    proj = F.linear(b.normed, mixer.in_proj)  # [T, conv_dim + value_dim + 2 * v_heads]
    views = pools.layer_views(row)
    gdn_kernels.gdn_prepare(
        proj, mixer.conv_weight, mixer.neg_decay, mixer.dt_bias, views["conv_state"], views["windows"],
        views["log_conv0"], views["log_in"], views["rin"], b.control,
        num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads,
        k_dim=c.linear_key_head_dim, v_dim=c.linear_value_head_dim, rows=b.segment_rows, segments=b.segments,
    )
    gdn_kernels.gdn_recurrence(
        pools.recurrence_inputs, pools.recurrent, pools.saved, b.core, b.control,
        layer0=row, layers=1, rows=b.segment_rows, num_k_heads=c.linear_num_key_heads, segments=b.segments,
    )
    z = proj[:, c.linear_conv_dim : c.linear_conv_dim + c.linear_value_dim]
    elementwise.gated_rms_norm(b.core[0], z, mixer.norm, c.rms_norm_eps, b.gdn_out)
    return F.linear(b.gdn_out, mixer.out_proj)


def _attention(model, layer: FusedLayer, pools: StatePools, b: StepBuffers, rows: int) -> torch.Tensor:
    c, mixer = model.config, layer.mixer
    qkv = F.linear(b.normed, mixer.qkv)
    attention_kernels.attention_step(
        qkv, mixer.q_norm, mixer.k_norm, b.cos, b.sin, pools.keys[layer.index], pools.values[layer.index],
        b.query, b.partials, b.attn_out, b.control,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rotary_dim=c.rotary_dim, eps=c.rms_norm_eps, rows=rows, segments=b.segments, segment_rows=b.segment_rows,
    )
    return F.linear(b.attn_out, mixer.o_proj)
