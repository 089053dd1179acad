"""`Peer`: who sent the request being handled, passed to each handler as a value."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """The peer of one request: `owner` is its Curve key (`curve:KEY`) or else its ZeroMQ routing id, the key its
    sequences are held under (PROTOCOL.md, "Who may do what"); `trusted` says whether it may SHUTDOWN (a file
    ipc:// socket, or an allowed Curve key)."""

    owner: bytes = b""
    trusted: bool = True
