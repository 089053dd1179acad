"""How much one client may cost `shardctl serve`: the numbers, and the open-file limit they need.
`coordinator.serve.frontdoor` enforces them (kept apart so the CLI imports no web framework to show --help)."""

from __future__ import annotations

import resource
from dataclasses import dataclass

REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 4096
# The listen queue: a burst of thousands of connections must not overflow it (a dropped SYN costs a client 1 s).
# asyncio accepts up to this many per loop turn, but each accept only schedules its connection's setup.
ACCEPT_BACKLOG = 4096
MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 64  # a prompt of max_context token ids ("123456, ") or of text (JSON escapes) fits easily
# One request's share of the server, checked before it is admitted: its choices (`n`), their tokens together, and
# its stop strings, which are matched against each choice's new text at every step.
MAX_CHOICES = 128
MAX_CHOICE_TOKENS = 1 << 18
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
# `seed`: a 64-bit integer, as vLLM bounds it (a larger one would wrap onto a seed in range)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


def default_max_body_bytes(max_context: int) -> int:
    """A body that can hold a prompt of the whole context, as token ids or as text, with room for the rest."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_context)


@dataclass
class FrontDoorLimits:
    max_body_bytes: int = MIN_BODY_BYTES
    request_timeout_s: float = REQUEST_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


def raise_open_file_limit(wanted: int) -> int:
    """Raise this process's open-file limit towards `wanted` (up to the hard limit); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def connection_budget(max_connections: int, spare_files: int = 256) -> int:
    """Connections this process can hold: `max_connections`, or fewer where the open-file limit stays lower."""
    soft = raise_open_file_limit(max_connections + spare_files)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(16, min(max_connections, soft - spare_files))


