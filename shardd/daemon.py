"""The shard daemon: a ZeroMQ ROUTER socket in front of one ShardModel, a hosted DFlash drafter, or both, and
their open sequences.

One table maps each message type to its handler. A handler validates everything first and only then
mutates, so a rejected request leaves every sequence as it was. An unexpected exception during compute
replies INTERNAL and marks only that sequence failed; the daemon keeps serving the others.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import operator
import os
import signal
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from common import __version__
from common.endpoints import is_loopback
from common.model_config import dtype_name
from protocol import (
    PROTOCOL_VERSION,
    Batch,
    ErrorCode,
    ForwardBatch,
    ItemRefused,
    Limits,
    MessageType,
    ProtocolError,
    Rows,
    RowsBatch,
    WireTensor,
    decode_request,
    encode_error,
    encode_reply,
    peek_id,
    peek_type,
)
from protocol.codec import clip_message, new_record
from protocol.layout import CHECKPOINT
from protocol.timing import DAEMON as PHASES
from shardd import systemd, timeline
from shardd.security import is_file_ipc, log_refused_handshakes, restrict_ipc_socket, start_authenticator
from shardd.draft.model import DraftState
from shardd.health import device_memory
from shardd.listen import Listener, bind
from shardd.loading import HostedDrafter
from shardd.model import rollback as rb
from shardd.model.errors import (
    BadInput,
    CapacityExceeded,
    ModelError,
    NoPendingStep,
    NoSnapshot,
    PositionMismatch,
    RollbackUnavailable,
)
from shardd.model.shard import ShardModel
from shardd.model.state import SequenceState
from shardd.batch import BatchItem
from shardd.batch import forward_batch as run_batch
from shardd.head import HeadRequest, answer_batch, answer_rows
from shardd.penalties import Penalties
from shardd.receive import receive_request, release_memory
from shardd.ring import DEFAULT_ROWS as RING_ROWS
from shardd.ring import DeviceRing, RingUnavailable, RowsLost, front_end_waits
from shardd.rows import WAIT_S, RowsInbox, RowsLink, Waiting, check_relay_to
from shardd.sampling import SamplingParams

log = logging.getLogger("shardd")

# The one place a model's refusal becomes a wire error code.
MODEL_ERROR_CODES: dict[type[ModelError], ErrorCode] = {
    BadInput: ErrorCode.BAD_REQUEST,
    PositionMismatch: ErrorCode.POSITION_MISMATCH,
    CapacityExceeded: ErrorCode.CAPACITY,
    RollbackUnavailable: ErrorCode.ROLLBACK_UNAVAILABLE,
    NoPendingStep: ErrorCode.NO_PENDING_STEP,
    NoSnapshot: ErrorCode.NO_SNAPSHOT,
}


class _WaitsForRows(Exception):
    """A FORWARD's rows (`rows_ticket`) have not come yet: it waits, unanswered (PROTOCOL.md, "Rows from shard to
    shard")."""


@dataclass
class ServeOptions:
    bind: str = "tcp://127.0.0.1:7700"
    max_sequences: int = 8
    max_context: int = 4096
    max_tokens_per_request: int = 4096
    curve_secret_key: str | None = None  # file written by `shardd keygen`
    curve_allow_dir: str | None = None  # directory of allowed client public keys
    tokenizer_dir: str | None = None  # the model directory when it ships a tokenizer.json (HELLO "tokenizer")
    memory: dict | None = None  # the memory plan (shardd.memory.MemoryPlan.describe), HELLO "memory"
    quantization: dict | None = None  # the FP8 scheme of the weights (shardd.quant.Fp8Scheme.describe), HELLO
    sequence_idle_timeout: float = 300.0  # seconds without a request before a sequence is closed; 0: never
    busy_poll_s: float = 0.0  # after a request, poll for the next without sleeping this long (--busy-poll-ms)
    relay_to: str | None = None  # the next shard, which a FORWARD's `send_rows` sends its rows to (--relay-to)
    relay_to_file: str | None = None  # or the file the next shard writes its endpoint to (--relay-to-file)
    rows_wait_s: float = WAIT_S  # the longest a FORWARD with `rows_ticket` waits for its rows (--rows-wait)


@dataclass
class Sequence:
    state: SequenceState | None  # the target layers' state; None on a drafter-only daemon
    draft: DraftState | None = None  # the hosted drafter's context (committed rows' features only)
    failed: str | None = None  # why, after an INTERNAL error; only CLOSE is served then
    last_used: float = field(default_factory=time.monotonic)  # the idle lease runs from here

    @property
    def length(self) -> int:
        return self.state.length if self.state is not None else self.draft.length


@dataclass
class Counters:
    requests: Counter = field(default_factory=Counter)  # by message type
    errors: Counter = field(default_factory=Counter)  # by error code
    errors_by_type: Counter = field(default_factory=Counter)  # by (message type, error code), for metrics
    forwards: int = 0
    captures: int = 0
    tokens_forwarded: int = 0
    captured_rows: int = 0
    checkpointed_steps: int = 0
    checkpoint_writes: int = 0  # per-token float32 states written into checkpoint buffers
    recurrence_log_tokens: int = 0  # per-token recurrence inputs logged (replay-ssm)
    rollbacks: Counter = field(default_factory=Counter)  # by mode
    rollbacks_by_keep: Counter = field(default_factory=Counter)
    snapshots: int = 0
    restores: int = 0
    sequences_opened: int = 0
    sequences_closed: int = 0
    sequences_failed: int = 0
    sequences_expired: int = 0  # closed by the idle lease (--sequence-idle-timeout)
    proposals: int = 0
    draft_tokens: int = 0
    proposals_in_reply: int = 0  # blocks proposed inside a CAPTURE reply (`propose`), no PROPOSE round trip
    draft_context_rows: int = 0  # feature rows added to drafter contexts
    draft_crops: int = 0  # PROPOSEs that first dropped context rows of rolled-back tokens
    draft_rows_cropped: int = 0
    compute_seconds: Counter = field(default_factory=Counter)  # by message type
    batches: int = 0  # FORWARD/CAPTURE/ROLLBACK requests naming several sequences (`items`)
    batch_items: int = 0  # the sequences they named, refused ones included
    batch_rows: int = 0  # the token rows of their FORWARD/CAPTURE items
    rows_sent: int = 0  # ROWS sent to the next shard (`send_rows`), refusals included
    rows_received: int = 0  # ROWS taken from the previous shard
    rows_waits: int = 0  # FORWARDs that waited for their rows (`rows_ticket` before its ROWS)
    rows_missing: int = 0  # FORWARDs refused ROWS_MISSING: refused upstream, cancelled, or no rows in time
    rows_on_device: int = 0  # ROWS taken through this shard's device ring (RING)


class ShardDaemon:
    """Serves a layer range (`shard`), a DFlash drafter (`drafter`), or both; at least one."""

    def __init__(self, shard: ShardModel | None, options: ServeOptions, drafter: HostedDrafter | None = None):
        if shard is None and drafter is None:
            raise ValueError("a daemon serves target layers, a drafter, or both")
        if shard is not None and drafter is not None and shard.fingerprint != drafter.target_fingerprint:
            raise ValueError(f"the drafter was built for {drafter.target_fingerprint}, the layers are {shard.fingerprint}")
        self.shard = shard
        self.drafter = drafter
        # The target model this daemon belongs to: its layers' model, or the one the drafter drafts for.
        self.config = shard.config if shard is not None else drafter.target
        self.fingerprint = shard.fingerprint if shard is not None else drafter.target_fingerprint
        model = shard if shard is not None else drafter.model
        self.dtype, self.device = model.dtype, model.device
        self.options = options
        self.limits = Limits(
            max_tokens_per_request=options.max_tokens_per_request,
            max_batch_items=options.max_sequences,  # a batch names open sequences: no more than may be open
            max_frame_bytes=largest_frame_bytes(
                self.config.hidden_size, drafter.config.feature_size if drafter is not None else 0,
                options.max_tokens_per_request,
            ),
        )
        # Keyed by (owner, seq): a sequence belongs to the peer that opened it (PROTOCOL.md, "Who may do what").
        self.sequences: dict[tuple[bytes, int], Sequence] = {}
        self.owner = b""  # the peer of the request being handled: its Curve key, else its ZeroMQ routing id
        self.trusted = True  # whether that peer may SHUTDOWN: a file ipc:// socket, or an allowed Curve key
        self.counters = Counters()
        self.started = time.time()
        self.metrics = None  # shardd.metrics.DaemonMetrics, with --metrics-port
        self.stopping = False
        self.phase_type = None
        self.handlers = {
            MessageType.HELLO: self.hello,
            MessageType.OPEN: self.open,
            MessageType.CLOSE: self.close,
            MessageType.FORWARD: self.forward,
            MessageType.CAPTURE: self.forward,
            MessageType.ROLLBACK: self.rollback,
            MessageType.SNAPSHOT: self.snapshot,
            MessageType.RESTORE: self.restore,
            MessageType.PROPOSE: self.propose,
            MessageType.STATS: self.stats,
            MessageType.SHUTDOWN: self.shutdown,
            MessageType.ROWS: self.take_rows,
            MessageType.RING: self.ring_for_writer,
        }
        # rows from shard to shard (shardd/rows.py): the link to the next shard (made on first use, `relay_target`),
        # the rows and waiting FORWARDs from the previous one, and the replies a request's handling completed
        self.relay: RowsLink | None = None
        self.ring = None  # shardd.ring.DeviceRing this shard reads the previous one's rows from (RING), once asked
        self.inbox = RowsInbox(capacity=2 * options.max_sequences + 8)
        self._waits: Waiting | None = None  # set by a FORWARD that waits for its rows: the loop parks it
        self._completed: list[list] = []  # envelope + reply of each waiting FORWARD a ROWS let run
        self.parked = False  # whether the request `answer` just handled waits for its rows
        # The same types naming several sequences (`items`; PROTOCOL.md, "Batches").
        self.batch_handlers = {
            MessageType.FORWARD: self.forward_batch,
            MessageType.CAPTURE: self.forward_batch,
            MessageType.ROLLBACK: self.rollback_batch,
            MessageType.ROWS: self.take_rows,
        }

    # ---- one request -----------------------------------------------------------------------------

    def handle(self, frames, owner: bytes = b"", trusted: bool = True) -> list | None:
        """Frames of one request from the peer `owner` -> frames of its reply (None: a FORWARD waiting for its
        rows, see `dispatch`). Never raises."""
        self.owner, self.trusted = owner, trusted
        self.phase_type = None  # the type the serving loop books this request's phases under
        try:
            request = decode_request(frames, self.limits)
        except ProtocolError as exc:
            return self._error(peek_id(frames), peek_type(frames), exc.code, exc.message, seq=None)
        except Exception as exc:  # a decoder bug must not take the daemon down
            return self._error(peek_id(frames), None, ErrorCode.BAD_REQUEST, f"undecodable request: {exc}", seq=None)
        PHASES.lap("decode")
        return self.dispatch(request, owner)

    def dispatch(self, request, owner: bytes) -> list | None:
        """A decoded request of `owner` -> frames of its reply, or None for a FORWARD that waits for its rows
        (`self._waits`; the serving loop answers it later). A FORWARD with `send_rows` that fails tells the next
        shard (a refused ROWS), so the FORWARD waiting there is refused too."""
        self.phase_type = request.type
        self.counters.requests[request.type.value] += 1
        seq = getattr(request, "seq", None)
        started = time.perf_counter()
        handler = self.batch_handlers[request.type] if isinstance(request, Batch) else self.handlers[request.type]
        try:
            result, tensors = handler(request)
        except _WaitsForRows:
            self._waits = Waiting([], request, owner, self.trusted, time.monotonic() + self.options.rows_wait_s)
            return None
        except ProtocolError as exc:
            self._refuse_downstream(request)
            return self._error(request.id, request.type, exc.code, exc.message, seq=seq)
        except ModelError as exc:
            self._refuse_downstream(request)
            return self._error(request.id, request.type, MODEL_ERROR_CODES[type(exc)], str(exc), seq=seq)
        except Exception as exc:
            self._refuse_downstream(request)
            message = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, RowsLost):  # not a bug: the previous shard's rows never came (its process died)
                log.warning("seq=%s type=%s: %s", seq, request.type.value, message)
            else:
                log.error("internal error seq=%s type=%s: %s\n%s", seq, request.type.value, message,
                          traceback.format_exc())
            # a batch's items each may have moved on before the error: none of their states can be trusted
            seqs = [item.seq for item in request.items] if isinstance(request, Batch) else [seq]
            for failed in seqs:
                self._fail(self.sequences.get((owner, failed)), message)
            return self._error(request.id, request.type, ErrorCode.INTERNAL, message, seq=seq)
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
            return self._error(request.id, request.type, ErrorCode.INTERNAL, f"cannot encode reply: {exc}", seq=seq)

    def _error(self, request_id, mtype, code: ErrorCode, message: str, seq) -> list:
        message = self._note_error(mtype, code, message, seq)
        return encode_error(request_id, mtype, code, message)

    def _note_error(self, mtype, code: ErrorCode, message: str, seq) -> str:
        """Count and log a refusal (of a request, or of one item of a batch); the message as the reply quotes it."""
        message = clip_message(message)  # the reply and the log quote a bad value's prefix only
        self.counters.errors[ErrorCode(code).value] += 1
        self.counters.errors_by_type[(getattr(mtype, "value", mtype), ErrorCode(code).value)] += 1
        log.warning("error seq=%s type=%s code=%s: %s", seq, getattr(mtype, "value", mtype), ErrorCode(code).value, message)
        return message

    def _layers(self, request) -> ShardModel:
        if self.shard is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"{request.type.value}: this daemon hosts only a drafter and owns no target layers"
            )
        return self.shard

    def _drafter(self) -> HostedDrafter:
        if self.drafter is None:
            raise ProtocolError(ErrorCode.NO_DRAFTER, "this shard hosts no drafter")
        return self.drafter

    def _sequence(self, seq: int, *, allow_failed: bool = False) -> Sequence:
        entry = self.sequences.get((self.owner, seq))  # another peer's sequence of that id is not there
        if entry is None:
            raise ProtocolError(ErrorCode.NO_SUCH_SEQUENCE, f"sequence {seq} is not open")
        entry.last_used = time.monotonic()
        if entry.failed and not allow_failed:
            raise ProtocolError(ErrorCode.SEQUENCE_FAILED, f"sequence {seq} failed ({entry.failed}); CLOSE and reopen it")
        return entry

    # ---- handlers: validate, then mutate ---------------------------------------------------------

    def hello(self, request):
        # What changes while the daemon runs is added here, not in describe().
        health = {"version": __version__, "uptime_seconds": self.uptime(), "device_memory": device_memory(self.device)}
        return {**self.describe(), **health}, {}

    def uptime(self) -> float:
        return time.time() - self.started

    def describe(self) -> dict:
        shard, c = self.shard, self.config
        storage = shard.storage if shard is not None else rb.RollbackStorage(None, 0)
        state_bytes = shard.state_bytes_per_sequence(self.options.max_context) if shard is not None else 0
        if self.drafter is not None:
            state_bytes += self.drafter.model.state_bytes_per_sequence(self.options.max_context)
        return {
            "protocol_version": PROTOCOL_VERSION,
            "model": {
                "fingerprint": self.fingerprint,
                "num_layers": c.num_layers,
                "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size,
                "layer_types": list(c.layer_types),
                "eos_token_ids": list(c.eos_token_ids),
            },
            # where this daemon's model keeps its tokenizer.json (None: synthetic, or the checkpoint ships none)
            "tokenizer": self.options.tokenizer_dir,
            "layers": [shard.begin, shard.end] if shard is not None else None,
            "owns_embedding": shard is not None and shard.owns_embedding,
            "owns_head": shard is not None and shard.owns_head,
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            # the step implementation; `step_rows` is the fast engine's T (inputs up to it take the fixed step)
            "engine": shard.engine if shard is not None else None,
            "step_rows": shard.step_rows if shard is not None else None,
            # R, the rows of every batched step (--step-rows; issue 20): the most rows of several sequences one step runs
            "batch_rows": getattr(shard, "batch_rows", None) if shard is not None else None,
            # P, the GPU prefill's piece (--prefill-rows): a piece of exactly P rows replays its CUDA graphs
            "prefill_rows": getattr(shard, "prefill_rows", None) if shard is not None else None,
            "rollback": {
                "mode": storage.mode if storage.enabled else None,
                "max_verify_tokens": storage.max_verify_tokens,
                "checkpoint_bytes_per_sequence": shard.checkpoint_bytes_per_sequence() if shard is not None else 0,
            },
            "limits": {
                "max_sequences": self.options.max_sequences,
                "max_context": self.options.max_context,
                "max_tokens_per_request": self.options.max_tokens_per_request,
            },
            "state_bytes_per_sequence": state_bytes,
            "drafter": self.drafter.describe(self.options.max_context) if self.drafter is not None else None,
            "memory": self.options.memory,
            "quantization": self.options.quantization,
            "pid": os.getpid(),
            # --busy-poll-ms as resolved (auto: 20 on a GPU host with 8+ CPUs): a coordinator's auto follows it
            "busy_poll_ms": round(self.options.busy_poll_s * 1000, 3),
            # the next shard this daemon sends a FORWARD's rows to when asked (`send_rows`; --relay-to), or None
            "relay_to": self.relay_target(),
            # rows on the device (PROTOCOL.md): a ring slot's rows asked for / granted, how a wait for them ends
            "device_rows": RING_ROWS,
            "ring_wait": self._ring_wait(),
        }

    def weight_bytes(self) -> int:
        layers = self.shard.weight_bytes() if self.shard is not None else 0
        return layers + (self.drafter.weight_bytes() if self.drafter is not None else 0)

    def open(self, request):
        if (self.owner, request.seq) in self.sequences:
            raise ProtocolError(ErrorCode.SEQUENCE_EXISTS, f"sequence {request.seq} is already open")
        if len(self.sequences) >= self.options.max_sequences:
            raise ProtocolError(ErrorCode.CAPACITY, f"{len(self.sequences)} sequences open, limit {self.options.max_sequences}")
        try:
            state = self.shard.new_state(self.options.max_context) if self.shard is not None else None
            draft = self.drafter.model.new_state(self.options.max_context) if self.drafter is not None else None
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            # torch.OutOfMemoryError on a GPU; on the CPU a failed allocation is a plain RuntimeError.
            if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "memory" not in str(exc).lower():
                raise
            raise ProtocolError(ErrorCode.CAPACITY, f"out of memory for a new sequence: {exc}") from None
        self.sequences[(self.owner, request.seq)] = Sequence(state, draft)
        self.counters.sequences_opened += 1
        log.info("open seq=%s", request.seq)
        return {"seq": request.seq, "length": 0}, {}

    def close(self, request):
        entry = self._sequence(request.seq, allow_failed=True)
        self._release((self.owner, request.seq))
        self.counters.sequences_closed += 1
        log.info("close seq=%s length=%s", request.seq, entry.length)
        return {"seq": request.seq, "length": entry.length}, {}

    def _release(self, key: tuple[bytes, int]) -> None:
        entry = self.sequences.pop(key)
        if self.shard is not None and entry.state is not None:
            self.shard.release_state(entry.state)
        if self.drafter is not None and entry.draft is not None:
            self.drafter.model.release_state(entry.draft)

    def expire_idle(self, now: float | None = None) -> int:
        """Close every sequence idle past --sequence-idle-timeout (its owner is gone or forgot it)."""
        timeout = self.options.sequence_idle_timeout
        if not timeout:
            return 0
        now = time.monotonic() if now is None else now
        idle = [key for key, entry in self.sequences.items() if now - entry.last_used > timeout]
        for key in idle:
            length = self.sequences[key].length
            self._release(key)
            self.counters.sequences_expired += 1
            log.info("expired seq=%s length=%s: idle for more than %g s", key[1], length, timeout)
        return len(idle)

    def relay_target(self) -> str | None:
        """The next shard's endpoint (--relay-to, or read from --relay-to-file once the next shard has written
        it), or None; the link to it is made on first use."""
        options = self.options
        if options.relay_to is None and options.relay_to_file is not None:
            try:
                endpoint = Path(options.relay_to_file).read_text().strip()
                check_relay_to(endpoint, curve=options.curve_secret_key is not None)
            except OSError:
                return None  # not written yet: the next shard has not bound its socket
            except ValueError as error:
                log.error("--relay-to-file %s: %s", options.relay_to_file, error)
                return None
            options.relay_to = endpoint
        if options.relay_to is not None and self.relay is None:
            on_gpu = self.shard is not None and self.shard.device.type == "cuda"
            self.relay = RowsLink(options.relay_to, device_rows=RING_ROWS if on_gpu else 0)
            if on_gpu and hasattr(self.shard, "rows_out_on_device"):
                self.shard.rows_out_on_device = True  # the fast step's rows stay on the device for the ring
        return options.relay_to

    def _check_send_rows(self, request, shard) -> None:
        """A FORWARD (or batch) with `send_rows` needs a next shard to send to, and rows to send."""
        if request.send_rows is not None:
            if self.relay_target() is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'send_rows': this daemon was started without "
                                                           "--relay-to (or its --relay-to-file is not written), so it "
                                                           "has no next shard to send rows to")
            if shard.owns_head:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'send_rows': the head shard's output is ids, not rows")

    def forward(self, request):
        shard = self._layers(request)
        self._check_send_rows(request, shard)
        ticket = request.rows_ticket
        if ticket is not None:
            request = self._with_rows(request, shard)  # or _WaitsForRows: the rows are not here yet
        entry, head, layers = self._check_forward(request, shard)
        proposing = request.type == MessageType.CAPTURE and request.propose is not None
        if proposing:
            self._check_proposal(request, shard, entry)
        PHASES.lap("lookup")
        wait = getattr(request.hidden, "wait", None)  # rows copied out of the ring behind a device wait (DeviceWait)
        out = shard.forward(  # validates everything (shard.check_forward) before it changes the state
            entry.state, request.pos, tokens=request.tokens, hidden=_hidden(request),
            checkpoint=request.checkpoint, capture_layers=layers)
        if wait is not None and not _rows_go_on_device(request, out.hidden):
            _check_landed([wait])  # else their wait's outcome goes on with them (or is checked before the host)
        answer = None
        if out.ids is not None and head.needed:  # on out.logits now: the fast path's buffer is valid until the next step
            answer = answer_rows(out.logits, out.ids.tolist(), request.pos, head)
        result, tensors = self._forward_result(request, entry, out, answer)
        if proposing:
            result["proposal"] = self._propose_after_verify(request, entry, result["ids"], out.captured)
        if request.send_rows is not None:  # the rows go on to the next shard first: they are what it waits for
            hidden = tensors.pop("hidden")
            seq, pos, ticket = request.seq, request.pos, request.send_rows
            if not self._on_device([hidden], lambda slot, gen: Rows(id=0, seq=seq, pos=pos, ticket=ticket, slot=slot,
                                                                     slot_rows=hidden.shape[0], slot_gen=gen),
                                   wait):
                hidden = on_host([hidden])[0]
                if wait is not None:  # the rows leave through the host: theirs must be real
                    _check_landed([wait])
                self.relay.send(Rows(id=0, seq=seq, pos=pos, ticket=ticket, hidden=WireTensor.from_torch(hidden)))
            self.counters.rows_sent += 1
            result["rows_sent"] = True
        return result, {name: WireTensor.from_torch(t) for name, t in zip(tensors, on_host(list(tensors.values())))}

    def _with_rows(self, request, shard):
        """A FORWARD with `rows_ticket` as if its rows had come in tensor `hidden`; _WaitsForRows while they have
        not come (checked first as far as it can be without them: a FORWARD that cannot run is refused now)."""
        rows = self.inbox.take(request.rows_ticket)
        if rows is None:
            entry, _, _ = self._check_forward(request, shard)
            placeholder = torch.empty((request.ticket_rows, shard.config.hidden_size), dtype=shard.dtype, device="meta")
            shard.check_forward(entry.state, request.pos, hidden=placeholder, checkpoint=request.checkpoint)
            raise _WaitsForRows
        self.counters.rows_received += 1
        if rows.refused:
            self.counters.rows_missing += 1
            raise ProtocolError(ErrorCode.ROWS_MISSING, f"the previous shard refused or failed this step (ticket "
                                                        f"{request.rows_ticket}): nothing changed here")
        if isinstance(rows, RowsBatch):  # a batch's ROWS: one sequence's FORWARD takes it only if it is that one's
            if len(rows.items) != 1:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"the ROWS of ticket {request.rows_ticket} are a batch of "
                                                           f"{len(rows.items)} sequences; this FORWARD is for one")
            rows = rows.items[0]
        rows_n = rows.hidden.shape[0]
        if (rows.seq, rows.pos, rows_n) != (request.seq, request.pos, request.ticket_rows):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the ROWS of ticket {request.rows_ticket} are for sequence "
                                                       f"{rows.seq} at {rows.pos}, {rows_n} rows; this FORWARD is for "
                                                       f"{request.seq} at {request.pos}, {request.ticket_rows} rows")
        # built as the decoder builds records (a FORWARD's ~25 fields through __init__ were ~7 us of this step)
        return new_record(type(request), {**request.__dict__, "hidden": rows.hidden, "rows_ticket": None,
                                          "ticket_rows": None})

    def _batch_with_rows(self, request):
        """A batched FORWARD with `rows_ticket`, each item as if its rows had come in tensor `hidden`; an item the
        ROWS has no rows for (the previous shard refused or failed it) is refused alone with ROWS_MISSING, one whose
        rows do not match with BAD_REQUEST, each changing nothing. _WaitsForRows while the ROWS has not come."""
        rows = self.inbox.take(request.rows_ticket)
        if rows is None:
            raise _WaitsForRows
        self.counters.rows_received += 1
        ticket = request.rows_ticket
        sent = {} if rows.refused else {part.seq: part for part in (rows.items if isinstance(rows, RowsBatch) else (rows,))}
        items = []
        for item in request.items:
            if isinstance(item, ProtocolError):
                items.append(item)
                continue
            part = sent.get(item.seq)
            if part is None:
                self.counters.rows_missing += 1
                items.append(ItemRefused(ErrorCode.ROWS_MISSING, f"the previous shard refused or failed this step of "
                                                                 f"sequence {item.seq} (ticket {ticket}): nothing "
                                                                 "changed here", item.seq))
            elif (part.pos, part.hidden.shape[0]) != (item.pos, item.ticket_rows):
                items.append(ItemRefused(ErrorCode.BAD_REQUEST, f"the ROWS of ticket {ticket} has sequence {item.seq} "
                                                                f"at {part.pos}, {part.hidden.shape[0]} rows; this item "
                                                                f"is at {item.pos}, {item.ticket_rows} rows", item.seq))
            else:
                # built as the decoder builds records (no dataclass __init__ per item)
                items.append(new_record(type(item), {**item.__dict__, "hidden": part.hidden, "rows_ticket": None,
                                                     "ticket_rows": None}))
        return dataclasses.replace(request, items=tuple(items), rows_ticket=None)

    def _send_batch_rows(self, request, answers: list) -> None:
        """A batched FORWARD's `send_rows`: the rows of its items that ran go to the next shard as one ROWS (each
        item's reply then carries `rows_sent` and no rows); none ran: a refused ROWS."""
        ran = [(item, answer[0], answer[1].pop("hidden")) for item, answer in zip(request.items, answers)
               if not isinstance(answer, Exception)]
        if not ran:
            self._refuse_downstream(request)
            return
        for _, result, _ in ran:
            result["rows_sent"] = True
        ticket = request.send_rows
        wait = next((w for w in (getattr(item.hidden, "wait", None) for item, _, _ in ran) if w is not None), None)
        in_slot = lambda slot, gen: RowsBatch(id=0, items=tuple(  # noqa: E731 (the rows of the slot, item by item)
            Rows(id=0, seq=item.seq, pos=item.pos, ticket=ticket, slot=slot, slot_rows=hidden.shape[0], slot_gen=gen)
            for item, _, hidden in ran))
        if not self._on_device([hidden for _, _, hidden in ran], in_slot, wait):
            hosted = on_host([hidden for _, _, hidden in ran])
            if wait is not None and not wait.landed():  # the rows leave through the host: theirs must be real
                self._fail_lost(request, [item for item, _, _ in ran], answers, RowsLost(wait.why()))
                return
            self.relay.send(RowsBatch(id=0, items=tuple(
                Rows(id=0, seq=item.seq, pos=item.pos, ticket=ticket, hidden=WireTensor.from_torch(hidden))
                for (item, _, _), hidden in zip(ran, hosted))))
        self.counters.rows_sent += 1

    def _fail_lost(self, request, items, answers: list, error: RowsLost) -> None:
        """A batch whose step ran on no rows (its device wait ended without them): each of `items` fails (INTERNAL,
        its sequence failed), the next shard's wait is refused."""
        message = f"{type(error).__name__}: {error}"
        log.warning("a step of sequences %s ran without its rows: %s", [item.seq for item in items], error)
        failed = {item.seq for item in items}
        for index, item in enumerate(request.items):
            if item.seq in failed:
                self._fail(self.sequences.get((self.owner, item.seq)), message)
                answers[index] = ProtocolError(ErrorCode.INTERNAL, message)
        self._refuse_downstream(request)

    def _fail(self, entry, message: str) -> None:
        """A sequence (its entry, or None when it is gone) failed by `message`; only CLOSE works on it then. The
        first failure is the one it keeps (and counts)."""
        if entry is not None and not entry.failed:
            entry.failed = message
            self.counters.sequences_failed += 1

    def _on_device(self, parts: list, make_rows, wait=None) -> bool:
        """Rows to the next shard through its device ring (RowsLink.send_on_device; `wait`: this shard's own
        device wait for its input rows, whose outcome the next shard's wait reads); once the ring is refused for
        good, the fast step hands its rows to the host again (its own pinned buffer, as without a ring)."""
        if self.relay.send_on_device(parts, make_rows, wait):
            return True
        if self.relay.ring_problem is not None and getattr(self.shard, "rows_out_on_device", False):
            self.shard.rows_out_on_device = False
        return False

    def take_rows(self, request):
        """ROWS from the previous shard: kept for its FORWARD; one already waiting runs now (its reply goes out
        after this one's acknowledgement)."""
        if isinstance(request, RowsBatch) and len({item.ticket for item in request.items}) != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the items of a batched ROWS share one ticket")
        parts = request.items if isinstance(request, RowsBatch) else (request,)
        if any(part.slot is not None for part in parts):
            try:
                request = self._rows_from_ring(request, parts)
            except ProtocolError:  # the FORWARD waiting for these rows is refused too, now, changing nothing
                first = parts[0]
                self._keep_rows(Rows(id=0, seq=first.seq, pos=first.pos, ticket=first.ticket, refused=True))
                raise
        return {"ticket": request.ticket, "waited": self._keep_rows(request)}, {}

    def _keep_rows(self, rows) -> bool:
        """`rows` into the inbox for their FORWARD; one already waiting runs now (whether one did)."""
        waiting = self.inbox.put(rows)
        if waiting is not None:
            self._completed.append(waiting.envelope + self._resume(waiting))
        return waiting is not None

    def _rows_from_ring(self, request, parts):
        """A ROWS naming a slot of this shard's device ring -> the ROWS as if its rows had come in tensor hidden,
        copied out of the slot behind the device wait (or, where the driver has no front-end wait, once a host
        poll saw them land); ProtocolError when they cannot be had."""
        slots = {part.slot for part in parts}
        total = sum(part.slot_rows or 0 for part in parts)
        problem = None
        if len(slots) != 1 or any(part.slot is None for part in parts):
            problem = "the items of a batched ROWS name one slot, all of them"
        elif self.ring is None:
            problem = "this shard has no device ring (no RING was answered since it started)"
        elif self.ring.broken is not None:
            problem = f"this shard's ring takes no slot rows until the next RING: {self.ring.broken}"
        elif slots.pop() >= len(self.ring.written) or total > self.ring.rows:
            problem = (f"slot {parts[0].slot} and {total} rows do not fit this shard's ring of "
                       f"{len(self.ring.written)} slots of {self.ring.rows} rows")
        wait = None
        if problem is None:
            if front_end_waits():
                if parts[0].slot_gen is None or any(part.slot_gen != parts[0].slot_gen for part in parts):
                    problem = "the device wait needs the slot's generation (field slot_gen, one for all items)"
                else:  # queued behind a wait kernel: nothing waits here (the outcome is read after the step)
                    rows, wait = self.ring.await_rows(parts[0].slot, total, parts[0].slot_gen,
                                                      self.options.rows_wait_s)
            else:
                try:
                    rows = self.ring.take(parts[0].slot, total, self.options.rows_wait_s)
                except RingUnavailable as error:
                    problem = str(error)
        if problem is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"ROWS of ticket {parts[0].ticket}: {problem}")
        self.counters.rows_on_device += 1
        done, start = [], 0
        for part in parts:
            done.append(dataclasses.replace(part, hidden=DeviceRows(rows[start:start + part.slot_rows], wait),
                                            slot=None, slot_rows=None, slot_gen=None))
            start += part.slot_rows
        return dataclasses.replace(request, items=tuple(done)) if isinstance(request, RowsBatch) else done[0]

    def ring_for_writer(self, request):
        """RING: the device ring the previous shard's ROWS may name slots of (allocated on the first, kept while
        its size is asked for), and its handles."""
        shard = self._layers(request)
        if (self.options.memory or {}).get("cap_bytes"):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "RING: this daemon runs under --max-gpu-memory, whose plan sets "
                                                       "no memory aside for a ring: rows come through the host")
        # a slot holds what was asked, at most RING_ROWS and a request's rows (the writer sends larger steps through
        # the host)
        rows = min(request.rows, RING_ROWS, self.limits.max_tokens_per_request)
        if self.ring is None or self.ring.rows != rows:
            if self.ring is not None:
                self.ring.close()
            self.ring = None
            try:
                self.ring = DeviceRing(rows, shard.config.hidden_size, shard.dtype, shard.device)
            except RingUnavailable as error:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"RING: rows cannot pass on this shard's device: "
                                                           f"{error}") from None
            except torch.OutOfMemoryError:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"RING: no device memory for {rows} rows a slot") from None
            log.info("device ring for the previous shard: %d x %d rows (%.1f MiB)", len(self.ring.written),
                     self.ring.rows, self.ring.nbytes / 2**20)
        self.ring.new_writer(request.pid or None, request.gpu)
        log.info("rows from the previous shard (on %s GPU) are waited for on the %s", "this" if
                 self.ring.writer_shares_gpu else "another", self._ring_wait())
        return self.ring.share(), {}

    def _ring_wait(self) -> str:
        """How this shard waits for rows in its ring: "device" (the GPU's front end) where the driver can, else "host"."""
        on_gpu = self.shard is not None and self.shard.device.type == "cuda"
        return "device" if on_gpu and front_end_waits() else "host"

    def _resume(self, waiting: Waiting) -> list:
        """The reply of a FORWARD that waited, handled as its own peer (its rows are in the inbox now); its phases
        booked under its type (counted now: its wait was not), the ROWS's so far under theirs."""
        sender = self.owner, self.trusted, self.phase_type
        self.owner, self.trusted = waiting.owner, waiting.trusted
        PHASES.book(sender[2], count=False)
        try:
            frames = self.dispatch(waiting.request, waiting.owner)
            if frames is None:  # cannot be: its rows are in the inbox; never leave it unanswered
                self._waits = None
                frames = self.rows_missing(waiting, "its rows were lost on the way in")
            return frames
        finally:
            PHASES.book(waiting.request.type)
            self.owner, self.trusted, self.phase_type = sender

    def rows_missing(self, waiting: Waiting, why: str) -> list:
        """The reply of a FORWARD whose rows did not come (`why`); it changed nothing, and a next shard waiting
        for its rows is told."""
        request = waiting.request
        self.counters.rows_missing += 1
        self._refuse_downstream(request)
        return self._error(request.id, request.type, ErrorCode.ROWS_MISSING,
                           f"no rows for ticket {request.rows_ticket}: {why}; nothing changed",
                           seq=getattr(request, "seq", None))  # a batch's wait is refused whole

    def _refuse_downstream(self, request) -> None:
        """A FORWARD (or batch) with `send_rows` that did not run: the next shard's FORWARD of that ticket must not
        wait."""
        ticket = getattr(request, "send_rows", None)
        if ticket is not None and self.relay_target() is not None:
            seq, pos = (request.items[0].seq, 0) if isinstance(request, Batch) else (request.seq, request.pos)
            self.relay.send(Rows(id=0, seq=seq, pos=pos, ticket=ticket, refused=True))
            self.counters.rows_sent += 1

    def _check_forward(self, request, shard: ShardModel):
        """What a FORWARD/CAPTURE (one sequence, alone or an item of a batch) needs before it runs: its sequence,
        its head-shard extras and the capture layers this shard owns; ProtocolError when it cannot run here."""
        entry = self._sequence(request.seq)
        layers = list(request.layers) if request.type == MessageType.CAPTURE else []
        bad = [layer for layer in layers if layer >= shard.config.num_layers]
        if bad:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"capture layer {bad[0]} is outside 0..{shard.config.num_layers - 1}")
        if request.return_logits and not shard.owns_head:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "return_logits asks for logits from a shard without the head")
        head = head_request(request)
        if head.needed and not shard.owns_head:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "sampling (temperature > 0), penalties or logprobs ask a shard "
                                                       "without the head")
        return entry, head, [layer for layer in layers if shard.begin <= layer < shard.end]

    def _forward_result(self, request, entry: Sequence, out, answer) -> tuple[dict, dict]:
        """The result and the tensors (torch, by frame name) of a forward that ran; `answer` is the head's
        (ids, accepted, logprobs) when the request asked for more than the argmax. Counts it."""
        shard, counters = self.shard, self.counters
        n = request.n_tokens
        counters.forwards += 1
        counters.tokens_forwarded += n
        if request.checkpoint:
            counters.checkpointed_steps += 1
            if shard.storage.mode == CHECKPOINT:
                counters.checkpoint_writes += n * len(shard.gdn_layers)
            else:
                counters.recurrence_log_tokens += n * len(shard.gdn_layers)
        result = {"seq": request.seq, "length": entry.state.length}
        tensors = {}
        if out.ids is not None:
            result["ids"] = out.ids.tolist()
            if answer is not None:
                result["ids"], accepted, logprobs = answer
                if request.drafts is not None:
                    result["accepted"] = accepted
                if logprobs is not None:
                    result["logprobs"] = logprobs
            if request.return_logits:
                # float32 on the wire, copied: the GPU step's logits are a view of a buffer its next step reuses
                tensors["logits"] = out.logits.to("cpu", torch.float32, copy=True)
        else:
            tensors["hidden"] = out.hidden
        if request.type == MessageType.CAPTURE:
            counters.captures += 1
            counters.captured_rows += n * len(out.captured)
            result["captured_layers"] = sorted(out.captured)
            for layer in sorted(out.captured):
                tensors[f"layer.{layer}"] = out.captured[layer]
        return result, tensors

    def forward_batch(self, request):
        """A FORWARD/CAPTURE naming several sequences: each item is checked as the one-sequence request would be,
        the items that pass run together (shardd.batch.forward_batch), and each gets its result or its own error;
        a refused item changes nothing. An exception during the step fails the sequences that were in it."""
        shard = self._layers(request)
        if isinstance(request, ForwardBatch):
            self._check_send_rows(request, shard)
            if request.rows_ticket is not None:
                request = self._batch_with_rows(request)  # or _WaitsForRows: the rows are not here yet
        items = request.items
        counters = self.counters
        counters.batches += 1
        counters.batch_items += len(items)
        counters.batch_rows += request.rows
        answers: list = [None] * len(items)  # per item: (result, tensors) or the error that refused it
        runs = []  # (index, request, entry, head)
        batch = []
        for index, item in enumerate(items):
            try:
                if isinstance(item, ProtocolError):
                    raise item
                entry, head, layers = self._check_forward(item, shard)
            except ProtocolError as error:
                answers[index] = error
                continue
            runs.append((index, item, entry, head))
            batch.append(BatchItem(entry.state, item.pos, tokens=item.tokens, hidden=_hidden(item),
                                   checkpoint=item.checkpoint, capture_layers=tuple(layers),
                                   logits=head.needed or bool(item.return_logits)))  # else ids only: no copies
        PHASES.lap("lookup")
        waits = {id(w): w for w in (getattr(item.hidden, "wait", None) for _, item, _, _ in runs) if w is not None}

        def compute():
            outputs = run_batch(shard, batch)
            if waits and not _rows_go_on_device(request, next((o.hidden for o in outputs
                                                                  if not isinstance(o, Exception)), None)):
                _check_landed(waits.values())  # a step that ran on no rows fails its sequences
            return outputs

        outputs = self._run_items(runs, compute)
        heads = [(i, out) for i, out in enumerate(outputs)
                 if not isinstance(out, Exception) and out.ids is not None and runs[i][3].needed]
        head_answers = {}
        if heads:
            rows = [(out.logits, out.ids.tolist(), runs[i][1].pos, runs[i][3]) for i, out in heads]
            answered = self._run_items([runs[i] for i, _ in heads], lambda: answer_batch(rows))
            head_answers = {i: answer for (i, _), answer in zip(heads, answered)}
        for i, (index, item, entry, head) in enumerate(runs):
            out = head_answers.get(i, outputs[i])
            if isinstance(out, Exception):
                answers[index] = out
                continue
            answers[index] = self._forward_result(item, entry, outputs[i], head_answers.get(i))
        if getattr(request, "send_rows", None) is not None:  # the rows go on first: they are what the next shard waits for
            self._send_batch_rows(request, answers)
        return self._batch_reply(request, answers, ("hidden", "logits"))

    def _run_items(self, runs: list, compute) -> list:
        """`compute()`'s per-item outputs; when it raises, every item in `runs` gets INTERNAL and its sequence is
        failed (its state may be half-updated), as a one-sequence request's would."""
        try:
            return compute()
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            seqs = [item.seq for _, item, _, _ in runs]
            if isinstance(exc, RowsLost):  # not a bug: the previous shard's rows never came (its process died)
                log.warning("a step of sequences %s ran without its rows: %s", seqs, exc)
            else:
                log.error("internal error in a batch of sequences %s: %s\n%s", seqs, message, traceback.format_exc())
            for _, _, entry, _ in runs:
                self._fail(entry, message)
            return [ProtocolError(ErrorCode.INTERNAL, message) for _ in runs]

    def _batch_reply(self, request, answers: list, order: tuple = ()) -> tuple[dict, dict]:
        """`{"items": [...]}`: per item its result or `{"seq", "error": {code, message}}`; each tensor holds the rows of
        the items that answered it, in item order (one frame per name for the whole batch)."""
        items, parts = [], {}
        for item, answer in zip(request.items, answers):
            seq = item.seq
            if isinstance(answer, Exception):
                code = MODEL_ERROR_CODES[type(answer)] if isinstance(answer, ModelError) else answer.code
                message = str(answer) if isinstance(answer, ModelError) else answer.message
                self._note_error(request.type, code, message, seq)
                items.append({"seq": seq, "error": {"code": ErrorCode(code).value, "message": clip_message(message)}})
                continue
            result, tensors = answer
            items.append(result)
            for name, tensor in tensors.items():
                parts.setdefault(name, []).append(tensor)
        # on the host before joining: an engine's items need not share a device (a fast shard's step rows come
        # back in pinned host memory, an item longer than its step through the prefill path on the GPU)
        tensors = {name: WireTensor.from_torch(joined_on_host(chunks)) for name, chunks in parts.items()}
        return {"items": items}, tensors

    def rollback(self, request):
        shard = self._layers(request)
        entry = self._sequence(request.seq)
        shard.check_rollback_storage()
        PHASES.lap("lookup")
        rb.rollback(entry.state, request.keep)  # validates (rb.check_rollback) before it changes the state
        self.counters.rollbacks[shard.storage.mode] += 1
        self.counters.rollbacks_by_keep[request.keep] += 1
        return {"seq": request.seq, "length": entry.state.length}, {}

    def rollback_batch(self, request):
        """ROLLBACK of several sequences: each item rolled back on its own, with its own result or error."""
        shard = self._layers(request)
        shard.check_rollback_storage()
        self.counters.batches += 1
        self.counters.batch_items += len(request.items)
        answers = []
        for item in request.items:
            try:
                if isinstance(item, ProtocolError):
                    raise item
                answers.append((self.rollback(item)[0], {}))
            except (ProtocolError, ModelError) as error:
                answers.append(error)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}"
                log.error("internal error seq=%s type=ROLLBACK: %s\n%s", item.seq, message, traceback.format_exc())
                entry = self.sequences.get((self.owner, item.seq))
                if entry is not None:
                    entry.failed = message
                    self.counters.sequences_failed += 1
                answers.append(ProtocolError(ErrorCode.INTERNAL, message))
        return self._batch_reply(request, answers)

    def snapshot(self, request):
        self._layers(request)
        entry = self._sequence(request.seq)
        rb.snapshot(entry.state)
        self.counters.snapshots += 1
        return {"seq": request.seq, "length": entry.state.length}, {}

    def restore(self, request):
        self._layers(request)
        entry = self._sequence(request.seq)
        rb.restore(entry.state)
        self.counters.restores += 1
        return {"seq": request.seq, "length": entry.state.length}, {}

    def _check_proposal(self, request, shard, entry) -> None:
        """A CAPTURE with `propose`, before it changes anything: the drafter, the head and every feature it needs."""
        drafter = self._drafter()
        if not shard.owns_head:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "propose asks a shard without the head (it needs the verify's ids)")
        model, config = drafter.model, drafter.config
        if request.propose > model.max_draft_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"propose {request.propose} exceeds the drafter's {model.max_draft_tokens} draft tokens")
        own = [layer for layer in request.layers if shard.begin <= layer < shard.end]
        carried = list(request.carried_layers or ())
        missing = [layer for layer in config.target_layer_ids if layer not in own and layer not in carried]
        if missing:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"propose needs target layer {missing[0]}'s output: capture it "
                                                       f"here or carry it from its shard (carried_layers)")
        if request.carried is not None:
            width = len(carried) * self.config.hidden_size
            if request.carried.shape[1] != width or request.carried.dtype != dtype_name(model.dtype):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"tensor 'carried' must be {dtype_name(model.dtype)} "
                                                           f"[n, {width}], got {request.carried.dtype}{list(request.carried.shape)}")
        if entry.draft.length < request.pos:
            raise ProtocolError(ErrorCode.POSITION_MISMATCH,
                                f"the drafter's context holds {entry.draft.length} rows, this verify starts at {request.pos}: "
                                f"send rows {entry.draft.length}..{request.pos - 1} with PROPOSE first")

    def _propose_after_verify(self, request, entry, ids: list[int], captured: dict) -> dict:
        """The verify's committed rows (the accepted drafts' prefix plus its first row) join the drafter's context,
        then the next block is drafted after the bonus token: what PROPOSE would answer after this step."""
        model, config = self.drafter.model, self.drafter.config
        drafts = request.drafts
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == ids[accepted]:
            accepted += 1
        keep = accepted + 1  # rows pos .. pos+accepted: the block's first token and the accepted drafts
        carried = request.carried.to_torch() if request.carried is not None else None
        width = self.config.hidden_size
        columns = []
        for layer in config.target_layer_ids:
            if layer in captured:
                columns.append(captured[layer][:keep])
            else:
                j = request.carried_layers.index(layer)
                columns.append(carried[:keep, j * width:(j + 1) * width])
        draft, counters = entry.draft, self.counters
        if draft.length > request.pos:
            counters.draft_crops += 1
            counters.draft_rows_cropped += draft.length - request.pos
            model.crop(draft, request.pos)
        model.add_context(draft, torch.cat(columns, dim=1))
        counters.draft_context_rows += keep
        tokens, _ = model.propose(draft, ids[accepted], request.propose + 1)
        counters.proposals += 1
        counters.proposals_in_reply += 1
        counters.draft_tokens += request.propose
        return {"accepted": accepted, "pos": request.pos + keep, "last_token": ids[accepted], "tokens": tokens.tolist(),
                "context_length": draft.length}

    def propose(self, request):
        """Features of positions pos-n .. pos-1 into the drafter's context, then a block after `last_token`.

        Context rows at or past pos-n belong to tokens rolled back since they were sent: they are cropped first
        (the only way the context shrinks). A context shorter than pos-n misses rows: POSITION_MISMATCH.
        The target layers' state of the sequence (on a daemon that has both) is not touched."""
        model = self._drafter().model
        draft = self._sequence(request.seq).draft
        features = request.features.to_torch() if request.features is not None else None
        model.check_propose(draft, request.pos, features, request.last_token, request.block_size)
        n = features.shape[0] if features is not None else 0
        start = request.pos - n

        counters = self.counters
        if draft.length > start:
            counters.draft_crops += 1
            counters.draft_rows_cropped += draft.length - start
            model.crop(draft, start)
        if n:
            model.add_context(draft, features)
            counters.draft_context_rows += n
        ids, _ = model.propose(draft, request.last_token, request.block_size + 1)
        counters.proposals += 1
        counters.draft_tokens += request.block_size
        return {"seq": request.seq, "tokens": ids.tolist(), "context_length": draft.length}, {}

    def stats(self, request):
        c = self.counters
        states = [entry.state for entry in self.sequences.values() if entry.state is not None]
        draft_state_bytes = (
            self.drafter.model.state_bytes_per_sequence(self.options.max_context) * len(self.sequences)
            if self.drafter is not None else 0
        )
        result = {
            "uptime_seconds": time.time() - self.started,
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
            "open_sequences": len(self.sequences),
            "failed_sequences": sum(1 for entry in self.sequences.values() if entry.failed),
            "state_bytes": sum(s.state_bytes() for s in states) + draft_state_bytes,
            "checkpoint_bytes": sum(s.rollback_bytes() for s in states),
            "weight_bytes": self.weight_bytes(),
            "compute_seconds": dict(c.compute_seconds),
            "batches": {"requests": c.batches, "items": c.batch_items, "rows": c.batch_rows},
            "rows": {"sent": c.rows_sent, "received": c.rows_received, "waits": c.rows_waits,
                     "missing": c.rows_missing, "waiting": len(self.inbox.waiting), "on_device": c.rows_on_device,
                     "sent_on_device": self.relay.on_device if self.relay is not None else 0,
                     "ring_bytes": self.ring.nbytes if self.ring is not None else 0,
                     "ring_wait": self._ring_wait() if self.ring is not None else None,
                     "ring_to_next": "on" if self.relay is not None and self.relay.ring is not None else
                     (self.relay.ring_problem if self.relay is not None else None)},
            # where requests' time went, per type and phase (protocol/timing.py): seconds since the start
            "phases": PHASES.totals(),
        }
        if timeline.TIMELINE is not None:  # SHARDD_TIMELINE: the GPU stamps and host events kept so far
            result["timeline"] = timeline.report()
        if self.drafter is not None:
            result["drafter"] = {
                "proposals": c.proposals,
                "proposals_in_reply": c.proposals_in_reply,
                "draft_tokens": c.draft_tokens,
                "context_rows_added": c.draft_context_rows,
                "crops": c.draft_crops,
                "rows_cropped": c.draft_rows_cropped,
                # only the asking peer's own sequences: ids are not shared between clients
                "context_rows": {str(seq): entry.draft.length for (owner, seq), entry in self.sequences.items()
                                 if owner == self.owner},
            }
        return result, {}

    def shutdown(self, request):
        if not self.trusted:
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                "SHUTDOWN is accepted over a file ipc:// socket or from an allowed Curve key; stop this daemon "
                "with a signal (SIGTERM) instead",
            )
        log.info("shutdown requested")
        self.stopping = True
        return {"stopping": True}, {}

    # ---- the socket loop -------------------------------------------------------------------------

    def serving(self) -> str:
        """What this daemon serves, in words: 'layers 0:3', 'layers 3:6 + dflash drafter', 'dflash drafter'."""
        parts = [f"layers {self.shard.begin}:{self.shard.end}"] if self.shard is not None else []
        parts += ["dflash drafter"] if self.drafter is not None else []
        return " + ".join(parts)

    def status_line(self, endpoint: str) -> str:
        """What `systemctl status` shows while serving."""
        return f"serving {self.serving()} on {endpoint}: {len(self.sequences)} sequences open"

    def serve(self, listener: Listener | None = None) -> None:
        """Serve until stopped, on `listener` (bound early by `shardd serve`) or a socket bound now."""
        options = self.options
        listener = listener if listener is not None else listen(options, self.limits.max_frame_bytes)
        socket = listener.socket
        curve = options.curve_secret_key is not None
        trusted_transport = curve or is_file_ipc(options.bind)
        next_sweep = busy_until = time.monotonic()
        self.relay_target()  # the link to the next shard, where it is known already
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)

        def stop(signum, frame):
            log.info("signal %s: stopping", signal.Signals(signum).name)
            self.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        timeline.start(self.device)  # SHARDD_TIMELINE (checked by `shardd serve` before loading): reported in STATS
        watchdog, status = systemd.Watchdog(), systemd.Status()
        status.set(self.status_line(listener.endpoint), "READY=1")
        log.info("ready: serving on %s", listener.endpoint)
        _freeze_heap()
        # SHARDD_PROFILE=DIR: the serving loop runs under cProfile, written to DIR/shardd-PID.prof on stop
        # (a host-side profile where no sampling profiler is installed; it slows every request down)
        profile_dir = os.environ.get("SHARDD_PROFILE")
        profiler = None
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        try:
            while not self.stopping:
                watchdog.ping()
                status.set(self.status_line(listener.endpoint))
                if time.monotonic() >= next_sweep:
                    self.expire_idle()
                    next_sweep = time.monotonic() + 1.0
                for waiting in self.inbox.expired(time.monotonic()):
                    socket.send_multipart(waiting.envelope + self.rows_missing(
                        waiting, f"none came within {options.rows_wait_s:g} s"), copy=False)
                if not self._next_request(poller, socket, watchdog.poll_ms(100), busy_until):
                    continue
                PHASES.start()
                received = receive_request(socket)  # frame by frame: no more frames held than the type allows
                envelope, body = received.envelope, received.body
                if not body:
                    PHASES.active = False
                    continue  # an identity with nothing after it: nothing to answer
                PHASES.lap("receive")
                timeline.host("receive")
                owner = envelope[0].bytes
                if curve:  # the authenticated key outlives a reconnect; the routing id does not
                    owner = b"curve:" + body[0].get("User-Id").encode()
                if received.refusal is not None:
                    def reply():
                        return self._error(peek_id(body), peek_type(body), received.refusal_code(self.limits.max_frames),
                                           received.refusal, seq=None)
                    release_memory()
                else:
                    def reply():
                        return self.handle(body, owner, trusted_transport)
                for frames in self.answer(envelope, owner, reply):
                    socket.send_multipart(frames, copy=False)
                PHASES.lap("send")
                timeline.host("sent", self.phase_type)
                # a FORWARD that now waits for its rows is counted when it is answered (`_resume`)
                PHASES.finish(self.phase_type, count=not self.parked)
                busy_until = time.monotonic() + options.busy_poll_s
        finally:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(os.path.join(profile_dir, f"shardd-{os.getpid()}.prof"))
            systemd.notify("STOPPING=1")
            if self.relay is not None:
                self.relay.close()
            listener.close()
            log.info("stopped: %d sequences were open", len(self.sequences))

    def answer(self, envelope: list, owner: bytes, reply) -> list[list]:
        """Every message one request of `owner` sends, in order: first the refusal of a FORWARD of its connection
        still waiting for its rows (its connection has moved on: PROTOCOL.md, "Rows from shard to shard"), then
        its own reply (`reply()`; none while it waits for its rows), then the replies of the FORWARDs its rows
        let run."""
        out = []
        self.parked = False
        waiting = self.inbox.cancel(owner)
        if waiting is not None:
            out.append(waiting.envelope + self.rows_missing(waiting, "a later request of its connection came first"))
        frames = reply()
        if frames is None:
            waiting, self._waits = self._waits, None
            waiting.envelope = envelope
            self.inbox.wait(waiting)
            self.counters.rows_waits += 1
            self.parked = True
        else:
            out.append(envelope + frames)
        out += self._completed
        self._completed = []
        return out

    def _next_request(self, poller, socket, timeout_ms: int, busy_until: float) -> bool:
        """Whether a request is waiting: polled without sleeping until `busy_until` (--busy-poll-ms after the last
        reply: the next request of a decode is usually milliseconds away, and a sleeping process wakes late on a
        loaded host), then waited for up to `timeout_ms`."""
        while not self.stopping and time.monotonic() < busy_until:
            if poller.poll(0):  # the loop's one poller (socket.poll builds a Poller per call)
                return True
        return bool(poller.poll(timeout_ms))


def _freeze_heap() -> None:
    """Everything loaded so far (torch, triton, the model) lives as long as the daemon: out of the garbage
    collector's sight, so no full collection walks it between two requests. (A function of its own, so that a
    profile of the serving loop can leave this one collection out.)"""
    gc.collect()
    gc.freeze()


MIN_FRAME_BYTES = 16 << 20  # small models still answer a modestly oversized frame with TOO_LARGE


class DeviceRows:
    """Rows already on this shard's device where a FORWARD's tensor hidden stands: copied out of its ring (behind
    `wait`, a shardd.ring.DeviceWait, with the device wait; None: after the host saw them land)."""

    def __init__(self, tensor, wait=None):
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.wait = wait

    def to_torch(self, device=None):
        return self.tensor if device is None else self.tensor.to(device)


def _rows_go_on_device(request, hidden) -> bool:
    """Whether a step's output rows stay on the device for the next shard's ring (send_rows): then its device
    wait's outcome goes on with them (a poisoned flag) instead of being read here."""
    return getattr(request, "send_rows", None) is not None and hidden is not None and hidden.is_cuda


def _check_landed(waits) -> None:
    """After a step behind device waits: RowsLost when one ended without its rows (the step ran on none)."""
    for wait in waits:
        if not wait.landed():
            raise RowsLost(wait.why())


def _hidden(request):
    """A FORWARD/CAPTURE's hidden rows as a tensor over the frame (None with tokens)."""
    return request.hidden.to_torch() if request.hidden is not None else None


# Tensors for the wire. `WireTensor.from_torch` of a GPU tensor copies it into fresh pageable pages and waits for
# that copy alone; a 512-token prefill's rows (5 MB, what the next shard waits for) take ~1-3 ms so, pinned ~0.2,
# and a step of 8 prompts paid 8 of them in series. Here every GPU tensor goes into pinned memory (PyTorch's
# caching host allocator) without blocking, then one wait for the device.


def on_host(tensors: list) -> list:
    """`tensors`, each in host memory (a CPU tensor as it is)."""
    copies, devices = [], set()
    for tensor in tensors:
        if tensor.device.type != "cpu":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            devices.add(tensor.device)
            tensor = host
        copies.append(tensor)
    _wait_for(devices)
    return copies


def joined_on_host(chunks: list):
    """The chunks (rows of one frame, item by item) as one host tensor: with any on a GPU, each copied straight
    into its rows of one pinned tensor (not a copy of each, then a join on the host)."""
    if len(chunks) == 1:
        return on_host(chunks)[0]
    first = chunks[0]
    if all(c.device.type == "cpu" for c in chunks) or any(c.dtype != first.dtype for c in chunks):
        return torch.cat(on_host(chunks))
    out = torch.empty((sum(c.shape[0] for c in chunks), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    devices, row = set(), 0
    for chunk in chunks:
        on_device = chunk.device.type != "cpu"
        out[row:row + chunk.shape[0]].copy_(chunk, non_blocking=on_device)
        if on_device:
            devices.add(chunk.device)
        row += chunk.shape[0]
    _wait_for(devices)
    return out


def _wait_for(devices) -> None:
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


# The fields head_request reads; with all of them absent a request wants the argmax alone.
HEAD_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "prompt_tokens", "output_tokens", "drafts", "logprobs")
_head_values = operator.attrgetter(*HEAD_FIELDS)
PLAIN_HEAD = HeadRequest()


def head_request(request) -> HeadRequest:
    """The head-shard extras a FORWARD/CAPTURE asks for (all absent: today's argmax request)."""
    if _head_values(request).count(None) == len(HEAD_FIELDS):
        return PLAIN_HEAD  # most items of a batch: one shared answer, no objects built per item
    sampling = None
    if request.temperature:
        sampling = SamplingParams(request.temperature, 1.0 if request.top_p is None else request.top_p,
                                  request.top_k or 0, request.seed or 0)
    penalties = Penalties(request.presence_penalty or 0.0, request.frequency_penalty or 0.0,
                          1.0 if request.repetition_penalty is None else request.repetition_penalty)
    return HeadRequest(sampling, penalties, request.prompt_tokens or (), request.output_tokens or (),
                       request.drafts or (), request.logprobs)


def largest_frame_bytes(hidden_size: int, feature_size: int, max_tokens: int) -> int:
    """The frame limit: twice the largest tensor a valid request can carry (max_tokens rows of hidden
    states or of a hosted drafter's features, float32), so a slightly oversized one is still answered TOO_LARGE."""
    return max(MIN_FRAME_BYTES, 2 * max_tokens * max(hidden_size, feature_size) * 4)


def listen(options: ServeOptions, max_frame_bytes: int) -> Listener:
    """Bind the daemon's ROUTER socket (BindError says why not, in one line). A frame over `max_frame_bytes`
    (largest_frame_bytes) is refused by libzmq from its length prefix, before any memory is allocated for it,
    and the connection dropped (PROTOCOL.md, "Limits"); set at bind, so it holds for every connection."""
    max_bytes = max(max_frame_bytes, Limits().max_header_bytes)

    def configure(context, socket):
        socket.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT; IPv4 binds are unaffected
        # A client that reconnects under its routing id (after a freeze or a network blip) takes the id over from
        # the connection it left behind, instead of being ignored while that one lingers (PROTOCOL.md, "Liveness").
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        return configure_security(context, socket, options)

    listener = bind(options.bind, max_message_bytes=max_bytes, configure=configure)
    restrict_ipc_socket(listener.endpoint)
    return listener


def configure_security(context, socket, options: ServeOptions):
    """Loopback and ipc:// binds need nothing; any other TCP bind requires CurveZMQ keys and an allow-list."""
    if options.curve_secret_key is None:
        if not is_loopback(options.bind):
            raise SystemExit(
                f"refusing to bind {options.bind} without encryption: a non-loopback bind needs "
                "--curve-secret-key (from `shardd keygen`) and --curve-allow DIR of client public keys"
            )
        return None
    if options.curve_allow_dir is None:
        raise SystemExit("--curve-secret-key needs --curve-allow DIR (the client public keys allowed to connect)")
    import zmq.auth

    public, secret = zmq.auth.load_certificate(options.curve_secret_key)
    if secret is None:
        raise SystemExit(f"{options.curve_secret_key} holds no secret key")
    authenticator = start_authenticator(context, options.curve_allow_dir)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    log_refused_handshakes(socket)  # a client without keys is refused before ZAP: say so in the log
    return authenticator
