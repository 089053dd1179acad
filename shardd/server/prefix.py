"""The prefix cache: a shard's state after a prompt prefix, kept so that a later sequence with the same prefix
starts from it instead of forwarding the prefix again (PROTOCOL.md, "Prefix caching").

An entry is what this shard needs to resume after `length` tokens: the GDN conv and recurrent state (float32) of its
layers, the attention K/V of its layers for positions `[start, length)` (the earlier positions are its parent's: a
sequence that saves an entry every chunk stores each chunk's K/V once), and, where the daemon hosts the drafter, the
drafter's context K/V for the same positions. The coordinator names entries (`save_prefix` on a FORWARD, `prefix` on
an OPEN) and decides where they are taken: only at its fixed prompt-chunk boundaries, so a sequence resumed from one
computes the rest of its prompt in exactly the pieces a cold run does (identical output by construction).

Entries belong to the client that saved them (its owner key) and live under a byte budget: eviction takes the least
recently used first, dropping an entry's GDN state while its K/V is still a descendant's prefix, never an entry a
live sequence was opened from or saved last (its next entry's parent). An entry is inserted only once it is whole."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from protocol import ErrorCode, ProtocolError

log = logging.getLogger("shardd")


@dataclass(eq=False)
class PrefixEntry:
    owner: bytes
    id: int
    length: int
    parent: "PrefixEntry | None"
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # attention layer -> key, value [heads, length - start, dim]
    gdn: tuple[torch.Tensor, ...] | None  # conv, recurrent of every GDN layer (a drafter-only daemon's: ()); None
    # once evicted
    draft: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # drafter context K/V rows [start, length)
    children: int = 0
    pins: int = 0  # open sequences that name it as their prefix
    last_used: float = field(default_factory=time.monotonic)

    @property
    def start(self) -> int:
        return self.parent.length if self.parent is not None else 0

    def kv_bytes(self) -> int:
        parts = [t for pair in self.kv.values() for t in pair] + [t for pair in self.draft or () for t in pair]
        return sum(t.nbytes for t in parts)

    def gdn_bytes(self) -> int:
        return sum(t.nbytes for t in self.gdn) if self.gdn is not None else 0

    def chain(self) -> list["PrefixEntry"]:
        """This entry and its ancestors, the root first."""
        entries, entry = [], self
        while entry is not None:
            entries.append(entry)
            entry = entry.parent
        return entries[::-1]


class PrefixCache:
    """Entries by (owner, id) under `budget_bytes` (0: the cache is off and every save is declined)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: dict[tuple[bytes, int], PrefixEntry] = {}
        self.bytes = 0
        self.saves = self.declined = self.hits = self.misses = self.evictions = self.tokens_served = 0

    # ---- lookup ----------------------------------------------------------------------------------

    def find(self, owner: bytes, entry_id: int, *, draft: bool) -> PrefixEntry:
        """The resumable entry `entry_id` of `owner`; PREFIX_MISSING (counted as a miss) when it was never saved,
        was evicted, is another client's, or (`draft`: the daemon hosts a drafter) lacks the drafter's context."""
        entry = self.entries.get((owner, entry_id))
        why = None
        if entry is None:
            why = "this client holds no such entry (never saved, evicted, or another client's)"
        elif entry.gdn is None:
            why = "its recurrent state was evicted"
        elif draft and any(e.draft is None for e in entry.chain()):
            why = "it holds no drafter context for its prefix"
        if why is not None:
            self.misses += 1
            raise ProtocolError(ErrorCode.PREFIX_MISSING, f"prefix entry {entry_id}: {why}; open the sequence cold")
        return entry

    def resumed(self, entry: PrefixEntry) -> None:
        """`entry` was copied into a new sequence, which now names it as its prefix."""
        now = time.monotonic()
        for e in entry.chain():
            e.last_used = now
        entry.pins += 1
        self.hits += 1
        self.tokens_served += entry.length

    def release(self, entry: PrefixEntry | None) -> None:
        if entry is not None:
            entry.pins -= 1

    # ---- saving ----------------------------------------------------------------------------------

    def check_new(self, owner: bytes, entry_id: int) -> None:
        if (owner, entry_id) in self.entries:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"prefix entry {entry_id} exists already; name a new one")

    def make_room(self, owner: bytes, entry_id: int, need: int, parent: PrefixEntry | None) -> bool:
        """Room for a new entry of `need` bytes after `parent`, evicting what it must (before anything is
        allocated); False, counted, when the budget cannot hold it."""
        if (owner, entry_id) in self.entries or need > self.budget_bytes or not self._make_room(need, keep=parent):
            self.declined += 1
            return False
        return True

    def insert(self, entry: PrefixEntry) -> None:
        """Keep `entry`, whole (its tensors copied), in the room `make_room` made."""
        self.entries[(entry.owner, entry.id)] = entry
        if entry.parent is not None:
            entry.parent.children += 1
        self.bytes += entry.kv_bytes() + entry.gdn_bytes()
        self.saves += 1

    def add_draft(self, entry: PrefixEntry, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The drafter's context rows of `entry`'s positions join it, if the budget can make room for them."""
        need = sum(t.nbytes for pair in rows for t in pair)
        if self._make_room(need, keep=entry):
            entry.draft = rows
            self.bytes += need

    def _make_room(self, need: int, keep: PrefixEntry | None) -> bool:
        """Evict the least recently used until `need` more bytes fit; `keep` (the new entry's parent) and the
        entries open sequences name stay whole."""
        kept = set(map(id, keep.chain())) if keep is not None else set()
        while self.bytes + need > self.budget_bytes:
            candidates = [e for e in self.entries.values()
                          if id(e) not in kept and not e.pins and (e.gdn is not None or not e.children)]
            if not candidates:
                return False
            self._evict(min(candidates, key=lambda e: e.last_used))
        return True

    def _evict(self, entry: PrefixEntry) -> None:
        """Drop `entry`'s GDN state; the whole entry once no descendant needs its K/V (and then its parent's
        K/V too, if that was all the parent was still held for)."""
        self.evictions += 1
        if entry.gdn is not None:
            self.bytes -= entry.gdn_bytes()
            entry.gdn = None
        while entry is not None and entry.gdn is None and not entry.children and not entry.pins:
            del self.entries[(entry.owner, entry.id)]
            self.bytes -= entry.kv_bytes()
            parent = entry.parent
            if parent is not None:
                parent.children -= 1
            entry = parent

    def describe(self) -> dict:
        """STATS' `prefix_cache`."""
        return {"budget_bytes": self.budget_bytes, "bytes": self.bytes, "entries": len(self.entries),
                "resumable": sum(1 for e in self.entries.values() if e.gdn is not None),
                "saves": self.saves, "declined": self.declined, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "tokens_served": self.tokens_served}


def entry_bytes(state, start: int, draft=None) -> int:
    """What `capture_entry` of `state` after `start` positions will allocate."""
    rows = state.length - start
    kv = sum(2 * cache.key[:, :rows].numel() * cache.key.element_size() for cache in state.kv.values())
    return kv + (draft_bytes(draft, rows) if draft else 0) + state.gdn.nbytes()


def draft_bytes(draft, rows: int) -> int:
    """What `rows` positions of a drafter context (a DraftState) take as an entry's copies."""
    return sum(2 * cache.key[:, :rows].numel() * cache.key.element_size() for cache in draft.kv)


def capture_entry(owner: bytes, entry_id: int, state, parent: PrefixEntry | None, draft=None) -> PrefixEntry:
    """Copies of a settled, non-pending sequence state (`SequenceState`) as an entry after `parent`: K/V of the
    positions past the parent's, the whole GDN state; `draft` (a DraftState) adds the drafter's context rows."""
    start = parent.length if parent is not None else 0
    length = state.length
    kv = {layer: (cache.key[:, start:length].clone(), cache.value[:, start:length].clone())
          for layer, cache in state.kv.items()}
    gdn = (state.gdn.conv.clone(), state.gdn.recurrent.clone())
    entry = PrefixEntry(owner, entry_id, length, parent, kv, gdn)
    if draft is not None:
        entry.draft = draft_rows(draft, start, length)
    return entry


def draft_rows(draft, start: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(cache.key[:, start:length].clone(), cache.value[:, start:length].clone()) for cache in draft.kv]


def resume(entry: PrefixEntry, state, draft=None) -> None:
    """Fill a fresh sequence state (None on a drafter-only daemon) and the drafter's `draft` context with
    `entry`'s prefix."""
    for e in entry.chain():
        for layer, (key, value) in e.kv.items():
            state.kv[layer].key[:, e.start:e.length].copy_(key)
            state.kv[layer].value[:, e.start:e.length].copy_(value)
        if draft is not None:
            for cache, (key, value) in zip(draft.kv, e.draft):
                cache.key[:, e.start:e.length].copy_(key)
                cache.value[:, e.start:e.length].copy_(value)
    if state is not None:
        conv, recurrent = entry.gdn
        state.gdn.conv.copy_(conv)
        state.gdn.recurrent.copy_(recurrent)
        state.length = entry.length
        state.pending = None
        state.snapshot = None
    if draft is not None:
        draft.length = entry.length
