"""Verify-geometry guard: until tree verification exists, only the pure chain is accepted.

`parents[i]` is the index (within the request) of token i's parent, -1 for the root. The
only accepted geometry for n tokens is the root-inclusive pure chain [-1, 0, 1, ..., n-2].
Anything else is rejected with GEOMETRY_REJECTED and one of these reasons, checked in
this order:

  missing         parents is None (absent from a checkpointed request)
  truncated       fewer entries than tokens
  too long        more entries than tokens
then the first offending token i (scanning from 0) decides, with p = parents[i]:
  out of range    p < -1 or p >= n
  malformed root  i == 0 and p != -1, or i > 0 and p == -1 (a second root)
  cyclic          p == i (token is its own parent)
  forward parent  p > i (parent comes after the child, which would form a cycle)
  sibling         p == parents[i-1] (a second candidate at the depth of token i-1)
  skipped parent  p < i-1 otherwise (attaches to an earlier ancestor, skipping token i-1)
"""

from __future__ import annotations

from typing import Sequence

from .errors import ErrorCode, ProtocolError


def pure_chain(n_tokens: int) -> list[int]:
    """The one geometry accepted for `n_tokens` tokens: [-1, 0, 1, ..., n-2]."""
    return list(range(-1, n_tokens - 1))


def check_verify_geometry(parents: Sequence[int] | None, n_tokens: int) -> None:
    """`parents` is None or a list of ints and n_tokens >= 1: the codec has checked both (schema, token count)."""
    def reject(reason: str) -> None:
        raise ProtocolError(ErrorCode.GEOMETRY_REJECTED, f"verify geometry rejected: {reason}")

    if parents == pure_chain(n_tokens):
        return  # every request the coordinator sends: one comparison, not the scan below
    if parents is None:
        reject(f"missing: a checkpointed request of {n_tokens} tokens must carry parents {pure_chain(n_tokens)[:4]}...")
    if len(parents) < n_tokens:
        reject(f"truncated: {len(parents)} parents for {n_tokens} tokens")
    if len(parents) > n_tokens:
        reject(f"too long: {len(parents)} parents for {n_tokens} tokens")
    for i, p in enumerate(parents):
        if p == i - 1:
            continue
        where = f"parents[{i}] = {p}"
        if p < -1 or p >= n_tokens:
            reject(f"out of range: {where}, must be in [-1, {n_tokens - 1}]")
        if p == -1 or i == 0:
            reject(f"malformed root: {where}; only token 0 is the root (parent -1)")
        if p == i:
            reject(f"cyclic: {where}, token {i} is its own parent")
        if p > i:
            reject(f"forward parent: {where}, the parent comes after the token")
        if p == parents[i - 1]:
            reject(f"sibling: {where} shares its parent with token {i - 1} (tree verification is not supported)")
        reject(f"skipped parent: {where} skips token {i - 1}; only the pure chain is accepted")
