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

    @property
    def link(self) -> bytes:
        """Its connection, as the rows from shard to shard know it: a FORWARD's wait for its rows ends at that
        connection's next request, not at another connection's of the same owner (PROTOCOL.md, "Micro-batches")."""
        return self.connection if self.connection is not None else self.owner
