"""Who owns a sequence when CurveZMQ is off: each connection gets an unguessable id at its handshake (a ZAP
handler for the NULL mechanism answers every handshake with a fresh random User-Id, which libzmq attaches to each
message of that connection), and a connection that presents its client's secret in HELLO (`owner`) takes that
client's sequences, so a coordinator that reconnects keeps them. A routing id, which any peer may present, decides
nothing (PROTOCOL.md, "Ownership")."""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections import OrderedDict

import zmq

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"shardd"


class ConnectionIds:
    """The ZAP handler of a daemon without Curve: accepts every handshake (the transport was checked at bind) and
    names its connection with 128 random bits."""

    def __init__(self, context: zmq.Context):
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)  # before the daemon's socket binds: no handshake goes unanswered
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="connection-ids", daemon=True)
        self.thread.start()  # the socket is the thread's from here on (a ZeroMQ socket is not thread-safe)

    def _serve(self) -> None:
        try:
            while not self.stopping.is_set():
                if not self.socket.poll(200):
                    continue
                request = self.socket.recv_multipart()
                version, request_id = request[0], request[1] if len(request) > 1 else b""
                self.socket.send_multipart([version, request_id, b"200", b"OK",
                                            secrets.token_hex(16).encode(), b""])
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            self.socket.close(linger=0)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=2.0)


class Owners:
    """Connection -> the owner its requests act as: itself, or the client whose secret it presented in HELLO. At
    most `capacity` claims are kept (the least recently used go first: such a connection acts as itself again, and
    its client's next HELLO claims its sequences back)."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self.claims: OrderedDict[bytes, bytes] = OrderedDict()

    def owner_of(self, connection: bytes) -> bytes:
        owner = self.claims.get(connection)
        if owner is None:
            return connection
        self.claims.move_to_end(connection)
        return owner

    def claim(self, connection: bytes, secret: str) -> None:
        """`connection` acts as the client holding `secret` from its next request on (kept as a digest only)."""
        self.claims[connection] = b"client:" + hashlib.sha256(secret.encode()).hexdigest().encode()
        self.claims.move_to_end(connection)
        while len(self.claims) > self.capacity:
            self.claims.popitem(last=False)
