"""The daemon's listening socket, bound before anything slow happens (importing torch, loading weights), so a
port in use or an ipc:// path held by another daemon is a one-line error within a second.

Torch-free on purpose: `shardd serve` binds before it imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq

from common.endpoints import ipc_file, ipc_in_use, is_loopback
from protocol import Limits
from shardd.server.owners import ZAP_DOMAIN, ConnectionIds
from shardd.server.security import log_refused_handshakes, restrict_ipc_socket, start_authenticator



class BindError(RuntimeError):
    """The endpoint cannot be bound; the message says why in one line."""


@dataclass
class Listener:
    """A bound ROUTER socket. `endpoint` is what it actually got (`tcp://127.0.0.1:*` -> the port chosen)."""

    context: zmq.Context
    socket: zmq.Socket
    endpoint: str
    authenticator: object = None

    @property
    def ipc_path(self) -> Optional[str]:
        return ipc_file(self.endpoint)

    def close(self) -> None:
        self.socket.close(linger=1000)
        if self.authenticator is not None:
            self.authenticator.stop()
        path = self.ipc_path
        if path and os.path.exists(path):
            os.unlink(path)


def bind(endpoint: str, *, max_message_bytes: Optional[int] = None, configure=None) -> Listener:
    """Bind a ROUTER socket at `endpoint`. `configure(context, socket)` may set security options first
    (it returns an authenticator to stop on close, or None)."""
    path = ipc_file(endpoint)
    if path is not None:
        if not Path(path).parent.is_dir():
            raise BindError(f"cannot bind {endpoint}: directory {Path(path).parent} does not exist")
        if os.path.exists(path):
            # libzmq would silently unlink a live daemon's socket file and take its endpoint over.
            if ipc_in_use(path):
                raise BindError(f"cannot bind {endpoint}: another process is serving on {path} "
                                "(stop it first, or choose another path)")
            os.unlink(path)  # stale: left by a daemon that died without cleaning up
    context = zmq.Context.instance()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 1000)
    if max_message_bytes is not None:
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    authenticator = None
    try:
        if configure is not None:
            authenticator = configure(context, socket)
        socket.bind(endpoint)
    except zmq.ZMQError as error:
        socket.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        hint = " (another shardd or program holds that port; pick another, or tcp://127.0.0.1:* for any free one)" \
            if error.errno == zmq.EADDRINUSE else ""
        raise BindError(f"cannot bind {endpoint}: {error.strerror}{hint}") from None
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
    # With IPv6 enabled an IPv4 bind reports its IPv4-mapped form: report the address as it was asked for.
    if bound.startswith("tcp://[::ffff:") and not endpoint.startswith("tcp://["):
        address, _, port = bound[len("tcp://[::ffff:"):].partition("]:")
        bound = f"tcp://{address}:{port}"
    return Listener(context, socket, bound, authenticator)


def write_endpoint_file(path: str, endpoint: str) -> None:
    """Atomically, so a launcher polling for the file never reads half of it."""
    staging = f"{path}.tmp"
    with open(staging, "w") as f:
        f.write(endpoint + "\n")
    os.replace(staging, path)


MIN_FRAME_BYTES = 16 << 20  # small models still answer a modestly oversized frame with TOO_LARGE


def largest_frame_bytes(hidden_size: int, feature_size: int, max_tokens: int) -> int:
    """The frame limit: twice the largest tensor a valid request can carry (max_tokens rows of hidden
    states or of a hosted drafter's features, float32), so a slightly oversized one is still answered TOO_LARGE."""
    return max(MIN_FRAME_BYTES, 2 * max_tokens * max(hidden_size, feature_size) * 4)


def listen(config, max_frame_bytes: int) -> Listener:
    """Bind the daemon's ROUTER socket at `config.bind` (a ShardConfig; BindError says why not, in one line). A
    frame over `max_frame_bytes` (largest_frame_bytes) is refused by libzmq from its length prefix, before any
    memory is allocated for it, and the connection dropped (PROTOCOL.md, "Limits"); set at bind, so it holds for
    every connection."""
    max_bytes = max(max_frame_bytes, Limits().max_header_bytes)

    def configure(context, socket):
        socket.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT; IPv4 binds are unaffected
        # A client that reconnects under its routing id (after a freeze or a network blip) takes the id over from
        # the connection it left behind, instead of being ignored while that one lingers (PROTOCOL.md, "Liveness").
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        return configure_security(context, socket, config)

    listener = bind(config.bind, max_message_bytes=max_bytes, configure=configure)
    restrict_ipc_socket(listener.endpoint)
    return listener


def configure_security(context, socket, config):
    """Loopback and ipc:// binds need no keys (a ZAP handler only names each connection); any other TCP bind
    requires CurveZMQ keys and an allow-list."""
    if config.curve_secret_key is None:
        if not is_loopback(config.bind):
            raise SystemExit(
                f"refusing to bind {config.bind} without encryption: a non-loopback bind needs "
                "--curve-secret-key (from `shardd keygen`) and --curve-allow DIR of client public keys"
            )
        socket.zap_domain = ZAP_DOMAIN  # every connection gets an id of its own: sequences are owned by it
        return ConnectionIds(context)
    if config.curve_allow_dir is None:
        raise SystemExit("--curve-secret-key needs --curve-allow DIR (the client public keys allowed to connect)")
    import zmq.auth

    public, secret = zmq.auth.load_certificate(config.curve_secret_key)
    if secret is None:
        raise SystemExit(f"{config.curve_secret_key} holds no secret key")
    authenticator = start_authenticator(context, config.curve_allow_dir)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    log_refused_handshakes(socket)  # a client without keys is refused before ZAP: say so in the log
    return authenticator
