"""Prometheus metrics of `shardctl serve` (`GET /metrics`), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("shardctl_requests", "HTTP API requests, by route and outcome",
                                ["route", "status"], registry=registry)
        self.running = Gauge("shardctl_requests_running", "Requests decoding now", registry=registry)
        self.prompt_tokens = Counter("shardctl_prompt_tokens", "Prompt tokens prefilled", registry=registry)
        self.generation_tokens = Counter("shardctl_generation_tokens", "Tokens generated", registry=registry)
        self.accepted_drafts = Histogram("shardctl_accepted_drafts_per_step", "Draft tokens accepted per verify step",
                                         buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32), registry=registry)
        self.step_seconds = Histogram("shardctl_step_seconds", "Latency of one decode / verify step",
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                                      registry=registry)
        self.ttft_seconds = Histogram("shardctl_time_to_first_token_seconds", "Request start to first token (prefill)",
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                      registry=registry)
        self.rollbacks = Counter("shardctl_rollbacks", "Rolled-back verify steps, by how (checkpoint, replay-ssm, "
                                 "replay, fallback: re-filled from history)", ["mode"], registry=registry)
        self.recoveries = Counter("shardctl_recoveries", "Sequences re-filled after a shard lost them",
                                  registry=registry)
        self.finished = Counter("shardctl_finished", "Finished requests, by finish_reason", ["reason"],
                                registry=registry)
        # The scheduler (coordinator.scheduler): one observation per step, one per admitted request.
        self.queued = Gauge("shardctl_requests_queued", "Requests waiting for a sequence slot", registry=registry)
        self.batch_size = Histogram("shardctl_batch_size", "Sequences with rows in one step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        self.step_rows = Histogram("shardctl_step_rows", "Rows (tokens) forwarded in one step: decode, verify and "
                                   "prompt rows", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
                                   registry=registry)
        self.prefill_rows = Counter("shardctl_prefill_rows", "Prompt rows forwarded in steps shared with running "
                                    "streams (chunked prefill)", registry=registry)
        self.prefix_cache_requests = Counter("shardctl_prefix_cache_requests", "Requests admitted with prefix caching "
                                             "on, by whether their prompt resumed from a cached prefix",
                                             ["outcome"], registry=registry)
        self.prefix_cache_tokens = Counter("shardctl_prefix_cache_cached_tokens", "Prompt tokens resumed from the "
                                           "shards' prefix cache instead of prefilled", registry=registry)
        self.queue_seconds = Histogram("shardctl_time_in_queue_seconds", "Request arrival to its admission",
                                       buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                       registry=registry)

    def record_step(self, report) -> None:
        """One scheduler step (`coordinator.scheduler.scheduler.StepReport`)."""
        self.queued.set(report.queued)
        self.running.set(report.running)
        if report.sequences:
            self.batch_size.observe(report.sequences)
            self.step_rows.observe(report.rows)
            self.prefill_rows.inc(report.prefill_rows)

    def record(self, result, rollback_mode: str | None, prefix_caching: bool = False) -> None:
        """A finished generation's `DecodeResult`."""
        self.prompt_tokens.inc(result.prompt_tokens)
        if prefix_caching:
            self.prefix_cache_requests.labels("hit" if result.cached_tokens else "miss").inc()
            self.prefix_cache_tokens.inc(result.cached_tokens)
        self.generation_tokens.inc(len(result.tokens))
        if result.drafted:
            for committed in result.commits:
                self.accepted_drafts.observe(max(committed - 1, 0))
        if result.rollbacks_fast:
            self.rollbacks.labels(rollback_mode or "checkpoint").inc(result.rollbacks_fast)
        if result.replays:
            self.rollbacks.labels("replay").inc(result.replays)
        if result.rollbacks_fallback:
            self.rollbacks.labels("fallback").inc(result.rollbacks_fallback)
        if result.recoveries:
            self.recoveries.inc(result.recoveries)
        self.finished.labels(result.finish_reason).inc()
