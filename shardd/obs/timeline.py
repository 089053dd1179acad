"""Where a relay step's time goes across processes: a timeline of GPU stamps and host events (SHARDD_TIMELINE).

The phase clocks (protocol/timing.py) time what each process's host does; they cannot see when the GPU reached
a wait, when another process's rows landed, or how long the GPU sat between two processes' kernels. With
SHARDD_TIMELINE=N in a daemon's environment it keeps its last N GPU stamps (shardd/engine/kernels/stamp.py: the GPU's
%globaltimer when the stream reaches the stamp, one clock for every process on the GPU, so two daemons' stamps
on one GPU pair up directly) and its last N host events (time.time_ns()); STATS reports them (`timeline`).
Each stamp is a one-thread kernel on the step's stream (a few microseconds): a diagnostic, off by default,
costing one global read per mark when off. `scripts/bench_gpu.py --timeline` turns the two daemons' timelines
into `relay_timeline` (median intervals of a verify step).
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Optional

ENV = "SHARDD_TIMELINE"


class Timeline:
    """The last `capacity` GPU stamps (a ring of int64 on `device`, their labels here) and host events."""

    def __init__(self, device, capacity: int):
        import torch

        self.capacity = capacity
        self.stamps = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.labels: list = [None] * capacity
        self.count = 0  # stamps queued so far; the last `capacity` are kept
        self.host: deque = deque(maxlen=capacity)
        self.offset_ns = self._offset()

    def _offset(self) -> int:
        """GPU clock minus host clock (ns): of five stamps each taken between two host readings, the one with the
        shortest bracket (the stamp's launch and the synchronization around it bound the error)."""
        import torch

        best = None
        for _ in range(5):
            before = time.time_ns()
            self.gpu("calibrate")
            torch.cuda.current_stream(self.stamps.device).synchronize()
            after = time.time_ns()
            value = int(self.stamps[(self.count - 1) % self.capacity].item())
            if best is None or after - before < best[0]:
                best = (after - before, value - (before + after) // 2)
        return best[1]

    def gpu(self, label: str) -> None:
        from shardd.engine.kernels.stamp import stamp

        index = self.count % self.capacity
        self.labels[index] = label
        stamp(self.stamps, index)
        self.count += 1

    def host_event(self, label: str) -> None:
        self.host.append((label, time.time_ns()))

    def report(self) -> dict:
        """{"gpu": [[label, ns], ...] oldest first, "host": [[label, ns], ...], "offset_ns"} (GPU and host clocks;
        host + offset_ns is GPU time). Waits for the stamps queued so far."""
        import torch

        torch.cuda.current_stream(self.stamps.device).synchronize()
        values = self.stamps.tolist()
        first = max(0, self.count - self.capacity)
        gpu = [[self.labels[i % self.capacity], values[i % self.capacity]] for i in range(first, self.count)]
        return {"gpu": gpu, "host": [list(event) for event in self.host], "offset_ns": self.offset_ns}


TIMELINE: Optional[Timeline] = None  # the process's timeline, when SHARDD_TIMELINE turned it on


def capacity(device) -> Optional[int]:
    """The stamps SHARDD_TIMELINE asks `device`'s daemon to keep (None: off); ValueError for a value that is not a
    positive whole number, or a device with no GPU clock to stamp (`shardd serve` asks before loading weights)."""
    value = os.environ.get(ENV, "")
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{ENV}={value!r}: give the number of stamps to keep (a positive whole number)")
    if not str(device).startswith("cuda"):
        raise ValueError(f"{ENV} stamps a GPU's clock; this shard runs on {device} (unset it)")
    return int(value)


def start(device) -> Optional[Timeline]:
    """Turn the process's timeline on for `device` when SHARDD_TIMELINE asks for it (capacity)."""
    global TIMELINE
    stamps = capacity(device)
    if stamps is not None:
        TIMELINE = Timeline(device, stamps)
    return TIMELINE


def gpu(label: str) -> None:
    """A stamp on the current stream, when the timeline is on."""
    if TIMELINE is not None:
        TIMELINE.gpu(label)


def host(label: str, kind=None) -> None:
    """A host event, when the timeline is on; `kind` (a message type) is appended to the label only then, so the
    serving loop formats nothing with the timeline off."""
    if TIMELINE is not None:
        TIMELINE.host_event(label if kind is None else f"{label} {getattr(kind, 'value', kind)}")


def report() -> Optional[dict]:
    return None if TIMELINE is None else TIMELINE.report()
