"""Per-sequence state a shard holds: KV caches of its attention layers, conv and recurrent state of its GDN layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class KVCache:
    """Preallocated keys and values of one attention layer: [num_kv_heads, max_context, head_dim]."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def allocate(cls, num_kv_heads: int, max_context: int, head_dim: int, dtype, device) -> "KVCache":
        shape = (num_kv_heads, max_context, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes


@dataclass
class GDNState:
    """One GDN layer's state, float32 whatever the weight dtype.

    conv:      [kernel - 1, conv_dim]  the last pre-convolution inputs (the causal conv window)
    recurrent: [num_v_heads, k_dim, v_dim]
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


class GDNStates:
    """The GDN states of all of a shard's GDN layers for one sequence, stacked so that a rollback,
    snapshot or restore is one op over every layer instead of one per layer.

    conv [layers, kernel - 1, conv_dim], recurrent [layers, num_v_heads, k_dim, v_dim]; `state[layer]`
    is that layer's GDNState (views into the stack).
    """

    def __init__(self, layers: list[int], conv: torch.Tensor, recurrent: torch.Tensor):
        self.layers = list(layers)
        self.conv = conv
        self.recurrent = recurrent
        self._by_layer = {layer: GDNState(conv[row], recurrent[row]) for row, layer in enumerate(self.layers)}

    @classmethod
    def allocate(cls, layers, conv_window, conv_dim, num_v_heads, k_dim, v_dim, device) -> "GDNStates":
        n = len(layers)
        return cls(
            layers,
            torch.zeros((n, conv_window, conv_dim), dtype=torch.float32, device=device),
            torch.zeros((n, num_v_heads, k_dim, v_dim), dtype=torch.float32, device=device),
        )

    def __getitem__(self, layer: int) -> GDNState:
        return self._by_layer[layer]

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def items(self):
        return self._by_layer.items()

    def copy_(self, other: "GDNStates") -> None:
        self.conv.copy_(other.conv)
        self.recurrent.copy_(other.recurrent)

    def clone(self) -> "GDNStates":
        return GDNStates(self.layers, self.conv.clone(), self.recurrent.clone())

    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


@dataclass
class PendingStep:
    """A checkpointed step whose tokens may still be rolled back: it appended `n` tokens at `start`."""

    start: int
    n: int


class RollbackStore(Protocol):
    """A sequence's rollback storage (shardd/engine/reference/rollback.py: CheckpointBuffers for `checkpoint`,
    RecurrenceLog for `replay-ssm`): what each GDN layer's forward records (`recorders`, by layer), and how the
    state after the first `keep` tokens of the step is put back."""

    recorders: dict

    def restore(self, states: "GDNStates", keep: int) -> None: ...

    def nbytes(self) -> int: ...


@dataclass
class Snapshot:
    """The replay baseline's saved state (SNAPSHOT): the length and the GDN states."""

    length: int
    gdn: "GDNStates"


@dataclass
class SequenceState:
    """Everything a shard keeps for one sequence. `length` is the committed length L."""

    max_context: int
    kv: dict[int, KVCache]
    gdn: GDNStates
    rollback_storage: RollbackStore | None = None  # None without storage or GDN layers
    length: int = 0
    pending: PendingStep | None = None
    snapshot: Snapshot | None = None
    slot: int | None = None  # the pool slot holding this state, on a shard whose states live in pools (shardd/engine/fast)

    def state_bytes(self) -> int:
        return sum(c.nbytes() for c in self.kv.values()) + self.gdn.nbytes()

    def rollback_bytes(self) -> int:
        return self.rollback_storage.nbytes() if self.rollback_storage is not None else 0
