"""GDN rollback: take rejected draft tokens back out of the recurrent state.

Attention layers roll back by truncating the KV length. GDN layers have folded every verified token
into a fixed-size recurrent state, so a checkpointed step records, per GDN layer, what a rollback needs:

- `checkpoint`: `CheckpointBuffers` hold the float32 state and conv window after every token
  (slot 0 = before the step). Rolling back to `keep` copies slot `keep` back.
- `replay-ssm`: `RecurrenceLog` holds the state before the step and each token's recurrence inputs
  (k, v, g, beta) and conv inputs. Rolling back re-runs only the recurrence for the kept tokens.
- `snapshot` / `restore` serve the `replay` baseline (restore, then forward the kept tokens again).

These are the reference engine's (ShardModel's rollback, snapshot and restore); the GPU step's slot storage
(shardd/engine/fast/pools.py) builds on the same classes.

Every mode leaves exactly the state that forwarding only the kept tokens gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model_config import ModelConfig
from protocol.layout import CHECKPOINT, SHARD_ROLLBACK_MODES
from shardd.engine.reference.delta_rule import chunked_delta_rule
from shardd.engine.reference.errors import BadInput, NoPendingStep, NoSnapshot
from shardd.engine.reference.state import GDNState, GDNStates, PendingStep, SequenceState, Snapshot


@dataclass(frozen=True)
class RollbackStorage:
    """How a shard stores rollback data: a mode and the most tokens one checkpointed step may carry."""

    mode: str | None = CHECKPOINT
    max_verify_tokens: int = 16

    def __post_init__(self):
        if self.max_verify_tokens < 0:
            raise ValueError("max_verify_tokens must be >= 0")
        if self.max_verify_tokens and self.mode not in SHARD_ROLLBACK_MODES:
            raise ValueError(f"rollback mode must be one of {SHARD_ROLLBACK_MODES}, got {self.mode!r}")

    @property
    def enabled(self) -> bool:
        return self.max_verify_tokens > 0


def _conv_windows(conv0: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """conv0 [W, C], inputs [n, C] -> the window after each of 0..n tokens as a view [n + 1, W, C]."""
    width = conv0.shape[0]
    full = torch.cat([conv0, inputs.float()], dim=0)
    return full.unfold(0, width, 1).permute(0, 2, 1)


class _LayerCheckpoint:
    """What one GDN layer's forward writes into the checkpoint buffers (views of that layer's rows)."""

    def __init__(self, recurrent: torch.Tensor, conv: torch.Tensor):
        self.recurrent, self.conv = recurrent, conv  # [T + 1, H, K, V], [T + 1, W, C]

    def begin(self, state: GDNState, conv_inputs: torch.Tensor) -> None:
        n = conv_inputs.shape[0]
        self.recurrent[0].copy_(state.recurrent)
        self.conv[: n + 1].copy_(_conv_windows(state.conv, conv_inputs))

    def state_slots(self, n: int) -> torch.Tensor:
        return self.recurrent[1 : n + 1]

    def record_recurrence(self, key, value, g, beta) -> None:
        pass  # the states themselves were written into the slots


class CheckpointBuffers:
    """All GDN layers of a sequence: the float32 state and conv window after every token of a step.

    recurrent [layers, T + 1, H, K, V], conv [layers, T + 1, W, C]; slot 0 is the state before the step.
    Rolling back is one copy of slot `keep` over every layer at once.
    """

    def __init__(self, config: ModelConfig, layers: list[int], max_tokens: int, device):
        slots = max_tokens + 1
        f32 = dict(dtype=torch.float32, device=device)
        heads, k_dim, v_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
        self._bind(
            torch.zeros((len(layers), slots, heads, k_dim, v_dim), **f32),
            torch.zeros((len(layers), slots, config.linear_conv_kernel_dim - 1, config.linear_conv_dim), **f32),
            layers,
        )

    @classmethod
    def over(cls, recurrent: torch.Tensor, conv: torch.Tensor, layers: list[int]) -> "CheckpointBuffers":
        """Buffers that exist already: a sequence's slot in the GPU step's pools (shardd/engine/fast/pools.py)."""
        buffers = cls.__new__(cls)
        buffers._bind(recurrent, conv, layers)
        return buffers

    def _bind(self, recurrent: torch.Tensor, conv: torch.Tensor, layers: list[int]) -> None:
        self.recurrent, self.conv = recurrent, conv
        self.recorders = {layer: _LayerCheckpoint(recurrent[row], conv[row]) for row, layer in enumerate(layers)}

    def restore(self, states: GDNStates, keep: int) -> None:
        states.recurrent.copy_(self.recurrent[:, keep])
        states.conv.copy_(self.conv[:, keep])

    def nbytes(self) -> int:
        return self.recurrent.nbytes + self.conv.nbytes


class _LayerLog:
    """What one GDN layer's forward logs for replay-ssm (views of that layer's rows)."""

    def __init__(self, log: "RecurrenceLog", row: int):
        self.log, self.row = log, row

    def begin(self, state: GDNState, conv_inputs: torch.Tensor) -> None:
        log, row, n = self.log, self.row, conv_inputs.shape[0]
        log.recurrent0[row].copy_(state.recurrent)
        log.conv0[row].copy_(state.conv)
        log.conv_inputs[row, :n].copy_(conv_inputs)

    def state_slots(self, n: int) -> None:
        return None  # the recurrence runs in place; only its inputs are logged

    def record_recurrence(self, key, value, g, beta) -> None:
        log, row, n = self.log, self.row, key.shape[1]
        log.key[row, :, :n].copy_(key)
        log.value[row, :, :n].copy_(value)
        log.g[row, :, :n].copy_(g)
        log.beta[row, :, :n].copy_(beta)


class RecurrenceLog:
    """All GDN layers of a sequence: the state before a step and each token's recurrence and conv inputs.

    Rolling back re-runs only the recurrence for the kept tokens, every layer in one batched call
    (layers are independent, so they stack along the head dimension). No weight is read.
    """

    def __init__(self, config: ModelConfig, layers: list[int], max_tokens: int, device):
        n = len(layers)
        heads, k_dim, v_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
        f32 = dict(dtype=torch.float32, device=device)
        self.recurrent0 = torch.zeros((n, heads, k_dim, v_dim), **f32)
        self.conv0 = torch.zeros((n, config.linear_conv_kernel_dim - 1, config.linear_conv_dim), **f32)
        self.conv_inputs = torch.zeros((n, max_tokens, config.linear_conv_dim), **f32)
        self.key = torch.zeros((n, heads, max_tokens, k_dim), **f32)
        self.value = torch.zeros((n, heads, max_tokens, v_dim), **f32)
        self.g = torch.zeros((n, heads, max_tokens), **f32)
        self.beta = torch.zeros((n, heads, max_tokens), **f32)
        self.recorders = {layer: _LayerLog(self, row) for row, layer in enumerate(layers)}

    def restore(self, states: GDNStates, keep: int) -> None:
        states.recurrent.copy_(self.recurrent0)
        if keep:
            layers, heads, _, k_dim = self.key.shape
            v_dim = self.value.shape[-1]
            stacked = states.recurrent.view(layers * heads, k_dim, v_dim)
            chunked_delta_rule(
                None,
                self.key[:, :, :keep].reshape(layers * heads, keep, k_dim),
                self.value[:, :, :keep].reshape(layers * heads, keep, v_dim),
                self.g[:, :, :keep].reshape(layers * heads, keep),
                self.beta[:, :, :keep].reshape(layers * heads, keep),
                stacked,
            )
        width = self.conv0.shape[1]
        full = torch.cat([self.conv0, self.conv_inputs[:, :keep]], dim=1)  # [layers, W + keep, C]
        states.conv.copy_(full[:, keep : keep + width])

    def nbytes(self) -> int:
        return sum(
            t.nbytes for t in (self.recurrent0, self.conv0, self.conv_inputs, self.key, self.value, self.g, self.beta)
        )


def allocate_storage(
    config: ModelConfig, gdn_layers: list[int], storage: RollbackStorage, device
) -> CheckpointBuffers | RecurrenceLog | None:
    """The rollback storage of one sequence on a shard owning `gdn_layers`, or None without storage."""
    if not storage.enabled or not gdn_layers:
        return None
    kind = CheckpointBuffers if storage.mode == CHECKPOINT else RecurrenceLog
    return kind(config, gdn_layers, storage.max_verify_tokens, device)


def storage_bytes_per_sequence(config: ModelConfig, gdn_layers: list[int], storage: RollbackStorage) -> int:
    """Bytes of rollback storage one open sequence costs on a shard owning `gdn_layers`."""
    store = allocate_storage(config, gdn_layers, storage, "meta")
    return store.nbytes() if store is not None else 0


def check_rollback(state: SequenceState, keep: int) -> PendingStep:
    """Validation only: raises a ModelError and changes nothing. `keep` >= 0 (the codec checks it)."""
    if state.pending is None:
        raise NoPendingStep("ROLLBACK with no pending checkpointed step")
    if keep > state.pending.n:
        raise BadInput(f"keep={keep} is outside 0..{state.pending.n} (tokens of the pending step)")
    return state.pending


def rollback(state: SequenceState, keep: int) -> None:
    """Keep the first `keep` tokens of the pending step; the state becomes what forwarding only those gives."""
    pending = check_rollback(state, keep)
    if keep < pending.n and state.rollback_storage is not None:
        state.rollback_storage.restore(state.gdn, keep)
    state.length = pending.start + keep
    state.pending = None


def snapshot(state: SequenceState) -> None:
    """Save the recurrent/conv state and length (KV rows below `length` are never rewritten).

    A snapshot ends a pending step (all its tokens kept), as the next FORWARD would.
    """
    state.pending = None
    state.snapshot = Snapshot(state.length, state.gdn.clone())


def restore(state: SequenceState) -> None:
    if state.snapshot is None:
        raise NoSnapshot("RESTORE with no snapshot taken for this sequence")
    state.gdn.copy_(state.snapshot.gdn)
    state.length = state.snapshot.length
    state.pending = None
