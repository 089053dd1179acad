"""Rows from shard to shard (PROTOCOL.md, "Rows from shard to shard").

A FORWARD with `send_rows` sends its output rows straight to the daemon's next shard (`shardd serve --relay-to`)
as a ROWS under the coordinator's ticket; the next shard's FORWARD with that `rows_ticket` waits for them instead
of the coordinator carrying them: per hop one delivery and the coordinator's decode and encode of the rows fewer.
`RowsLink` is the sending side, `RowsInbox` the receiving one (the rows that came first, and the FORWARDs that
wait, one per connection: the next request of that connection ends the wait).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import zmq

from protocol import ProtocolError, Rows, decode_reply, encode_request
from shardd.listen import endpoint_problem
from shardd.security import is_loopback

log = logging.getLogger("shardd")

WAIT_S = 120.0  # the longest a FORWARD waits for its rows (the coordinator's default compute timeout)


def check_relay_to(endpoint: str, curve: bool) -> None:
    """ValueError unless `endpoint` can take this daemon's ROWS: ipc:// or loopback tcp, without CurveZMQ (the
    rows between two daemons of one host go unencrypted, as the loopback traffic of a daemon does)."""
    problem = endpoint_problem(endpoint)
    if problem:
        raise ValueError(f"--relay-to {endpoint}: {problem}")
    if curve:
        raise ValueError("--relay-to sends rows unencrypted between daemons of one host; it does not go with "
                         "--curve-secret-key (the coordinator carries the rows then)")
    if endpoint.endswith(":*"):
        raise ValueError(f"--relay-to {endpoint}: name the next shard's port")
    if not is_loopback(endpoint):
        raise ValueError(f"--relay-to {endpoint}: only ipc:// or a loopback tcp:// endpoint (a daemon of this host)")


class RowsLink:
    """The ROWS this daemon sends to its next shard: one DEALER, never waited on. The next shard acknowledges
    each ROWS; the acknowledgements (and refusals, logged) are read and dropped before each send."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self._ids = itertools.count(1)
        self.sent = self.refused = self.dropped = 0

    def send(self, rows: Rows) -> None:
        self.drain()
        try:
            frames = encode_request(dataclasses.replace(rows, id=next(self._ids)), validate=False)
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self.sent += 1
        except zmq.Again:  # the next shard is gone and its queue full: its FORWARD ends waiting, by itself
            self.dropped += 1
            log.warning("ROWS of sequence %s (ticket %s) dropped: %s takes nothing", rows.seq, rows.ticket,
                        self.endpoint)

    def drain(self) -> None:
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            try:
                reply = decode_reply(frames)
            except ProtocolError as error:
                log.warning("%s answered a ROWS with a malformed reply: %s", self.endpoint, error)
                continue
            if not reply.ok:
                self.refused += 1
                log.warning("%s refused a ROWS: %s %s", self.endpoint, reply.error_code, reply.error_message)

    def close(self) -> None:
        self.socket.close(linger=0)


@dataclass
class Waiting:
    """A FORWARD waiting for its rows: what its reply needs later."""

    envelope: list
    request: object
    owner: bytes
    trusted: bool
    deadline: float


class RowsInbox:
    """ROWS that came before their FORWARD, by ticket (at most `capacity`, none older than WAIT_S), and the
    FORWARDs waiting for theirs, by connection."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: OrderedDict[int, tuple[Rows, float]] = OrderedDict()
        self.waiting: dict[bytes, Waiting] = {}

    def put(self, rows: Rows, now: Optional[float] = None) -> Optional[Waiting]:
        """Keep `rows` for its FORWARD; the FORWARD already waiting for them, if one is (its wait ends)."""
        now = time.monotonic() if now is None else now
        self.rows[rows.ticket] = (rows, now)
        self.rows.move_to_end(rows.ticket)
        while len(self.rows) > self.capacity or (self.rows and next(iter(self.rows.values()))[1] < now - WAIT_S):
            self.rows.popitem(last=False)
        for owner, waiting in self.waiting.items():
            if waiting.request.rows_ticket == rows.ticket:
                return self.waiting.pop(owner)
        return None

    def take(self, ticket: int) -> Optional[Rows]:
        kept = self.rows.pop(ticket, None)
        return kept[0] if kept is not None else None

    def wait(self, waiting: Waiting) -> None:
        self.waiting[waiting.owner] = waiting

    def cancel(self, owner: bytes) -> Optional[Waiting]:
        """The FORWARD of `owner`'s connection still waiting, taken off the wait (a later request of it came)."""
        return self.waiting.pop(owner, None)

    def expired(self, now: float) -> list[Waiting]:
        done = [owner for owner, waiting in self.waiting.items() if waiting.deadline <= now]
        return [self.waiting.pop(owner) for owner in done]
