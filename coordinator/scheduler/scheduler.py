"""Continuous batching: many requests share each step of the target, as vLLM's and SGLang's schedulers do.

Every step the scheduler decides which sequences run and how many rows each gets (one decode token, a
speculative block of `[t0, drafts]`, or a chunk of a prompt), sends them to the target as one
`forward_batch`, commits each sequence's answer with the same rule as `coordinator.decoding`, and sends the
step's rollbacks as one `rollback_batch`. Requests join and leave only between steps.

Rules, in the order a step applies them:

- A cancelled request's sequence is closed; new requests are admitted in arrival order while fewer than
  `max_sequences` run (the shards' limit); the rest wait in the queue.
- A step holds at most `batch_rows` rows (default: the shards' fixed step, at least DEFAULT_BATCH_ROWS). Running
  streams (decode and verify rows) go first, those that waited longest ahead; then prompt chunks, in admission
  order, while they fit. A prompt whose chunk found no room goes first the next step, so a long prompt and
  running streams both advance.
- A prompt is prefilled in chunks of `prefill_chunk` tokens at fixed positions (0, C, 2C, ...): where a
  chunk boundary falls never depends on the other requests, and each row's result is the same whichever rows
  shared its step (the fixed-shape step), so every request's tokens equal the same request run alone.
- Each request samples with its own settings on the head shard and has its own drafter and rollback; a
  failure of one request's item (its SequenceLost, a bad input) is handled for that request alone: it is
  re-filled from its committed history (`coordinator.scheduler.recovery`), or it fails, and the others go on.

Micro-batches: over N shards that pass the rows from shard to shard, the running streams go in up to
`pipeline_groups` groups (default 1; one per shard is the intent), each its own step in flight (`Pipeline.start_forward_batch`), so
while shard k computes one group's step shard k-1 computes the next group's. A step's streams are those not in flight,
at most an equal share of the running ones; prompt chunks join as they join a step. A group's answer is read, committed
and rolled back, and its next step started, while the other groups' steps are in the shards; rows never depend on
who shares their step, so a stream's tokens are the same whatever its group.

The commit rule and its bookkeeping (`coordinator.scheduler.commit`) and the recovery are the same functions the
reference loop in `coordinator.decoding` calls.
The `replay` baseline runs batched too (`batches.ReplayBatches`: snapshots, then the step; restores, then the kept
tokens again as one more batch). A drafter that reads the target's features (DFlash) is a batch stream like the
others: its drafter `prepare`s each of its forwards as a capture item of the step's batch (the head shard
proposing the next block in its reply where it hosts the drafter) and `collect`s the rows and the proposal from
the answer; its rollback goes in the step's rollback batch. Its sequence is opened, closed and re-filled through
the drafter's `target`, so the drafter's context follows. A re-fill (`recover`) runs inside the step, so the
other streams wait for it, and their tokens stay the same.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Optional

from coordinator.relay.pipeline import BatchForward
from coordinator.relay.target import ReplayTarget, RollbackFailed, SequenceLost
from coordinator.scheduler.batches import Answered, LoopBatches, ReplayBatches
from coordinator.scheduler.commit import (
    commit_block, committed_ids, count_rollback, finished, keep_logprobs, last_row, record_commit,
)
from coordinator.scheduler.fallback import DRAFTER_RETRY_S, log  # noqa: F401 - still importable from here
from coordinator.scheduler.fallback import DrafterFallback
from coordinator.scheduler.prefix import PrefixIndex, open_sequence
from coordinator.scheduler.recovery import RECOVERY_TIMEOUT_S, recover
from coordinator.scheduler.requests import (
    DECODE, DONE, LENGTH, PREFILL, STOP, DecodeResult, Request, StopDecoding, check_prompt_fits, context_limit,
    step_keywords, with_drafts,
)
from coordinator.scheduler.sizing import DEFAULT_BATCH_ROWS, PREFIX_CHUNK, default_prefill_chunk, shard_capacity
from protocol.layout import CHECKPOINT, REPLAY, ROLLBACK_MODES


@dataclass
class StepReport:
    """What one step ran: the metrics' input."""

    rows: int = 0  # tokens forwarded (decode, verify and prompt rows)
    sequences: int = 0  # sequences with rows in the step
    prefill_rows: int = 0
    queued: int = 0  # requests still waiting for admission after the step
    running: int = 0


@dataclass
class _Item:
    request: Request
    kind: str  # PREFILL or DECODE
    forward: BatchForward
    drafts: Optional[list[int]] = None
    room: int = 0


@dataclass
class _Group:
    """A step in flight: its items, what went to the target for each, and the target's handle on the answer."""

    items: list[_Item]
    forwards: list[BatchForward]
    answer: object  # `result()` -> per item its ids or its exception


class Scheduler:
    """Continuous batching over `target` (a `Pipeline`, a `LocalTarget`: anything with `forward_batch` and
    `rollback_batch`, else their loop). Owned by one thread: `submit` and `Request.cancel` are the only calls
    other threads make; `step` / `run` belong to the owner."""

    def __init__(
        self,
        target,
        *,
        max_sequences: int,
        batch_rows: Optional[int] = None,
        prefill_chunk: Optional[int] = None,
        rollback: str = CHECKPOINT,
        recovery_timeout_s: float = RECOVERY_TIMEOUT_S,
        on_step: Optional[Callable[[StepReport], None]] = None,
        pipeline_groups: Optional[int] = None,
        prefix_caching: bool = True,
    ) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        if rollback not in ROLLBACK_MODES:
            raise ValueError(f"unknown rollback mode {rollback!r}; choose one of {', '.join(ROLLBACK_MODES)}")
        self.target = ReplayTarget(target) if rollback == REPLAY else target
        self.rollback = rollback
        batched = hasattr(target, "forward_batch") and hasattr(target, "rollback_batch")
        self.batches = target if batched else LoopBatches(target)
        if rollback == REPLAY:
            self.batches = ReplayBatches(self.target, self.batches)
        self.max_sequences = max_sequences
        # A step of more rows than the shards' fixed step runs there as several (shardd.engine.batch); a row's bits stay.
        self.batch_rows = batch_rows or max(getattr(target, "step_rows", None) or 0, DEFAULT_BATCH_ROWS)
        # prompts resume from the shards' prefix entries where every shard keeps them (Pipeline.prefix_cache)
        caching = prefix_caching and bool(getattr(target, "prefix_cache", False))
        self.prefill_chunk = prefill_chunk or (min(PREFIX_CHUNK, self.batch_rows) if caching else
                                               default_prefill_chunk(self.batch_rows, getattr(target, "prefill_rows", None)))
        if not 1 <= self.prefill_chunk <= self.batch_rows:
            raise ValueError(f"prefill_chunk must be in [1, batch_rows={self.batch_rows}], got {self.prefill_chunk}")
        self.prefixes = PrefixIndex(self.prefill_chunk) if caching else None
        if pipeline_groups is not None and pipeline_groups < 1:
            raise ValueError(f"pipeline_groups must be >= 1, got {pipeline_groups}")
        # micro-batches in flight at once (1: every step waits for the one before)
        self.pipeline_groups = pipeline_groups or 1
        self.recovery_timeout_s = recovery_timeout_s
        self.on_step = on_step
        self.limit = context_limit(target)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps = 0
        self._in_flight: deque[_Group] = deque()  # oldest first
        self._busy: set[Request] = set()  # the requests of the steps in flight
        self._incoming: deque[Request] = deque()  # appended by any thread (deque appends are atomic)
        self._wake = threading.Event()
        self._prompt_waited = False  # a prompt chunk found no room last step: prompts go first this one
        self.drafters = DrafterFallback(self.target)  # a failed drafter's streams decode plainly

    # ---- from any thread ------------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        """Queue `request`; ValueError (nothing queued) when its prompt cannot fit the shards' context."""
        check_prompt_fits(request.prompt, self.limit)
        if request.drafter is not None and request.block_size > self.batch_rows:
            raise ValueError(f"a block of {request.block_size} tokens does not fit a step of {self.batch_rows} rows")
        request.arrived = time.monotonic()
        self._incoming.append(request)
        self._wake.set()
        return request

    def wake(self) -> None:
        """Have `run` look again (a request was cancelled)."""
        self._wake.set()

    # ---- the owner's thread ---------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self._incoming or self._in_flight)

    def run(self, stop: threading.Event, idle_wait_s: float = 0.5) -> None:
        """Step while there is work, until `stop` is set (an engine's thread)."""
        while not stop.is_set():
            if not self.busy:
                self._wake.wait(idle_wait_s)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - a defect here fails the requests it touched, not the engine
                self.abort(error)

    def run_all(self, requests: Iterable[Request]) -> list[Request]:
        """Submit `requests` and step until every one is done (generate, bench, tests)."""
        requests = [self.submit(request) for request in requests]
        try:
            while not all(request.done.is_set() for request in requests):
                self.step()
        except BaseException as error:  # Ctrl-C, SIGTERM: no sequence is left open on the shards
            self.abort(error)
            raise
        return requests

    def abort(self, error: BaseException) -> None:
        """End every request with `error`, closing the open sequences (best effort)."""
        self._in_flight.clear()  # their replies are dropped as the sequences close
        self._busy.clear()
        for request in [*self.running, *self.waiting, *self._incoming]:
            self._fail(request, error)
        self.waiting.clear()
        self._incoming.clear()

    def step(self) -> StepReport:
        """One step: admit, plan the rows of each group not in flight and start its step, then read the oldest step's
        answer, commit it, roll back, finish."""
        while self._incoming:
            self.waiting.append(self._incoming.popleft())
        self._drop_cancelled()
        self._admit()
        for request in [r for r in self.running if r.state == DECODE and r not in self._busy]:
            if request.room(self.limit) <= 0:
                self._finish(request, LENGTH)  # the context limit ends the request
        while len(self._in_flight) < self.pipeline_groups:
            items = self._plan()
            if not items:
                break
            self.steps += 1
            self._in_flight.append(self._start(items))
        report = StepReport()
        if self._in_flight:
            group = self._in_flight.popleft()
            items = group.items
            report = StepReport(rows=sum(len(item.forward.tokens) for item in items), sequences=len(items),
                                prefill_rows=sum(len(item.forward.tokens) for item in items if item.kind == PREFILL))
            self._run(group)
        report.queued, report.running = len(self.waiting), len(self.running)
        if self.on_step is not None:
            self.on_step(report)
        return report

    # ---- admission --------------------------------------------------------------------------

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self._finish(request, STOP)
        for request in [r for r in self.running if r.cancelled and r not in self._busy]:
            self._finish(request, STOP)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_sequences:
            request = self.waiting.popleft()
            request.queued_seconds = time.monotonic() - request.arrived
            if request.max_new_tokens == 0 and request.prompt_logprobs is None:  # nothing to compute
                self._finish(request, LENGTH)
                continue
            request.seq = secrets.randbelow(1 << 62)
            request.target = self._target_for(request)
            try:
                open_sequence(request, self.prefixes)
            except Exception as error:  # noqa: BLE001 - this request fails; the others run
                request.seq = None
                self._fail(request, error)
                continue
            request.state = PREFILL
            request._started = time.perf_counter()
            self.running.append(request)

    def _target_for(self, request: Request):
        """What opens, closes and re-fills the request's sequence: the batch's target, or a feature drafter's own,
        which the drafter follows (wrapped for the replay baseline as the batch's is)."""
        if request.feature_target is None:
            return self.target
        return ReplayTarget(request.feature_target) if self.rollback == REPLAY else request.feature_target

    # ---- planning ---------------------------------------------------------------------------

    def _plan(self) -> list[_Item]:
        """The next step's items, of the requests not in flight: the streams (at most an equal share of the running
        ones per group), then prompt chunks, within `batch_rows`."""
        decoding = [r for r in self.running if r.state == DECODE]
        share = math.ceil(len(decoding) / self.pipeline_groups) if decoding else 0
        streams = sorted((r for r in decoding if r not in self._busy), key=lambda r: r.last_step)[:share]
        prompts = [r for r in self.running if r.state == PREFILL and r not in self._busy]
        plan: list[tuple[Request, int]] = []
        used = 0

        def take(candidates: list[Request], rows_of: Callable[[Request], int]) -> None:
            nonlocal used
            for request in candidates:
                rows = rows_of(request)
                if used + rows <= self.batch_rows or not plan:
                    plan.append((request, rows))
                    used += rows

        chunk = lambda r: min(self.prefill_chunk, len(r.prompt) - r.prefilled)  # noqa: E731
        if self._prompt_waited:
            take(prompts, chunk)
            take(streams, lambda r: r.rows_wanted(self.limit))
        else:
            take(streams, lambda r: r.rows_wanted(self.limit))
            take(prompts, chunk)
        self._prompt_waited = any(r not in (p for p, _ in plan) for r in prompts)
        items = []
        for request, rows in plan:
            try:
                items.append(self._item(request, rows))
            except Exception as error:  # noqa: BLE001 - a drafter that fails fails its own request
                self._fail(request, error)
        return items

    def _item(self, request: Request, rows: int) -> _Item:
        request.last_step = self.steps
        guide = request.guide
        if request.state == PREFILL:
            start = request.prefilled
            tokens = request.prompt[start:start + rows]
            last = start + rows == len(request.prompt)
            sampling = step_keywords(request.sampled, request.prompt, request.result).get("sampling") if last else None
            entry = self.prefixes.new_entry(request.prefix_digests, start + rows) if request.prefix_digests else None
            if entry is not None:
                request.saving[start + rows] = entry
            token_mask = guide.plan()[1] if last and guide is not None else None
            forward = BatchForward(request.seq, start, tokens, sampling=sampling, save_prefix=entry,
                                   token_mask=token_mask)
            scored = request.prompt[start + 1:start + rows + 1]  # the prompt token after each row
            if request.prompt_logprobs is not None and scored:
                forward = replace(forward, prompt_logprobs=request.prompt_logprobs, next_tokens=scored)
            return _Item(request, PREFILL, forward)
        history, room = request.history, request.room(self.limit)
        sampling = step_keywords(request.sampled, history, request.result)
        if request.drafter is None:
            return _Item(request, DECODE, BatchForward(request.seq, len(history) - 1, [history[-1]],
                                                       sampling=sampling.get("sampling"),
                                                       token_mask=guide.plan()[1] if guide is not None else None),
                         room=room)
        started = time.perf_counter()
        drafts = self.drafters.propose(request, history, rows - 1)
        request.result.draft_seconds += time.perf_counter() - started
        if drafts is None:  # its drafter failed: a plain decode step, the same tokens
            return self._item(request, 1)
        if len(drafts) != rows - 1:
            raise ValueError(f"drafter {request.drafter.name!r} proposed {len(drafts)} tokens, asked for {rows - 1}")
        token_mask = None
        if guide is not None:  # the drafts the grammar takes, and the mask of each answered row
            drafts, token_mask = guide.plan(drafts)
        extra = with_drafts(sampling, drafts)
        if guide is not None:  # the mask covers the answered rows: the head is told the drafts, greedy or not
            extra["drafts"] = drafts
        forward = BatchForward(request.seq, len(history) - 1, [history[-1]] + drafts, checkpoint=True,
                               sampling=extra.get("sampling"), drafts=extra.get("drafts"), token_mask=token_mask)
        return _Item(request, DECODE, forward, drafts=drafts, room=room)

    # ---- running a step -------------------------------------------------------------------

    def _start(self, items: list[_Item]) -> _Group:
        """The step of `items` begun as one batch (a feature drafter's item captures its layers there); its requests
        are marked in flight."""
        forwards = [self._prepared(item) for item in items]
        # one group: the step runs whole (forward_batch); several: each begun and read later
        start = getattr(self.batches, "start_forward_batch", None) if self.pipeline_groups > 1 else None
        try:
            answer = start(forwards) if start is not None else Answered(self.batches.forward_batch(forwards))
        except Exception as error:  # noqa: BLE001 - the whole batch failed: each of its requests with it
            answer = Answered([error] * len(items))
        self._busy.update(item.request for item in items)
        return _Group(items, forwards, answer)

    def _outputs(self, group: _Group) -> list:
        """Per item its ids or its exception; a feature drafter takes its rows (and the proposal) from the answer."""
        items, forwards = group.items, group.forwards
        try:
            outputs = group.answer.result()
        except Exception as error:  # noqa: BLE001 - the whole batch failed: each of its requests with it
            outputs = [error] * len(items)
        for index, (item, forward) in enumerate(zip(items, forwards)):
            if item.request.feature_target is not None and not isinstance(outputs[index], BaseException):
                try:
                    outputs[index] = item.request.drafter.collect(forward, outputs[index])
                except Exception as error:  # noqa: BLE001 - a malformed answer fails its request alone
                    outputs[index] = error
        return outputs

    @staticmethod
    def _prepared(item: _Item) -> BatchForward:
        request = item.request
        return item.forward if request.feature_target is None else request.drafter.prepare(item.forward)

    def _run(self, group: _Group) -> None:
        """Read a step's answer: commit each item, roll back, re-fill what was lost, record."""
        items = group.items
        outputs = self._outputs(group)
        self._busy.difference_update(item.request for item in items)
        rollbacks: list[tuple[Request, int]] = []
        commits: list[tuple[Request, list[int]]] = []
        lost: list[tuple[Request, Exception]] = []
        for item, output in zip(items, outputs):
            request = item.request
            if isinstance(output, (SequenceLost, RollbackFailed)) and request.state == DECODE:
                lost.append((request, output))
            elif isinstance(output, BaseException):
                self._fail(request, output)
            else:
                try:
                    if item.kind == PREFILL:
                        self._prefilled(item, output)
                    else:
                        commits.append((request, self._verified(item, output, rollbacks)))
                except Exception as error:  # noqa: BLE001 - a malformed answer fails its request alone
                    self._fail(request, error)
        if rollbacks:
            failures = self._rollback(rollbacks)
            lost.extend((request, failures[request.seq]) for request, _ in commits if request.seq in failures)
        for request, failure in lost:
            # The history holds every commit, this step's too when only its rollback failed.
            try:
                recover(request.target, request.seq, request.history, len(request.prompt), request.result, failure,
                         self.recovery_timeout_s, self.prefill_chunk)
            except Exception as error:  # noqa: BLE001 - could not re-fill: this request fails
                self._fail(request, error)
        for request, committed in commits:
            if request.state == DECODE:
                self._record(request, committed)

    def _rollback(self, rollbacks: list[tuple[Request, int]]) -> dict[int, Exception]:
        """Per sequence, the rollback that failed at once (a `Pipeline` reports its failures at the next call)."""
        batched = [(request.seq, keep) for request, keep in rollbacks]
        try:
            return self.batches.rollback_batch(batched) or {}
        except (RollbackFailed, SequenceLost) as error:  # which one is unknown: re-fill them all, output unchanged
            return {seq: error for seq, _ in batched}

    def _prefilled(self, item: _Item, outputs) -> None:
        request = item.request
        n = len(item.forward.tokens)
        if len(outputs) != n:
            raise RuntimeError(f"prefill of {n} tokens returned {len(outputs)} ids")
        result = request.result
        if result.prompt_logprobs is not None:
            scored = len(item.forward.next_tokens or ())
            rows = getattr(outputs, "prompt_logprobs", None) or []
            if len(rows) != scored:
                raise RuntimeError(f"the head shard answered {len(rows)} prompt logprob rows for {scored} prompt tokens")
            result.prompt_logprobs.extend(rows)
        request.prefilled += n
        entry = request.saving.pop(request.prefilled, None)
        if entry is not None:  # every shard ran the chunk and (budget allowing) kept its state as `entry`
            self.prefixes.saved(request.prefix_digests, request.prefilled, entry)
        if request.prefilled < len(request.prompt):
            return
        result.prefill_seconds = time.perf_counter() - request._started
        if request.max_new_tokens == 0:  # prefilled for its prompt logprobs alone
            self._finish(request, LENGTH)
            return
        first = outputs[-1]
        if request.guide is not None:
            request.guide.commit([first])
        if result.logprobs is not None:
            keep_logprobs(result, last_row(outputs), 1)
        result.tokens.append(first)
        request.history = request.prompt + [first]
        request.state = DECODE
        request._started = time.perf_counter()
        self._notify(request, [first])

    def _verified(self, item: _Item, verified, rollbacks: list[tuple[Request, int]]) -> list[int]:
        """Commit what a decode or verify row answered (coordinator.scheduler.commit's rule); queue its rollback."""
        request, result = item.request, item.request.result
        guide = request.guide
        if item.drafts is None:
            (token,) = verified
            if guide is not None:
                guide.commit([token])
            request.history.append(token)
            keep_logprobs(result, verified, 1)
            return [token]
        before = len(request.history)
        keep = commit_block(result, request.history, item.drafts, verified, item.room, request.eos,
                            guide.commit if guide is not None else None)
        if keep < len(item.forward.tokens):
            rollbacks.append((request, keep))
            count_rollback(result, self.rollback)
        return request.history[before:]

    # ---- commits and endings -----------------------------------------------------------------

    def _record(self, request: Request, committed: list[int]) -> None:
        record_commit(request.result, committed)
        self._notify(request, committed)

    def _notify(self, request: Request, committed: list[int]) -> None:
        try:
            if request.on_commit is not None:
                request.on_commit(committed_ids(request.result, committed))
        except StopDecoding:
            self._finish(request, STOP)
            return
        except Exception as error:  # noqa: BLE001 - a failing callback fails its own request only
            self._fail(request, error)
            return
        tokens = request.result.tokens
        if request.guide is not None and request.guide.finished:  # the grammar is complete
            self._finish(request, STOP)
        elif finished(tokens, request.max_new_tokens, request.eos):
            self._finish(request, STOP if tokens[-1] in request.eos else LENGTH)

    def _finish(self, request: Request, reason: str) -> None:
        request.result.finish_reason = reason
        if request.state == DECODE:
            request.result.decode_seconds = time.perf_counter() - request._started
        self._end(request)

    def _fail(self, request: Request, error: BaseException) -> None:
        request.error = error
        self._end(request)

    def _end(self, request: Request) -> None:
        if request.state == DONE:
            return
        if request.seq is not None:
            with contextlib.suppress(Exception):  # the output is complete; a shard that is gone frees it anyway
                request.target.close(request.seq)
        if request in self.running:
            self.running.remove(request)
        if request.queued_seconds is None:
            request.queued_seconds = time.monotonic() - request.arrived
        request.state = DONE
        request.done.set()
        if request.on_finish is not None:
            with contextlib.suppress(Exception):  # the requester went away (its event loop closed)
                request.on_finish(request)


def decode_all(target, requests: Sequence[Request], **options) -> list[DecodeResult]:
    """Run `requests` together through a fresh scheduler over `target` (at most the shards' capacity at once);
    each one's result, or its error raised."""
    options.setdefault("max_sequences", min(len(requests) or 1, shard_capacity(target) or len(requests) or 1))
    scheduler = Scheduler(target, **options)
    return [request.outcome() for request in scheduler.run_all(requests)]
