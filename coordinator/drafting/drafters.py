"""Drafters: guess the next tokens so the target can verify several at once.

A drafter never changes the output (the target decides every token); it only changes
how many tokens one verify step commits.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from coordinator.drafting.dflash import DFlashDrafterClient
from coordinator.relay.client import ShardClient
from coordinator.relay.pipeline import Pipeline

DRAFTERS = ("ngram", "oracle", "dflash")


@runtime_checkable
class Drafter(Protocol):
    """Proposes drafts from the token history. A drafter that reads the target's features as well (DFlash) also
    has `target`: the target every forward of its sequence must go through, capturing them."""

    name: str

    def propose(self, history: list[int], n: int) -> list[int]:
        """Exactly `n` guesses for the tokens after `history` (prompt + committed)."""


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix
    n-gram of the history and propose what followed it.

    The copy continues through its own output (like an LZ77 match), so a repeating
    pattern is proposed for the whole block. Without any match it repeats the last token.

    The earlier occurrences are kept in an index of every n-gram (per size: its latest start), extended by the
    tokens that are new since the last call while the history starts with the tokens indexed (a decode's,
    grown), else built again: a scan of the whole history per step would grow with every token, per stream, on
    the engine thread.
    tests/unit/test_drafters.py holds the scan the index is checked against.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # size -> n-gram -> its latest indexed start
        self._grams: dict[int, dict[tuple, int]] = {size: {} for size in range(min_ngram, max_ngram + 1)}
        self._seen: list[int] = []  # the tokens whose n-grams are indexed (a history that does not start with
                                    # them is indexed again)

    def propose(self, history: list[int], n: int) -> list[int]:
        if n <= 0:
            return []
        if not history:
            raise ValueError("cannot draft after an empty history")
        source = self._match_end(history)
        if source is None:
            return [history[-1]] * n
        length, drafts = len(history), []
        for index in range(source, source + n):  # through its own output past the history's end
            drafts.append(history[index] if index < length else drafts[index - length])
        return drafts

    def _match_end(self, history: list[int]) -> int | None:
        """Index just past the most recent earlier occurrence of the longest suffix (one that is not the
        suffix itself: it ends before the history's last token)."""
        length = len(history)
        self._index(history, length - 1)
        for size in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._grams[size].get(tuple(history[length - size:]))
            if start is not None:
                return start + size
        return None

    def _index(self, history: list[int], upto: int) -> None:
        """The n-grams inside history[:upto] indexed: those of the tokens new since the last call when the
        history starts with the tokens indexed before (a decode's, grown), all of them again otherwise."""
        seen = self._seen
        if not (len(seen) <= upto and history[:len(seen)] == seen):
            self._grams = {size: {} for size in range(self.min_ngram, self.max_ngram + 1)}
            seen.clear()
        for end in range(len(seen), upto):  # each n-gram ending at `end`, the later start kept
            for size, grams in self._grams.items():
                start = end - size + 1
                if start >= 0:
                    grams[tuple(history[start:end + 1])] = start
        seen.extend(history[len(seen):upto])


# Maps a seeded random generator to the number of correct drafts for one step.
AcceptProfile = Callable[[random.Random], int]


class OracleDrafter:
    """BENCHMARK drafter, not a real one: it is handed the target's greedy continuation
    and proposes it, then deliberately goes wrong on a seeded schedule so the number of
    accepted drafts per step follows `accept_profile`.

    It isolates the cost of the speculative machinery (verify width, rollback mode) from
    drafter quality. The schedule depends only on `seed` and the history length, so two
    runs over the same target see the same proposals.
    """

    name = "oracle (benchmark drafter)"

    def __init__(self, reference: list[int], prompt_len: int, accept_profile: AcceptProfile, seed: int = 0):
        self.reference = list(reference)
        self.prompt_len = prompt_len
        self.accept_profile = accept_profile
        self.seed = seed

    @classmethod
    def with_mean_commit(
        cls,
        reference: list[int],
        prompt_len: int,
        block_size: int = 16,
        mean_commit: float = 6.0,
        seed: int = 0,
    ) -> "OracleDrafter":
        """Tokens committed per full-width step average `mean_commit` (accepted drafts
        plus the bonus token), varying uniformly around it within [1, block_size]."""
        mean_correct = mean_commit - 1
        most = block_size - 1
        if not 0 <= mean_correct <= most:
            raise ValueError(f"mean_commit must be within [1, {block_size}], got {mean_commit}")
        # Symmetric around the mean so clipping to [0, most] never shifts it.
        spread = min(mean_correct, most - mean_correct)

        def profile(rng: random.Random) -> int:
            x = rng.uniform(mean_correct - spread, mean_correct + spread)
            whole = int(x)
            # Rounding up with probability frac(x) keeps the mean exact.
            return whole + (1 if rng.random() < x - whole else 0)

        return cls(reference, prompt_len, profile, seed)

    def propose(self, history: list[int], n: int) -> list[int]:
        if n <= 0:
            return []
        generated = len(history) - self.prompt_len
        if generated < 0:
            raise ValueError(f"history ({len(history)}) is shorter than the prompt ({self.prompt_len})")
        rng = random.Random((self.seed << 32) ^ len(history))
        correct = max(0, self.accept_profile(rng))
        truth = self.reference[generated:generated + n]
        filler = truth[-1] if truth else history[-1]
        truth += [filler] * (n - len(truth))
        if correct >= n:
            return truth
        wrong = 0 if truth[correct] != 0 else 1
        return truth[:correct] + [wrong] * (n - correct)


def make_drafter(
    name: str,
    *,
    prompt_len: int = 0,
    reference: list[int] | None = None,
    block_size: int = 16,
    mean_commit: float = 6.0,
    seed: int = 0,
    draft_client: ShardClient | None = None,
    pipeline: Pipeline | None = None,
) -> Drafter:
    """The drafter a CLI name stands for; each takes the arguments it needs and ignores the rest.

    "ngram": prompt lookup. "oracle": the benchmark drafter over `reference` (the target's own greedy
    continuation of a `prompt_len`-token prompt) committing `mean_commit` of `block_size` tokens per step
    on the schedule of `seed`. "dflash": the drafter hosted by the daemon behind `draft_client`, fed with
    the features `pipeline` captures: decode through its `.target`, not through `pipeline`."""
    if name == "ngram":
        return NgramDrafter()
    if name == "oracle":
        if reference is None:
            raise ValueError("the oracle drafter needs the target's greedy continuation (reference)")
        return OracleDrafter.with_mean_commit(reference, prompt_len, block_size, mean_commit, seed)
    if name == "dflash":
        if draft_client is None or pipeline is None:
            raise ValueError("the dflash drafter needs a drafter daemon's client and the pipeline it drafts for")
        return DFlashDrafterClient(draft_client, pipeline)
    raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
