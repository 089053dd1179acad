"""The gated delta rule, in two exact forms.

Per value head, with state S [k_dim, v_dim], decay a_t = exp(g_t) and write strength beta_t:

    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T        o_t = S_t^T q_t

`recurrent_delta_rule` walks the tokens one by one (single-token decode). `chunked_delta_rule` solves
each chunk with a triangular system (prefill, verify blocks); it can also write the state after every
token (the `checkpoint` rollback mode) and run without queries (the `replay-ssm` rollback).
Shapes: q, k [heads, n, k_dim] (l2-normalised, q already scaled), v [heads, n, v_dim], g, beta [heads, n];
all float32.
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64


def delta_rule_step(
    state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor
) -> None:
    """One token, in place. key [H, K], value [H, V], decay/beta [H]."""
    state.mul_(decay[:, None, None])
    predicted = torch.bmm(key[:, None, :], state).squeeze(1)  # [H, V]: what the decayed state recalls for k_t
    delta = (value - predicted) * beta[:, None]
    state.baddbmm_(key[:, :, None], delta[:, None, :])


def recurrent_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """Token-by-token form; updates `state` in place and returns o [H, n, V]."""
    heads, n, _ = key.shape
    out = torch.empty((heads, n, value.shape[-1]), dtype=torch.float32, device=value.device)
    decay = g.exp()
    for t in range(n):
        delta_rule_step(state, key[:, t], value[:, t], decay[:, t], beta[:, t])
        out[:, t] = torch.bmm(query[:, t, None, :], state).squeeze(1)
    return out


def chunked_delta_rule(
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    state_after_each: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Chunked form; updates `state` in place and returns o [H, n, V] (None when `query` is None).

    Inside a chunk with cumulative log-decay G_t, the state is S_t = e^{G_t} S_0 + sum_{j<=t} e^{G_t-G_j} k_j u_j^T,
    where the corrected values u solve the unit lower-triangular system (I + A) u = beta v - beta e^{G} K S_0,
    A_tj = beta_t e^{G_t-G_j} k_t.k_j for j < t. With `state_after_each` ([n, H, K, V]) every S_t is written
    there in a few batched ops: the per-token checkpoints of the `checkpoint` rollback mode.
    """
    heads, n, k_dim = key.shape
    out = None if query is None else torch.empty((heads, n, value.shape[-1]), dtype=torch.float32, device=value.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        size = end - start
        k, v = key[:, start:end], value[:, start:end]
        b = beta[:, start:end]
        cum = g[:, start:end].cumsum(-1)  # [H, c]
        causal = torch.ones(size, size, dtype=torch.bool, device=key.device).tril()
        # e^{G_t - G_j} for j <= t, 0 above the diagonal (masked before exp so it cannot overflow)
        pair_decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        system = (b[:, :, None] * (k @ k.transpose(-1, -2)) * pair_decay).tril(-1)
        system = system + torch.eye(size, dtype=system.dtype, device=system.device)
        u_values = torch.linalg.solve_triangular(system, b[:, :, None] * v, upper=False, unitriangular=True)
        u_state = torch.linalg.solve_triangular(
            system, (b * cum.exp())[:, :, None] * k, upper=False, unitriangular=True
        )
        u = u_values - u_state @ state  # [H, c, V]
        if out is not None:
            q = query[:, start:end]
            scores = (q @ k.transpose(-1, -2)) * pair_decay
            out[:, start:end] = (q * cum.exp()[:, :, None]) @ state + scores @ u
        if state_after_each is not None:
            # S_t for every t: [H, c, c, K] decayed keys, summed against u -> [H, c, K, V]
            decayed_keys = pair_decay[:, :, :, None] * k[:, None, :, :]
            states = decayed_keys.transpose(-1, -2) @ u[:, None]
            states += cum.exp()[:, :, None, None] * state[:, None]
            state_after_each[start:end].copy_(states.transpose(0, 1))
            state.copy_(state_after_each[end - 1])
        else:
            to_end = (cum[:, -1:] - cum).exp()  # e^{G_c - G_j}
            state.mul_(cum[:, -1].exp()[:, None, None]).add_((k * to_end[:, :, None]).transpose(-1, -2) @ u)
    return out
