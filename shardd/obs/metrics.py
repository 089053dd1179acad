"""Prometheus metrics of one daemon (`shardd serve --metrics-port`), served from a thread by prometheus_client.

Counts come from the daemon's own `Counters` (the ones STATS reports), read at scrape time, so there is one set of
counters; only request latencies are observed here, as they happen, into histograms."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol.timing import DAEMON as PHASES
from shardd.obs.health import device_memory

# Request latencies: 1 ms (a CLOSE) .. 60 s (a long prefill on a CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class DaemonMetrics:
    """A collector over a ShardDaemon's counters and state, plus the latency histograms it observes."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.registry = CollectorRegistry()
        self.latency = Histogram("shardd_request_seconds", "Time to compute one request's reply, by message type",
                                 ["type"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self.registry.register(self)

    def observe(self, message_type: str, seconds: float) -> None:
        self.latency.labels(message_type).observe(seconds)

    def collect(self):
        daemon = self.daemon
        c = daemon.counters
        layers = daemon.shard
        mode = layers.storage.mode if layers is not None and layers.storage.enabled else "none"

        def counter(name, documentation, labels=(), items=()):
            family = CounterMetricFamily(name, documentation, labels=list(labels))
            for label_values, value in items:
                family.add_metric(list(label_values), value)
            return family

        def gauge(name, documentation, value):
            return GaugeMetricFamily(name, documentation, value=value)

        # list(...) copies in one step under the GIL: the serving thread may add keys meanwhile.
        yield counter("shardd_requests", "Requests answered, by message type", ["type"],
                      [((t,), n) for t, n in list(c.requests.items())])
        yield counter("shardd_errors", "Error replies, by message type and error code", ["type", "code"],
                      [((str(t), code), n) for (t, code), n in list(c.errors_by_type.items())])
        yield counter("shardd_rollbacks", "ROLLBACKs served, by rollback mode and tokens kept", ["mode", "keep"],
                      [((mode, str(keep)), n) for keep, n in list(c.rollbacks_by_keep.items())])
        yield counter("shardd_forwards", "FORWARD and CAPTURE steps computed", items=[((), c.forwards)])
        yield counter("shardd_captures", "CAPTURE steps computed", items=[((), c.captures)])
        yield counter("shardd_captured_rows", "Feature rows returned by CAPTUREs", items=[((), c.captured_rows)])
        yield counter("shardd_tokens_forwarded", "Tokens through this daemon's layers", items=[((), c.tokens_forwarded)])
        yield counter("shardd_checkpointed_steps", "Steps with checkpoint: true", items=[((), c.checkpointed_steps)])
        yield counter("shardd_sequences_opened", "Sequences opened", items=[((), c.sequences_opened)])
        yield counter("shardd_sequences_failed", "Sequences failed by an internal error", items=[((), c.sequences_failed)])
        yield counter("shardd_request_phase_seconds", "Time spent in each phase of a request (protocol/timing.py), "
                      "by message type and phase", ["type", "phase"],
                      [((t, phase), ns / 1e9) for (t, phase), ns in list(PHASES.ns.items())])
        yield counter("shardd_proposals", "PROPOSEs served by the hosted drafter", items=[((), c.proposals)])
        yield counter("shardd_rows", "Rows from shard to shard (PROTOCOL.md): ROWS sent to the next shard, taken from "
                      "the previous one, FORWARDs that waited for theirs, FORWARDs refused ROWS_MISSING, and ROWS "
                      "sent and taken through a device ring", ["event"],
                      [(("sent",), c.rows_sent), (("received",), c.rows_received), (("waited",), c.rows_waits),
                       (("missing",), c.rows_missing),
                       (("sent_on_device",), daemon.relay.link.on_device if daemon.relay.link is not None else 0),
                       (("received_on_device",), c.rows_on_device)])
        yield gauge("shardd_rows_waiting", "FORWARDs waiting for their rows from the previous shard now",
                    len(daemon.relay.inbox.waiting))
        cache = daemon.prefix_cache
        yield counter("shardd_prefix_cache", "Prefix cache events (PROTOCOL.md, \"Prefix caching\"): entries saved, "
                      "declined for want of room, resumed from (hits), refused (misses), evicted", ["event"],
                      [(("saved",), cache.saves), (("declined",), cache.declined), (("hit",), cache.hits),
                       (("miss",), cache.misses), (("evicted",), cache.evictions)])
        yield counter("shardd_prefix_cache_tokens_served", "Prompt tokens resumed from prefix entries",
                      items=[((), cache.tokens_served)])
        yield gauge("shardd_prefix_cache_bytes", "Prefix entries held, bytes", cache.bytes)
        yield gauge("shardd_prefix_cache_entries", "Prefix entries held", len(cache.entries))
        entries = list(daemon.sequences.values())
        states = [entry.state for entry in entries if entry.state is not None]
        yield gauge("shardd_open_sequences", "Sequences open now", len(entries))
        yield gauge("shardd_checkpoint_bytes", "Rollback storage held by open sequences, bytes",
                    sum(state.rollback_bytes() for state in states))
        yield gauge("shardd_state_bytes", "Sequence state (KV cache, GDN state) held, bytes",
                    sum(state.state_bytes() for state in states))
        yield gauge("shardd_weight_bytes", "Weights held, bytes", daemon.weight_bytes())
        memory = device_memory(daemon.device)
        for key, documentation in (("used_bytes", "Memory in use on the daemon's device (all processes), bytes"),
                                   ("total_bytes", "Memory of the daemon's device, bytes"),
                                   ("process_bytes", "Memory this daemon holds on its device, bytes")):
            family = GaugeMetricFamily(f"shardd_device_memory_{key}", documentation, labels=["device"])
            family.add_metric([str(daemon.device)], memory[key])
            yield family
        yield gauge("shardd_uptime_seconds", "Seconds since the daemon started serving", daemon.uptime())


def serve_metrics(daemon, host: str, port: int) -> str:
    """Start the /metrics endpoint in a thread; attach the histograms to the daemon. Returns its URL."""
    metrics = DaemonMetrics(daemon)
    daemon.metrics = metrics
    server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    return f"http://{host}:{server.server_port}/metrics"
