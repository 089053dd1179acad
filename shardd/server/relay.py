"""Rows from shard to shard, on a daemon (PROTOCOL.md, "Rows from shard to shard"): the link to the next shard
(--relay-to), the rows and waiting FORWARDs from the previous one, the device ring the previous shard writes into,
and the ROWS and RING handlers.

A FORWARD whose `rows_ticket` rows have not come is parked (`WaitsForRows`); the ROWS that brings them resumes it
through `resume`, and its reply goes out after the ROWS's acknowledgement (`completed`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from common.model_config import dtype_name
from protocol import ErrorCode, ProtocolError, Rows, RowsBatch, WireTensor
from protocol import Batch
from protocol.tensors import expected_nbytes
from shardd.server.errors import Refusals
from shardd.server.handlers.common import layers_of
from shardd.server.peer import Peer
from shardd.server.ring import DEFAULT_ROWS as RING_ROWS
from shardd.server.ring import DeviceRing, RingUnavailable, RowsLost, front_end_waits
from shardd.server.rows import RowsInbox, RowsLink, Waiting, check_relay_to, same_key
from shardd.server.stats import Counters
from shardd.server.tensors import DeviceRows, on_host

log = logging.getLogger("shardd")


PARKED_STEPS = 4  # a sender's rows kept ahead of their FORWARDs: this many requests' worth at most


class WaitsForRows(Exception):
    """A FORWARD's rows (`rows_ticket`) have not come yet: it waits, unanswered."""


class Relay:
    """This daemon's side of the rows between shards; `shard` is its engine (None on a drafter-only daemon)."""

    def __init__(self, config, shard, counters: Counters, refusals: Refusals, resume: Callable[[Waiting], list], *,
                 max_tokens_per_request: int, carried_layers: int = 0):
        """`carried_layers`: the hosted drafter's target layers that earlier shards own; each ring slot holds that
        many more rows of H per row, so a step's carried feature rows come through the ring beside its rows."""
        self.config = config  # ShardConfig: relay_to, relay_to_file, relay_key, curve_secret_key, rows_wait_s, ...
        self.shard = shard
        self.counters = counters
        self.max_tokens_per_request = max_tokens_per_request
        self.carried_layers = carried_layers
        self.endpoint: str | None = config.relay_to  # the next shard, once known (--relay-to or its file)
        self.link: RowsLink | None = None  # made on first use (`target`)
        self.ring: DeviceRing | None = None  # the ring the previous shard's ROWS name slots of (RING), once asked
        # with --relay-key: the connection that presented the key last, the only one whose ROWS and RING are taken
        self.upstream: bytes | None = None
        # what one sender may park: a few steps' rows ahead of their FORWARDs (the coordinator keeps at most one
        # micro-batch per shard in flight), never longer than a FORWARD would wait for them
        row_bytes = shard.config.hidden_size * shard.dtype.itemsize if shard is not None else 0
        self.inbox = RowsInbox(capacity=2 * config.max_sequences + 8,
                               max_bytes=PARKED_STEPS * max_tokens_per_request * row_bytes,
                               max_age_s=config.rows_wait_s)
        self.parked: Waiting | None = None  # set by a FORWARD that waits for its rows: the serving loop parks it
        self.completed: list[list] = []  # envelope + reply of each waiting FORWARD a ROWS let run
        self.refusals = refusals
        self.resume = resume  # the frames of a parked FORWARD's reply once its rows are in the inbox

    # ---- the next shard --------------------------------------------------------------------------

    def target(self) -> str | None:
        """The next shard's endpoint (--relay-to, or read from --relay-to-file once the next shard has written
        it), or None; the link to it is made on first use."""
        config = self.config
        if self.endpoint is None and config.relay_to_file is not None:
            try:
                endpoint = Path(config.relay_to_file).read_text().strip()
                check_relay_to(endpoint, curve=config.curve_secret_key is not None)
            except OSError:
                return None  # not written yet: the next shard has not bound its socket
            except ValueError as error:
                log.error("--relay-to-file %s: %s", config.relay_to_file, error)
                return None
            self.endpoint = endpoint
        if self.endpoint is not None and self.link is None:
            on_gpu = self.shard is not None and self.shard.device.type == "cuda"
            self.link = RowsLink(self.endpoint, device_rows=RING_ROWS if on_gpu else 0, relay_key=config.relay_key)
            if on_gpu and self.shard.supports_device_rows:
                self.shard.rows_out_on_device = True  # the fast step's rows stay on the device for the ring
        return self.endpoint

    def check_send_rows(self, request) -> None:
        """A FORWARD (or batch) with `send_rows` needs a next shard to send to, and rows to send."""
        if request.send_rows is not None:
            if self.target() is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'send_rows': this daemon was started without "
                                                           "--relay-to (or its --relay-to-file is not written), so it "
                                                           "has no next shard to send rows to")
            if self.shard.owns_head:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'send_rows': the head shard's output is ids, not rows")

    def send(self, request, hidden, wait, carried=None) -> None:
        """A one-sequence FORWARD's output rows to the next shard under its `send_rows` ticket, with `carried` (its
        `carry`'s feature rows [n, k * H], or None) as `send_batch` sends a batch's; RowsLost when they would leave
        through the host without their own rows (`wait`: the device wait its input rows came behind)."""
        lost = self._send([(request, hidden, carried)], request.send_rows, wait, one=True)
        if lost is not None:
            raise lost

    def send_batch(self, request, ran: list, wait) -> RowsLost | None:
        """A batched FORWARD's rows (`ran`: (item, hidden, carried) of each item that ran; carried: its `carry`'s
        feature rows [n, k * H], or None) to the next shard as one ROWS; the RowsLost to fail them with when they
        would leave through the host without their own rows."""
        return self._send(ran, request.send_rows, wait, one=False)

    def _send(self, ran: list, ticket: int, wait, one: bool) -> RowsLost | None:
        """The rows and carried rows of `ran` as one ROWS (`one`: a one-sequence ROWS): both through the next
        shard's device ring where they fit one slot together, the carried rows after every item's rows; else the
        rows there and the carried ones through the host; else all of it through the host."""
        width = ran[0][1].shape[1]
        carried = [c for _, _, c in ran]
        wrap = (lambda items: items[0]) if one else (lambda items: RowsBatch(id=0, items=tuple(items)))

        def in_slot(hosted):  # hosted: each item's carried rows on the host (None: they are in the slot)
            return lambda slot, gen: wrap([
                Rows(id=0, seq=item.seq, pos=item.pos, ticket=ticket, slot=slot, slot_rows=hidden.shape[0],
                     slot_gen=gen, carries=c is not None or None,
                     slot_carried=c.shape[1] // width if c is not None and hosted is None else None,
                     carried=None if hosted is None else hosted[i])
                for i, (item, hidden, c) in enumerate(ran)])

        hiddens = [hidden for _, hidden, _ in ran]
        together = [c.contiguous().view(-1, width) for c in carried if c is not None]
        ring = self.link.ring  # (opened by the first rows that try it)
        fits = bool(together) and ring is not None and ring.fits(hiddens + together)
        sent = fits and self._on_device(hiddens + together, in_slot(None), wait)
        if not sent:
            on_cpu = iter(on_host([c for c in carried if c is not None]))
            hosted = [None if c is None else WireTensor.from_torch(next(on_cpu)) for c in carried]
            # (a slot not let go of in time is not waited for twice)
            sent = not fits and self._on_device(hiddens, in_slot(hosted), wait)
        if not sent:
            if wait is not None and not wait.landed():  # the rows leave through the host: theirs must be real
                return RowsLost(wait.why())
            self.link.send(wrap([
                Rows(id=0, seq=item.seq, pos=item.pos, ticket=ticket, hidden=WireTensor.from_torch(hidden),
                     carried=c, carries=c is not None or None)
                for (item, _, _), hidden, c in zip(ran, on_host(hiddens), hosted)]))
        self.counters.rows_sent += 1
        return None

    def _on_device(self, parts: list, make_rows, wait=None) -> bool:
        """Rows to the next shard through its device ring (RowsLink.send_on_device); once the ring is refused for
        good, the fast step hands its rows to the host again (its own pinned buffer, as without a ring)."""
        if self.link.send_on_device(parts, make_rows, wait):
            return True
        if self.link.ring_problem is not None and self.shard.rows_out_on_device:
            self.shard.rows_out_on_device = False
        return False

    def refuse_downstream(self, request) -> None:
        """A FORWARD (or batch) with `send_rows` that did not run: the next shard's FORWARD of that ticket must not
        wait."""
        ticket = getattr(request, "send_rows", None)
        if ticket is not None and self.target() is not None:
            seq, pos = (request.items[0].seq, 0) if isinstance(request, Batch) else (request.seq, request.pos)
            self.link.send(Rows(id=0, seq=seq, pos=pos, ticket=ticket, refused=True))
            self.counters.rows_sent += 1

    # ---- the previous shard ----------------------------------------------------------------------

    def present(self, key: str, peer: Peer) -> None:
        """HELLO `relay_key`: with --relay-key, the connection that presents it is the previous shard's from now on
        (one that restarted presents it on its new connection); a wrong key is FORBIDDEN and changes nothing.
        Without --relay-key it changes nothing (every connection's ROWS are taken)."""
        if self.config.relay_key is None:
            return
        if peer.connection is None or not same_key(key, self.config.relay_key):
            self.counters.rows_forbidden += 1
            raise ProtocolError(ErrorCode.FORBIDDEN, "HELLO: relay_key is not this daemon's --relay-key; this "
                                                     "connection's ROWS are not taken")
        if peer.connection != self.upstream:
            log.info("rows from the previous shard: taken on the connection that presented the relay key")
        self.upstream = peer.connection

    def check_upstream(self, request, peer: Peer) -> None:
        """With --relay-key, only the previous shard's connection may send ROWS or RING: FORBIDDEN, changing
        nothing, for any other."""
        if self.config.relay_key is not None and (self.upstream is None or peer.connection != self.upstream):
            self.counters.rows_forbidden += 1
            raise ProtocolError(ErrorCode.FORBIDDEN, f"{request.type.value} is taken only from the previous shard "
                                                     "(the connection that presented this daemon's relay key in "
                                                     "HELLO); nothing changed")

    def rows_for(self, ticket: int):
        """The ROWS of `ticket` if it came (taken out of the inbox), else None."""
        rows = self.inbox.take(ticket)
        if rows is not None:
            self.counters.rows_received += 1
        return rows

    def park(self, request, peer: Peer) -> None:
        """`request` waits for its rows; the serving loop files it in the inbox under its connection."""
        self.parked = Waiting([], request, peer, time.monotonic() + self.config.rows_wait_s)

    def take_rows(self, request, peer: Peer):
        """ROWS from the previous shard: kept for its FORWARD; one already waiting runs now (its reply goes out
        after this one's acknowledgement)."""
        self.check_upstream(request, peer)
        if isinstance(request, RowsBatch) and len({item.ticket for item in request.items}) != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the items of a batched ROWS share one ticket")
        parts = request.items if isinstance(request, RowsBatch) else (request,)
        shard = layers_of(self.shard, request)
        nbytes = 0
        for part in parts:  # rows no FORWARD here could take are not kept
            if part.hidden is not None:
                if part.hidden.shape[1] != shard.config.hidden_size or part.hidden.dtype != dtype_name(shard.dtype):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"tensor 'hidden' of ROWS must be "
                                                               f"{dtype_name(shard.dtype)} [n, {shard.config.hidden_size}], "
                                                               f"got {part.hidden.dtype}{list(part.hidden.shape)}")
                nbytes += expected_nbytes(part.hidden.dtype, part.hidden.shape)
            if part.carried is not None:
                width = shard.config.hidden_size
                if part.carried.shape[1] % width or part.carried.dtype != dtype_name(shard.dtype):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"tensor 'carried' of ROWS must be "
                                                               f"{dtype_name(shard.dtype)} [n, k * {width}], got "
                                                               f"{part.carried.dtype}{list(part.carried.shape)}")
                nbytes += expected_nbytes(part.carried.dtype, part.carried.shape)
        sender = peer.link
        if any(part.slot is not None for part in parts):
            try:
                request = self._rows_from_ring(request, parts)
            except ProtocolError:  # the FORWARD waiting for these rows is refused too, now, changing nothing
                first = parts[0]
                self._keep(Rows(id=0, seq=first.seq, pos=first.pos, ticket=first.ticket, refused=True), sender)
                raise
        return {"ticket": request.ticket, "waited": self._keep(request, sender, nbytes)}, {}

    def _keep(self, rows, sender: bytes, nbytes: int = 0) -> bool:
        """`rows` (`nbytes` of them, from `sender`'s connection) into the inbox for their FORWARD; one already
        waiting runs now (whether one did)."""
        waiting = self.inbox.put(rows, sender, nbytes)
        if waiting is not None:
            self.completed.append(waiting.envelope + self.resume(waiting))
        return waiting is not None

    def missing(self, waiting: Waiting, why: str) -> list:
        """The reply of a FORWARD whose rows did not come (`why`); it changed nothing, and a next shard waiting
        for its rows is told."""
        request = waiting.request
        self.counters.rows_missing += 1
        self.refuse_downstream(request)
        return self.refusals.reply(request.id, request.type, ErrorCode.ROWS_MISSING,
                           f"no rows for ticket {request.rows_ticket}: {why}; nothing changed",
                           seq=getattr(request, "seq", None))  # a batch's wait is refused whole

    def _rows_from_ring(self, request, parts):
        """A ROWS naming a slot of this shard's device ring -> the ROWS as if its rows had come in tensor hidden,
        copied out of the slot behind the device wait (or, where the driver has no front-end wait, once a host
        poll saw them land); ProtocolError when they cannot be had."""
        slots = {part.slot for part in parts}
        total = sum((part.slot_rows or 0) * (1 + (part.slot_carried or 0)) for part in parts)
        problem = None
        if len(slots) != 1 or any(part.slot is None for part in parts):
            problem = "the items of a batched ROWS name one slot, all of them"
        elif self.ring is None:
            problem = "this shard has no device ring (no RING was answered since it started)"
        elif self.ring.broken is not None:
            problem = f"this shard's ring takes no slot rows until the next RING: {self.ring.broken}"
        elif slots.pop() >= len(self.ring.written) or total > self.ring.rows:
            problem = (f"slot {parts[0].slot} and {total} rows do not fit this shard's ring of "
                       f"{len(self.ring.written)} slots of {self.ring.rows} rows")
        wait = None
        if problem is None:
            if front_end_waits():
                if parts[0].slot_gen is None or any(part.slot_gen != parts[0].slot_gen for part in parts):
                    problem = "the device wait needs the slot's generation (field slot_gen, one for all items)"
                else:  # queued behind a wait kernel: nothing waits here (the outcome is read after the step)
                    rows, wait = self.ring.await_rows(parts[0].slot, total, parts[0].slot_gen,
                                                      self.config.rows_wait_s)
            else:
                try:
                    rows = self.ring.take(parts[0].slot, total, self.config.rows_wait_s)
                except RingUnavailable as error:
                    problem = str(error)
        if problem is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"ROWS of ticket {parts[0].ticket}: {problem}")
        self.counters.rows_on_device += 1
        self.counters.carried_on_device += any(part.slot_carried is not None for part in parts)
        done, start = [], 0
        after = sum(part.slot_rows for part in parts)  # the carried rows follow every item's rows
        for part in parts:
            n, k = part.slot_rows, part.slot_carried
            carried = part.carried
            if k is not None:  # k rows of H per row, as the sender viewed its [n, k * H]
                carried = DeviceRows(rows[after:after + n * k].view(n, k * rows.shape[1]), wait)
                after += n * k
            done.append(dataclasses.replace(part, hidden=DeviceRows(rows[start:start + n], wait), carried=carried,
                                            slot=None, slot_rows=None, slot_gen=None, slot_carried=None))
            start += n
        return dataclasses.replace(request, items=tuple(done)) if isinstance(request, RowsBatch) else done[0]

    def ring_for_writer(self, request, peer: Peer):
        """RING: the device ring the previous shard's ROWS may name slots of (allocated on the first, kept while
        its size is asked for), and its handles."""
        self.check_upstream(request, peer)
        shard = layers_of(self.shard, request)
        if self.config.max_gpu_memory:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "RING: this daemon runs under --max-gpu-memory, whose plan sets "
                                                       "no memory aside for a ring: rows come through the host")
        # a slot holds what was asked, at most RING_ROWS and a request's rows (the writer sends larger steps through
        # the host), and with a hosted drafter those rows' carried feature rows
        rows = min(request.rows, RING_ROWS, self.max_tokens_per_request) * (1 + self.carried_layers)
        if self.ring is None or self.ring.rows != rows:
            if self.ring is not None:
                self.ring.close()
            self.ring = None
            try:
                self.ring = DeviceRing(rows, shard.config.hidden_size, shard.dtype, shard.device)
            except RingUnavailable as error:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"RING: rows cannot pass on this shard's device: "
                                                           f"{error}") from None
            except torch.OutOfMemoryError:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"RING: no device memory for {rows} rows a slot") from None
            log.info("device ring for the previous shard: %d x %d rows (%.1f MiB)", len(self.ring.written),
                     self.ring.rows, self.ring.nbytes / 2**20)
        self.ring.new_writer(request.pid or None, request.gpu)
        log.info("rows from the previous shard (on %s GPU) are waited for on the %s", "this" if
                 self.ring.writer_shares_gpu else "another", self.ring_wait())
        return self.ring.share(), {}

    def ring_wait(self) -> str:
        """How this shard waits for rows in its ring: "device" (the GPU's front end) where the driver can, else "host"."""
        on_gpu = self.shard is not None and self.shard.device.type == "cuda"
        return "device" if on_gpu and front_end_waits() else "host"

    def describe(self) -> dict:
        """STATS `rows`."""
        c, link = self.counters, self.link
        return {"sent": c.rows_sent, "received": c.rows_received, "waits": c.rows_waits,
                "missing": c.rows_missing, "waiting": len(self.inbox.waiting), "parked": len(self.inbox.rows),
                "forbidden": c.rows_forbidden,
                "on_device": c.rows_on_device, "carried_on_device": c.carried_on_device,
                "sent_on_device": link.on_device if link is not None else 0,
                "ring_bytes": self.ring.nbytes if self.ring is not None else 0,
                "ring_wait": self.ring_wait() if self.ring is not None else None,
                "ring_to_next": "on" if link is not None and link.ring is not None else
                (link.ring_problem if link is not None else None)}

    def close(self) -> None:
        if self.link is not None:
            self.link.close()


def rows_go_on_device(request, hidden) -> bool:
    """Whether a step's output rows stay on the device for the next shard's ring (send_rows): then its device
    wait's outcome goes on with them (a poisoned flag) instead of being read here."""
    return getattr(request, "send_rows", None) is not None and hidden is not None and hidden.is_cuda


def check_landed(waits) -> None:
    """After a step behind device waits: RowsLost when one ended without its rows (the step ran on none)."""
    for wait in waits:
        if not wait.landed():
            raise RowsLost(wait.why())
