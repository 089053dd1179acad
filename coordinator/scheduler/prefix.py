"""Which prompt prefixes the shards hold, by hashed blocks of tokens (as vLLM's prefix caching keys its blocks).

A prompt is prefilled in chunks of `chunk` tokens at fixed positions (coordinator.scheduler); after a chunk that ends on
that grid every shard keeps its state as a prefix entry (`save_prefix`), named here by the digest of every token before
it and the request's `salt`. A later prompt with the same first `k * chunk` tokens (and salt) opens its sequence from
that entry and prefills the rest in exactly the chunks a cold run would, so its output is the cold run's, bit for bit.

The salt keeps tenants apart: the API key a request came with and its `cache_salt`; an entry is only ever found by
a prompt with the same salt. The index is this coordinator's own (the shards' entries belong to its connection); an
entry a shard no longer holds (evicted, restarted) is refused at OPEN and dropped here (`forget`).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from coordinator.relay.pipeline import PrefixMissing
from coordinator.scheduler.requests import Request

# Digests remembered at most; the least recently used go first (each a few dozen bytes here: the shards' budget, not
# this, bounds what is cached).
MAX_ENTRIES = 1 << 16


@dataclass(frozen=True)
class Hit:
    entry: int  # the shards' prefix entry id
    length: int  # tokens it holds: a multiple of the chunk


class PrefixIndex:
    """Digest of (salt, tokens[:k * chunk]) -> the prefix entry the shards keep for it."""

    def __init__(self, chunk: int, max_entries: int = MAX_ENTRIES) -> None:
        if chunk < 1:
            raise ValueError(f"the prefix grid needs a chunk of at least one token, got {chunk}")
        self.chunk, self.max_entries = chunk, max_entries
        self._entries: OrderedDict[bytes, Hit] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.cached_tokens = self.saves = self.lost = 0

    def digests(self, salt: str, tokens: list[int]) -> list[bytes]:
        """The digest of `tokens[:k * chunk]` for every whole chunk boundary k >= 1, in order."""
        h = hashlib.sha256(salt.encode())
        out = []
        for end in range(self.chunk, len(tokens) + 1, self.chunk):
            h.update(b"".join(t.to_bytes(4, "little") for t in tokens[end - self.chunk:end]))
            out.append(h.copy().digest())
        return out

    def lookup(self, digests: list[bytes], prompt_length: int) -> Optional[Hit]:
        """The longest cached prefix (of a prompt with these `digests`) that leaves at least the prompt's last token
        to forward: its logits give the first new token."""
        with self._lock:
            for k in range(min(len(digests), (prompt_length - 1) // self.chunk), 0, -1):
                hit = self._entries.get(digests[k - 1])
                if hit is not None:
                    self._entries.move_to_end(digests[k - 1])
                    return hit
        return None

    def new_entry(self, digests: list[bytes], end: int) -> Optional[int]:
        """An entry id to save the state after the first `end` tokens as, when `end` is on the grid and not cached."""
        if end % self.chunk or not 0 < end // self.chunk <= len(digests):
            return None
        with self._lock:
            if digests[end // self.chunk - 1] in self._entries:
                return None
        return secrets.randbits(62)

    def saved(self, digests: list[bytes], end: int, entry: int) -> None:
        """Every shard kept `entry` for the first `end` tokens."""
        digest = digests[end // self.chunk - 1]
        with self._lock:
            self._entries[digest] = Hit(entry, end)
            self._entries.move_to_end(digest)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            self.saves += 1

    def forget(self, entry: int) -> None:
        """A shard no longer holds `entry`: no prompt resumes from it again."""
        with self._lock:
            for digest in [d for d, hit in self._entries.items() if hit.entry == entry]:
                del self._entries[digest]
            self.lost += 1

    def describe(self) -> dict:
        return {"chunk": self.chunk, "entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                "cached_tokens": self.cached_tokens, "saves": self.saves, "lost": self.lost}


def open_sequence(request: Request, prefixes: Optional[PrefixIndex]) -> None:
    """Open the request's sequence: from the longest prefix of its prompt the shards keep (prefix caching, where
    its target resumes: the batch's own, a drafter's beside a shard), else empty. A prefix entry a shard no
    longer holds is forgotten (one a drafter daemon of its own lacks is not: the shards still serve it) and the
    sequence opens empty: the same tokens either way."""
    prefixes = prefixes if getattr(request.target, "prefix_cache", False) else None
    if prefixes is not None:
        request.prefix_digests = prefixes.digests(request.cache_salt, request.prompt)
        # a prompt scored token by token (prompt logprobs) forwards all of it, leaving entries for others
        hit = prefixes.lookup(request.prefix_digests, len(request.prompt)) if request.prompt_logprobs is None \
            else None
        if hit is not None:
            try:
                request.target.open(request.seq, prefix=hit.entry)
            except PrefixMissing as missing:
                if not missing.held:  # held: the shards keep it for streams that do not draft elsewhere
                    prefixes.forget(hit.entry)
            else:
                request.prefilled = request.result.cached_tokens = hit.length
                prefixes.hits += 1
                prefixes.cached_tokens += hit.length
                return
        prefixes.misses += 1
    request.target.open(request.seq)
