"""The daemon's serving loop: the ROUTER socket, polling (busy for --busy-poll-ms after a reply), signals, the
systemd watchdog and status, the idle lease's sweep, and the FORWARDs parked waiting for their rows."""

from __future__ import annotations

import gc
import logging
import os
import signal
import time

import zmq

from protocol import peek_id, peek_type
from protocol.timing import DAEMON as PHASES
from shardd.obs import timeline
from shardd.server import systemd
from shardd.server.listen import listen
from shardd.server.peer import Peer
from shardd.server.receive import receive_request, release_memory
from shardd.server.security import is_file_ipc

log = logging.getLogger("shardd")


def serve_loop(daemon, listener=None) -> None:
    """Serve `daemon` (a ShardDaemon) until it stops, on `listener` (bound early by `shardd serve`) or a socket
    bound now."""
    config = daemon.config
    listener = listener if listener is not None else listen(config, daemon.limits.max_frame_bytes)
    socket = listener.socket
    curve = config.curve_secret_key is not None
    trusted_transport = curve or is_file_ipc(config.bind)
    relay = daemon.relay
    next_sweep = busy_until = time.monotonic()
    relay.target()  # the link to the next shard, where it is known already
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)

    def stop(signum, frame):
        log.info("signal %s: stopping", signal.Signals(signum).name)
        daemon.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    timeline.start(daemon.device)  # SHARDD_TIMELINE (checked by `shardd serve` before loading): reported in STATS
    watchdog, status = systemd.Watchdog(), systemd.Status()
    status.set(daemon.status_line(listener.endpoint), "READY=1")
    log.info("ready: serving on %s", listener.endpoint)
    _freeze_heap()
    # SHARDD_PROFILE=DIR: the serving loop runs under cProfile, written to DIR/shardd-PID.prof on stop
    # (a host-side profile where no sampling profiler is installed; it slows every request down)
    profile_dir = os.environ.get("SHARDD_PROFILE")
    profiler = None
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        while not daemon.stopping:
            watchdog.ping()
            status.set(daemon.status_line(listener.endpoint))
            if time.monotonic() >= next_sweep:
                daemon.sequences.expire_idle()
                next_sweep = time.monotonic() + 1.0
            for waiting in relay.inbox.expired(time.monotonic()):
                socket.send_multipart(waiting.envelope + relay.missing(
                    waiting, f"none came within {config.rows_wait_s:g} s"), copy=False)
            if not _next_request(daemon, poller, watchdog.poll_ms(100), busy_until):
                continue
            PHASES.start()
            received = receive_request(socket)  # frame by frame: no more frames held than the type allows
            envelope, body = received.envelope, received.body
            if not body:
                PHASES.active = False
                continue  # an identity with nothing after it: nothing to answer
            PHASES.lap("receive")
            timeline.host("receive")
            if curve:  # the authenticated key outlives a reconnect
                peer = Peer(b"curve:" + body[0].get("User-Id").encode(), trusted_transport)
            else:  # the connection's id from the handshake (owners.ConnectionIds): no peer can present another's
                connection = b"connection:" + body[0].get("User-Id").encode()
                peer = Peer(daemon.owners.owner_of(connection), trusted_transport, connection)
            if received.refusal is not None:
                def reply():
                    code = received.refusal_code(daemon.limits.max_frames)
                    return daemon.refusals.reply(peek_id(body), peek_type(body), code, received.refusal,
                                                 seq=None), None
                release_memory()
            else:
                def reply():
                    return daemon.handle_from(body, peer)
            frames, mtype, parked = answer(daemon, envelope, peer, reply)
            for message in frames:
                socket.send_multipart(message, copy=False)
            PHASES.lap("send")
            timeline.host("sent", mtype)
            # a FORWARD that now waits for its rows is counted when it is answered (Relay.resume)
            PHASES.finish(mtype, count=not parked)
            busy_until = time.monotonic() + config.busy_poll_s
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"shardd-{os.getpid()}.prof"))
        systemd.notify("STOPPING=1")
        relay.close()
        listener.close()
        log.info("stopped: %d sequences were open", len(daemon.sequences))


def answer(daemon, envelope: list, peer: Peer, reply) -> tuple[list[list], object, bool]:
    """Every message one request of `peer` sends, in order: first the refusal of a FORWARD of its connection
    still waiting for its rows (its connection has moved on: PROTOCOL.md, "Rows from shard to shard"), then
    its own reply (`reply()`: its frames and type; none while it waits for its rows), then the replies of the
    FORWARDs its rows let run. Also the request's type, and whether it now waits for its rows."""
    relay = daemon.relay
    out = []
    waiting = relay.inbox.cancel(peer.link)
    if waiting is not None:
        out.append(waiting.envelope + relay.missing(waiting, "a later request of its connection came first"))
    frames, mtype = reply()
    parked = frames is None
    if parked:
        waiting, relay.parked = relay.parked, None
        waiting.envelope = envelope
        relay.inbox.wait(waiting)
        daemon.counters.rows_waits += 1
    else:
        out.append(envelope + frames)
    out += relay.completed
    relay.completed = []
    return out, mtype, parked


def _next_request(daemon, poller, timeout_ms: int, busy_until: float) -> bool:
    """Whether a request is waiting: polled without sleeping until `busy_until` (--busy-poll-ms after the last
    reply: the next request of a decode is usually milliseconds away, and a sleeping process wakes late on a
    loaded host), then waited for up to `timeout_ms`."""
    while not daemon.stopping and time.monotonic() < busy_until:
        if poller.poll(0):  # the loop's one poller (socket.poll builds a Poller per call)
            return True
    return bool(poller.poll(timeout_ms))


def _freeze_heap() -> None:
    """Everything loaded so far (torch, triton, the model) lives as long as the daemon: out of the garbage
    collector's sight, so no full collection walks it between two requests. (A function of its own, so that a
    profile of the serving loop can leave this one collection out.)"""
    gc.collect()
    gc.freeze()
