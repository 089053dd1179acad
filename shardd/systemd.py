"""systemd's notify protocol (sd_notify): a datagram to $NOTIFY_SOCKET; nothing when not under systemd."""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send e.g. 'READY=1' or 'STOPPING=1'. Returns whether a notify socket was there."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError:
            return False
    return True
