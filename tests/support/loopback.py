"""Test traffic stays on this machine's loopback. `offline_environment` turns the Hugging Face libraries'
downloads and telemetry off, and puts tests/support/site on PYTHONPATH, for the test process and every process a
test starts (they inherit the environment); `refuse_outside_connections`, which that directory's sitecustomize
runs in each of those Python processes, makes a connection to any address but loopback, or a name lookup of
anything but `localhost`, fail at once with an error naming it, so a library or a daemon that reaches out fails
the same way on every machine instead of waiting on whatever network that machine has."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from pathlib import Path

OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
           "DO_NOT_TRACK")
LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}
# what a server binds to; binding is not traffic, and a connection to it is refused by `_check_address`
BIND_ALL = {"", "0.0.0.0", "::"}
SITE = Path(__file__).resolve().parent / "site"  # its sitecustomize guards every Python process the tests start


def offline_environment(environ) -> None:
    for name in OFFLINE:
        environ[name] = "1"
    paths = [path for path in environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    if str(SITE) not in paths:
        environ["PYTHONPATH"] = os.pathsep.join([str(SITE), *paths])


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _check_name(host) -> None:
    name = host.decode() if isinstance(host, bytes) else host
    if name is None or name in BIND_ALL or name.lower() in LOCAL_NAMES or _is_loopback(name):
        return
    raise socket.gaierror(socket.EAI_NONAME, f"test traffic stays on loopback: refused to look up {name!r}")


def _check_address(family, address) -> None:
    if family not in (socket.AF_INET, socket.AF_INET6) or not isinstance(address, tuple):
        return  # AF_UNIX and friends stay on this machine
    host = address[0].decode() if isinstance(address[0], bytes) else address[0]
    if host.lower() not in LOCAL_NAMES and not _is_loopback(host):
        # refused as a closed port would be, so a library handles it as it handles one
        raise ConnectionRefusedError(errno.ECONNREFUSED,
                                     f"test traffic stays on loopback: refused to connect to {host}:{address[1]}")


def refuse_outside_connections() -> None:
    if getattr(socket, "_loopback_guard", False):
        return
    socket._loopback_guard = True

    def checked_lookup(lookup):
        def guarded(host, *args, **kwargs):
            _check_name(host)
            return lookup(host, *args, **kwargs)
        return guarded

    def checked_connect(connect):
        def guarded(self, address):
            _check_address(self.family, address)
            return connect(self, address)
        return guarded

    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex"):
        setattr(socket, name, checked_lookup(getattr(socket, name)))
    for name in ("connect", "connect_ex"):
        setattr(socket.socket, name, checked_connect(getattr(socket.socket, name)))
