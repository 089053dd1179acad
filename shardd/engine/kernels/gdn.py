"""The GDN layer's step kernels: the causal conv with its window bookkeeping, and the gated delta rule
token by token in float32 (the math of shardd/engine/reference/gdn.py and delta_rule.py).

`gdn_prepare` turns the projected rows into the recurrence inputs (l2-normalised q and k, v, g, beta),
advances the conv window by the step's real rows, and saves what a rollback needs. `gdn_recurrence`
runs the recurrence over those inputs. A `replay-ssm` rollback re-runs the very same compiled kernel
over the kept tokens, so its state is bit-identical to the `checkpoint` slot of the same token.

Per-sequence buffers are pools with a leading slot dimension; the slot, the number of real rows `n`
and what to save are read from device scalars, so a captured CUDA graph serves every sequence. A step holds
several sequences: `control` is a table of segments (shardd/engine/kernels/segments.py), and both
kernels run one program per segment (times channel groups, or heads and layers), each over its own
sequence's rows exactly as if that sequence were alone in the step. A segment's rows are at most T
(`rows`: the per-sequence tile); the recurrence inputs are kept per slot, segment-relative.

A `checkpoint` rollback copies nothing: it leaves `start` (control[5]) at the kept token's checkpoint slot,
and the next step reads its conv window and recurrent state from that slot instead of the sequence's own
(`start` -1). Everything read from the old window is read before anything is written, since the step's own
checkpoint writes may overwrite that very slot.
"""

from __future__ import annotations

import triton
import triton.language as tl

# What a step saves for a rollback (the `save` device scalar)
SAVE_NOTHING, SAVE_WINDOWS, SAVE_LOG = 0, 1, 2


@triton.jit
def _gdn_prepare_kernel(
    proj_ptr, proj_stride, conv_w_ptr, neg_decay_ptr, dt_bias_ptr,
    conv_state_ptr, conv_state_slot_stride,  # [S, W, C] float32 (this layer)
    windows_ptr, windows_slot_stride,        # checkpoint: [S, T + 1, W, C] window after each token
    log_conv0_ptr, log_conv0_slot_stride,    # replay-ssm: [S, W, C] window before the step
    log_in_ptr, log_in_slot_stride,          # replay-ssm: [S, T, C] the step's conv inputs
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rin_slot_stride_qk, rin_slot_stride_v, rin_slot_stride_g,
    control_ptr,                             # int32 segments [slot, n, pos, save, n_save, start, first, -]
    C, K, V, HK, HV, b_col, a_col,
    T: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, SWP: tl.constexpr, BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    segment_ptr = control_ptr + tl.program_id(1) * 8
    slot = tl.load(segment_ptr + 0)
    n = tl.load(segment_ptr + 1)
    save = tl.load(segment_ptr + 3)
    start = tl.load(segment_ptr + 5)
    # the segment's rows of the step: proj rows first .. first + n (a segment of no sequence has n = 0)
    proj_ptr += tl.load(segment_ptr + 6).to(tl.int64) * proj_stride
    if n > 0:
        _gdn_prepare_segment(
            proj_ptr, proj_stride, conv_w_ptr, neg_decay_ptr, dt_bias_ptr, conv_state_ptr, conv_state_slot_stride,
            windows_ptr, windows_slot_stride, log_conv0_ptr, log_conv0_slot_stride, log_in_ptr, log_in_slot_stride,
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rin_slot_stride_qk, rin_slot_stride_v, rin_slot_stride_g,
            program, slot, n, save, start, C, K, V, HK, HV, b_col, a_col, T, TP, W, WP, SWP, BLOCK,
        )


@triton.jit
def _gdn_prepare_segment(
    proj_ptr, proj_stride, conv_w_ptr, neg_decay_ptr, dt_bias_ptr, conv_state_ptr, conv_state_slot_stride,
    windows_ptr, windows_slot_stride, log_conv0_ptr, log_conv0_slot_stride, log_in_ptr, log_in_slot_stride,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rin_slot_stride_qk, rin_slot_stride_v, rin_slot_stride_g,
    program, slot, n, save, start, C, K, V, HK, HV, b_col, a_col,
    T: tl.constexpr, TP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, SWP: tl.constexpr, BLOCK: tl.constexpr,
):
    # which channel group: q heads, then k heads, then v heads
    is_q = program < HK
    is_k = (program >= HK) & (program < 2 * HK)
    head = tl.where(is_q, program, tl.where(is_k, program - HK, program - 2 * HK))
    width = tl.where(is_q | is_k, K, V)
    c0 = tl.where(is_q, head * K, tl.where(is_k, HK * K + head * K, 2 * HK * K + head * V))
    lanes = tl.arange(0, BLOCK)
    cols = c0 + lanes
    cmask = lanes < width
    state_ptr = conv_state_ptr + slot.to(tl.int64) * conv_state_slot_stride
    # the window before the step: the sequence's own, or (after a checkpoint rollback) the kept token's slot
    if start >= 0:
        old_ptr = windows_ptr + slot.to(tl.int64) * windows_slot_stride + start * W * C
    else:
        old_ptr = state_ptr
    dtype = proj_ptr.dtype.element_ty

    rows = tl.arange(0, TP)
    rmask = rows < n  # n <= T
    mask2 = rmask[:, None] & cmask[None, :]
    # conv over the window: out[t] = sum_j w[j] * ext[t + j], ext = old window rows then the step's rows
    acc = tl.zeros([TP, BLOCK], dtype=tl.float32)
    for j in tl.static_range(W + 1):
        tap = rows[:, None] + j
        from_state = tl.load(old_ptr + tap * C + cols[None, :], mask=mask2 & (tap < W), other=0.0)
        from_proj = tl.load(proj_ptr + (tap - W) * proj_stride + cols[None, :], mask=mask2 & (tap >= W), other=0.0)
        ext = tl.where(tap < W, from_state, from_proj.to(tl.float32))
        w = tl.load(conv_w_ptr + cols * (W + 1) + j, mask=cmask, other=0.0).to(tl.float32)
        acc += ext * w[None, :]
    conv = acc.to(dtype).to(tl.float32)
    conv = (conv / (1.0 + tl.exp(-conv))).to(dtype).to(tl.float32)  # silu, rounded as the reference's

    if is_q | is_k:
        normed = conv * (1.0 / tl.sqrt(tl.sum(conv * conv, axis=1) + 1e-6))[:, None]
        if is_q:
            normed = normed * (1.0 / tl.sqrt(K.to(tl.float32)))
        qk_base = tl.where(is_q, q_ptr, k_ptr) + slot.to(tl.int64) * rin_slot_stride_qk
        tl.store(qk_base + rows[:, None] * (HK * K) + head * K + lanes[None, :], normed, mask=mask2)
    else:
        v_base = v_ptr + slot.to(tl.int64) * rin_slot_stride_v
        tl.store(v_base + rows[:, None] * (HV * V) + head * V + lanes[None, :], conv, mask=mask2)
        # g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) (rounded to the weights' dtype first)
        b = tl.load(proj_ptr + rows * proj_stride + b_col + head, mask=rmask, other=0.0).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)
        a = tl.load(proj_ptr + rows * proj_stride + a_col + head, mask=rmask, other=0.0).to(tl.float32)
        x = a + tl.load(dt_bias_ptr + head).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        g = tl.load(neg_decay_ptr + head) * softplus
        gbase = slot.to(tl.int64) * rin_slot_stride_g + rows * HV + head
        tl.store(g_ptr + gbase, g, mask=rmask)
        tl.store(beta_ptr + gbase, beta, mask=rmask)

    if save == 2:  # replay-ssm: the window before the step and the step's conv inputs
        for i in tl.static_range(W):
            old = tl.load(old_ptr + i * C + cols, mask=cmask, other=0.0)
            tl.store(log_conv0_ptr + slot.to(tl.int64) * log_conv0_slot_stride + i * C + cols, old, mask=cmask)
        step_rows = tl.load(proj_ptr + rows[:, None] * proj_stride + cols[None, :], mask=mask2, other=0.0)
        tl.store(log_in_ptr + slot.to(tl.int64) * log_in_slot_stride + rows[:, None] * C + cols[None, :],
                 step_rows.to(tl.float32), mask=mask2)
    # checkpoint (save 1): the window after each of 0 .. n tokens, slot s = ext[s .. s + W)
    flat = tl.arange(0, SWP)  # (slot, row of the window) pairs
    s_of, i_of = flat // W, flat % W
    ext_row = (s_of + i_of)[:, None]
    smask = ((flat < (T + 1) * W) & (s_of <= n) & (save == 1))[:, None] & cmask[None, :]
    saved_old = tl.load(old_ptr + ext_row * C + cols[None, :], mask=smask & (ext_row < W), other=0.0)
    saved_new = tl.load(proj_ptr + (ext_row - W) * proj_stride + cols[None, :], mask=smask & (ext_row >= W), other=0.0)
    # the window after the step's n real rows, ext[n .. n + W)
    wrows = tl.arange(0, WP)
    wmask = (wrows[:, None] < W) & cmask[None, :]
    new_row = n + wrows[:, None]
    kept_old = tl.load(old_ptr + new_row * C + cols[None, :], mask=wmask & (new_row < W), other=0.0)
    kept_new = tl.load(proj_ptr + (new_row - W) * proj_stride + cols[None, :], mask=wmask & (new_row >= W), other=0.0)
    window = tl.where(new_row < W, kept_old, kept_new.to(tl.float32))
    tl.debug_barrier()  # every read of the old window is done: now it may be overwritten
    if save == 1:
        tl.store(windows_ptr + slot.to(tl.int64) * windows_slot_stride + flat[:, None] * C + cols[None, :],
                 tl.where(ext_row < W, saved_old, saved_new.to(tl.float32)), mask=smask)
    tl.store(state_ptr + wrows[:, None] * C + cols[None, :], window, mask=wmask)


@triton.jit(do_not_specialize=["saved_slots", "layer0", "layers_total", "segments", "out_rows"])
def _gdn_recurrence_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # recurrence inputs [S, L, T, HK|HV, K|V], [S, L, T, HV]
    init_ptr,                              # where the state before the first token is read: like state_ptr
    state_ptr,                             # [S, L, HV, K, V] float32
    saved_ptr, saved_slots,                # [S, L, saved_slots, HV, K, V]: the state after 0, 1, .. tokens
    out_ptr, out_rows,                     # [grid L, out_rows, HV, V] float32: token t at row first + t
    control_ptr, segments,                 # int32 segments [slot, n, pos, save, n_save, start, first, -]
    layer0, layers_total, K, V, HK, HV,
    T: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
):
    head = tl.program_id(0)
    vblock = tl.program_id(1)
    grid_layer = tl.program_id(2) // segments
    segment_ptr = control_ptr + (tl.program_id(2) % segments) * 8
    layer = (layer0 + grid_layer).to(tl.int64)
    slot = tl.load(segment_ptr + 0).to(tl.int64)
    n = tl.load(segment_ptr + 1)
    n_save = tl.load(segment_ptr + 4)
    start = tl.load(segment_ptr + 5)  # >= 0: the state before the step is the checkpoint slot `start`
    first = tl.load(segment_ptr + 6)
    if n > 0:  # a segment of no sequence
        _gdn_recurrence_segment(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, init_ptr, state_ptr, saved_ptr, saved_slots,
                                out_ptr, out_rows, head, vblock, grid_layer, layer, slot, n, n_save, start, first,
                                layers_total, K, V, HK, HV, T, KP, BV)


@triton.jit
def _gdn_recurrence_segment(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, init_ptr, state_ptr, saved_ptr, saved_slots, out_ptr, out_rows,
    head, vblock, grid_layer, layer, slot, n, n_save, start, first, layers_total, K, V, HK, HV,
    T: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
):
    kh = head // (HV // HK)  # each q/k head serves consecutive value heads
    seq_layer = slot * layers_total + layer

    ks = tl.arange(0, KP)
    vs = vblock * BV + tl.arange(0, BV)
    kmask, vmask = ks < K, vs < V
    mask2 = kmask[:, None] & vmask[None, :]
    head_state = (seq_layer * HV + head) * K * V
    offsets = ks[:, None] * V + vs[None, :]
    saved_base = seq_layer * saved_slots
    if start >= 0:
        state = tl.load(saved_ptr + ((saved_base + start) * HV + head) * K * V + offsets, mask=mask2, other=0.0)
    else:
        state = tl.load(init_ptr + head_state + offsets, mask=mask2, other=0.0)
    tl.debug_barrier()  # read whole before this step's checkpoints overwrite the slot it came from
    if n_save > 0:
        tl.store(saved_ptr + (saved_base * HV + head) * K * V + offsets, state, mask=mask2)
    qk_row = seq_layer * T * HK
    v_row = seq_layer * T * HV
    out_base = (grid_layer.to(tl.int64) * out_rows + first) * HV * V
    for t in tl.static_range(T):
        if t < n:
            key = tl.load(k_ptr + ((qk_row + t * HK + kh) * K) + ks, mask=kmask, other=0.0)
            query = tl.load(q_ptr + ((qk_row + t * HK + kh) * K) + ks, mask=kmask, other=0.0)
            value = tl.load(v_ptr + ((v_row + t * HV + head) * V) + vs, mask=vmask, other=0.0)
            decay = tl.exp(tl.load(g_ptr + v_row + t * HV + head))
            beta = tl.load(beta_ptr + v_row + t * HV + head)
            state = state * decay
            predicted = tl.sum(state * key[:, None], axis=0)  # what the decayed state recalls for k_t
            delta = (value - predicted) * beta
            state = state + key[:, None] * delta[None, :]
            out = tl.sum(state * query[:, None], axis=0)
            tl.store(out_ptr + out_base + (t * HV + head) * V + vs, out, mask=vmask)
            if t + 1 < n_save:
                tl.store(saved_ptr + ((saved_base + t + 1) * HV + head) * K * V + offsets, state, mask=mask2)
    tl.store(state_ptr + head_state + offsets, state, mask=mask2)


def gdn_prepare(proj, conv_weight, neg_decay, dt_bias, conv_state, windows, log_conv0, log_in, rin, control,
                *, num_k_heads, num_v_heads, k_dim, v_dim, rows, segments=1):
    """Conv + SiLU + q/k l2 norm + g/beta for one layer's projected rows, per segment of `control` its n rows
    (at most `rows` = T) from its first; advances each segment's conv window by its n rows and saves windows
    (checkpoint) or the window and inputs (replay-ssm).

    proj [R, P] (qkv | z | b | a), conv_state [S, W, C] float32, windows [S, T + 1, W, C], log_conv0 [S, W, C],
    log_in [S, T, C]; rin = (q, k, v, g, beta) views of this layer: [S, T, HK, K] .. [S, T, HV]."""
    q, k, v, g, beta = rin
    conv_dim = conv_state.shape[-1]
    width = conv_state.shape[-2]
    b_col = conv_dim + num_v_heads * v_dim
    _gdn_prepare_kernel[(2 * num_k_heads + num_v_heads, segments)](
        proj, proj.stride(0), conv_weight, neg_decay, dt_bias,
        conv_state, conv_state.stride(0), windows, windows.stride(0), log_conv0, log_conv0.stride(0),
        log_in, log_in.stride(0), q, k, v, g, beta, q.stride(0), v.stride(0), g.stride(0), control,
        conv_dim, k_dim, v_dim, num_k_heads, num_v_heads, b_col, b_col + num_v_heads,
        T=rows, TP=max(16, triton.next_power_of_2(rows)), W=width, WP=triton.next_power_of_2(width),
        SWP=triton.next_power_of_2((rows + 1) * width),
        BLOCK=triton.next_power_of_2(max(k_dim, v_dim)),
    )


# Launch shape of the recurrence (scripts/tune_kernels.py times the alternatives). Both rollback modes and the
# replay-ssm rollback use the same one: the same compiled kernel is what makes their states bit-identical.
RECURRENCE_BLOCK_V = 16
RECURRENCE_WARPS = 2


def gdn_recurrence(rin, state, saved, out, control, *, layer0, layers, rows, num_k_heads, initial=None, segments=1):
    """The gated delta rule over each segment's n tokens of `layers` GDN layers from `layer0`, token by token.

    rin = (q, k, v, g, beta) pools [S, L, T, ..], state [S, L, HV, K, V], saved [S, L, slots, HV, K, V] (the
    state after 0 .. n_save - 1 tokens), out [layers, R, HV, V] (a segment's token t at row first + t). The
    state before the first token is read from `initial` (laid out like `state`; default `state` itself): a
    replay-ssm rollback starts from the saved one."""
    q, k, v, g, beta = rin
    _, layers_total, num_v_heads, k_dim, v_dim = state.shape
    initial = state if initial is None else initial
    assert initial.stride()[:2] == state.stride()[:2] and initial[0, 0].numel() == state[0, 0].numel()
    block_v = min(RECURRENCE_BLOCK_V, triton.next_power_of_2(v_dim))
    _gdn_recurrence_kernel[(num_v_heads, triton.cdiv(v_dim, block_v), layers * segments)](
        q, k, v, g, beta, initial, state, saved, saved.shape[2], out, out.shape[1], control, segments,
        layer0, layers_total, k_dim, v_dim, num_k_heads, num_v_heads,
        T=rows, KP=triton.next_power_of_2(k_dim), BV=block_v, num_warps=RECURRENCE_WARPS,
    )


@triton.jit
def _prefill_conv_kernel(x_ptr, x_stride, state_ptr, w_ptr, out_ptr, n, C,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[t] = silu(sum_j w[j] * ext[t + j]) for the rows of one tile, ext = the W window rows (float32, the
    values of x's dtype) then x's n rows; the sum in float32 over the taps in order, rounded to x's dtype, the
    silu of that rounded again: the step's conv (`_gdn_prepare_segment`) over a prompt's rows."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask2 = (rows < n)[:, None] & cmask[None, :]
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W + 1):
        tap = rows[:, None] + j
        from_state = tl.load(state_ptr + tap * C + cols[None, :], mask=mask2 & (tap < W), other=0.0)
        from_x = tl.load(x_ptr + (tap - W) * x_stride + cols[None, :], mask=mask2 & (tap >= W), other=0.0)
        ext = tl.where(tap < W, from_state.to(dtype).to(tl.float32), from_x.to(tl.float32))
        w = tl.load(w_ptr + cols * (W + 1) + j, mask=cmask, other=0.0).to(tl.float32)
        acc += ext * w[None, :]
    conv = acc.to(dtype).to(tl.float32)
    conv = conv / (1.0 + tl.exp(-conv))
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], conv.to(dtype), mask=mask2)


def prefill_conv(x, state, weight):
    """A prompt's causal conv and its silu in one launch: x [n, C] (rows may be strided: the conv part of the
    in_proj output), state [W, C] the window before it (float32 holding x's dtype's values; read, not
    changed), weight [C, W + 1] -> [n, C] in x's dtype. One launch where the window concatenation, PyTorch's
    generic depthwise conv1d and its silu were three."""
    import torch

    n, C = x.shape
    W = state.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if state.shape != (W, C) or weight.shape != (C, W + 1):
        raise ValueError(f"prefill_conv: state [W, {C}] and weight [{C}, W + 1]; got {tuple(state.shape)} and "
                         f"{tuple(weight.shape)}")
    state, weight = state.contiguous(), weight.contiguous()
    out = torch.empty((n, C), dtype=x.dtype, device=x.device)
    if n:
        BLOCK_T, BLOCK_C = 16, 128
        _prefill_conv_kernel[(triton.cdiv(n, BLOCK_T), triton.cdiv(C, BLOCK_C))](
            x, x.stride(0), state, weight, out, n, C, W=W, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4)
    return out
