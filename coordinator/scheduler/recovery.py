"""Re-filling a sequence from its committed history: after a shard restarted (`SequenceLost`) or could not roll
back fast (`RollbackFailed`), the same state is built again and decoding carries on with the same output."""

from __future__ import annotations

import contextlib
import time

from coordinator.relay.target import RollbackFailed, SequenceLost, Target
from coordinator.scheduler.requests import DecodeResult
from protocol import ErrorCode, RemoteError

RECOVERY_TIMEOUT_S = 60.0  # how long a lost sequence is retried (a shard restarting, loading weights)
RETRY_INTERVAL_S = 0.25


class RecoveryFailed(SequenceLost):
    """The sequence could not be re-filled within the recovery timeout; the message says why."""


def _refill(target: Target, seq: int, history: list[int], prompt_len: int, prompt_chunk: int | None = None) -> None:
    """Forward the committed history (everything but t0) the way it went the first time: the prompt as one
    prefill (or in the chunks of `prompt_chunk` tokens the scheduler prefilled it in), the generated tokens in
    steps of at most the target's `step_rows`. A shard serving the fixed-shape GPU step computes a token the
    same way in any step of at most that many rows, but a prefill rounds differently in bf16, so this
    re-builds exactly the state that decoding had built."""
    chunk = prompt_chunk or prompt_len
    for start in range(0, prompt_len, chunk):
        target.forward(seq, start, history[start : min(start + chunk, prompt_len)])
    generated = history[prompt_len:-1]
    rows = getattr(target, "step_rows", None) or max(len(generated), 1)
    for start in range(0, len(generated), rows):
        target.forward(seq, prompt_len + start, generated[start : start + rows])


def recover(
    target: Target, seq: int, history: list[int], prompt_len: int, result: DecodeResult,
    failure: SequenceLost | RollbackFailed,
    timeout_s: float = RECOVERY_TIMEOUT_S,
    prompt_chunk: int | None = None,
) -> None:
    """Rebuild the state from the committed history and count why: a rollback
    the target could not do fast, or a sequence it lost (a restarted shard or drafter daemon). A shard
    that is down is retried every RETRY_INTERVAL_S (each try fails within the client's liveness
    timeout) and re-filled as soon as it answers; after `timeout_s` the last reason is raised."""
    started = time.monotonic()
    while True:
        try:
            with contextlib.suppress(Exception):  # the sequence may be gone from some shards already
                target.close(seq)
            target.open(seq)  # a Pipeline checks first that every shard is the one the sequence started on
            _refill(target, seq, history, prompt_len, prompt_chunk)
            break
        except (SequenceLost, RemoteError) as error:
            if isinstance(error, RemoteError) and error.code is not ErrorCode.SEQUENCE_EXISTS:
                raise
            # SEQUENCE_EXISTS: a shard frozen while the sequence was closed holds it still; close it again
            waited = time.monotonic() - started
            if waited + RETRY_INTERVAL_S >= timeout_s:
                raise RecoveryFailed(
                    f"gave up re-filling sequence {seq} after {waited:.1f} s: {error.__cause__ or error}"
                ) from None
            time.sleep(RETRY_INTERVAL_S)
    if isinstance(failure, RollbackFailed):
        result.rollbacks_fallback += 1
    else:
        result.recoveries += 1
