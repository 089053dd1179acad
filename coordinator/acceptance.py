"""Greedy acceptance of a verified draft block.

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

from collections.abc import Iterable


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
) -> tuple[list[int], int]:
    """Tokens this step commits, and how many verify inputs stay in the state.

    committed = `d1 .. da` + bonus `y_a`, cut to `room` tokens and after the first EOS;
    keep = len(committed) (see the module invariant)."""
    if room < 0:
        raise ValueError(f"room must be >= 0, got {room}")
    accepted = accept_length(draft, verified)
    committed = (draft[:accepted] + [verified[accepted]])[:room]
    eos = set(eos_ids)
    for index, token in enumerate(committed):
        if token in eos:
            committed = committed[: index + 1]
            break
    return committed, len(committed)
