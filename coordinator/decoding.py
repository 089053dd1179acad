"""Greedy and speculative decoding over a `Target`.

Both loops keep the invariant documented in `coordinator.acceptance`: the target's state
holds every committed token except the last one, `t0`, which is the next input. Prefill
forwards the whole prompt; its last output is the first generated token.

Speculative decoding must produce exactly the tokens greedy decoding produces, for every
drafter and rollback mode; only the number of target forwards changes.

The loop keeps every committed token, so when the target loses a sequence (a shard restarted,
`SequenceLost`) or cannot roll back fast (`RollbackFailed`), it re-fills the sequence from that
history and carries on: the output does not change.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from coordinator.acceptance import accept_length, commit_tokens
from coordinator.drafters import Drafter
from coordinator.sampling import TokenIds
from coordinator.target import ReplayTarget, RollbackFailed, SequenceLost, Target
from protocol import ErrorCode, RemoteError
from protocol.layout import CHECKPOINT, REPLAY, ROLLBACK_MODES

RECOVERY_TIMEOUT_S = 60.0  # how long a lost sequence is retried (a shard restarting, loading weights)
RETRY_INTERVAL_S = 0.25

STOP, LENGTH = "stop", "length"  # finish reasons, as the OpenAI API names them


class StopDecoding(Exception):
    """Raised by an `on_commit` callback to end the request after this commit (a stop string matched, the
    client went away): the sequence is closed normally and the result's finish_reason is "stop"."""

OnCommit = Callable[[list[int]], None]
# One decoding step: (history, room, result) -> appends to history what it commits, at most room tokens.
Step = Callable[[list[int], int, "DecodeResult"], None]


@dataclass
class DecodeResult:
    tokens: list[int] = field(default_factory=list)  # generated ids, prompt excluded
    prompt_tokens: int = 0
    steps: int = 0  # target forwards after prefill (verify steps when speculating)
    drafted: int = 0
    accepted: int = 0  # drafts the target agreed with, before any budget / EOS cut
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # of decode_seconds, in the drafter's propose (speculative decoding)
    rollbacks_fast: int = 0  # Target.rollback calls that succeeded
    rollbacks_fallback: int = 0  # RollbackFailed, state re-filled from history
    replays: int = 0  # replay mode: restore plus a forward of the kept tokens
    recoveries: int = 0  # SequenceLost (e.g. a restarted shard), state re-filled from history
    commits: list[int] = field(default_factory=list)  # tokens committed per step
    logprobs: list | None = None  # with sampling.logprobs: per token [logprob, [[id, logprob], ...top]]
    finish_reason: str = LENGTH  # "stop": an EOS or a StopDecoding; "length": max_new_tokens or the context limit

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def avg_commit(self) -> float | None:
        return sum(self.commits) / self.steps if self.steps else None

    @property
    def prefill_tok_s(self) -> float | None:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        # The first token comes from prefill, so decode speed counts the steps' commits.
        return sum(self.commits) / self.decode_seconds if self.decode_seconds > 0 else None

    def summary(self) -> dict:
        """One run as a flat dict, the input `benchstats.summarize_runs` expects."""
        return {
            "new_tokens": len(self.tokens),
            "prompt_tokens": self.prompt_tokens,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "avg_commit": self.avg_commit,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "wall_seconds": self.prefill_seconds + self.decode_seconds,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            "rollbacks_fast": self.rollbacks_fast,
            "rollbacks_fallback": self.rollbacks_fallback,
            "replays": self.replays,
            "recoveries": self.recoveries,
        }


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


def commit_block(result: DecodeResult, history: list[int], drafts: list[int], verified, room: int,
                 eos: frozenset[int]) -> int:
    """The commit rule of a verify step (the reference loop's and the scheduler's): the agreeing prefix of
    `drafts` plus the target's own next token, at most `room` and up to an EOS, appended to `history` and
    counted in `result`. Returns `keep`, the block rows to keep (len(drafts) + 1: nothing to roll back)."""
    committed, keep = commit_tokens(drafts, verified, room, eos)
    history.extend(committed)
    keep_logprobs(result, verified, len(committed))
    result.drafted += len(drafts)
    result.accepted += accept_length(drafts, verified)
    return keep


def count_rollback(result: DecodeResult, rollback: str) -> None:
    if rollback == REPLAY:
        result.replays += 1
    else:
        result.rollbacks_fast += 1


def record_commit(result: DecodeResult, committed: list[int]) -> None:
    """A step's commit into the result (the reference loop's and the scheduler's bookkeeping)."""
    result.steps += 1
    result.commits.append(len(committed))
    result.tokens.extend(committed)


def sampled_keywords(sampling) -> dict:
    """Extra forward keywords of a sampled request; none for plain greedy, so greedy calls stay as they were."""
    return {} if sampling is None or sampling.plain else {"sampling": sampling}


def step_keywords(sampled: dict, history: list[int], result: DecodeResult) -> dict:
    """The step's keywords: penalties see the prompt and the tokens generated so far (t0 included)."""
    if not sampled:
        return sampled
    prompt_len = result.prompt_tokens
    return {"sampling": sampled["sampling"].at(history[:prompt_len], history[prompt_len:])}


def keep_logprobs(result: DecodeResult, ids, committed: int) -> None:
    """The logprobs of the first `committed` answered rows, when the request asked for logprobs."""
    if result.logprobs is None:
        return
    rows = getattr(ids, "logprobs", None)
    if rows is None or len(rows) < committed:
        raise RuntimeError(f"the head shard answered {None if rows is None else len(rows)} logprob rows, "
                           f"{committed} tokens were committed")
    result.logprobs.extend(rows[:committed])


def with_drafts(sampled: dict, drafts: list[int]) -> dict:
    return {**sampled, "drafts": list(drafts)} if sampled else {}


def context_limit(target) -> int | None:
    """The most tokens (prompt and output) a sequence may hold on `target`, or None when it says nothing;
    wrappers (`ReplayTarget`, `FeatureCapture`) answer for what they wrap."""
    for _ in range(4):
        limit = getattr(target, "max_context", None)
        if isinstance(limit, int):
            return limit
        target = getattr(target, "target", None) or getattr(target, "pipeline", None)
        if target is None:
            return None
    return None


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


def check_prompt_fits(prompt: Sequence[int], limit: int | None) -> None:
    """ValueError when `prompt` leaves no room for output within the shards' context `limit` (None: no limit)."""
    if limit is not None and len(prompt) >= limit:
        raise ValueError(f"the prompt holds {len(prompt)} tokens; the shards hold {limit} per sequence, "
                         f"prompt and output together")


def room_left(max_new_tokens: int, generated: Sequence[int], history: Sequence[int], limit: int | None) -> int:
    """How many more tokens a request may commit: its budget, cut by the context `limit` (prompt and output)."""
    room = max_new_tokens - len(generated)
    return room if limit is None else min(room, limit - len(history))


def check_request(prompt: list[int], max_new_tokens: int) -> None:
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


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


def last_row(outputs) -> "TokenIds":
    last = TokenIds(outputs[-1:])
    rows = getattr(outputs, "logprobs", None)
    last.logprobs = rows[-1:] if rows else None
    return last


def committed_ids(result: DecodeResult, committed: list[int]) -> "TokenIds":
    """What on_commit gets: the committed ids, with their logprobs when the request asked for them."""
    ids = TokenIds(committed)
    if result.logprobs is not None:
        ids.logprobs = result.logprobs[len(result.logprobs) - len(committed):]
    return ids


def finished(tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> bool:
    return len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in eos)


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
