"""The commit rule of a verify step and its bookkeeping, the scheduler's and the reference loop's
(coordinator.decoding).

State invariant of the decoding loop (kept after prefill and after every step):

    history = prompt + generated tokens (everything committed)
    the target's state holds exactly history[:-1]; its length is len(history) - 1
    t0 = history[-1] is the next verify input, not yet in the state

A step verifies `[t0, d1 .. d_{T-1}]` at `pos = len(history) - 1` and gets the argmax
outputs `y0 .. y_{T-1}` (y_i follows input i). With `a` leading drafts equal to the
target's own choice (d_i == y_{i-1}), the step commits `d1 .. da` and the bonus `y_a`.
After committing `c` tokens the state must hold `t0, d1 .. d_{c-1}` on top of what it
had: the first `c` verify inputs. So `keep == len(committed)`, whether or not the commit
was cut short by the token budget or an EOS (the last committed token is the next t0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional

from coordinator.sampling import TokenIds
from coordinator.scheduler.requests import DecodeResult
from protocol.layout import REPLAY


def accept_length(draft: list[int], verified: list[int]) -> int:
    """Number of leading drafts the target agrees with.

    `draft` is `d1 .. d_{T-1}`, `verified` is `y0 .. y_{T-1}` (one longer)."""
    if len(verified) != len(draft) + 1:
        raise ValueError(f"verify returned {len(verified)} ids for {len(draft)} drafts; expected {len(draft) + 1}")
    accepted = 0
    for drafted, expected in zip(draft, verified):
        if drafted != expected:
            break
        accepted += 1
    return accepted


def commit_tokens(
    draft: list[int],
    verified: list[int],
    room: int,
    eos_ids: Iterable[int] = (),
    cut: Optional[Callable[[list[int]], int]] = None,
) -> tuple[list[int], int]:
    """Tokens this step commits, and how many verify inputs stay in the state.

    committed = `d1 .. da` + bonus `y_a`, cut to `room` tokens, after the first EOS and to the first `cut(committed)`
    (a grammar's end: `coordinator.guided.Guide.commit`); keep = len(committed) (see the module invariant)."""
    if room < 0:
        raise ValueError(f"room must be >= 0, got {room}")
    accepted = accept_length(draft, verified)
    committed = (draft[:accepted] + [verified[accepted]])[:room]
    eos = set(eos_ids)
    for index, token in enumerate(committed):
        if token in eos:
            committed = committed[: index + 1]
            break
    if cut is not None:
        committed = committed[:cut(committed)]
    return committed, len(committed)


def commit_block(result: DecodeResult, history: list[int], drafts: list[int], verified, room: int,
                 eos: frozenset[int], cut: Optional[Callable[[list[int]], int]] = None) -> int:
    """The commit rule of a verify step (the reference loop's and the scheduler's): the agreeing prefix of
    `drafts` plus the target's own next token, at most `room`, up to an EOS and a grammar's end (`cut`), appended
    to `history` and counted in `result`. Returns `keep`, the block rows to keep (len(drafts) + 1: nothing to roll
    back)."""
    committed, keep = commit_tokens(drafts, verified, room, eos, cut)
    history.extend(committed)
    keep_logprobs(result, verified, len(committed))
    accepted = accept_length(drafts, verified)
    result.drafted += len(drafts)
    result.accepted += accepted
    result.rejected += accepted < len(drafts)
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


def keep_logprobs(result: DecodeResult, ids, committed: int) -> None:
    """The logprobs of the first `committed` answered rows, when the request asked for logprobs."""
    if result.logprobs is None:
        return
    rows = getattr(ids, "logprobs", None)
    if rows is None or len(rows) < committed:
        raise RuntimeError(f"the head shard answered {None if rows is None else len(rows)} logprob rows, "
                           f"{committed} tokens were committed")
    result.logprobs.extend(rows[:committed])


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
