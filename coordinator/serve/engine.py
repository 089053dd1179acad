"""Requests to sequences: one engine thread owns a `Pipeline` and runs the scheduler
(`coordinator.scheduler`), so all requests share each batched step; the HTTP handlers live on the event loop,
submit a request and read its commits from an asyncio queue the engine thread fills. The frontend's work
(detokenizing, stop strings, per-request metrics) runs there, on the event loop, so the engine thread only steps.
A client that goes away, or a stop string, cancels its request: its sequence is closed at the next step boundary.
At most `max_sequences` (the smallest any shard allows) decode at once; more wait in arrival order. Every drafter
runs in that one loop: a DFlash request's rows go through its drafter's capturing target inside the same steps."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Optional, Sequence

from coordinator.guided import GrammarCompiler, GrammarError, GrammarSpec
from coordinator.drafting.drafters import NgramDrafter, make_drafter
from coordinator.relay.client import ShardClient
from coordinator.relay.liveness import LIVENESS_TIMEOUT_S
from coordinator.relay.pipeline import Pipeline
from coordinator.sampling import Sampling
from coordinator.scheduler.block_size import verify_cost_of
from coordinator.scheduler.recovery import RECOVERY_TIMEOUT_S
from coordinator.scheduler.requests import DecodeResult
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import Scheduler
from coordinator.serve.metrics import ServeMetrics
from protocol.layout import CHECKPOINT

GREEDY = "none"
SERVE_DRAFTERS = (GREEDY, "ngram", "dflash")  # oracle needs the answer first: a benchmark, not a server


class RequestError(ValueError):
    """The request cannot be served as asked (HTTP 400); the message says why."""


@dataclass
class GenerateParams:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # as vLLM: special tokens (<|im_start|>, <|endoftext|>) are not text
    shown_special: frozenset = frozenset()  # special ids kept as text all the same (a tool call's markers)
    cache_salt: str = ""  # prompts share cached prefixes only with prompts of the same salt
    prompt_logprobs: Optional[int] = None  # top logprobs per prompt position; None: the prompt is not scored
    grammar: Optional[GrammarSpec] = None  # what the output keeps to (compiled first: Engine.compile)


@dataclass
class Delta:
    text: str = ""
    logprobs: list = field(default_factory=list)  # (token, head-shard entry) of the tokens this text covers
    finish_reason: Optional[str] = None
    result: Optional[DecodeResult] = None  # on the last delta
    # on a delta of its own before any text, when the prompt was scored: per prompt token after the first
    # [logprob, [[id, logprob], ...top], rank]
    prompt_logprobs: Optional[list] = None


@dataclass
class Connection:
    pipeline: Pipeline
    draft_client: Optional[ShardClient] = None

    def close(self) -> None:
        self.pipeline.disconnect()
        if self.draft_client is not None:
            self.draft_client.close()


def generation_defaults(model_dir: Optional[str]) -> dict:
    """Sampling defaults from generation_config.json (as vLLM applies them): temperature, top_p, top_k."""
    if model_dir is None or not (Path(model_dir) / "generation_config.json").is_file():
        return {}
    config = json.loads((Path(model_dir) / "generation_config.json").read_text())
    defaults = {key: config[key] for key in ("temperature", "top_p", "top_k") if config.get(key) is not None}
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


@dataclass(frozen=True)
class EngineConfig:
    """What `shardctl serve` asks of its engine, built once from the flags and handed whole to the `Engine`."""

    model_name: str  # --served-model-name
    drafter: str = "ngram"  # --drafter
    rollback: str = CHECKPOINT  # --rollback-mode
    block_size: int = 16  # --block-size (a DFlash drafter's own limit cuts it); with adaptive_block the most
    adaptive_block: bool = False  # --block-size auto: each verify block chosen by coordinator.scheduler.block_size
    batch_rows: Optional[int] = None  # --batch-rows: the scheduler's rows per step (None: the Scheduler's default)
    pipeline_groups: int = 1  # --pipeline-groups: micro-batches in flight
    prefix_caching: bool = True  # --enable-prefix-caching: prompts resume from the shards' prefix entries
    draft_endpoint: Optional[str] = None  # the DFlash drafter's daemon
    eos_ids: tuple[int, ...] = ()
    defaults: dict = field(default_factory=dict)  # sampling defaults (generation_config.json)
    timeout_s: float = 120.0  # --timeout: a shard's reply
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S  # --recovery-timeout
    liveness_timeout_s: float = LIVENESS_TIMEOUT_S  # --liveness-timeout
    busy_poll_s: Optional[float] = 0.0  # --busy-poll-ms (None: as each daemon does)

    def __post_init__(self) -> None:
        if self.drafter not in SERVE_DRAFTERS:
            raise ValueError(f"shardctl serve drafts with one of {', '.join(SERVE_DRAFTERS)}, not {self.drafter!r}")
        if self.drafter == "dflash" and self.draft_endpoint is None:
            raise ValueError("--drafter dflash needs the drafter daemon (--draft-shard)")


class Engine:
    health_timeout_s = 1.0  # GET /health answers within about this long, also with a shard down
    # set (to the reason) when a launched shard died or hung and could not be brought back: the server answers 503
    lost: Optional[str] = None

    def __init__(self, endpoints: Sequence[str], tokenizer, config: EngineConfig, *, curve=None,
                 chat_template=None, metrics: Optional[ServeMetrics] = None) -> None:
        self.config = config
        self.endpoints = list(endpoints)
        self.tokenizer = tokenizer
        self.model_name = config.model_name
        self.drafter = config.drafter
        self.rollback = config.rollback
        self.block_size = config.block_size
        self.eos_ids = tuple(config.eos_ids)
        self.defaults = config.defaults
        self.curve = curve
        self.chat_template = chat_template
        self.metrics = metrics or ServeMetrics()
        self._grammars = None  # the GrammarCompiler, built at the first request with a grammar
        self._grammar_lock = threading.Lock()
        drafter, rollback, block_size = config.drafter, config.rollback, config.block_size
        first = self._connect()  # refuses a shard set that cannot form the model, or cannot speculate so
        self._dflash = None  # the checked DFlash drafter each request's own (`fresh`) is made from
        try:
            pipeline = first.pipeline
            if drafter != GREEDY:
                pipeline.check_speculation(rollback, block_size)
            self.vocab_size = pipeline.vocab_size
            self.max_context = pipeline.max_context
            self.max_sequences = min(s.hello["limits"]["max_sequences"] for s in pipeline.shards)
            self.fingerprint = pipeline.shards[0].model["fingerprint"]
            if drafter == "dflash":
                self._dflash = make_drafter("dflash", draft_client=first.draft_client, pipeline=pipeline)
                self.block_size = min(block_size, self._dflash.max_block_size)
            self.verify_cost = verify_cost_of(pipeline) if config.adaptive_block and drafter != GREEDY else None
        except BaseException:
            first.close()
            raise
        self._engine_connection = first
        self.scheduler = Scheduler(first.pipeline, max_sequences=self.max_sequences, batch_rows=config.batch_rows,
                                   pipeline_groups=config.pipeline_groups, prefix_caching=config.prefix_caching,
                                   rollback=rollback, recovery_timeout_s=config.recovery_timeout_s,
                                   on_step=self.metrics.record_step)
        if drafter != GREEDY and block_size > self.scheduler.batch_rows:
            first.close()
            raise ValueError(f"--block-size {block_size} does not fit the scheduler's step of "
                             f"{self.scheduler.batch_rows} rows")
        self._stop = threading.Event()
        self._engine = threading.Thread(target=self.scheduler.run, args=(self._stop,), name="shardctl-engine",
                                        daemon=True)
        self._engine.start()

    # ---- connections -----------------------------------------------------------------------

    def _connect(self) -> Connection:
        config = self.config
        pipeline = Pipeline.connect(self.endpoints, timeout_s=config.timeout_s, curve=self.curve,
                                    liveness_timeout_s=config.liveness_timeout_s, busy_poll_s=config.busy_poll_s)
        draft_client = None
        if config.draft_endpoint is not None:
            draft_client = ShardClient(config.draft_endpoint, timeout_s=config.timeout_s, curve=self.curve,
                                       liveness_timeout_s=config.liveness_timeout_s, busy_poll_s=config.busy_poll_s)
        return Connection(pipeline, draft_client)

    def close(self) -> None:
        if self._engine.is_alive():
            self._stop.set()
            self.scheduler.wake()
            self._engine.join(self.config.timeout_s)
            if not self._engine.is_alive():
                self._engine_connection.close()

    def health(self) -> tuple[bool, dict]:
        """Ready when every shard answers HELLO with one model fingerprint."""
        def ask(endpoint: str) -> dict:
            # Every shard at once, each within health_timeout_s: a shard down costs a second, not the liveness window.
            try:
                with ShardClient(endpoint, timeout_s=self.health_timeout_s, curve=self.curve,
                                 liveness_timeout_s=self.health_timeout_s) as client:
                    hello = client.hello()
                return {"fingerprint": hello["model"]["fingerprint"], "layers": hello["layers"]}
            except Exception as error:  # noqa: BLE001 - any failure means not ready, with its reason
                return {"error": str(error)}

        endpoints = self.endpoints + ([self.config.draft_endpoint] if self.config.draft_endpoint else [])
        with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
            shards = dict(zip(endpoints, pool.map(ask, endpoints)))
        problems = [f"{endpoint}: {answer['error']}" for endpoint, answer in shards.items() if "error" in answer]
        if self.lost is not None:
            problems.insert(0, self.lost)
        fingerprints = {s["fingerprint"] for s in shards.values() if "fingerprint" in s}
        if len(fingerprints) > 1:
            problems.append(f"shards disagree on the model fingerprint: {sorted(fingerprints)}")
        elif fingerprints and fingerprints != {self.fingerprint}:
            problems.append(f"the shards now serve {fingerprints.pop()}, not {self.fingerprint}")
        return not problems, {"status": "ok" if not problems else "unavailable", "shards": shards, "problems": problems}

    # ---- requests --------------------------------------------------------------------------

    def sampling(self, temperature, top_p, top_k, seed, **extras) -> Sampling:
        """`extras`: penalties and logprobs (coordinator.sampling.Sampling's fields); None: the default."""
        pick = lambda value, key, default: value if value is not None else self.defaults.get(key, default)  # noqa: E731
        if top_k is not None and top_k >= self.vocab_size:
            top_k = 0  # at least the whole vocabulary: all tokens (the wire carries top_k below 2**31)
        try:
            return Sampling.make(pick(temperature, "temperature", 1.0), pick(top_p, "top_p", None),
                                 pick(top_k, "top_k", None), seed,
                                 **{key: value for key, value in extras.items() if value is not None})
        except ValueError as error:
            raise RequestError(str(error)) from None

    def compile(self, spec) -> None:
        """Compile `spec` (a `coordinator.guided.GrammarSpec`) now, so a grammar xgrammar refuses is a 400 naming its
        field before any sequence opens (RequestError with `param`); cached for the requests that follow."""
        try:
            with self._grammar_lock:
                if self._grammars is None:  # xgrammar and the tokenizer's vocabulary, at the first grammar
                    self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
            self._grammars.compile(spec)
        except GrammarError as error:
            refusal = RequestError(str(error))
            refusal.param = error.param
            raise refusal from None

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary 0..{self.vocab_size - 1}")
        if len(ids) >= self.max_context:
            raise RequestError(
                f"This model's maximum context length is {self.max_context} tokens; the prompt holds {len(ids)} "
                f"tokens, leaving no room for output"
            )

    async def generate(self, params: GenerateParams) -> AsyncIterator[Delta]:
        """Text deltas as the request's tokens commit; the last one carries finish_reason and the result.
        Closing the iterator early (the client went away) ends the sequence after its current step."""
        loop = asyncio.get_running_loop()
        commits: asyncio.Queue = asyncio.Queue()
        request = self._request(params, lambda item: loop.call_soon_threadsafe(commits.put_nowait, item))
        try:
            self.scheduler.submit(request)
        except ValueError as error:
            raise RequestError(str(error)) from None
        try:
            async for delta in self._outputs(params, request, commits):
                yield delta
        finally:
            request.cancel()  # a no-op once it finished; else its sequence closes at the next step boundary
            self.scheduler.wake()

    def _request(self, params: GenerateParams, post: Callable[[object], None]) -> Request:
        """The scheduler's request for `params`: the engine thread only hands each commit (ids, with their
        logprobs) and the end (the result, or the error) to `post`; the text is made by `_outputs`."""
        def on_finish(request: Request) -> None:
            self.metrics.queue_seconds.observe(request.queued_seconds or 0.0)
            post(request.error if request.error is not None else request.result)

        eos = () if params.ignore_eos else self.eos_ids
        drafter = None
        if self.drafter == "ngram":
            drafter = NgramDrafter()
        elif self.drafter == "dflash":
            drafter = self._dflash.fresh()  # no I/O: its calls run on the engine thread, on the engine's connections
        guide = None
        if params.grammar is not None:
            self.compile(params.grammar)
            guide = self._grammars.guide(params.grammar)  # each choice its own matcher
        return Request(params.prompt_ids, params.max_tokens, eos_ids=eos, sampling=params.sampling, drafter=drafter,
                       block_size=self.block_size, verify_cost=self.verify_cost, on_commit=post, on_finish=on_finish,
                       cache_salt=params.cache_salt, prompt_logprobs=params.prompt_logprobs, guide=guide)

    async def _outputs(self, params: GenerateParams, request: Request, commits: asyncio.Queue) -> AsyncIterator[Delta]:
        """The frontend's half of a request, on the event loop (as vLLM's output processor): commits become text
        deltas (with the logprobs of the tokens each covers), stop strings are matched, per-request metrics kept.
        A stop string ends the request: the tokens the engine committed after it are not the request's."""
        text = TextTracker(self.tokenizer, params.stop, () if params.ignore_eos else self.eos_ids,
                           params.skip_special_tokens, params.shown_special)
        last = time.perf_counter()  # the first commit observes the time to first token
        pending: list = []  # (token, logprobs entry) committed since the last text delta; an EOS is not text
        stopped_at: Optional[int] = None  # tokens the request holds, once a stop string matched
        scored = request.prompt_logprobs is None  # the prompt's scores were handed on (or none were asked)
        while True:
            item = await commits.get()
            if isinstance(item, BaseException):
                raise item
            if not scored:  # the prefill ended before the first commit or the end: the scores are complete
                scored = True
                yield Delta(prompt_logprobs=request.result.prompt_logprobs)
            if isinstance(item, DecodeResult):
                if stopped_at is not None:
                    cut_result(item, stopped_at)
                rest = text.finish()
                if rest or pending:
                    yield Delta(text=rest, logprobs=pending[:])
                if text.stopped:
                    item.finish_reason = "stop"
                self.metrics.record(item, self.rollback if self.drafter != GREEDY else None,
                                    prefix_caching=self.scheduler.prefixes is not None)
                yield Delta(finish_reason=item.finish_reason, result=item)
                return
            if stopped_at is not None:
                continue
            now = time.perf_counter()
            (self.metrics.ttft_seconds if not text.tokens else self.metrics.step_seconds).observe(now - last)
            last = now
            entries = getattr(item, "logprobs", None)
            if entries is not None:
                pending.extend((t, e) for t, e in zip(item, entries) if t not in text.eos)
            delta, stopped = text.add(item)
            if delta:
                yield Delta(text=delta, logprobs=pending[:])
                pending.clear()
            if stopped:
                stopped_at = len(text.tokens)
                request.cancel()
                self.scheduler.wake()

    async def complete(self, params: GenerateParams) -> tuple[str, DecodeResult, list]:
        """The whole text, the result, and the logprobs of the tokens the text covers."""
        parts, result, logprobs = [], None, []
        async for delta in self.generate(params):
            parts.append(delta.text)
            logprobs.extend(delta.logprobs)
            result = delta.result or result
        return "".join(parts), result, logprobs


def cut_result(result: DecodeResult, tokens: int) -> None:
    """`result` as if the request had ended after its first `tokens` tokens (a stop string matched there):
    the tokens, their logprobs and the steps that committed them; the drafting counters cover every step run."""
    result.tokens = result.tokens[:tokens]
    if result.logprobs is not None:
        result.logprobs = result.logprobs[:tokens]
    kept, total = [], 1  # the first token comes from the prefill, not a step
    for committed in result.commits:
        if total + committed > tokens:
            break
        kept.append(committed)
        total += committed
    result.commits, result.steps = kept, len(kept)


class TextTracker:
    """Committed tokens -> the text to send: an EOS at the end is not text, stop strings end the request
    (the stop string itself is not returned), an incomplete UTF-8 character or a possible stop-string prefix
    is held back until it resolves.

    The text is decoded incrementally, as vLLM and TGI detokenize: each commit decodes the window of the tokens
    last turned into text (their context: a tokenizer may render a token differently at the start) and the
    tokens after it, and keeps the difference, instead of decoding the whole history again (quadratic over a
    long generation). The end (`finish`) decodes the whole once, as the reference does
    (tests/integration/test_serve.py holds the whole-history version the incremental one is checked against)."""

    def __init__(self, tokenizer, stop: Sequence[str], eos_ids: Sequence[int], skip_special_tokens: bool = True,
                 shown_special: frozenset = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # special tokens skipped except those shown: dropped here, the rest decoded as they are
        self._hidden = tokenizer.special_ids() - shown_special if skip_special_tokens and shown_special else None
        self.stop = [s for s in stop if s]
        self.eos = frozenset(eos_ids)
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False
        self._decoded = ""  # the text of the visible tokens before `_read`, whose characters are all complete
        self._prefix = self._read = 0  # the window decoded again as context (tokens _prefix .. _read - 1)

    def _decode(self, ids: list[int]) -> str:
        if self._hidden is None:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode([i for i in ids if i not in self._hidden], skip_special_tokens=False)

    def _visible(self) -> list[int]:
        return self.tokens[:-1] if self.tokens and self.tokens[-1] in self.eos else self.tokens

    def _text(self) -> str:
        """The text of the visible tokens so far (what decoding them all gives), decoding only the last window."""
        visible = self._visible()
        if len(visible) <= self._read:
            return self._decoded
        decode = self._decode
        before = decode(visible[self._prefix:self._read])
        after = decode(visible[self._prefix:])
        if not after.startswith(before):  # a tokenizer whose window does not extend: decode it all
            return decode(visible)
        tail = after[len(before):]
        if tail and not tail.endswith("\ufffd"):  # complete characters: the window moves on
            self._decoded += tail
            self._prefix, self._read = self._read, len(visible)
            return self._decoded
        return self._decoded + tail

    def add(self, committed: list[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.tokens.extend(committed)
        text = self._text()
        hits = [index for index in (text.find(s, max(0, len(self.sent) - len(s))) for s in self.stop) if index >= 0]
        if hits:
            self.stopped = True
            return self._advance(text[:min(hits)]), True
        stable = text.rstrip("\ufffd")
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._advance(stable[:len(stable) - hold] if hold else stable), False

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self) -> str:
        """What is left to send once decoding ended (the whole decoded once: exactly what the tokens say)."""
        if self.stopped:
            return ""
        text = self._decode(self._visible())
        if text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
            return delta
        return ""
