"""Where a request's time goes, at both ends of the wire: always-on phase clocks.

A `PhaseClock` adds the nanoseconds between consecutive `lap(phase)` calls of one request to per (request
type, phase) totals. A lap costs one `time.perf_counter_ns()` and a list append (well under a microsecond),
so the daemon and the coordinator keep their clocks on in production; `totals()` is what STATS
(`phases`), the daemon's Prometheus metrics and `scripts/bench_gpu.py`'s `relay_by_phase` read.

Daemon phases (in order): receive, decode, lookup (sequence and request validation), launch (host inputs
to the device, the step's launch), wait (for the device; with rows in the device ring, also for them to
land), copy (device to host), compute (a handler's work outside the fast step), encode, send. Coordinator
phases: encode, send, wait, receive, decode.
"""

from __future__ import annotations

import time
from collections import Counter


class PhaseClock:
    def __init__(self) -> None:
        self.ns: Counter = Counter()  # (request type, phase) -> nanoseconds
        self.requests: Counter = Counter()  # request type -> requests timed
        self._laps: list[tuple[str, int]] = []
        self._last = 0
        self.active = False  # laps outside a request (a FastShard used without a daemon) are not kept

    def start(self) -> None:
        self._laps.clear()
        self.active = True
        self._last = time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        if self.active:
            now = time.perf_counter_ns()
            self._laps.append((phase, now - self._last))
            self._last = now

    def finish(self, request_type, *, count: bool = True) -> None:
        """Book the laps since start() under `request_type` (None: an undecodable request); `count` False: a part
        of the request only (a FORWARD that waits for its rows is counted when it is answered)."""
        self.book(request_type, count=count)
        self.active = False

    def book(self, request_type, *, count: bool = True) -> None:
        """Book the laps so far under `request_type` and go on timing (another request handled inside this one:
        the FORWARD a ROWS lets run)."""
        key = getattr(request_type, "value", request_type) or "UNDECODABLE"
        for phase, ns in self._laps:
            self.ns[(key, phase)] += ns
        if count:
            self.requests[key] += 1
        self._laps.clear()

    def add(self, request_type, phase: str, ns: int) -> None:
        """Book `ns` directly (an end with several requests in flight times each apart)."""
        self.ns[(getattr(request_type, "value", request_type), phase)] += ns

    def count(self, request_type) -> None:
        self.requests[getattr(request_type, "value", request_type)] += 1

    def totals(self) -> dict:
        """{type: {"requests": n, "seconds": {phase: total seconds}}} (JSON-ready)."""
        out: dict = {}
        for (mtype, phase), ns in list(self.ns.items()):
            entry = out.setdefault(mtype, {"requests": self.requests[mtype], "seconds": {}})
            entry["seconds"][phase] = ns / 1e9
        return out


# The daemon's process-wide clock: its serving loop starts and finishes it, the fast step laps inside it.
DAEMON = PhaseClock()


def per_request_ms(before: dict, after: dict) -> dict:
    """Two `totals()` readings -> {type: {"requests": n, phase: ms per request}} for what happened between."""
    out = {}
    for mtype, entry in after.items():
        old = before.get(mtype, {"requests": 0, "seconds": {}})
        n = entry["requests"] - old["requests"]
        if n <= 0:
            continue
        row = {"requests": n}
        for phase, seconds in entry["seconds"].items():
            row[phase] = round((seconds - old["seconds"].get(phase, 0.0)) * 1e3 / n, 4)
        out[mtype] = row
    return out
