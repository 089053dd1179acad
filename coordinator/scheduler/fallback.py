"""A stream whose drafter fails decodes plainly, with the same output; a drafter daemon that timed out rests a while."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

from coordinator.relay.target import SequenceLost
from coordinator.scheduler.requests import Request

# A drafter daemon that timed out is not asked again for this long (its streams, and those admitted meanwhile,
# decode plainly); after it, new proposals try it again.
DRAFTER_RETRY_S = 60.0

log = logging.getLogger("shardctl")


class DrafterFallback:
    """The scheduler's asking of its streams' drafters: a block of drafts, or None and the stream decodes plainly."""

    def __init__(self, target) -> None:
        self.target = target  # the batch's target: where a stream without its drafter goes on
        self.down: dict[str, float] = {}  # a drafter daemon that timed out -> when to try it again
        self.reported: set = set()  # drafters whose failure was logged (one line each)

    def propose(self, request: Request, history: list[int], n: int) -> Optional[list[int]]:
        """The drafter's guesses; None when it failed (or failed for another stream and is not tried again yet),
        after which the request decodes plainly: a drafter never changes the output (greedy: the same tokens;
        sampled: the same distribution)."""
        drafter, endpoint = request.drafter, request.drafter_endpoint
        down = self.down.get(endpoint) if endpoint else None
        if down is not None and time.monotonic() < down:
            self.decode_plainly(request, close_drafter=False)
            return None
        try:
            return drafter.propose(history, n)
        except Exception as error:  # noqa: BLE001 - its stream decodes plainly, with the same output
            unreachable = isinstance(error, SequenceLost) and isinstance(error.__cause__, TimeoutError)
            if endpoint and unreachable:  # hung or gone: its other streams stop asking it too
                self.down[endpoint] = time.monotonic() + DRAFTER_RETRY_S
            if endpoint not in self.reported or not endpoint:
                self.reported.add(endpoint)
                where = f" at {endpoint}" if endpoint else ""
                log.warning("the %s drafter%s failed (%s: %s); its streams decode without drafts, output unchanged",
                            drafter.name, where, type(error).__name__, error)
            self.decode_plainly(request, close_drafter=not unreachable)
            return None

    def decode_plainly(self, request: Request, *, close_drafter: bool) -> None:
        """The request goes on without its drafter: its sequence on the batch's target as it stands (a sequence
        the drafter's daemon failed with it is re-filled like any lost one); a drafter that answers gets its own
        sequence closed (one that hangs is not asked again)."""
        drafter, feature_target = request.drafter, request.feature_target
        request.drafter, request.feature_target, request.target = None, None, self.target
        request.result.drafter_failed = True
        if feature_target is not None and close_drafter and request.seq is not None:
            with contextlib.suppress(Exception):
                drafter.closed(request.seq)
