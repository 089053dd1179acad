"""A request and what it comes to: `Request` (a prompt, its budget and sampling, its drafter, its place in the
scheduler), `DecodeResult` (the tokens and the step counts), and the checks and keywords of a request, the same for
the scheduler and the reference loop in `coordinator.decoding`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from coordinator.drafting.drafters import Drafter
from coordinator.scheduler.block_size import VerifyCost, acceptance_estimate, choose_block_size

STOP, LENGTH = "stop", "length"  # finish reasons, as the OpenAI API names them
QUEUED, PREFILL, DECODE, DONE = "queued", "prefill", "decode", "done"


class StopDecoding(Exception):
    """Raised by an `on_commit` callback to end the request after this commit (a stop string matched, the
    client went away): the sequence is closed normally and the result's finish_reason is "stop"."""


@dataclass
class DecodeResult:
    tokens: list[int] = field(default_factory=list)  # generated ids, prompt excluded
    prompt_tokens: int = 0
    steps: int = 0  # target forwards after prefill (verify steps when speculating)
    drafted: int = 0
    accepted: int = 0  # drafts the target agreed with, before any budget / EOS cut
    rejected: int = 0  # verify steps that ended at a draft the target disagreed with
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # of decode_seconds, in the drafter's propose (speculative decoding)
    rollbacks_fast: int = 0  # Target.rollback calls that succeeded
    rollbacks_fallback: int = 0  # RollbackFailed, state re-filled from history
    replays: int = 0  # replay mode: restore plus a forward of the kept tokens
    recoveries: int = 0  # SequenceLost (e.g. a restarted shard), state re-filled from history
    drafter_failed: bool = False  # the drafter failed and the request went on without drafts (same output)
    cached_tokens: int = 0  # prompt tokens resumed from the shards' prefix cache instead of forwarded
    commits: list[int] = field(default_factory=list)  # tokens committed per step
    logprobs: list | None = None  # with sampling.logprobs: per token [logprob, [[id, logprob], ...top]]
    # with prompt logprobs asked: per prompt token after the first [logprob, [[id, logprob], ...top], rank]
    prompt_logprobs: list | None = None
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


class Request:
    """One generation: a prompt, its budget and sampling, and, when speculating, its drafter.

    With `verify_cost` (`--block-size auto`) each verify block takes coordinator.scheduler.block_size's choice, at
    most `block_size` rows. With `guide` (constrained decoding) each answered row is masked to the tokens its grammar
    allows, and the request ends ("stop") when the grammar is complete.
    `on_commit(ids)` runs on the scheduler's thread as tokens commit (ids carry `.logprobs` when asked for);
    raising `StopDecoding` there ends the request after this commit. `on_finish(request)` runs once at the
    end, whether it finished, failed or was cancelled. `cancel()` may be called from any thread.
    With `prompt_logprobs` (top logprobs per position) the prefill also scores each prompt token after the first
    (`result.prompt_logprobs`, complete before the first commit); with it, `max_new_tokens` 0 prefills and ends."""

    def __init__(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        eos_ids: Iterable[int] = (),
        sampling=None,
        drafter: Optional[Drafter] = None,
        block_size: int = 16,
        verify_cost: Optional[VerifyCost] = None,
        on_commit: Optional[Callable[[list[int]], None]] = None,
        on_finish: Optional[Callable[["Request"], None]] = None,
        cache_salt: str = "",
        prompt_logprobs: Optional[int] = None,
        guide=None,
    ) -> None:
        check_request(list(prompt), max_new_tokens)
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {prompt_logprobs}")
        if drafter is not None and block_size < 2:
            raise ValueError(f"block_size must be >= 2 to speculate, got {block_size}")
        self.prompt = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(eos_ids)
        self.sampled = sampled_keywords(sampling)
        self.drafter = drafter
        # A drafter that reads the target's features (DFlash) names the target that opens, closes and re-fills its
        # sequence, so the drafter follows; its forwards go in the step's batch, prepared and collected by the drafter.
        self.feature_target = getattr(drafter, "target", None)
        # A drafter served by a daemon names it (`endpoint`): when it times out, every stream it drafts for stops
        # asking it for a while (coordinator.scheduler).
        self.drafter_endpoint = getattr(drafter, "endpoint", None)
        self.target = None  # what opens, closes and re-fills this request's sequence, chosen at admission
        self.block_size = block_size  # the verify block's rows; with `verify_cost` (--block-size auto) the most
        self.verify_cost = verify_cost
        # prefix caching (coordinator.scheduler.prefix): only prompts of the same salt share cached prefixes
        self.cache_salt = cache_salt
        self.prefix_digests: list[bytes] = []
        self.saving: dict[int, int] = {}  # prompt position -> the prefix entry its chunk's step saves
        self.on_commit = on_commit
        self.on_finish = on_finish
        self.guide = guide  # a coordinator.guided.Guide: the grammar its output keeps to (None: unconstrained)
        self.result = DecodeResult(prompt_tokens=len(self.prompt))
        if self.sampled and self.sampled["sampling"].logprobs is not None:
            self.result.logprobs = []
        self.prompt_logprobs = prompt_logprobs
        if prompt_logprobs is not None:
            self.result.prompt_logprobs = []
        self.state = QUEUED
        self.seq: Optional[int] = None
        self.history: list[int] = []  # prompt + committed, once prefilled
        self.prefilled = 0  # prompt tokens in the state
        self.error: Optional[BaseException] = None
        self.cancelled = False
        self.arrived = time.monotonic()
        self.queued_seconds: Optional[float] = None
        self.last_step = -1  # the step this request last had rows in (fairness when rows run short)
        self.done = threading.Event()
        self._started = 0.0

    def cancel(self) -> None:
        self.cancelled = True

    def outcome(self) -> DecodeResult:
        """The result once done; the request's error raised."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result

    def room(self, limit: Optional[int]) -> int:
        """Tokens this request may still commit: its budget, and the context the shards hold."""
        return room_left(self.max_new_tokens, self.result.tokens, self.history, limit)

    def rows_wanted(self, limit: Optional[int]) -> int:
        if self.drafter is None:
            return 1
        return min(self.next_block_size(), self.room(limit))

    def next_block_size(self) -> int:
        """The rows of this request's next verify block: `block_size`, or with a `verify_cost` the one with the most
        expected tokens per byte moved at this sequence's acceptance rate so far."""
        if self.verify_cost is None:
            return self.block_size
        acceptance = acceptance_estimate(self.result.accepted, self.result.rejected)
        return choose_block_size(self.verify_cost, acceptance, self.block_size)


def check_request(prompt: list[int], max_new_tokens: int) -> None:
    if not prompt:
        raise ValueError("prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def check_prompt_fits(prompt: Sequence[int], limit: int | None) -> None:
    """ValueError when `prompt` leaves no room for output within the shards' context `limit` (None: no limit)."""
    if limit is not None and len(prompt) >= limit:
        raise ValueError(f"the prompt holds {len(prompt)} tokens; the shards hold {limit} per sequence, "
                         f"prompt and output together")


def room_left(max_new_tokens: int, generated: Sequence[int], history: Sequence[int], limit: int | None) -> int:
    """How many more tokens a request may commit: its budget, cut by the context `limit` (prompt and output)."""
    room = max_new_tokens - len(generated)
    return room if limit is None else min(room, limit - len(history))


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


def sampled_keywords(sampling) -> dict:
    """Extra forward keywords of a sampled request; none for plain greedy, so greedy calls stay as they were."""
    return {} if sampling is None or sampling.plain else {"sampling": sampling}


def step_keywords(sampled: dict, history: list[int], result: DecodeResult) -> dict:
    """The step's keywords: penalties see the prompt and the tokens generated so far (t0 included)."""
    if not sampled:
        return sampled
    prompt_len = result.prompt_tokens
    return {"sampling": sampled["sampling"].at(history[:prompt_len], history[prompt_len:])}


def with_drafts(sampled: dict, drafts: list[int]) -> dict:
    return {**sampled, "drafts": list(drafts)} if sampled else {}
