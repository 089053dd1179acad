"""systemd's notify protocol (sd_notify): a datagram to $NOTIFY_SOCKET; nothing when not under systemd."""

from __future__ import annotations

import os
import socket
import time


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


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings: half the WATCHDOG_USEC systemd gives (None when it asks for none)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):  # WATCHDOG_PID names the process meant (sd_watchdog_enabled)
        return None
    try:
        return int(usec) / 2e6 if int(usec) > 0 else None
    except ValueError:
        return None


class Watchdog:
    """WATCHDOG=1 from the serving loop: a loop that stops turning stops the pings, and systemd restarts it."""

    def __init__(self) -> None:
        self.interval = watchdog_interval()
        self.next_ping = 0.0

    def ping(self) -> None:
        if self.interval is None:
            return
        now = time.monotonic()
        if now >= self.next_ping:
            notify("WATCHDOG=1")
            self.next_ping = now + self.interval

    def poll_ms(self, longest_ms: int) -> int:
        """How long the loop may wait for a request before it must ping again."""
        if self.interval is None:
            return longest_ms
        return max(1, min(longest_ms, int((self.next_ping - time.monotonic()) * 1000)))


class Status:
    """STATUS= lines (shown by `systemctl status`), sent only when they change."""

    def __init__(self) -> None:
        self.text: str | None = None

    def set(self, text: str, *extra: str) -> None:
        if text != self.text or extra:
            self.text = text
            notify("\n".join([*extra, f"STATUS={text}"]))
