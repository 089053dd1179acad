"""Gated DeltaNet layer: in_proj_qkv/z/b/a, depthwise causal conv + SiLU, l2-normalised q/k,
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), gated delta rule, gated RMSNorm, out_proj."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model_config import ModelConfig
from shardd.engine.reference.delta_rule import chunked_delta_rule, recurrent_delta_rule
from shardd.engine.reference.norm import gated_rms_norm
from shardd.engine.reference.state import GDNState

# Single-token decode steps use the token-by-token form; anything longer (prefill, verify blocks,
# replays) uses the chunked form, whose few batched ops suit a GPU better than a loop over tokens.
RECURRENT_MAX_TOKENS = 1


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.k_dim = config.linear_key_head_dim
        self.v_dim = config.linear_value_head_dim
        self.key_dim = config.linear_key_dim
        self.value_dim = config.linear_value_dim
        self.eps = config.rms_norm_eps
        self.in_proj_qkv = weights[f"{prefix}.in_proj_qkv.weight"]
        self.in_proj_z = weights[f"{prefix}.in_proj_z.weight"]
        self.in_proj_b = weights[f"{prefix}.in_proj_b.weight"]
        self.in_proj_a = weights[f"{prefix}.in_proj_a.weight"]
        self.conv_weight = weights[f"{prefix}.conv1d.weight"]  # [conv_dim, 1, kernel]
        self.dt_bias = weights[f"{prefix}.dt_bias"]
        self.neg_decay_rate = -weights[f"{prefix}.A_log"].float().exp()  # -exp(A_log), fixed per head
        self.norm = weights[f"{prefix}.norm.weight"]
        self.out_proj = weights[f"{prefix}.out_proj.weight"]

    def __call__(self, x: torch.Tensor, state: GDNState, recorder=None) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]; advances `state` by n tokens.

        `recorder` (from shardd.engine.reference.rollback) is given on checkpointed steps: it saves what a rollback needs.
        """
        n = x.shape[0]
        mixed = F.linear(x, self.in_proj_qkv)  # [n, conv_dim], pre-conv inputs
        z = F.linear(x, self.in_proj_z).view(n, self.num_v_heads, self.v_dim)
        b = F.linear(x, self.in_proj_b)  # [n, v_heads]
        a = F.linear(x, self.in_proj_a)

        if recorder is not None:
            recorder.begin(state, mixed)
        window = torch.cat([state.conv.to(mixed.dtype), mixed], dim=0)  # [kernel - 1 + n, conv_dim]
        state.conv.copy_(window[n:])
        conv = F.conv1d(window.t()[None], self.conv_weight, groups=window.shape[1])[0].t()  # [n, conv_dim]
        conv = F.silu(conv)

        query, key, value = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = l2_normalize(query.reshape(n, self.num_k_heads, self.k_dim).float()) * self.k_dim**-0.5
        key = l2_normalize(key.reshape(n, self.num_k_heads, self.k_dim).float())
        value = value.reshape(n, self.num_v_heads, self.v_dim).float()
        if self.num_v_heads != self.num_k_heads:  # each q/k head serves consecutive value heads
            repeat = self.num_v_heads // self.num_k_heads
            query, key = query.repeat_interleave(repeat, dim=1), key.repeat_interleave(repeat, dim=1)
        # -> [heads, n, dim] for the kernels
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        beta = torch.sigmoid(b).float().t()  # [v_heads, n]
        g = (self.neg_decay_rate * F.softplus(a.float() + self.dt_bias)).t()

        if recorder is not None:
            core = chunked_delta_rule(
                query, key, value, g, beta, state.recurrent, state_after_each=recorder.state_slots(n)
            )
            recorder.record_recurrence(key, value, g, beta)
        elif n <= RECURRENT_MAX_TOKENS:
            core = recurrent_delta_rule(query, key, value, g, beta, state.recurrent)
        else:
            core = chunked_delta_rule(query, key, value, g, beta, state.recurrent)

        core = core.transpose(0, 1).to(x.dtype)  # [n, v_heads, v_dim]
        out = gated_rms_norm(core, z, self.norm, self.eps).reshape(n, self.value_dim)
        return F.linear(out, self.out_proj)
