"""Greedy and speculative decoding over a `Target`.

The reference loop, one sequence at a time; production requests run in `coordinator.scheduler`, which shares its
commit rule (`coordinator.scheduler.commit`), request checks and recovery. Both keep the invariant documented in
`coordinator.scheduler.commit`: the target's state holds every committed token except the last one, `t0`, which is
the next input. Prefill forwards the whole prompt; its last output is the first generated token.

Speculative decoding must produce exactly the tokens greedy decoding produces, for every
drafter and rollback mode; only the number of target forwards changes.

The loop keeps every committed token, so when the target loses a sequence (a shard restarted,
`SequenceLost`) or cannot roll back fast (`RollbackFailed`), it re-fills the sequence from that
history and carries on: the output does not change.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

from coordinator.drafting.drafters import Drafter
from coordinator.relay.target import ReplayTarget, RollbackFailed, SequenceLost, Target
from coordinator.scheduler.commit import (
    commit_block, committed_ids, count_rollback, finished, keep_logprobs, last_row, record_commit,
)
from coordinator.scheduler.recovery import RECOVERY_TIMEOUT_S, recover
from coordinator.scheduler.requests import (
    STOP, DecodeResult, StopDecoding, check_prompt_fits, check_request, context_limit, room_left, sampled_keywords,
    step_keywords, with_drafts,
)
from protocol.layout import CHECKPOINT, REPLAY, ROLLBACK_MODES

OnCommit = Callable[[list[int]], None]
# One decoding step: (history, room, result) -> appends to history what it commits, at most room tokens.
Step = Callable[[list[int], int, "DecodeResult"], None]


def greedy_decode(
    target: Target,
    seq: int,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: Iterable[int] = (),
    on_commit: OnCommit | None = None,
    sampling=None,
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S,
) -> DecodeResult:
    """Plain greedy decoding: prefill, then one token per forward. With `sampling` (a
    `coordinator.sampling.Sampling` at temperature > 0) the head shard samples each token instead."""
    sampled = sampled_keywords(sampling)

    def step(history: list[int], room: int, result: DecodeResult) -> None:
        ids = target.forward(seq, len(history) - 1, [history[-1]], **step_keywords(sampled, history, result))
        (token,) = ids
        history.append(token)
        keep_logprobs(result, ids, 1)

    return _decode(target, seq, prompt, max_new_tokens, frozenset(eos_ids), on_commit, step, sampled,
                   recovery_timeout_s)


def speculative_decode(
    target: Target,
    seq: int,
    prompt: list[int],
    drafter: Drafter,
    *,
    block_size: int = 16,
    rollback: str = CHECKPOINT,
    max_new_tokens: int,
    eos_ids: Iterable[int] = (),
    on_commit: OnCommit | None = None,
    sampling=None,
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S,
) -> DecodeResult:
    """Draft `block_size - 1` tokens, verify `[t0, drafts]` in one forward, keep the
    agreeing prefix plus the target's own next token, roll the rest back.

    `rollback` says who rolls back: the shards ("checkpoint", "replay-ssm": the target as
    given), or the `replay` baseline (`ReplayTarget`: restore a snapshot, forward the kept
    tokens again). The step is the same for all three.

    With `sampling` the drafts travel to the head shard, which accepts each by speculative rejection
    sampling and answers a residual sample at the first rejection (never equal to its draft), so the
    "agreeing prefix" below is exactly the accepted drafts and the output follows plain sampling."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 to speculate, got {block_size}")
    if rollback not in ROLLBACK_MODES:
        raise ValueError(f"unknown rollback mode {rollback!r}; choose one of {', '.join(ROLLBACK_MODES)}")
    verifier = ReplayTarget(target) if rollback == REPLAY else target
    eos = frozenset(eos_ids)
    sampled = sampled_keywords(sampling)

    def step(history: list[int], room: int, result: DecodeResult) -> None:
        # Draft: a block of T tokens commits at most T, so never draft past the budget.
        wanted = min(block_size, room) - 1
        started = time.perf_counter()
        drafts = drafter.propose(history, wanted)
        result.draft_seconds += time.perf_counter() - started
        if len(drafts) != wanted:
            raise ValueError(f"drafter {drafter.name!r} proposed {len(drafts)} tokens, asked for {wanted}")
        # Verify [t0, d1 .. d_{T-1}] in one forward; the state holds history[:-1].
        block = [history[-1]] + drafts
        verified = verifier.forward(seq, len(history) - 1, block, checkpoint=True,
                                    **with_drafts(step_keywords(sampled, history, result), drafts))
        # Accept the longest agreeing prefix plus the target's own next token.
        keep = commit_block(result, history, drafts, verified, room, eos)
        # Roll the rejected rest of the block back.
        if keep < len(block):
            verifier.rollback(seq, keep)
            count_rollback(result, rollback)

    return _decode(verifier, seq, prompt, max_new_tokens, eos, on_commit, step, sampled, recovery_timeout_s)


def _decode(
    target: Target,
    seq: int,
    prompt: list[int],
    max_new_tokens: int,
    eos: frozenset[int],
    on_commit: OnCommit | None,
    step: Step,
    sampled: dict | None = None,
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S,
) -> DecodeResult:
    """Prefill, then `step(history, room, result)` until `max_new_tokens` or an EOS: a step appends
    what it commits to `history` (at most `room` tokens). When the target loses the sequence or
    cannot roll back, the state is re-filled from `history` and decoding carries on."""
    check_request(prompt, max_new_tokens)
    limit = context_limit(target)
    check_prompt_fits(prompt, limit)
    result = DecodeResult(prompt_tokens=len(prompt))
    if sampled and sampled["sampling"].logprobs is not None:
        result.logprobs = []
    if max_new_tokens == 0:
        return result
    start = time.perf_counter()
    with _open_sequence(target, seq):
        try:
            history = _prefill(target, seq, prompt, result, on_commit, sampled or {})
            start = time.perf_counter()
            while not finished(result.tokens, max_new_tokens, eos):
                # The context limit ends the request ("length"); near it the step's block shrinks.
                room = room_left(max_new_tokens, result.tokens, history, limit)
                if room <= 0:
                    break
                committed_before = len(history)
                try:
                    step(history, room, result)
                except (SequenceLost, RollbackFailed) as failure:
                    # `history` holds every commit, this step's too when only its rollback failed.
                    recover(target, seq, history, len(prompt), result, failure, recovery_timeout_s)
                if len(history) > committed_before:
                    _record(result, history[committed_before:], on_commit)
        except StopDecoding:
            result.finish_reason = STOP
        else:
            if result.tokens and result.tokens[-1] in eos:
                result.finish_reason = STOP
        result.decode_seconds = time.perf_counter() - start
    return result


@contextlib.contextmanager
def _open_sequence(target: Target, seq: int):
    """Open the sequence; close it afterwards, best effort when unwinding an error."""
    target.open(seq)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            target.close(seq)
        raise
    target.close(seq)


def _prefill(
    target: Target, seq: int, prompt: list[int], result: DecodeResult, on_commit: OnCommit | None, sampled: dict
) -> list[int]:
    start = time.perf_counter()
    outputs = target.forward(seq, 0, list(prompt), **step_keywords(sampled, list(prompt), result))
    result.prefill_seconds = time.perf_counter() - start
    if len(outputs) != len(prompt):
        raise RuntimeError(f"prefill of {len(prompt)} tokens returned {len(outputs)} ids")
    first = outputs[-1]
    if result.logprobs is not None:
        keep_logprobs(result, last_row(outputs), 1)
    result.tokens.append(first)
    if on_commit is not None:
        on_commit(committed_ids(result, [first]))
    return list(prompt) + [first]


def _record(result: DecodeResult, committed: list[int], on_commit: OnCommit | None) -> None:
    record_commit(result, committed)
    if on_commit is not None:
        on_commit(committed_ids(result, committed))


