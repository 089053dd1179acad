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
from shardd.server.prefix import (PrefixCache, PrefixEntry, capture_entry, draft_bytes, draft_rows, entry_bytes,
                                  resume)
from shardd.server.stats import Counters

log = logging.getLogger("shardd")


@dataclass
class Sequence:
    state: SequenceState | None  # the target layers' state; None on a drafter-only daemon
    draft: DraftState | None = None  # the hosted drafter's context (committed rows' features only)
    failed: str | None = None  # why, after an INTERNAL error; only CLOSE is served then
    prefix: PrefixEntry | None = None  # the prefix entry it resumed from or saved last (pinned while open)
    # its saved entries still waiting for the drafter's context rows of their prefix
    draft_waiting: list[PrefixEntry] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)  # the idle lease runs from here

    @property
    def length(self) -> int:
        return self.state.length if self.state is not None else self.draft.length


class SequenceTable:
    """Open sequences keyed by (owner, seq): a sequence belongs to the peer that opened it, and another peer's
    sequence of the same id is not there for it. Each holds the engine's state and the drafter's context, made
    by `open` and given back by `close` or the idle lease (`expire_idle`)."""

    def __init__(self, shard, drafter, *, max_sequences: int, max_context: int, idle_timeout: float,
                 counters: Counters, prefix_cache: PrefixCache | None = None):
        self.shard, self.drafter = shard, drafter
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0)
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

    def open(self, owner: bytes, seq: int, prefix: int | None = None, draft_context: bool = True) -> Sequence:
        """A fresh state for `owner`'s `seq`: of length 0, or `prefix`'s (a prefix entry of `owner`), with a drafter
        context where the daemon hosts the drafter, unless `draft_context` is False (the sequence never proposes
        here); ProtocolError (changing nothing) when it is open already, the table is full, the entry is not held or
        the device has no memory for it."""
        if (owner, seq) in self.entries:
            raise ProtocolError(ErrorCode.SEQUENCE_EXISTS, f"sequence {seq} is already open")
        if len(self.entries) >= self.max_sequences:
            raise ProtocolError(ErrorCode.CAPACITY, f"{len(self.entries)} sequences open, limit {self.max_sequences}")
        if self.shard is None and not draft_context:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "draft_context false on a drafter-only daemon: its sequences "
                                                       "are drafter contexts")
        drafts = self.drafter is not None and draft_context
        cached = None
        if prefix is not None:
            cached = self.prefix_cache.find(owner, prefix, draft=drafts)
        try:
            state = self.shard.new_state(self.max_context) if self.shard is not None else None
            draft = self.drafter.model.new_state(self.max_context) if drafts else None
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            # torch.OutOfMemoryError on a GPU; on the CPU a failed allocation is a plain RuntimeError.
            if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "memory" not in str(exc).lower():
                raise
            raise ProtocolError(ErrorCode.CAPACITY, f"out of memory for a new sequence: {exc}") from None
        if cached is not None:
            resume(cached, state, draft)
            self.prefix_cache.resumed(cached)
        entry = self.entries[(owner, seq)] = Sequence(state, draft, prefix=cached)
        self.counters.sequences_opened += 1
        log.info("open seq=%s%s", seq, f" from prefix entry {prefix} ({cached.length} tokens)" if cached else "")
        return entry

    def save_prefix(self, owner: bytes, entry: Sequence, entry_id: int) -> bool:
        """Keep `entry`'s state (settled, nothing pending) as `owner`'s prefix entry `entry_id`, after the entry it
        resumed from or saved last; False when the budget cannot hold it. The drafter's context rows of the prefix
        join it as soon as the drafter holds them (`draft_added`)."""
        state = entry.state
        self.shard.settle(state)
        draft = entry.draft if entry.draft is not None and entry.draft.length >= state.length else None
        start = entry.prefix.length if entry.prefix is not None else 0
        saved = self._save(owner, entry, entry_id, entry_bytes(state, start, draft),
                           lambda parent: capture_entry(owner, entry_id, state, parent, draft))
        if saved is None:
            return False
        if entry.draft is not None and draft is None:  # its context has yet to catch up
            entry.draft_waiting.append(saved)
        return True

    def save_draft_prefixes(self, owner: bytes, entry: Sequence, saves: list[tuple[int, int]]) -> list[bool]:
        """On a drafter-only daemon: keep the first `length` rows of `entry`'s drafter context as `owner`'s prefix
        entry `entry_id`, for each (entry_id, length) in ascending length, each after the last one kept; whether
        each was kept (the budget may decline one)."""
        kept = []
        for entry_id, length in saves:
            start = entry.prefix.length if entry.prefix is not None else 0
            saved = self._save(owner, entry, entry_id, draft_bytes(entry.draft, length - start),
                               lambda parent: PrefixEntry(owner, entry_id, length, parent, kv={}, gdn=(),
                                                          draft=draft_rows(entry.draft, start, length)))
            kept.append(saved is not None)
        return kept

    def _save(self, owner: bytes, entry: Sequence, entry_id: int, need: int, capture) -> PrefixEntry | None:
        """`capture(parent)` kept as `owner`'s entry `entry_id` after the entry `entry` resumed from or saved last
        (pinned: never evicted while open), once the budget made room for its `need` bytes; it is then `entry`'s
        newest, pinned in its parent's place. None when the budget or the device declines it."""
        cache, parent = self.prefix_cache, entry.prefix
        if not cache.make_room(owner, entry_id, need, parent):
            return None
        try:
            saved = capture(parent)
        except (torch.OutOfMemoryError, MemoryError):  # the step stands; only the entry is not kept
            cache.declined += 1
            return None
        cache.insert(saved)
        cache.release(parent)
        saved.pins += 1
        entry.prefix = saved
        return saved

    def draft_added(self, entry: Sequence) -> None:
        """The drafter's context of `entry` grew: its saved entries whose prefix it now covers take their rows."""
        for saved in [s for s in entry.draft_waiting if s.length <= entry.draft.length]:
            entry.draft_waiting.remove(saved)
            if (saved.owner, saved.id) in self.prefix_cache.entries and saved.draft is None:
                self.prefix_cache.add_draft(saved, draft_rows(entry.draft, saved.start, saved.length))

    def close(self, owner: bytes, seq: int) -> Sequence:
        """Close `owner`'s `seq` (a failed one too) and give its memory back."""
        entry = self.get(owner, seq, allow_failed=True)
        self._release((owner, seq))
        self.counters.sequences_closed += 1
        log.info("close seq=%s length=%s", seq, entry.length)
        return entry

    def _release(self, key: tuple[bytes, int]) -> None:
        entry = self.entries.pop(key)
        self.prefix_cache.release(entry.prefix)
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
