"""The attention layer's step kernels: q/k RMSNorm + partial RoPE + the KV-cache append, attention over
the cache in fixed-size key chunks (split-KV), and the merge of the chunks with the sigmoid output gate
(the math of shardd/engine/reference/attention.py).

The same kernels run the DFlash drafter's attention (shardd/draft/model.py, shardd/engine/fast/draft.py): Qwen3's
ungated query, plain `w` q/k norms, full RoPE, and a block whose rows see every row of the block (`causal=False`)
or, in a sliding-window layer, the `window` keys ending at their own position.

A row's keys are cut into chunks of CHUNK positions that do not depend on the step: a token's output
is the same whichever row of whichever step it is in. Chunks past the step's last position cost one
early exit, so the cost grows with the real context, not the preallocated one.

A step's rows hold several sequences: the device `control` is a table of segments, one per
sequence, each its own contiguous rows (shardd.engine.kernels.segment: slot, n, pos, first row, ...). A row finds
its segment in the table; a row of no segment (padding) writes nothing to any cache and outputs zeros.
The split kernel runs one program per (heads, chunk, segment) over that segment's rows in a tile of a fixed
`segment_rows`, the rows at the same offsets as when the sequence is alone in the step: a token's bits do
not depend on who shares its step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shardd.engine.kernels.segments import segment_of

CHUNK = 1024  # key positions per split; fixed, so a row's reduction order never depends on its step
# Launch shape of the split kernel: (query heads of one GQA group per program, keys per inner block, warps),
# by the cache length a shard was built for (fixed per shard, so every token of it takes the same kernel).
# One head per program is the fastest at short contexts; three heads, which read each key once for three, at
# long ones (scripts/tune_kernels.py measures them).
LONG_CONTEXT = 8192
SHORT_LAUNCH = (1, 64, 4)
LONG_LAUNCH = (3, 32, 4)


@triton.jit
def _qk_norm_rope_append_kernel(
    qkv_ptr, qkv_stride, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, query_ptr,
    k_cache_ptr, v_cache_ptr, cache_slot_stride, cache_head_stride,
    control_ptr, HQ, HKV, D, ROT, eps, DP: tl.constexpr,
    GATED: tl.constexpr = True, ZERO_CENTRED: tl.constexpr = True, SEGMENTS: tl.constexpr = 1,
):
    row = tl.program_id(0)  # the step's row; t: its offset in its sequence's segment
    head = tl.program_id(1)
    seg = segment_of(control_ptr, row, SEGMENTS)
    if seg >= 0:  # a padding row writes nothing
        _qk_norm_rope_append_row(qkv_ptr, qkv_stride, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, query_ptr,
                                 k_cache_ptr, v_cache_ptr, cache_slot_stride, cache_head_stride, control_ptr + seg * 8,
                                 row, head, HQ, HKV, D, ROT, eps, DP, GATED, ZERO_CENTRED)


@triton.jit
def _qk_norm_rope_append_row(
    qkv_ptr, qkv_stride, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, query_ptr,
    k_cache_ptr, v_cache_ptr, cache_slot_stride, cache_head_stride, segment_ptr,
    row, head, HQ, HKV, D, ROT, eps, DP: tl.constexpr, GATED: tl.constexpr, ZERO_CENTRED: tl.constexpr,
):
    slot = tl.load(segment_ptr + 0).to(tl.int64)
    pos = tl.load(segment_ptr + 2)
    t = row - tl.load(segment_ptr + 6)
    is_query = head < HQ
    kv_head = head - HQ
    # q_proj gives per head [query D | gate D] (or the query alone, ungated); then k (HKV * D), then v (HKV * D)
    if GATED:
        q_width = 2 * D
    else:
        q_width = D
    col0 = tl.where(is_query, head * q_width, q_width * HQ + kv_head * D)
    lanes = tl.arange(0, DP)
    mask = lanes < D
    half = ROT // 2
    partner = tl.where(lanes < half, lanes + half, lanes - half)
    row_ptr = qkv_ptr + row * qkv_stride + col0
    x = tl.load(row_ptr + lanes, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row_ptr + partner, mask=mask & (lanes < ROT), other=0.0).to(tl.float32)
    norm_ptr = tl.where(is_query, q_norm_ptr, k_norm_ptr)
    w = tl.load(norm_ptr + lanes, mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(norm_ptr + partner, mask=mask & (lanes < ROT), other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    dtype = query_ptr.dtype.element_ty
    if ZERO_CENTRED:
        y = (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
        yp = (xp * rstd * (1.0 + wp)).to(dtype).to(tl.float32)
    else:  # Qwen3's plain norm: normalised, rounded, then scaled by w
        y = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        yp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    position = pos + t
    cos = tl.load(cos_ptr + position * ROT + lanes, mask=mask & (lanes < ROT), other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * ROT + lanes, mask=mask & (lanes < ROT), other=0.0).to(tl.float32)
    rotated_half = tl.where(lanes < half, -yp, yp)
    roped = ((y * cos).to(dtype).to(tl.float32) + (rotated_half * sin).to(dtype).to(tl.float32)).to(dtype)
    out = tl.where(lanes < ROT, roped, y.to(dtype))
    if is_query:
        tl.store(query_ptr + (row * HQ + head) * D + lanes, out, mask=mask)
    else:
        cache = slot * cache_slot_stride + kv_head * cache_head_stride + position.to(tl.int64) * D + lanes
        tl.store(k_cache_ptr + cache, out, mask=mask)
        value = tl.load(qkv_ptr + row * qkv_stride + q_width * HQ + HKV * D + kv_head * D + lanes, mask=mask)
        tl.store(v_cache_ptr + cache, value, mask=mask)


@triton.jit
def _attention_split_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, cache_slot_stride, cache_head_stride, max_context,
    m_ptr, l_ptr, acc_ptr, num_splits, control_ptr, HQ, HKV, D, scale,
    T: tl.constexpr, G: tl.constexpr, HG: tl.constexpr, ROWS: tl.constexpr, DP: tl.constexpr, CHUNK_: tl.constexpr,
    BLOCK: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr = True, WINDOW: tl.constexpr = 0,
):
    # one program: a chunk of keys against the T rows of one segment (sequence) of HG query heads that share a
    # kv head (HG divides the GQA group G), so each key and value is read once per HG heads; tile row r is
    # (head r // T, token r % T), the segment's token t at the step's row first + t
    split = tl.program_id(1)
    segment_ptr = control_ptr + tl.program_id(2) * 8
    slot = tl.load(segment_ptr + 0).to(tl.int64)
    n = tl.load(segment_ptr + 1)
    pos = tl.load(segment_ptr + 2)
    first = tl.load(segment_ptr + 6)
    start = split * CHUNK_
    lowest = pos * 0
    if WINDOW > 0:
        lowest = pos - WINDOW + 1  # no row of a windowed step sees a key before it
    if (start <= pos + n - 1) & (start + CHUNK_ > lowest):  # else: the whole chunk lies outside every row's keys
        rows = tl.arange(0, ROWS)
        t = rows % T
        head = tl.program_id(0) * HG + rows // T
        kv_head = (tl.program_id(0) * HG) // G
        rmask = (rows < HG * T) & (t < n)
        lanes = tl.arange(0, DP)
        dmask = lanes < D
        query = tl.load(query_ptr + ((first + t)[:, None] * HQ + head[:, None]) * D + lanes[None, :],
                        mask=rmask[:, None] & dmask[None, :], other=0.0)
        if CAUSAL:
            limit = pos + t  # token t sees keys 0 .. pos + t
        else:
            limit = pos + t * 0 + n - 1  # every row sees the whole step: keys 0 .. pos + n - 1
        floor = pos + t - WINDOW + 1  # with a window: keys pos + t - WINDOW + 1 .. pos + t
        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, DP], dtype=tl.float32)
        cache = slot * cache_slot_stride + kv_head * cache_head_stride
        for block in tl.static_range(0, CHUNK_, BLOCK):
            if start + block <= pos + n - 1:
                keys_at = start + block + tl.arange(0, BLOCK)
                kmask = (keys_at[:, None] < max_context) & dmask[None, :]
                key = tl.load(k_cache_ptr + cache + keys_at[:, None].to(tl.int64) * D + lanes[None, :], mask=kmask, other=0.0)
                value = tl.load(v_cache_ptr + cache + keys_at[:, None].to(tl.int64) * D + lanes[None, :], mask=kmask, other=0.0)
                scores = tl.dot(query, tl.trans(key), input_precision=PRECISION) * scale
                visible = keys_at[None, :] <= limit[:, None]
                if WINDOW > 0:
                    visible = visible & (keys_at[None, :] >= floor[:, None])
                scores = tl.where(visible, scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(scores - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                l = l * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(value.dtype), value, input_precision=PRECISION)
                m = m_new
        part = ((first + t) * HQ + head) * num_splits + split
        tl.store(m_ptr + part, m, mask=rmask)
        tl.store(l_ptr + part, l, mask=rmask)
        tl.store(acc_ptr + part[:, None].to(tl.int64) * D + lanes[None, :], acc, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _attention_merge_kernel(
    m_ptr, l_ptr, acc_ptr, qkv_ptr, qkv_stride, out_ptr, control_ptr, HQ, D,
    NUM_SPLITS: tl.constexpr, DP: tl.constexpr, CHUNK_: tl.constexpr,
    GATED: tl.constexpr = True, CAUSAL: tl.constexpr = True, WINDOW: tl.constexpr = 0, SEGMENTS: tl.constexpr = 1,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    lanes = tl.arange(0, DP)
    dmask = lanes < D
    seg = segment_of(control_ptr, row, SEGMENTS)
    if seg >= 0:
        _attention_merge_row(m_ptr, l_ptr, acc_ptr, qkv_ptr, qkv_stride, out_ptr, control_ptr + seg * 8, row, head,
                             HQ, D, NUM_SPLITS, DP, CHUNK_, GATED, CAUSAL, WINDOW)
    else:  # a padding row: zeros, whatever the buffers held
        tl.store(out_ptr + row * HQ * D + head * D + lanes, tl.zeros([DP], dtype=out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _attention_merge_row(
    m_ptr, l_ptr, acc_ptr, qkv_ptr, qkv_stride, out_ptr, segment_ptr, row, head, HQ, D,
    NUM_SPLITS: tl.constexpr, DP: tl.constexpr, CHUNK_: tl.constexpr,
    GATED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
):
    n = tl.load(segment_ptr + 1)
    pos = tl.load(segment_ptr + 2)
    t = row - tl.load(segment_ptr + 6)
    lanes = tl.arange(0, DP)
    dmask = lanes < D
    if CAUSAL:
        last = pos + t
    else:
        last = pos + n - 1
    own_splits = last // CHUNK_ + 1  # the chunks holding this row's keys, merged in order
    first_split = pos * 0
    if WINDOW > 0:
        first_split = tl.maximum(pos + t - WINDOW + 1, 0) // CHUNK_
    m = tl.zeros([], dtype=tl.float32) - float("inf")
    l = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([DP], dtype=tl.float32)
    part = (row * HQ + head) * NUM_SPLITS
    for split in range(0, NUM_SPLITS):
        if (split < own_splits) & (split >= first_split):
            m_split = tl.load(m_ptr + part + split)
            m_new = tl.maximum(m, m_split)
            a = tl.exp(m - m_new)
            b = tl.exp(m_split - m_new)
            l = l * a + tl.load(l_ptr + part + split) * b
            acc = acc * a + tl.load(acc_ptr + (part + split).to(tl.int64) * D + lanes, mask=dmask, other=0.0) * b
            m = m_new
    dtype = out_ptr.dtype.element_ty
    attended = (acc / l).to(dtype).to(tl.float32)
    if GATED:
        gate = tl.load(qkv_ptr + row * qkv_stride + head * 2 * D + D + lanes, mask=dmask, other=0.0).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        attended = attended * gate
    tl.store(out_ptr + row * HQ * D + head * D + lanes, attended.to(dtype), mask=dmask)


def launch(cache_positions: int) -> str:
    """Which launch shape the split kernel takes over a cache of this many positions: "long" (LONG_LAUNCH) or
    "short". The two reduce a row's keys in another order, so a token's bits depend on it (HELLO's `numerics`)."""
    return "long" if cache_positions >= LONG_CONTEXT else "short"


def num_splits(max_context: int) -> int:
    return triton.cdiv(max_context, CHUNK)


def append_kv(kv, k_norm, cos, sin, k_cache, v_cache, scratch, control, *, num_kv_heads, head_dim, rotary_dim,
              eps, rows, zero_centred=True, segments=1):
    """Keys and values alone into the cache: kv [T, 2 * HKV * D] (k | v), k normed and rotated, each segment's
    n rows at its pos (the DFlash drafter's context rows). `scratch` gives the rounding dtype."""
    _qk_norm_rope_append_kernel[(rows, num_kv_heads)](
        kv, kv.stride(0), k_norm, k_norm, cos, sin, scratch, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        control, 0, num_kv_heads, head_dim, rotary_dim, eps, DP=triton.next_power_of_2(head_dim),
        GATED=False, ZERO_CENTRED=zero_centred, SEGMENTS=segments,
    )


def attention_step(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, query, partials, out, control, *,
                   num_heads, num_kv_heads, head_dim, rotary_dim, eps, rows,
                   gated=True, zero_centred=True, causal=True, window=0, segments=1, segment_rows=None):
    """One attention layer's step for `rows` (= T) rows: norms, RoPE, the cache append of each segment's n rows at
    its pos, attention of its row t over keys 0 .. pos + t, merged and gated into out [T, heads * D]. `control`
    holds `segments` segments (shardd.engine.kernels.segment) of at most `segment_rows` rows each (default `rows`).

    qkv [T, 2 * H * D + 2 * HKV * D], k/v_cache [S, HKV, max_context, D], query [T, H, D] scratch,
    partials = (m [T, H, splits], l [T, H, splits], acc [T, H, splits, D]) float32 scratch.
    The drafter's attention: `gated=False` (qkv [T, H * D + 2 * HKV * D], no output gate), `zero_centred=False`
    (plain `w` q/k norms), `causal=False` (every row over keys 0 .. pos + n - 1), `window` w > 0 (causal, keys
    pos + t - w + 1 .. pos + t)."""
    d_block = triton.next_power_of_2(head_dim)
    segment_rows = rows if segment_rows is None else segment_rows
    _qk_norm_rope_append_kernel[(rows, num_heads + num_kv_heads)](
        qkv, qkv.stride(0), q_norm, k_norm, cos, sin, query, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        control, num_heads, num_kv_heads, head_dim, rotary_dim, eps, DP=d_block,
        GATED=gated, ZERO_CENTRED=zero_centred, SEGMENTS=segments,
    )
    m, l, acc = partials
    splits = m.shape[-1]
    group = num_heads // num_kv_heads
    heads, block_n, warps = LONG_LAUNCH if launch(k_cache.shape[2]) == "long" else SHORT_LAUNCH
    if CHUNK % block_n:  # a key block across two chunks would count its keys in both
        raise ValueError(f"CHUNK {CHUNK} is not a multiple of the launch's key block {block_n}")
    heads_per_program = math.gcd(group, heads)
    _attention_split_kernel[(num_heads // heads_per_program, splits, segments)](
        query, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.shape[2], m, l, acc, splits,
        control, num_heads, num_kv_heads, head_dim, head_dim**-0.5,
        T=segment_rows, G=group, HG=heads_per_program,
        ROWS=max(16, triton.next_power_of_2(heads_per_program * segment_rows)),
        DP=d_block, CHUNK_=CHUNK, BLOCK=block_n, num_warps=warps,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # float32 means float32, as in the reference
        CAUSAL=causal, WINDOW=window,
    )
    _attention_merge_kernel[(rows, num_heads)](
        m, l, acc, qkv, qkv.stride(0), out, control, num_heads, head_dim, NUM_SPLITS=splits, DP=d_block, CHUNK_=CHUNK,
        GATED=gated, CAUSAL=causal, WINDOW=window, SEGMENTS=segments,
    )
    return out
