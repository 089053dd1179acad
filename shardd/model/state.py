"""Per-sequence state a shard holds: KV caches of its attention layers, conv and recurrent state of its GDN layers."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    @classmethod
    def allocate(cls, conv_window: int, conv_dim: int, num_v_heads: int, k_dim: int, v_dim: int, device) -> "GDNState":
        return cls(
            torch.zeros((conv_window, conv_dim), dtype=torch.float32, device=device),
            torch.zeros((num_v_heads, k_dim, v_dim), dtype=torch.float32, device=device),
        )

    def copy_(self, other: "GDNState") -> None:
        self.conv.copy_(other.conv)
        self.recurrent.copy_(other.recurrent)

    def clone(self) -> "GDNState":
        return GDNState(self.conv.clone(), self.recurrent.clone())

    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


@dataclass
class PendingStep:
    """A checkpointed step whose tokens may still be rolled back: it appended `n` tokens at `start`."""

    start: int
    n: int


@dataclass
class SequenceState:
    """Everything a shard keeps for one sequence. `length` is the committed length L."""

    max_context: int
    kv: dict[int, KVCache]
    gdn: dict[int, GDNState]
    # Rollback storage per GDN layer (CheckpointBuffers or RecurrenceLog), None without storage.
    rollback_storage: dict[int, object] | None = None
    length: int = 0
    pending: PendingStep | None = None
    snapshot: object | None = None
    extra: dict = field(default_factory=dict)

    def state_bytes(self) -> int:
        return sum(c.nbytes() for c in self.kv.values()) + sum(s.nbytes() for s in self.gdn.values())

    def rollback_bytes(self) -> int:
        if not self.rollback_storage:
            return 0
        return sum(store.nbytes() for store in self.rollback_storage.values())
