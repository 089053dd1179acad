"""The sequence table: each open sequence's state under the peer that opened it, its idle lease, its failure."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from protocol import ErrorCode, ProtocolError
from shardd.draft.model import DraftState
from shardd.engine.reference.state import SequenceState
from shardd.server.stats import Counters

log = logging.getLogger("shardd")


@dataclass
class Sequence:
    state: SequenceState | None  # the target layers' state; None on a drafter-only daemon
    draft: DraftState | None = None  # the hosted drafter's context (committed rows' features only)
    failed: str | None = None  # why, after an INTERNAL error; only CLOSE is served then
    last_used: float = field(default_factory=time.monotonic)  # the idle lease runs from here

    @property
    def length(self) -> int:
        return self.state.length if self.state is not None else self.draft.length


class SequenceTable:
    """Open sequences keyed by (owner, seq): a sequence belongs to the peer that opened it, and another peer's
    sequence of the same id is not there for it. Each holds the engine's state and the drafter's context, made
    by `open` and given back by `close` or the idle lease (`expire_idle`)."""

    def __init__(self, shard, drafter, *, max_sequences: int, max_context: int, idle_timeout: float,
                 counters: Counters):
        self.shard, self.drafter = shard, drafter
        self.max_sequences, self.max_context, self.idle_timeout = max_sequences, max_context, idle_timeout
        self.counters = counters
        self.entries: dict[tuple[bytes, int], Sequence] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def values(self):
        return self.entries.values()

    def items(self) -> Iterator[tuple[tuple[bytes, int], Sequence]]:
        return iter(self.entries.items())

    def get(self, owner: bytes, seq: int, *, allow_failed: bool = False) -> Sequence:
        """`owner`'s sequence `seq`, its lease renewed; ProtocolError when it is not open, or failed."""
        entry = self.entries.get((owner, seq))
        if entry is None:
            raise ProtocolError(ErrorCode.NO_SUCH_SEQUENCE, f"sequence {seq} is not open")
        entry.last_used = time.monotonic()
        if entry.failed and not allow_failed:
            raise ProtocolError(ErrorCode.SEQUENCE_FAILED, f"sequence {seq} failed ({entry.failed}); CLOSE and reopen it")
        return entry

    def find(self, owner: bytes, seq: int) -> Sequence | None:
        return self.entries.get((owner, seq))

    def open(self, owner: bytes, seq: int) -> Sequence:
        """A fresh state of length 0 for `owner`'s `seq`; ProtocolError (changing nothing) when it is open already,
        the table is full or the device has no memory for it."""
        if (owner, seq) in self.entries:
            raise ProtocolError(ErrorCode.SEQUENCE_EXISTS, f"sequence {seq} is already open")
        if len(self.entries) >= self.max_sequences:
            raise ProtocolError(ErrorCode.CAPACITY, f"{len(self.entries)} sequences open, limit {self.max_sequences}")
        try:
            state = self.shard.new_state(self.max_context) if self.shard is not None else None
            draft = self.drafter.model.new_state(self.max_context) if self.drafter is not None else None
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            # torch.OutOfMemoryError on a GPU; on the CPU a failed allocation is a plain RuntimeError.
            if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "memory" not in str(exc).lower():
                raise
            raise ProtocolError(ErrorCode.CAPACITY, f"out of memory for a new sequence: {exc}") from None
        entry = self.entries[(owner, seq)] = Sequence(state, draft)
        self.counters.sequences_opened += 1
        log.info("open seq=%s", seq)
        return entry

    def close(self, owner: bytes, seq: int) -> Sequence:
        """Close `owner`'s `seq` (a failed one too) and give its memory back."""
        entry = self.get(owner, seq, allow_failed=True)
        self._release((owner, seq))
        self.counters.sequences_closed += 1
        log.info("close seq=%s length=%s", seq, entry.length)
        return entry

    def _release(self, key: tuple[bytes, int]) -> None:
        entry = self.entries.pop(key)
        if self.shard is not None and entry.state is not None:
            self.shard.release_state(entry.state)
        if self.drafter is not None and entry.draft is not None:
            self.drafter.model.release_state(entry.draft)

    def fail(self, entry: Sequence | None, message: str) -> None:
        """A sequence (its entry, or None when it is gone) failed by `message`; only CLOSE works on it then. The
        first failure is the one it keeps (and counts)."""
        if entry is not None and not entry.failed:
            entry.failed = message
            self.counters.sequences_failed += 1

    def expire_idle(self, now: float | None = None) -> int:
        """Close every sequence idle past --sequence-idle-timeout (its owner is gone or forgot it)."""
        if not self.idle_timeout:
            return 0
        now = time.monotonic() if now is None else now
        idle = [key for key, entry in self.entries.items() if now - entry.last_used > self.idle_timeout]
        for key in idle:
            length = self.entries[key].length
            self._release(key)
            self.counters.sequences_expired += 1
            log.info("expired seq=%s length=%s: idle for more than %g s", key[1], length, self.idle_timeout)
        return len(idle)
