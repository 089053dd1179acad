"""What an endpoint string says, without a socket of our own: whether it is well formed, its ipc:// path, whether
a live process serves that path, and whether it stays on this host. Torch- and zmq-free: both the daemon and
shardctl check endpoints before anything slow happens."""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import Optional


def endpoint_problem(endpoint: str) -> Optional[str]:
    """What is wrong with an endpoint as written (no scheme, a port out of range), or None. libzmq itself
    would take `tcp://H:99999` as some other port and read `H:P` as a host name."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        guess = f"ipc://{endpoint}" if endpoint.startswith("/") else f"tcp://{endpoint}"
        return f"{endpoint!r} has no transport: write tcp://HOST:PORT or ipc:///PATH (did you mean {guess}?)"
    if scheme == "ipc":
        return None if rest else f"{endpoint!r} names no socket path (ipc:///PATH)"
    if scheme != "tcp":
        return f"{endpoint!r}: unsupported transport {scheme!r}; use tcp:// or ipc://"
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return f"{endpoint!r} names no port: write tcp://HOST:PORT (PORT 1-65535, or * for a free one)"
    if port == "*":
        return None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{endpoint!r}: port {port!r} is not a port number (1-65535, or * for a free one)"
    return None


def ipc_file(endpoint: str) -> Optional[str]:
    """The filesystem path of an ipc:// endpoint (None for other transports and abstract sockets)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return path if path and not path.startswith("@") and path != "*" else None


def ipc_in_use(path: str) -> bool:
    """Whether a live process accepts connections on this unix socket path (a stale file refuses them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError as error:
            if error.errno in (errno.ENOTSOCK, errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise
    return True


def tcp_host(endpoint: str) -> str | None:
    """`tcp://HOST:PORT` -> HOST (brackets of an IPv6 literal removed); None for other transports."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def is_loopback(endpoint: str) -> bool:
    """True for ipc:// and inproc://, and for a TCP host whose every resolved address is loopback:
    a name that only looks local (`127.evil.example`) is judged by what it resolves to."""
    if endpoint.startswith("ipc://") or endpoint.startswith("inproc://"):
        return True
    host = tcp_host(endpoint)
    if not host:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)
