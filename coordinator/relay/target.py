"""The model interface the decoding loop drives.

A `Target` holds per-sequence state (KV cache, GDN conv and recurrent state) and turns
token ids into next-token ids. The `Pipeline` over shard daemons (and the tests' in-process
`LocalTarget`) implement it; the loop in `coordinator.decoding` only ever sees this.

Sequence semantics are the daemons' (PROTOCOL.md): a sequence has a committed length `L`,
`forward` appends at `pos == L`, a checkpointed forward is pending until the next call, and
exactly one `rollback` may follow it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class RollbackFailed(Exception):
    """A shard could not roll the pending step back fast (no checkpoint storage, a
    restarted shard, a lost pending window). The sequence's state is then undefined:
    the caller re-fills it from its committed history."""


class SequenceLost(Exception):
    """The target no longer holds the sequence as the loop left it: a shard restarted (it answers
    NO_SUCH_SEQUENCE), stopped answering mid-step, or the shards now disagree on its length.
    The loop re-fills the sequence from its committed history and carries on."""


@runtime_checkable
class Target(Protocol):
    """A target may also name `step_rows`: inputs of at most that many tokens take its shards' fixed-shape
    GPU step (shardd/engine/fast), so a re-fill forwards the generated tokens in steps no longer than that."""

    def open(self, seq: int) -> None:
        """Create an empty sequence (length 0)."""

    def close(self, seq: int) -> None:
        """Free the sequence's state."""

    def forward(self, seq: int, pos: int, tokens: list[int], *, checkpoint: bool = False) -> list[int]:
        """Append `tokens` at positions `pos .. pos+n-1` (`pos` must equal the current
        length) and return the argmax next-token id after each position (n ids).

        With `checkpoint=True` the step is pending: exactly one `rollback(seq, keep)` may
        follow; any other call on the sequence keeps all n tokens.

        A target that samples (the `Pipeline`) also takes `sampling=` and `drafts=` keywords; the
        decoding loop passes them only when sampling, so a greedy-only target needs neither."""

    def rollback(self, seq: int, keep: int) -> None:
        """Keep the first `keep` tokens (0 <= keep <= n) of the pending step, leaving the
        state equal to having forwarded only those. Raises `RollbackFailed` when a shard
        could not do it fast: here, or (a target that does not wait for the shards' replies, as the
        `Pipeline`) from the next call about `seq`."""


@runtime_checkable
class SnapshotTarget(Target, Protocol):
    """A target that can also save and restore a sequence: what the `replay` baseline needs."""

    def snapshot(self, seq: int) -> None:
        """Save the recurrent state and length."""

    def restore(self, seq: int) -> None:
        """Go back to the last snapshot."""


class ReplayTarget:
    """The `replay` baseline as a `Target` that can roll back: a checkpointed forward snapshots the
    recurrent state first and runs as a plain forward; `rollback` restores the snapshot and forwards
    the kept tokens again (one more pass through every layer)."""

    def __init__(self, target: SnapshotTarget) -> None:
        self.target = target
        self.pending: dict[int, tuple[int, list[int]]] = {}  # seq -> (pos, tokens) of the checkpointed step

    def open(self, seq: int, **prefix) -> int:
        return self.target.open(seq, **prefix)

    @property
    def prefix_cache(self) -> bool:
        return bool(getattr(self.target, "prefix_cache", False))

    def close(self, seq: int) -> None:
        self.pending.pop(seq, None)
        self.target.close(seq)

    def forward(self, seq: int, pos: int, tokens: list[int], *, checkpoint: bool = False, **sampled) -> list[int]:
        self.pending.pop(seq, None)
        if checkpoint:
            self.target.snapshot(seq)
        ids = self.target.forward(seq, pos, tokens, **sampled)
        if checkpoint:
            self.pending[seq] = (pos, list(tokens))
        return ids

    @property
    def step_rows(self) -> int | None:
        return getattr(self.target, "step_rows", None)

    def rollback(self, seq: int, keep: int) -> None:
        if seq not in self.pending:
            raise RollbackFailed(f"sequence {seq} has no checkpointed step to roll back")
        pos, tokens = self.pending.pop(seq)
        self.target.restore(seq)
        if keep:
            self.target.forward(seq, pos, tokens[:keep])
