"""How long an end polls its socket for the next message without sleeping (`--busy-poll-ms auto`): the daemons'
default, and the coordinator's rule for following its daemons. Torch-free: both sides use it."""

from __future__ import annotations

import os

# A daemon on a GPU host with cores to spare polls this long after each reply; the relay gains only when both ends
# poll (docs/performance.md), and on a small host polling takes the cores the daemons' own threads need.
AUTO_BUSY_POLL_MS = 20.0
AUTO_BUSY_POLL_CPUS = 8


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def follow_busy_poll(daemon_ms, cpus: int | None = None) -> float:
    """A coordinator's polling for `--busy-poll-ms auto`, in seconds: as long as its daemon polls (HELLO's
    `busy_poll_ms`) when this host has at least AUTO_BUSY_POLL_CPUS usable CPUs too, else 0."""
    if not isinstance(daemon_ms, (int, float)) or not 0 < daemon_ms <= 1000:
        return 0.0
    return daemon_ms / 1000 if (usable_cpus() if cpus is None else cpus) >= AUTO_BUSY_POLL_CPUS else 0.0
