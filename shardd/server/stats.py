"""The daemon's counters: what STATS reports and the Prometheus collector (shardd/obs/metrics.py) reads."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Counters:
    requests: Counter = field(default_factory=Counter)  # by message type
    errors: Counter = field(default_factory=Counter)  # by error code
    errors_by_type: Counter = field(default_factory=Counter)  # by (message type, error code), for metrics
    forwards: int = 0
    captures: int = 0
    tokens_forwarded: int = 0
    captured_rows: int = 0
    checkpointed_steps: int = 0
    checkpoint_writes: int = 0  # per-token float32 states written into checkpoint buffers
    recurrence_log_tokens: int = 0  # per-token recurrence inputs logged (replay-ssm)
    rollbacks: Counter = field(default_factory=Counter)  # by mode
    rollbacks_by_keep: Counter = field(default_factory=Counter)
    snapshots: int = 0
    restores: int = 0
    sequences_opened: int = 0
    sequences_closed: int = 0
    sequences_failed: int = 0
    sequences_expired: int = 0  # closed by the idle lease (--sequence-idle-timeout)
    proposals: int = 0
    draft_tokens: int = 0
    proposals_in_reply: int = 0  # blocks proposed inside a CAPTURE reply (`propose`), no PROPOSE round trip
    proposal_failures: int = 0  # drafter calls after a verify that failed (the verifies stood; `proposal.error`)
    draft_context_rows: int = 0  # feature rows added to drafter contexts
    draft_crops: int = 0  # PROPOSEs that first dropped context rows of rolled-back tokens
    draft_rows_cropped: int = 0
    compute_seconds: Counter = field(default_factory=Counter)  # by message type
    batches: int = 0  # FORWARD/CAPTURE/ROLLBACK requests naming several sequences (`items`)
    batch_items: int = 0  # the sequences they named, refused ones included
    batch_rows: int = 0  # the token rows of their FORWARD/CAPTURE items
    rows_sent: int = 0  # ROWS sent to the next shard (`send_rows`), refusals included
    rows_received: int = 0  # ROWS taken from the previous shard
    rows_waits: int = 0  # FORWARDs that waited for their rows (`rows_ticket` before its ROWS)
    rows_missing: int = 0  # FORWARDs refused ROWS_MISSING: refused upstream, cancelled, or no rows in time
    rows_on_device: int = 0  # ROWS taken through this shard's device ring (RING)
    carried_on_device: int = 0  # of those, the ROWS whose carried feature rows came in the slot too
    rows_forbidden: int = 0  # ROWS, RING or relay keys refused FORBIDDEN: not from the previous shard (--relay-key)
