"""Whether a shard daemon is there at all, apart from how long its compute takes.

ZeroMQ heartbeats (ZMTP PING/PONG) are answered by the daemon's libzmq I/O thread, also while its
Python thread computes a long prefill. A killed daemon closes the connection at once; a stopped or
unreachable one stops answering PINGs and libzmq drops the connection after the heartbeat timeout.
`ConnectionWatch` turns libzmq's socket events into "is a handshake-complete connection up" and
"did the connection drop since this request went out", so a client fails a request within seconds of
the shard going away instead of waiting out the compute timeout (PROTOCOL.md, "Liveness").
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

HEARTBEAT_INTERVAL_S = 1.0  # a PING this often on an idle connection
LIVENESS_TIMEOUT_S = 5.0  # no PONG (or no connection) for this long: the shard is down

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def enable_heartbeats(socket: zmq.Socket, liveness_timeout_s: float) -> None:
    interval = min(HEARTBEAT_INTERVAL_S, liveness_timeout_s / 3)
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(interval * 1000)))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(liveness_timeout_s * 1000)))
    # A connection attempt to a stopped process completes in the kernel; without a greeting it is dropped.
    socket.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(liveness_timeout_s * 1000)))


class ConnectionWatch:
    """libzmq's connection events of one connecting socket, read without blocking."""

    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        self.monitor = socket.get_monitor_socket(_EVENTS)
        self.up = False
        self.drops = 0  # connections lost since the socket was made

    def update(self) -> None:
        """Read every pending event."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.up = False
                self.drops += 1

    def close(self) -> None:
        if not self.monitor.closed:
            self._socket.disable_monitor()
            self.monitor.close(linger=0)
