"""A client for one shard daemon: a ZeroMQ DEALER socket speaking protocol v1.

Several requests may be in flight; replies are matched by id, so a reply that arrives
after its request timed out is recognised as stale and dropped. A request that waits on the
daemon for rows from the previous shard (`rows_ticket`) holds back the requests sent after it
until its reply has come: the daemon would end that wait at its connection's next request. Tensor frames are relayed
as `WireTensor`s over the received frames (no copy, no torch), so a hidden state goes
from one shard's reply to the next shard's request without being decoded.

A `ShardClient` (its socket) belongs to one thread at a time: ZeroMQ sockets are not
thread-safe. Threads that talk to the same daemon each build their own client.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import zmq

from common.busy_poll import follow_busy_poll
from coordinator.relay.liveness import LIVENESS_TIMEOUT_S, ConnectionWatch, enable_heartbeats
from protocol import (
    Batch,
    Capture,
    Close,
    ErrorCode,
    Forward,
    Hello,
    Open,
    Propose,
    ProtocolError,
    RemoteError,
    Reply,
    Request,
    Restore,
    Rollback,
    Snapshot,
    Stats,
    WireTensor,
    decode_reply,
    encode_request,
    pure_chain,
    split_batch_reply,
)
from protocol.codec import new_record, with_id
from protocol.timing import PhaseClock


class ShardError(RemoteError):
    """The daemon at `endpoint` answered `ok: false` with `code` (an ErrorCode)."""

    def __init__(self, code: ErrorCode | str, message: str, endpoint: str) -> None:
        super().__init__(code, message)
        self.endpoint = endpoint
        # Exception.__str__ shows args[0]: put the endpoint in front of "CODE: message".
        self.args = (f"{endpoint}: {self.code.value}: {self.message}",)


class ShardTimeout(TimeoutError):
    """No reply from the daemon at `endpoint` within the timeout."""

    def __init__(self, endpoint: str, what: str, timeout_s: float, connected: bool = False) -> None:
        if connected:  # heartbeats answered all along: the daemon is there but has not answered this request
            reason = ("the daemon is connected and answers heartbeats but is still busy with this or an earlier "
                      "request (a long compute, or stuck: see its log)")
        else:
            reason = "is the daemon running? off loopback: are the CurveZMQ keys right?"
        super().__init__(f"{endpoint}: no reply to {what} within {timeout_s:g} s ({reason})")
        self.endpoint = endpoint
        self.timeout_s = timeout_s


class ShardUnavailable(ShardTimeout):
    """The daemon at `endpoint` is not there: no connection within the liveness timeout, or the
    connection dropped (killed, stopped, unreachable) while a request was in flight."""

    def __init__(self, endpoint: str, what: str, reason: str, waited_s: float) -> None:
        TimeoutError.__init__(self, f"{endpoint}: {reason} while waiting for {what} ({waited_s:.1f} s)")
        self.endpoint = endpoint
        self.timeout_s = waited_s


# The compute timeout grows with the tokens a request carries: a long prefill is not a HELLO.
SECONDS_PER_TOKEN = 0.05


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ keys for a daemon bound off loopback: the server's public key and this
    client's key pair (its public key must be in the daemon's --curve-allow directory)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key_file: str, client_secret_file: str) -> "CurveKeys":
        """From `shardd keygen` files: the server's NAME.key and the client's NAME.key_secret."""
        import zmq.auth  # Curve only: a loopback client never loads it

        server_public, _ = zmq.auth.load_certificate(server_key_file)
        public, secret = zmq.auth.load_certificate(client_secret_file)
        if secret is None:
            raise ValueError(f"{client_secret_file} holds no secret key: give the client's .key_secret file")
        return cls(server_public, public, secret)


class ShardClient:
    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 120.0,
        curve: Optional[CurveKeys] = None,
        liveness_timeout_s: float = LIVENESS_TIMEOUT_S,
        busy_poll_s: Optional[float] = 0.0,
    ) -> None:
        self.endpoint = endpoint
        self._options = dict(timeout_s=timeout_s, curve=curve, liveness_timeout_s=liveness_timeout_s,
                             busy_poll_s=busy_poll_s)
        # a reply awaited for up to this long is polled for without sleeping (a core kept busy, no wake-up on its way
        # in; the daemons' --busy-poll-ms is the same on their side). None: as the daemon does, from its HELLO
        # (common.busy_poll.follow_busy_poll; 0 until then)
        self.follow_busy_poll = busy_poll_s is None
        self.busy_poll_s = busy_poll_s or 0.0
        self.timeout_s = timeout_s  # compute timeout of a request without tokens; more per token
        self.liveness_timeout_s = liveness_timeout_s
        self._ids = itertools.count(1)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A reconnect under the same routing id takes the daemon's old connection over (ROUTER_HANDOVER) ...
        self._socket.setsockopt(zmq.ROUTING_ID, b"shardctl-" + secrets.token_hex(16).encode())
        # ... and this secret, presented in HELLO on each new connection before anything else, keeps the
        # sequences this client opened on earlier ones (without Curve: PROTOCOL.md, "Ownership").
        self._owner = secrets.token_hex(32)
        self._claimed_at: Optional[int] = None  # the connection (its drop count) the secret was presented on
        # Queue nothing while no daemon is connected: a request sent to nobody fails, not waits for a restart.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.IPV6, 1)
        enable_heartbeats(self._socket, liveness_timeout_s)
        self._watch = ConnectionWatch(self._socket)
        if curve is not None:
            self._socket.curve_serverkey = curve.server_public
            self._socket.curve_publickey = curve.public
            self._socket.curve_secretkey = curve.secret
        self._socket.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._watch.monitor, zmq.POLLIN)
        # Requests sent and not yet answered: id -> the connection drops counted when it went out. Several may be
        # in flight (a ROLLBACK and the next FORWARD back to back); the daemon answers in order, and a reply that
        # comes while another is awaited waits in `_early` for its own receive().
        self._in_flight: dict[int, int] = {}
        self._early: dict[int, Reply] = {}
        # The request sent that may still be waiting on the daemon for its rows (`rows_ticket`), and the requests
        # sent after it that are not on the wire yet: each goes out as soon as the reply before it came (several
        # micro-batches' steps in flight through one shard: PROTOCOL.md, "Micro-batches").
        self._waiting_for_rows: Optional[Request] = None
        self._held: deque[tuple[Request, list]] = deque()
        self._failed: dict[int, Exception] = {}  # a held request that could not go out: raised by its receive
        # where this client's requests spend their time: encode, send, wait, receive, decode (protocol/timing.py)
        self.phases = PhaseClock()

    def sibling(self) -> "ShardClient":
        """A second connection to the same daemon acting on this client's sequences (the same owner secret, or Curve
        key): its requests are not held back behind this one's waits for rows (micro-batches in flight)."""
        other = ShardClient(self.endpoint, **self._options)
        other._owner = self._owner
        return other

    # ---- transport -----------------------------------------------------------------------

    def request(self, record: Request, timeout_s: Optional[float] = None) -> Reply:
        """Send `record` (its id replaced by this client's next id) and return the reply.

        Raises ShardError for `ok: false`, ShardUnavailable when the daemon is not connected or
        goes away, ShardTimeout when nothing comes back in time, ProtocolError for a reply that
        is not valid protocol v1. An explicit `timeout_s` also bounds the wait for a connection."""
        return self.receive(self.send(record, timeout_s), timeout_s)

    def send(self, record: Request, connect_timeout_s: Optional[float] = None, *, validate: bool = True) -> Request:
        """Send without waiting for the reply; returns the record as sent (with its id) for `receive`.
        Lets a caller keep several daemons busy at once, and send a daemon several requests back to back (it
        serves them in order; each reply is then read with its own `receive`, in any order).
        Waits up to `connect_timeout_s` (default: the liveness timeout) for a connection to the daemon,
        else ShardUnavailable; nothing is left queued then. The record is checked as the daemon will check it
        (ProtocolError, nothing sent) unless `validate` is False: a batch whose bad items the daemon is to refuse
        one by one, leaving the others to run."""
        if self._socket.closed:
            raise RuntimeError(f"{self.endpoint}: client is closed")
        started = time.perf_counter_ns()
        record = with_id(record, next(self._ids))
        frames = encode_request(record, validate=validate)
        self.phases.add(record.type, "encode", time.perf_counter_ns() - started)
        if self._waiting_for_rows is not None:  # it goes out once the request waiting for rows is answered
            self._held.append((record, frames))
            return record
        self._transmit(record, frames, connect_timeout_s)
        return record

    def _transmit(self, record: Request, frames: list, connect_timeout_s: Optional[float] = None) -> None:
        sending = time.perf_counter_ns()
        if connect_timeout_s is None:
            connect_timeout_s = min(self.liveness_timeout_s, self.compute_timeout(record))
        wait_s = connect_timeout_s
        self._await_connection(record, wait_s)
        try:
            if self._claimed_at != self._watch.drops:  # a new connection: claim this client's sequences first
                self._socket.send_multipart(encode_request(Hello(id=next(self._ids), owner=self._owner)),
                                            flags=zmq.NOBLOCK)  # served first; its reply is dropped as stale
                self._claimed_at = self._watch.drops
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise ShardUnavailable(self.endpoint, _describe(record), "send queue full", 0) from None
        self._in_flight[record.id] = self._watch.drops
        if getattr(record, "rows_ticket", None) is not None:
            self._waiting_for_rows = record
        self.phases.count(record.type)
        self.phases.add(record.type, "send", time.perf_counter_ns() - sending)

    def _answered(self, request_id: Optional[int]) -> None:
        """The request `request_id` was answered, failed or forgotten: if it held later ones back, they go out now,
        up to the next one that may wait for rows. A held request that cannot go out fails the ones behind it too
        (the same connection)."""
        if self._waiting_for_rows is None or request_id != self._waiting_for_rows.id:
            return
        self._waiting_for_rows = None
        while self._held and self._waiting_for_rows is None:
            record, frames = self._held.popleft()
            try:
                self._transmit(record, frames)
            except ShardUnavailable as error:
                for failed, _ in [(record, frames), *self._held]:
                    self._failed[failed.id] = error
                self._held.clear()

    def _release(self, sent: Request) -> None:
        """Until `sent`, held back, is on the wire (or failed): the replies it waits behind are read and kept."""
        while any(record.id == sent.id for record, _ in self._held):
            ahead = self._waiting_for_rows
            try:
                self._early[ahead.id] = self._await(ahead, self.compute_timeout(ahead))
            except (ShardTimeout, ProtocolError) as error:
                self._failed[ahead.id] = error
            finally:
                self._in_flight.pop(ahead.id, None)
                self._answered(ahead.id)

    def _await_connection(self, record: Request, wait_s: float) -> None:
        """Until a connection is up: the monitor saw its handshake and no drop since (a socket still writable
        into a connection the monitor already reported down would swallow the request), and it has room
        (with IMMEDIATE a DEALER is writable only while a handshake-complete connection has room)."""
        deadline = time.monotonic() + wait_s
        while True:
            self._watch.update()
            if self._watch.up and self._socket.poll(0, zmq.POLLOUT):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = ("no connection to the daemon" if not self._watch.up
                          else "the connection to the daemon stayed full")
                raise ShardUnavailable(self.endpoint, _describe(record), reason, wait_s)
            # the monitor wakes this on a handshake; a full connection is polled again shortly
            self._watch.monitor.poll(max(1, int(min(remaining, 0.05) * 1000)))

    def compute_timeout(self, record: Request) -> float:
        """How long a reply to `record` may take while the daemon is alive: the base plus per token."""
        if isinstance(record, Batch):
            return self.timeout_s + record.rows * SECONDS_PER_TOKEN
        n = record.n_tokens if isinstance(record, Forward) else 0
        return self.timeout_s + n * SECONDS_PER_TOKEN

    def forget(self, sent: Request) -> None:
        """Stop awaiting `sent`: its reply, when it comes, is dropped as stale (one held back is not sent)."""
        self._held = deque((record, frames) for record, frames in self._held if record.id != sent.id)
        self._failed.pop(sent.id, None)
        self._in_flight.pop(sent.id, None)
        self._early.pop(sent.id, None)
        self._answered(sent.id)  # a wait for rows it left behind ends with the next request sent

    def receive(self, sent: Request, timeout_s: Optional[float] = None) -> Reply:
        """The reply to `sent` (as `send` returned it); replies to earlier requests that
        timed out are dropped on the way, replies to other requests still in flight are kept for
        their own receive(). ShardUnavailable as soon as the connection drops (every request in
        flight is lost with it), ShardTimeout after the compute timeout."""
        self._release(sent)
        failed = self._failed.pop(sent.id, None)
        if failed is not None:
            raise failed
        reply = self._early.pop(sent.id, None)
        if reply is None:
            try:
                reply = self._await(sent, self.compute_timeout(sent) if timeout_s is None else timeout_s)
            finally:
                self._in_flight.pop(sent.id, None)  # answered, lost or timed out: a late reply is stale
                self._answered(sent.id)
        return self._check(reply, sent)

    def receive_items(self, sent: Batch, timeout_s: Optional[float] = None) -> list:
        """The reply to a batched request (as `send` returned it), per item: its `Reply` (with its rows of each
        tensor) or the ShardError that refused that item alone. Raises as `receive` does when the whole request
        failed (an envelope refused, a timeout, a lost connection), ProtocolError for a reply that does not fit."""
        reply = self.receive(sent, timeout_s)
        try:
            items = split_batch_reply(reply, sent)
        except ProtocolError as error:
            raise ProtocolError(error.code, f"{self.endpoint}: malformed reply to {_describe(sent)}: {error.message}") from error
        return [item if item.ok else ShardError(item.error_code, item.error_message, self.endpoint) for item in items]

    def _await(self, sent: Request, timeout_s: float) -> Reply:
        what = _describe(sent)
        started = time.monotonic()
        deadline = started + timeout_s
        waited = time.perf_counter_ns()
        while True:
            # a drop since `sent` went out (seen here, or by a later send's update) took it along
            if self._watch.drops != self._in_flight.get(sent.id, self._watch.drops):
                raise ShardUnavailable(self.endpoint, what, "connection to the daemon lost", time.monotonic() - started)
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0:
                self._watch.update()
                raise ShardTimeout(self.endpoint, what, timeout_s, connected=self._watch.up)
            spinning = time.monotonic() - started < self.busy_poll_s
            events = dict(self._poller.poll(0 if spinning else max(1, int(remaining_ms))))
            if self._socket not in events:
                if self._watch.monitor in events:
                    self._watch.update()
                continue
            arrived = time.perf_counter_ns()
            self.phases.add(sent.type, "wait", arrived - waited)
            frames = self._socket.recv_multipart(copy=False)
            received = time.perf_counter_ns()
            try:
                reply = decode_reply(frames)
            except ProtocolError as error:
                raise ProtocolError(error.code, f"{self.endpoint}: malformed reply to {what}: {error.message}") from error
            waited = time.perf_counter_ns()
            mtype = reply.type or sent.type
            self.phases.add(mtype, "receive", received - arrived)
            self.phases.add(mtype, "decode", waited - received)
            if reply.id is not None and reply.id != sent.id:
                self._answered(reply.id)  # a reply that lets held requests go out
            # id None: the daemon could not read our id, so this error answers the oldest request in flight.
            if reply.id is None or reply.id == sent.id:
                return reply
            if reply.id in self._in_flight:  # sent after or before `sent`, still awaited: its receive() takes it
                self._in_flight.pop(reply.id)
                self._early[reply.id] = reply
            # else stale: the answer to a request that timed out earlier

    def _check(self, reply: Reply, sent: Request) -> Reply:
        if not reply.ok:
            raise ShardError(reply.error_code, reply.error_message, self.endpoint)
        if reply.type is not sent.type:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{self.endpoint}: reply to {_describe(sent)} has type {reply.type}")
        return reply

    def close(self, seq: Optional[int] = None) -> Optional[dict]:
        """`close(seq)` sends CLOSE for that sequence; `close()` closes this client's socket."""
        if seq is not None:
            return self.request(Close(id=0, seq=seq)).result
        self._held.clear()
        if not self._socket.closed:
            self._poller.unregister(self._socket)
            self._poller.unregister(self._watch.monitor)
            self._watch.close()
            self._socket.close(linger=0)
        return None

    def __enter__(self) -> "ShardClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShardClient({self.endpoint!r})"

    # ---- one method per message type -----------------------------------------------------

    def hello(self, timeout_s: Optional[float] = None) -> dict:
        result = self.request(Hello(id=0, owner=self._owner), timeout_s).result
        if self.follow_busy_poll:
            self.busy_poll_s = follow_busy_poll(result.get("busy_poll_ms"))
        return result

    def open(self, seq: int, prefix: Optional[int] = None) -> dict:
        return self.request(Open(id=0, seq=seq, prefix=prefix)).result

    def forward(
        self,
        seq: int,
        pos: int,
        tokens: Optional[list[int]] = None,
        hidden: Optional[WireTensor] = None,
        checkpoint: bool = False,
    ) -> Reply:
        return self.request(forward_record(seq, pos, tokens, hidden, checkpoint))

    def propose(
        self, seq: int, pos: int, last_token: int, block_size: int, features: Optional[WireTensor] = None,
        saves: Sequence[tuple[int, int]] = (),
    ) -> dict:
        """PROPOSE: the feature rows of positions pos-n .. pos-1 join the drafter's context; the result holds
        `block_size` draft `tokens` after `last_token` (at `pos`) and the drafter's `context_length`. `saves`:
        (prefix entry id, length) the drafter-only daemon keeps of the context (the result's `prefix_saved`)."""
        ids, lengths = ([entry for entry, _ in saves], [length for _, length in saves]) if saves else (None, None)
        return self.request(
            Propose(id=0, seq=seq, pos=pos, last_token=last_token, block_size=block_size, features=features,
                    save_prefix=ids, save_lengths=lengths)
        ).result

    def rollback(self, seq: int, keep: int) -> dict:
        return self.request(Rollback(id=0, seq=seq, keep=keep)).result

    def snapshot(self, seq: int) -> dict:
        return self.request(Snapshot(id=0, seq=seq)).result

    def restore(self, seq: int) -> dict:
        return self.request(Restore(id=0, seq=seq)).result

    def stats(self) -> dict:
        return self.request(Stats(id=0)).result


def _describe(record: Request) -> str:
    return f"{record.type.value} (id {record.id})"


def forward_record(
    seq: int,
    pos: int,
    tokens: Optional[list[int]] = None,
    hidden: Optional[WireTensor] = None,
    checkpoint: bool = False,
    layers: Optional[list[int]] = None,
    sampling: Optional[dict] = None,
    *,
    rows_ticket: Optional[int] = None,
    ticket_rows: Optional[int] = None,
    send_rows: Optional[int] = None,
    save_prefix: Optional[int] = None,
    carry: Optional[bool] = None,
) -> Forward:
    """A FORWARD (or, with `layers`, a CAPTURE) request; checkpointed ones carry the pure chain. `rows_ticket` /
    `ticket_rows`: its n input rows come from the previous shard's ROWS of that ticket; `send_rows`: its output
    rows go to the next shard under that ticket (PROTOCOL.md, "Rows from shard to shard")."""
    n = len(tokens) if tokens is not None else (hidden.shape[0] if hidden is not None else ticket_rows or 0)
    fields = {
        "tokens": None if tokens is None else list(tokens),
        "hidden": hidden,
        "rows_ticket": rows_ticket,
        "ticket_rows": ticket_rows,
        "send_rows": send_rows,
        "checkpoint": checkpoint,
        "parents": pure_chain(n) if checkpoint else None,
        "save_prefix": save_prefix,
        "carry": carry,
        **(sampling or {}),  # head shard only: temperature, top_p, top_k, seed, drafts
    }
    if layers is not None:
        return new_record(Capture, {"id": 0, "seq": seq, "pos": pos, **fields, "layers": list(layers)})
    return new_record(Forward, {"id": 0, "seq": seq, "pos": pos, **fields})
