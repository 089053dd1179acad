"""`Peer`: who sent the request being handled, passed to each handler as a value."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """The peer of one request: `owner` is its Curve key (`curve:KEY`) or else its connection, or the client whose
    secret that connection presented in HELLO (shardd/server/owners.py): the key its sequences are held under
    (PROTOCOL.md, "Ownership"); `connection` names its connection where Curve is off (a HELLO's `owner` binds it);
    `trusted` says whether it may SHUTDOWN (a file ipc:// socket, or an allowed Curve key)."""

    owner: bytes = b""
    trusted: bool = True
    connection: bytes | None = None
