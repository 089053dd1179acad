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

from common.endpoints import ipc_file, ipc_in_use



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
