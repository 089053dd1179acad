"""The device ring's host-side rules (shardd/server/ring.py) that run without a GPU: how a wait for a sender's rows ends
(its event happened, the time limit, or the sender's death), and how the sender's life is read."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from shardd.server.ring import pid_alive, wait_for_event


class _Event:
    """An event stand-in that happens at a given time (never: None)."""

    def __init__(self, at: float | None):
        self.at = at

    def query(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


def test_a_wait_ends_when_the_event_happens():
    started = time.monotonic()
    assert wait_for_event(_Event(started + 0.05), timeout_s=5)
    assert time.monotonic() - started < 2
    assert wait_for_event(_Event(0.0), timeout_s=0)  # already happened: no poll at all


def test_a_wait_ends_at_its_limit_when_nothing_happens():
    started = time.monotonic()
    assert not wait_for_event(_Event(None), timeout_s=0.2)
    assert 0.2 <= time.monotonic() - started < 2


def test_a_wait_ends_a_second_after_its_sender_is_seen_dead():
    """A killed sender's event never happens (scripts/probe_cuda_ipc.py shows it on a GPU); the wait ends
    about a second after the sender is seen gone, long before its limit."""
    started = time.monotonic()
    assert not wait_for_event(_Event(None), timeout_s=60, alive=lambda: False)
    assert 1.0 <= time.monotonic() - started < 5


def test_a_sender_s_life_is_read_from_its_pid():
    assert pid_alive(os.getpid())
    assert pid_alive(None) and pid_alive(0)  # unknown: only a known death ends a wait early
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    assert not pid_alive(child.pid)
