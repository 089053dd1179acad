"""The shard daemon: one engine's layer range (`shard`), a hosted DFlash drafter, or both, and their open sequences,
behind one table of handlers.

A handler validates everything first and only then mutates, so a rejected request leaves every sequence as it was.
An unexpected exception during compute replies INTERNAL and fails only that request's sequences; the daemon keeps
serving the others. The socket loop is shardd/server/loop.py; the handlers are in shardd/server/handlers/ and the
relay's (ROWS, RING) in shardd/server/relay.py.
"""

from __future__ import annotations

import logging
import time
import traceback

from protocol import Batch, ErrorCode, Limits, MessageType, ProtocolError, decode_request, encode_reply, peek_id, peek_type
from protocol.timing import DAEMON as PHASES
from shardd.config import ShardConfig
from shardd.engine.reference.errors import ModelError
from shardd.server.errors import MODEL_ERROR_CODES, Refusals
from shardd.server.handlers.forward import Forward
from shardd.server.handlers.propose import Propose
from shardd.server.handlers.rollback import Rollback
from shardd.server.handlers.session import Session
from shardd.server import loop
from shardd.server.listen import largest_frame_bytes
from shardd.server.owners import Owners
from shardd.server.peer import Peer
from shardd.server.prefix import PrefixCache
from shardd.server.relay import Relay, RowsLost, WaitsForRows
from shardd.server.rows import Waiting
from shardd.server.sequences import SequenceTable
from shardd.server.stats import Counters

log = logging.getLogger("shardd")


def prefix_budget(shard, config: ShardConfig, memory: dict | None) -> int:
    """The prefix cache's bytes: the memory plan's item (`shardd serve`), else --prefix-cache-gib or its CPU
    default (a daemon built in-process). A drafter-only daemon keeps entries of drafter context rows."""
    from common.memory import PREFIX_CACHE_CPU

    if memory is not None and "prefix_cache" in memory.get("items", {}):
        return memory["items"]["prefix_cache"]
    return config.prefix_cache_bytes if config.prefix_cache_bytes is not None else PREFIX_CACHE_CPU


class ShardDaemon:
    """Serves a layer range (`shard`, a ShardEngine), a DFlash drafter (`drafter`), or both; at least one.
    `memory` and `quantization` are what HELLO reports of the memory plan and the weights' FP8 scheme."""

    def __init__(self, shard, config: ShardConfig, drafter=None, *, memory: dict | None = None,
                 quantization: dict | None = None):
        if shard is None and drafter is None:
            raise ValueError("a daemon serves target layers, a drafter, or both")
        if shard is not None and drafter is not None and shard.fingerprint != drafter.target_fingerprint:
            raise ValueError(f"the drafter was built for {drafter.target_fingerprint}, the layers are {shard.fingerprint}")
        self.shard = shard
        self.drafter = drafter
        self.config = config
        self.memory, self.quantization = memory, quantization
        # The target model this daemon belongs to: its layers' model, or the one the drafter drafts for.
        self.model_config = shard.config if shard is not None else drafter.target
        self.fingerprint = shard.fingerprint if shard is not None else drafter.target_fingerprint
        model = shard if shard is not None else drafter.model
        self.dtype, self.device = model.dtype, model.device
        self.limits = Limits(
            max_tokens_per_request=config.max_tokens_per_request,
            max_batch_items=config.max_sequences,  # a batch names open sequences: no more than may be open
            max_frame_bytes=largest_frame_bytes(
                self.model_config.hidden_size, drafter.config.feature_size if drafter is not None else 0,
                config.max_tokens_per_request,
            ),
        )
        self.counters = Counters()
        self.refusals = Refusals(self.counters)
        self.prefix_cache = PrefixCache(prefix_budget(shard, config, memory))
        self.sequences = SequenceTable(shard, drafter, max_sequences=config.max_sequences,
                                       max_context=config.max_context, idle_timeout=config.sequence_idle_timeout,
                                       counters=self.counters, prefix_cache=self.prefix_cache)
        self.owners = Owners()  # connection -> the client whose secret it presented in HELLO (Curve off)
        # the drafter's target layers of earlier shards: a verify's rows bring theirs along (`carry`)
        carried_layers = (sum(layer < shard.begin for layer in drafter.config.target_layer_ids)
                          if shard is not None and drafter is not None else 0)
        self.relay = Relay(config, shard, self.counters, self.refusals, self.resume,
                           max_tokens_per_request=config.max_tokens_per_request, carried_layers=carried_layers)
        self.started = time.time()
        self.metrics = None  # shardd.obs.metrics.DaemonMetrics, with --metrics-port
        self.stopping = False
        session = Session(self)
        rollback = Rollback(shard, self.sequences, self.counters, self.refusals)
        proposer = Propose(drafter, self.sequences, self.counters, self.model_config.hidden_size)
        forward = Forward(shard, self.sequences, self.counters, self.relay, proposer, self.refusals)
        self.handlers = {
            MessageType.HELLO: session.hello,
            MessageType.OPEN: session.open,
            MessageType.CLOSE: session.close,
            MessageType.FORWARD: forward.forward,
            MessageType.CAPTURE: forward.forward,
            MessageType.ROLLBACK: rollback.rollback,
            MessageType.SNAPSHOT: rollback.snapshot,
            MessageType.RESTORE: rollback.restore,
            MessageType.PROPOSE: proposer.propose,
            MessageType.STATS: session.stats,
            MessageType.SHUTDOWN: session.shutdown,
            MessageType.ROWS: self.relay.take_rows,
            MessageType.RING: self.relay.ring_for_writer,
        }
        # The same types naming several sequences (`items`; PROTOCOL.md, "Batches").
        self.batch_handlers = {
            MessageType.FORWARD: forward.forward_batch,
            MessageType.CAPTURE: forward.forward_batch,
            MessageType.ROLLBACK: rollback.rollback_batch,
            MessageType.ROWS: self.relay.take_rows,
        }

    # ---- one request -----------------------------------------------------------------------------

    def handle(self, frames, owner: bytes = b"", trusted: bool = True) -> list | None:
        """Frames of one request from the peer `owner` -> frames of its reply (None: a FORWARD waiting for its
        rows, see `dispatch`). Never raises."""
        return self.handle_from(frames, Peer(owner, trusted))[0]

    def handle_from(self, frames, peer: Peer) -> tuple[list | None, MessageType | None]:
        """`handle`, and the request's type (None: it did not decode), which the serving loop books its time under."""
        try:
            request = decode_request(frames, self.limits)
        except ProtocolError as exc:
            return self.refusals.reply(peek_id(frames), peek_type(frames), exc.code, exc.message, seq=None), None
        except Exception as exc:  # a decoder bug must not take the daemon down
            return self.refusals.reply(peek_id(frames), None, ErrorCode.BAD_REQUEST, f"undecodable request: {exc}",
                                       seq=None), None
        PHASES.lap("decode")
        return self.dispatch(request, peer), request.type

    def dispatch(self, request, peer: Peer) -> list | None:
        """A decoded request of `peer` -> frames of its reply, or None for a FORWARD that waits for its rows
        (`relay.parked`; the serving loop answers it later). A FORWARD with `send_rows` that fails tells the next
        shard (a refused ROWS), so the FORWARD waiting there is refused too."""
        self.counters.requests[request.type.value] += 1
        seq = getattr(request, "seq", None)
        started = time.perf_counter()
        handler = self.batch_handlers[request.type] if isinstance(request, Batch) else self.handlers[request.type]
        try:
            result, tensors = handler(request, peer)
        except WaitsForRows:
            self.relay.park(request, peer)
            return None
        except ProtocolError as exc:
            self.relay.refuse_downstream(request)
            return self.refusals.reply(request.id, request.type, exc.code, exc.message, seq=seq)
        except ModelError as exc:
            self.relay.refuse_downstream(request)
            return self.refusals.reply(request.id, request.type, MODEL_ERROR_CODES[type(exc)], str(exc), seq=seq)
        except Exception as exc:
            self.relay.refuse_downstream(request)
            message = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, RowsLost):  # not a bug: the previous shard's rows never came (its process died)
                log.warning("seq=%s type=%s: %s", seq, request.type.value, message)
            else:
                log.error("internal error seq=%s type=%s: %s\n%s", seq, request.type.value, message,
                          traceback.format_exc())
            # a batch's items each may have moved on before the error: none of their states can be trusted
            seqs = [item.seq for item in request.items] if isinstance(request, Batch) else [seq]
            for failed in seqs:
                self.sequences.fail(self.sequences.find(peer.owner, failed), message)
            return self.refusals.reply(request.id, request.type, ErrorCode.INTERNAL, message, seq=seq)
        finally:
            PHASES.lap("compute")
            elapsed = time.perf_counter() - started
            self.counters.compute_seconds[request.type.value] += elapsed
            if self.metrics is not None:
                self.metrics.observe(request.type.value, elapsed)
        try:
            reply = encode_reply(request.id, request.type, result, tensors)
            PHASES.lap("encode")
            return reply
        except Exception as exc:  # a result that cannot be encoded is our bug, not the client's
            log.error("cannot encode reply seq=%s type=%s: %s", seq, request.type.value, exc)
            return self.refusals.reply(request.id, request.type, ErrorCode.INTERNAL, f"cannot encode reply: {exc}",
                                       seq=seq)

    def resume(self, waiting: Waiting) -> list:
        """The reply of a FORWARD that waited, handled as its own peer (its rows are in the inbox now; a ROWS
        brought them); its phases booked under its type (counted now: its wait was not), the ROWS's so far under
        theirs."""
        PHASES.book(MessageType.ROWS, count=False)
        try:
            frames = self.dispatch(waiting.request, waiting.peer)
            if frames is None:  # cannot be: its rows are in the inbox; never leave it unanswered
                self.relay.parked = None
                frames = self.relay.missing(waiting, "its rows were lost on the way in")
            return frames
        finally:
            PHASES.book(waiting.request.type)

    # ---- what it is ------------------------------------------------------------------------------

    def uptime(self) -> float:
        return time.time() - self.started

    def weight_bytes(self) -> int:
        layers = self.shard.weight_bytes() if self.shard is not None else 0
        return layers + (self.drafter.weight_bytes() if self.drafter is not None else 0)

    def serving(self) -> str:
        """What this daemon serves, in words: 'layers 0:3', 'layers 3:6 + dflash drafter', 'dflash drafter'."""
        parts = [f"layers {self.shard.begin}:{self.shard.end}"] if self.shard is not None else []
        parts += ["dflash drafter"] if self.drafter is not None else []
        return " + ".join(parts)

    def status_line(self, endpoint: str) -> str:
        """What `systemctl status` shows while serving."""
        return f"serving {self.serving()} on {endpoint}: {len(self.sequences)} sequences open"

    def serve(self, listener=None) -> None:
        """Serve until stopped, on `listener` (bound early by `shardd serve`) or a socket bound now."""
        loop.serve_loop(self, listener)
