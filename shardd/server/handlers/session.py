"""HELLO, OPEN, CLOSE, STATS and SHUTDOWN: the daemon as a whole, and a sequence's life."""

from __future__ import annotations

import logging
import os

from common import __version__
from common.model_config import dtype_name
from protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError
from protocol.timing import DAEMON as PHASES
from shardd.engine.reference.rollback import RollbackStorage
from shardd.engine.select import numerics
from shardd.obs import timeline
from shardd.obs.health import device_memory
from shardd.server.peer import Peer
from shardd.server.ring import DEFAULT_ROWS as RING_ROWS

log = logging.getLogger("shardd")


class Session:
    """The handlers that describe and control the daemon (`daemon`, a ShardDaemon) and open and close sequences."""

    def __init__(self, daemon):
        self.daemon = daemon

    def hello(self, request, peer: Peer):
        # What changes while the daemon runs is added here, not in describe().
        daemon = self.daemon
        if request.relay_key is not None:  # before anything changes: a wrong key refuses the whole HELLO
            daemon.relay.present(request.relay_key, peer)
        if request.owner is not None and peer.connection is not None:  # with Curve the key is the owner
            daemon.owners.claim(peer.connection, request.owner)
        health = {"version": __version__, "uptime_seconds": daemon.uptime(),
                  "device_memory": device_memory(daemon.device)}
        return {**self.describe(), **health}, {}

    def describe(self) -> dict:
        daemon = self.daemon
        shard, c, config = daemon.shard, daemon.model_config, daemon.config
        storage = shard.storage if shard is not None else RollbackStorage(None, 0)
        state_bytes = shard.state_bytes_per_sequence(config.max_context) if shard is not None else 0
        if daemon.drafter is not None:
            state_bytes += daemon.drafter.model.state_bytes_per_sequence(config.max_context)
        return {
            "protocol_version": PROTOCOL_VERSION,
            "model": {
                "fingerprint": daemon.fingerprint,
                "num_layers": c.num_layers,
                "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size,
                "layer_types": list(c.layer_types),
                "eos_token_ids": list(c.eos_token_ids),
                "moe": None if c.moe is None else {"num_experts": c.moe.num_experts,
                                                   "num_experts_per_tok": c.moe.num_experts_per_tok},
            },
            # where this daemon's model keeps its tokenizer.json (None: synthetic, or the checkpoint ships none)
            "tokenizer": config.tokenizer_dir,
            "layers": [shard.begin, shard.end] if shard is not None else None,
            "owns_embedding": shard is not None and shard.owns_embedding,
            "owns_head": shard is not None and shard.owns_head,
            "dtype": dtype_name(daemon.dtype),
            "device": str(daemon.device),
            # the step implementation; `step_rows` is the fast engine's T (inputs up to it take the fixed step)
            "engine": shard.engine if shard is not None else None,
            "step_rows": shard.step_rows if shard is not None else None,
            # R, the rows of every batched step (--step-rows): the most rows of several sequences one step runs
            "batch_rows": shard.batch_rows if shard is not None else None,
            # P, the GPU prefill's piece (--prefill-rows): a piece of exactly P rows replays its CUDA graphs
            "prefill_rows": shard.prefill_rows if shard is not None else None,
            "rollback": {
                "mode": storage.mode if storage.enabled else None,
                "max_verify_tokens": storage.max_verify_tokens,
                "checkpoint_bytes_per_sequence": shard.checkpoint_bytes_per_sequence() if shard is not None else 0,
            },
            "limits": {
                "max_sequences": config.max_sequences,
                "max_context": config.max_context,
                "max_tokens_per_request": config.max_tokens_per_request,
            },
            "state_bytes_per_sequence": state_bytes,
            "drafter": daemon.drafter.describe(config.max_context) if daemon.drafter is not None else None,
            "memory": daemon.memory,
            "quantization": daemon.quantization,
            # what decides a token's bits beyond weights and dtype: a restarted shard must match it to be re-filled
            "numerics": numerics(shard, config.max_context, daemon.quantization),
            "pid": os.getpid(),
            # --busy-poll-ms as resolved (auto: on a GPU host with the cores for it): a coordinator's auto follows it
            "busy_poll_ms": round(config.busy_poll_s * 1000, 3),
            # the next shard this daemon sends a FORWARD's rows to when asked (`send_rows`; --relay-to), or None
            "relay_to": daemon.relay.target(),
            # ROWS and RING taken only from the connection that presented the shard set's relay key (--relay-key)
            "rows_from_key": config.relay_key is not None,
            # rows on the device (PROTOCOL.md): a ring slot's rows asked for / granted, how a wait for them ends
            "device_rows": RING_ROWS,
            "ring_wait": daemon.relay.ring_wait(),
            # prefix entries this daemon can keep (PROTOCOL.md, "Prefix caching"; a drafter-only daemon's hold its
            # context rows); null: none (--prefix-cache-gib 0)
            "prefix_cache": {"budget_bytes": daemon.prefix_cache.budget_bytes}
            if daemon.prefix_cache.budget_bytes else None,
        }

    def open(self, request, peer: Peer):
        entry = self.daemon.sequences.open(peer.owner, request.seq, request.prefix, request.draft_context is not False)
        return {"seq": request.seq, "length": entry.length}, {}

    def close(self, request, peer: Peer):
        entry = self.daemon.sequences.close(peer.owner, request.seq)
        return {"seq": request.seq, "length": entry.length}, {}

    def stats(self, request, peer: Peer):
        daemon = self.daemon
        c, sequences = daemon.counters, daemon.sequences
        states = [entry.state for entry in sequences.values() if entry.state is not None]
        draft_state_bytes = (
            daemon.drafter.model.state_bytes_per_sequence(daemon.config.max_context)
            * sum(entry.draft is not None for entry in sequences.values()) if daemon.drafter is not None else 0
        )
        result = {
            "uptime_seconds": daemon.uptime(),
            "requests": dict(c.requests),
            "errors": dict(c.errors),
            "forwards": c.forwards,
            "captures": c.captures,
            "tokens_forwarded": c.tokens_forwarded,
            "captured_rows": c.captured_rows,
            "checkpointed_steps": c.checkpointed_steps,
            "checkpoint_writes": c.checkpoint_writes,
            "recurrence_log_tokens": c.recurrence_log_tokens,
            "rollbacks": dict(c.rollbacks),
            "rollbacks_by_keep": {str(k): v for k, v in sorted(c.rollbacks_by_keep.items())},
            "snapshots": c.snapshots,
            "restores": c.restores,
            "sequences_opened": c.sequences_opened,
            "sequences_closed": c.sequences_closed,
            "sequences_failed": c.sequences_failed,
            "sequences_expired": c.sequences_expired,
            "open_sequences": len(sequences),
            "failed_sequences": sum(1 for entry in sequences.values() if entry.failed),
            "state_bytes": sum(s.state_bytes() for s in states) + draft_state_bytes,
            "checkpoint_bytes": sum(s.rollback_bytes() for s in states),
            "weight_bytes": daemon.weight_bytes(),
            "compute_seconds": dict(c.compute_seconds),
            "batches": {"requests": c.batches, "items": c.batch_items, "rows": c.batch_rows},
            "rows": daemon.relay.describe(),
            "prefix_cache": daemon.prefix_cache.describe(),
            "engine": daemon.shard.describe() if daemon.shard is not None else {},
            # where requests' time went, per type and phase (protocol/timing.py): seconds since the start
            "phases": PHASES.totals(),
        }
        if timeline.TIMELINE is not None:  # SHARDD_TIMELINE: the GPU stamps and host events kept so far
            result["timeline"] = timeline.report()
        if daemon.drafter is not None:
            result["drafter"] = {
                "proposals": c.proposals,
                "proposals_in_reply": c.proposals_in_reply,
                "proposal_failures": c.proposal_failures,
                "draft_tokens": c.draft_tokens,
                "context_rows_added": c.draft_context_rows,
                "crops": c.draft_crops,
                "rows_cropped": c.draft_rows_cropped,
                # only the asking peer's own sequences: ids are not shared between clients
                "context_rows": {str(seq): entry.draft.length for (owner, seq), entry in sequences.items()
                                 if owner == peer.owner and entry.draft is not None},
            }
        return result, {}

    def shutdown(self, request, peer: Peer):
        if not peer.trusted:
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                "SHUTDOWN is accepted over a file ipc:// socket or from an allowed Curve key; stop this daemon "
                "with a signal (SIGTERM) instead",
            )
        log.info("shutdown requested")
        self.daemon.stopping = True
        return {"stopping": True}, {}
