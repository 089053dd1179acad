"""Rows from shard to shard (PROTOCOL.md, "Rows from shard to shard").

A FORWARD with `send_rows` sends its output rows straight to the daemon's next shard (`shardd serve --relay-to`)
as a ROWS under the coordinator's ticket; the next shard's FORWARD with that `rows_ticket` waits for them instead
of the coordinator carrying them: per hop one delivery and the coordinator's decode and encode of the rows fewer.
`RowsLink` is the sending side, `RowsInbox` the receiving one (the rows that came first, and the FORWARDs that
wait, one per connection: the next request of that connection ends the wait).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.endpoints import endpoint_problem, is_loopback
from protocol import ErrorCode, Hello, MessageType, ProtocolError, Ring, Rows, decode_reply, encode_request
from protocol.codec import with_id
from shardd.server.peer import Peer

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


RELAY_KEY_CHARS = (32, 128)  # as HELLO's `relay_key` takes it


def read_relay_key(path: str) -> str:
    """The relay key in the file `path` (`shardd serve --relay-key`): ValueError naming the file unless it is a
    regular file only its owner may read or write, holding 32 to 128 printable characters."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file")
        if mode & 0o077:
            raise ValueError(f"{path}: mode {stat.S_IMODE(mode):04o} lets other users read or write the "
                             f"key; make it 0600 (chmod 600 {path})")
        key = Path(path).read_text(encoding="ascii").strip()
    except OSError as error:
        raise ValueError(f"{path}: cannot read it: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: the key must be ASCII text") from None
    low, high = RELAY_KEY_CHARS
    if not low <= len(key) <= high or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"{path}: the key must be {low} to {high} printable characters without spaces "
                         f"(one line, e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return key


def same_key(presented: str, key: str) -> bool:
    """Whether a presented relay key is this daemon's, in time that does not depend on where they differ."""
    return hmac.compare_digest(presented.encode(), key.encode())


class RowsLink:
    """The ROWS this daemon sends to its next shard: one DEALER, never waited on. The next shard acknowledges
    each ROWS; the acknowledgements (and refusals, logged) are read and dropped before each send.

    With `device_rows` (a GPU shard), the first rows on a GPU ask the next shard for its device ring (RING,
    shardd/server/ring.py) and, when it has one, every step's rows that fit go through a slot of it: a ROWS naming the
    slot, sent without waiting for the device. A slot is written again only once the ROWS that last used it is
    acknowledged (the reader has copied it out by then, or is about to on its stream).

    With `relay_key` (the shard set's, `--relay-key`), the link presents it in a HELLO first, and again as soon as
    it sees its connection drop (the next shard died: its restart answers on a new connection, which delivers the
    HELLO queued then ahead of any later ROWS), so the next shard takes its ROWS as its upstream's."""

    RING_REPLY_S = 5.0  # how long the first rows wait for the next shard's RING reply before going by host
    ACK_WAIT_S = 1.0  # how long rows wait for the acknowledgement that frees their slot, else they go by host

    def __init__(self, endpoint: str, device_rows: int = 0, relay_key: Optional[str] = None):
        self.endpoint = endpoint
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.relay_key = relay_key
        self.monitor = None  # the link's dropped connections: the next one presents the key again
        self.present_again = False  # a HELLO goes ahead of the next ROWS (a dropped connection, a refusal)
        if relay_key is not None:
            self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.socket.connect(endpoint)
        self._ids = itertools.count(1)
        if relay_key is not None:
            self._present_key()  # queued ahead of any ROWS: the first connection delivers it first
        self.sent = self.refused = self.dropped = 0
        self.device_rows = device_rows
        self.ring = None  # shardd.server.ring.RingWriter once the next shard gave its ring
        self.ring_problem: Optional[str] = None if device_rows else "off (not a GPU shard)"
        self.on_device = 0  # ROWS whose rows went through the ring
        self._slot_ids: dict[int, int] = {}  # slot -> id of the ROWS that used it, until acknowledged
        self._replies: dict[int, object] = {}  # id -> reply, for the one request whose reply is awaited (RING)

    def _present_key(self) -> None:
        """HELLO with the relay key, without waiting (its reply is read with the ROWS acknowledgements)."""
        try:
            self.socket.send_multipart(encode_request(Hello(id=next(self._ids), relay_key=self.relay_key)),
                                       flags=zmq.NOBLOCK)
            self.present_again = False
        except zmq.Again:  # the next shard takes nothing now: present it before the next ROWS
            self.present_again = True

    def _present_key_after_drops(self) -> None:
        """Before a ROWS or RING: after a dropped connection (or a refusal as not the upstream), a HELLO first."""
        if self.monitor is None:
            return
        while self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self.present_again = True
        if self.present_again:
            self._present_key()

    def send(self, rows) -> int:
        """Send `rows` (Rows or RowsBatch); its id."""
        self.drain()
        self._present_key_after_drops()
        request_id = next(self._ids)
        try:
            frames = encode_request(with_id(rows, request_id), validate=False)
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self.sent += 1
        except zmq.Again:  # the next shard is gone and its queue full: its FORWARD ends waiting, by itself
            self.dropped += 1
            log.warning("ROWS of ticket %s dropped: %s takes nothing", getattr(rows, "ticket", "?"), self.endpoint)
        return request_id

    def send_on_device(self, parts: list, make_rows: Callable[[int, int], object], own=None) -> bool:
        """Put `parts` (GPU tensors, rows end to end) in the next shard's ring and send `make_rows(slot, gen)`, the
        ROWS naming the slot and the put's generation: True; False when they must go through the host (no ring,
        they do not fit, or the slot is not free in time), nothing sent then. `own`: this shard's own device wait for
        its input rows (shardd.server.ring.DeviceWait: the next shard's wait ends poisoned when they never landed)."""
        if self.ring is None:
            if self.ring_problem is not None or not parts or parts[0].device.type != "cuda":
                return False
            self._open_ring(parts[0].device)
            if self.ring is None:
                return False
        if not self.ring.fits(parts):
            return False
        slot = self.ring.next
        if not self._acknowledged(slot):
            log.warning("ring slot %d of %s not acknowledged in %g s: these rows go through the host", slot,
                        self.endpoint, self.ACK_WAIT_S)
            return False
        if self.ring.put(parts, self.ACK_WAIT_S, own) is None:
            return False
        self._slot_ids[slot] = self.send(make_rows(slot, self.ring.generations[slot]))
        self.on_device += 1
        return True

    def _open_ring(self, device=None) -> None:
        """RING to the next shard (`device`: where this shard's rows are, its GPU named in the request)."""
        from shardd.server.ring import RingUnavailable, RingWriter, gpu_uuid

        self._present_key_after_drops()
        request_id = next(self._ids)
        try:
            gpu = gpu_uuid(device) if device is not None and device.type == "cuda" else None
            ring = Ring(id=request_id, rows=self.device_rows, pid=os.getpid(), gpu=gpu)
            self.socket.send_multipart(encode_request(ring), flags=zmq.NOBLOCK)
            reply = self._await(request_id, self.RING_REPLY_S)
            if reply is None:
                raise RingUnavailable(f"no RING reply in {self.RING_REPLY_S:g} s")
            if not reply.ok:
                raise RingUnavailable(f"{reply.error_code}: {reply.error_message}")
            self.ring = RingWriter(reply.result)
            log.info("rows to %s go through its device ring (%d slots of %d rows)", self.endpoint, self.ring.slots,
                     self.ring.rows)
        except (RingUnavailable, zmq.Again) as error:
            self.ring_problem = str(error) or type(error).__name__
            log.info("rows to %s go through the host: %s", self.endpoint, self.ring_problem)

    def _await(self, request_id: int, timeout_s: float):
        self._drain_until(lambda: request_id in self._replies, timeout_s)
        return self._replies.pop(request_id, None)

    def _acknowledged(self, slot: int) -> bool:
        return self._drain_until(lambda: slot not in self._slot_ids, self.ACK_WAIT_S)

    def _drain_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Read the next shard's replies until `done()` (True) or `timeout_s` has passed (False)."""
        deadline = time.monotonic() + timeout_s
        self.drain()
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.socket.poll(max(1, int(left * 1000)))
            self.drain()
        return True

    def drain(self) -> None:
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            try:
                reply = decode_reply(frames)
            except ProtocolError as error:
                log.warning("%s answered a ROWS with a malformed reply: %s", self.endpoint, error)
                continue
            if reply.type == MessageType.RING:
                self._replies[reply.id] = reply
                continue
            if reply.type == MessageType.HELLO:
                if not reply.ok:
                    log.error("%s refused this shard's relay key: %s %s", self.endpoint, reply.error_code,
                              reply.error_message)
                continue
            freed = [slot for slot, sent in self._slot_ids.items() if sent == reply.id]
            for slot in freed:
                del self._slot_ids[slot]
            if not reply.ok:
                self.refused += 1
                log.warning("%s refused a ROWS: %s %s", self.endpoint, reply.error_code, reply.error_message)
                if reply.error_code is ErrorCode.FORBIDDEN and self.relay_key is not None:
                    self.present_again = True  # a ROWS came on this connection before its HELLO
                if freed:  # the next shard has no ring now (restarted?): ask again on the next rows
                    self.ring = None

    def close(self) -> None:
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
        self.socket.close(linger=0)


@dataclass
class Waiting:
    """A FORWARD waiting for its rows: what its reply needs later."""

    envelope: list
    request: object
    peer: Peer  # who sent it: its reply is handled as theirs
    deadline: float


class RowsInbox:
    """ROWS that came before their FORWARD, by ticket, and the FORWARDs waiting for theirs, by connection.

    What one sender parks is bounded on its own: at most `capacity` ROWS and `max_bytes` of rows, none older than
    `max_age_s`; past that its own oldest go, never another sender's, so a peer that sends ROWS nobody asks for
    cannot push out the rows a real step is about to take."""

    def __init__(self, capacity: int, max_bytes: int = 1 << 62, max_age_s: float = WAIT_S):
        self.capacity, self.max_bytes, self.max_age_s = capacity, max_bytes, max_age_s
        self.rows: OrderedDict[int, tuple[Rows, float, bytes, int]] = OrderedDict()  # ticket -> rows, time, sender, bytes
        self.held: dict[bytes, list[int]] = {}  # sender -> [ROWS, bytes] it has parked
        self.waiting: dict[bytes, Waiting] = {}

    def put(self, rows: Rows, sender: bytes = b"", nbytes: int = 0, now: Optional[float] = None) -> Optional[Waiting]:
        """Keep `rows` (`nbytes` of rows, from `sender`) for its FORWARD; the FORWARD already waiting for them, if
        one is (its wait ends)."""
        now = time.monotonic() if now is None else now
        self._drop(rows.ticket)
        self.rows[rows.ticket] = (rows, now, sender, nbytes)
        held = self.held.setdefault(sender, [0, 0])
        held[0] += 1
        held[1] += nbytes
        while held[0] > self.capacity or held[1] > self.max_bytes:
            self._drop(next(ticket for ticket, kept in self.rows.items() if kept[2] == sender))
        self.expire(now)
        for owner, waiting in self.waiting.items():
            if waiting.request.rows_ticket == rows.ticket:
                return self.waiting.pop(owner)
        return None

    def take(self, ticket: int) -> Optional[Rows]:
        kept = self._drop(ticket)
        return kept[0] if kept is not None else None

    def _drop(self, ticket: int):
        kept = self.rows.pop(ticket, None)
        if kept is not None:
            held = self.held[kept[2]]
            held[0] -= 1
            held[1] -= kept[3]
            if not held[0]:
                del self.held[kept[2]]
        return kept

    def expire(self, now: float) -> None:
        """Let go of the rows no FORWARD took within `max_age_s`."""
        while self.rows and next(iter(self.rows.values()))[1] < now - self.max_age_s:
            self._drop(next(iter(self.rows)))

    def wait(self, waiting: Waiting) -> None:
        self.waiting[waiting.peer.link] = waiting

    def cancel(self, link: bytes) -> Optional[Waiting]:
        """The FORWARD of connection `link` still waiting, taken off the wait (a later request of it came)."""
        return self.waiting.pop(link, None)

    def expired(self, now: float) -> list[Waiting]:
        self.expire(now)
        done = [owner for owner, waiting in self.waiting.items() if waiting.deadline <= now]
        return [self.waiting.pop(owner) for owner in done]
