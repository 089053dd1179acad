"""Message types and one typed record per request type; the records are the request schema.

Each header field of a record carries its wire kind, bounds and doc as field metadata (`_header`), each tensor
frame its rank and dtypes (`_tensor`); `REQUEST_FIELDS` and `REQUEST_TENSORS`, which `decode.decode_request`
validates against and `PROTOCOL.md` documents, are derived from them. Record field names equal header field names
(tensor records: frame names).
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, Optional, Union, get_args

from .tensors import FLOAT_DTYPES, WireTensor

MASK_DTYPES = frozenset({"int32"})  # a token mask: 32 tokens per word, bit j of word i is token 32 * i + j

PROTOCOL_VERSION = 1

ID_LIMIT = 1 << 63      # ids and sequence numbers: 0 <= x < 2**63
TOKEN_LIMIT = 1 << 31   # token ids: 0 <= t < 2**31
RING_SLOTS_LIMIT = 16   # slots of a device ring a ROWS may name (shardd.server.ring.SLOTS uses 2)
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): logits / T would overflow float32 and pick the last id.
SAMPLING_EPS = 1e-5


def samples(temperature: Optional[float]) -> bool:
    """Whether a request's `temperature` asks the head shard to sample (else: the argmax)."""
    return temperature is not None and temperature >= SAMPLING_EPS


class MessageType(str, enum.Enum):
    HELLO = "HELLO"
    OPEN = "OPEN"
    CLOSE = "CLOSE"
    FORWARD = "FORWARD"
    CAPTURE = "CAPTURE"
    ROLLBACK = "ROLLBACK"
    SNAPSHOT = "SNAPSHOT"
    RESTORE = "RESTORE"
    PROPOSE = "PROPOSE"
    STATS = "STATS"
    SHUTDOWN = "SHUTDOWN"
    ROWS = "ROWS"
    RING = "RING"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FieldSpec:
    """One header field of a request type. Integer bounds are `minimum <= x < limit`."""

    name: str
    kind: str                     # "int", "bool" or "int_list"
    required: bool = True
    default: Any = None           # value when an optional field is absent
    minimum: Optional[int] = None  # for "int", or each item of "int_list"; "str": the fewest characters
    limit: Optional[int] = None
    doc: str = ""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor frame a request type may carry (always optional at the schema level)."""

    name: str
    ndim: int
    dtypes: frozenset
    doc: str = ""


# Fields every request header carries, whatever its type.
COMMON_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("v", "int", doc="protocol version, must equal PROTOCOL_VERSION"),
    FieldSpec("type", "str", doc="a MessageType value"),
    FieldSpec("id", "int", minimum=0, limit=ID_LIMIT, doc="client-chosen, echoed in the reply"),
    FieldSpec("tensors", "descriptors", required=False, default=(),
              doc="one {name, dtype, shape} per frame after the header, in frame order"),
)


def _header(kind: str, doc: str, *, minimum: Optional[int] = None, limit: Optional[int] = None,
            default: Any = MISSING, kw_only: bool = False) -> Any:
    """A record field that travels as a header field; without `default` the field is required."""
    spec = {"kind": kind, "minimum": minimum, "limit": limit, "doc": doc}
    return field(default=default, kw_only=kw_only, metadata={"header": spec})


def _tensor(ndim: int, doc: str) -> Any:
    """A record field that travels as a tensor frame of floats."""
    return field(default=None, metadata={"tensor": {"ndim": ndim, "dtypes": FLOAT_DTYPES, "doc": doc}})


# --- records -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Request:
    id: int


@dataclass(frozen=True)
class _SequenceRequest(_Request):
    seq: int = _header("int", "client-chosen sequence id", minimum=0, limit=ID_LIMIT)


@dataclass(frozen=True)
class Hello(_Request):
    type: ClassVar[MessageType] = MessageType.HELLO
    owner: Optional[str] = _header("str", "the client's secret (32 to 128 characters, chosen at random once per client): "
                                   "this connection then acts on the sequences of the connections that presented it "
                                   "(without Curve; see PROTOCOL.md, \"Ownership\")", minimum=32, limit=128,
                                   default=None)
    relay_key: Optional[str] = _header("str", "the relay key of the daemon's shard set (shardd serve --relay-key): "
                                       "a daemon started with one takes ROWS and RING only from the connection that "
                                       "presented it last (PROTOCOL.md, \"Who may do what\")", minimum=32, limit=128,
                                       default=None)


@dataclass(frozen=True)
class Stats(_Request):
    type: ClassVar[MessageType] = MessageType.STATS


@dataclass(frozen=True)
class Shutdown(_Request):
    type: ClassVar[MessageType] = MessageType.SHUTDOWN


@dataclass(frozen=True)
class Open(_SequenceRequest):
    type: ClassVar[MessageType] = MessageType.OPEN
    prefix: Optional[int] = _header("int", "start from this prefix entry of this client (its state and length) "
                                    "instead of empty; PREFIX_MISSING when it is not held", minimum=0,
                                    limit=ID_LIMIT, default=None)
    draft_context: Optional[bool] = _header("bool", "on a daemon hosting the drafter: keep a drafter context for the "
                                            "sequence (absent: true; false: it never proposes here, none is kept and "
                                            "a prefix entry without one resumes it)", default=None)


@dataclass(frozen=True)
class Close(_SequenceRequest):
    type: ClassVar[MessageType] = MessageType.CLOSE


@dataclass(frozen=True)
class Snapshot(_SequenceRequest):
    type: ClassVar[MessageType] = MessageType.SNAPSHOT


@dataclass(frozen=True)
class Restore(_SequenceRequest):
    type: ClassVar[MessageType] = MessageType.RESTORE


@dataclass(frozen=True)
class Forward(_SequenceRequest):
    """Append n tokens (or n rows of hidden state) at `pos`; n = len(tokens) or hidden.shape[0]."""

    type: ClassVar[MessageType] = MessageType.FORWARD
    pos: int = _header("int", "must equal the committed length", minimum=0, limit=ID_LIMIT)
    tokens: Optional[list[int]] = _header("int_list", "token ids; exactly one of tokens / tensor hidden",
                                          minimum=0, limit=TOKEN_LIMIT, default=None)
    hidden: Optional[WireTensor] = _tensor(2, "[n, H] activations from the previous shard")
    # Rows straight from shard to shard (PROTOCOL.md, "Rows from shard to shard"): one sequence, not in a batch.
    send_rows: Optional[int] = _header(
        "int", "send the output rows to this daemon's --relay-to shard as ROWS under this ticket; the reply then "
        "carries no tensor hidden", minimum=0, limit=ID_LIMIT, default=None)
    rows_ticket: Optional[int] = _header(
        "int", "take the input rows from the ROWS of this ticket (the previous shard's) instead of tensor hidden; "
        "with ticket_rows", minimum=0, limit=ID_LIMIT, default=None)
    ticket_rows: Optional[int] = _header("int", "how many rows the ROWS of rows_ticket brings (n)", minimum=1,
                                         limit=ID_LIMIT, default=None)
    checkpoint: bool = _header("bool", "make the step pending so one ROLLBACK may follow", default=False)
    parents: Optional[list[int]] = _header(
        "int_list", "verify geometry, one entry per token; required with checkpoint, rejected without", default=None)
    return_logits: bool = _header("bool", "head shard also returns float32 logits [n, V]", default=False)
    # Sampling on the head shard (shardd.engine.head.sampling); temperature 0 (the default), or any below
    # SAMPLING_EPS, is the argmax path.
    # Absent (None) on a greedy request, so its header is exactly what it was before sampling.
    temperature: Optional[float] = _header("float", "head shard samples at this temperature (absent or below 1e-5: argmax)",
                                           minimum=0, limit=100, default=None)
    top_p: Optional[float] = _header("float", "nucleus mass kept when sampling (absent: 1, all)",
                                     minimum=0, limit=1, default=None)
    top_k: Optional[int] = _header("int", "most likely tokens kept when sampling (absent or 0: all)",
                                   minimum=0, limit=TOKEN_LIMIT, default=None)
    seed: Optional[int] = _header("int", "request seed; row i draws from a generator seeded by (seed, pos + i)",
                                  minimum=0, limit=ID_LIMIT, default=None)
    drafts: Optional[list[int]] = _header(
        "int_list", "draft tokens of a speculative verify: the last len(drafts)+1 rows are verified by rejection "
        "sampling (needs temperature >= 1e-5, a penalty, logprobs, a token mask or propose)", minimum=0, limit=TOKEN_LIMIT, default=None)
    # Head-shard extras (shardd.engine.head.answer): penalties over the output so far, and logprobs of the answered rows.
    logprobs: Optional[int] = _header("int", "also answer the logprob of each answered row's id and this many top "
                                      "logprobs (absent: none)", minimum=0, limit=21, default=None)
    # Prompt logprobs (shardd.engine.head.logprobs): a prefill's rows scored against the prompt's next tokens.
    prompt_logprobs: Optional[int] = _header(
        "int", "also answer, for each of the first len(next_tokens) rows, the logprob and rank of that row's next "
        "token and this many top logprobs (with next_tokens)", minimum=0, limit=21, default=None)
    next_tokens: Optional[list[int]] = _header(
        "int_list", "the token that follows each of the first rows (1 to n of them), scored by prompt_logprobs",
        minimum=0, limit=TOKEN_LIMIT, default=None)
    presence_penalty: Optional[float] = _header("float", "vLLM's presence penalty over the output (absent: 0)",
                                                minimum=-2, limit=2, default=None)
    frequency_penalty: Optional[float] = _header("float", "vLLM's frequency penalty over the output (absent: 0)",
                                                 minimum=-2, limit=2, default=None)
    repetition_penalty: Optional[float] = _header("float", "vLLM's repetition penalty over prompt and output "
                                                  "(absent: 1; > 0)", minimum=0, limit=100, default=None)
    output_tokens: Optional[list[int]] = _header(
        "int_list", "the tokens generated before the first answered row (penalties)", minimum=0, limit=TOKEN_LIMIT,
        default=None)
    prompt_tokens: Optional[list[int]] = _header(
        "int_list", "the prompt (repetition penalty)", minimum=0, limit=TOKEN_LIMIT, default=None)
    carry: Optional[bool] = _header(
        "bool", "with send_rows (this request's or its batch's): the ROWS also bring the next shard tensor carried, "
        "the carried rows this request took in followed by the outputs of its CAPTURE layers this shard owns, "
        "ascending (absent: false)", default=None)
    save_prefix: Optional[int] = _header(
        "int", "after this forward (not checkpointed) keep the sequence's state as this client's prefix entry of "
        "this id; the reply says whether it was kept (prefix_saved)", minimum=0, limit=ID_LIMIT, default=None)
    # Constrained decoding (PROTOCOL.md, "Token masks"): the tokens each answered row may take, on the head shard.
    mask_rows: Optional[int] = _header("int", "rows of tensor token_mask: the answered rows, len(drafts) + 1",
                                       minimum=1, limit=TOKEN_LIMIT, default=None)
    token_mask: Optional[WireTensor] = field(default=None, metadata={"tensor": {
        "ndim": 2, "dtypes": MASK_DTYPES, "doc": "[mask_rows, ceil(V / 32)] int32 bitmask of the tokens each "
                                                 "answered row may take (bit set: allowed)"}})

    @property
    def n_tokens(self) -> int:
        if self.tokens is not None:
            return len(self.tokens)
        if self.hidden is not None:
            return self.hidden.shape[0]
        return self.ticket_rows or 0


@dataclass(frozen=True)
class Capture(Forward):
    """A FORWARD that also returns the outputs of `layers` owned by the shard."""

    type: ClassVar[MessageType] = MessageType.CAPTURE
    layers: list[int] = _header("int_list", "non-empty, distinct layer indices whose outputs to return",
                                minimum=0, limit=ID_LIMIT, kw_only=True)
    # The next block proposed in the reply (PROTOCOL.md, "Proposing in the verify reply"): on the daemon hosting
    # the drafter and the head, greedy; `carried` brings the drafter's target layers captured by earlier shards.
    propose: Optional[int] = _header("int", "draft tokens to propose after this verify, in the same reply",
                                     minimum=1, limit=TOKEN_LIMIT, default=None, kw_only=True)
    carried_layers: Optional[list[int]] = _header(
        "int_list", "layers of earlier shards whose outputs `carried` holds side by side (with propose)",
        minimum=0, limit=ID_LIMIT, default=None, kw_only=True)
    carried: Optional[WireTensor] = field(default=None, kw_only=True, metadata={"tensor": {
        "ndim": 2, "dtypes": FLOAT_DTYPES, "doc": "[n, len(carried_layers) * H] earlier shards' captured rows"}})


@dataclass(frozen=True)
class Rollback(_SequenceRequest):
    type: ClassVar[MessageType] = MessageType.ROLLBACK
    keep: int = _header("int", "tokens of the pending step to keep", minimum=0, limit=ID_LIMIT)


@dataclass(frozen=True)
class Propose(_SequenceRequest):
    """Append the feature rows of positions pos-n .. pos-1 to the drafter's context (cropping rows at or past
    pos-n first: their tokens were rolled back), then draft `block_size` tokens after `last_token` at `pos`."""

    type: ClassVar[MessageType] = MessageType.PROPOSE
    pos: int = _header("int", "committed length: the position of last_token; the features are the rows just before it",
                       minimum=0, limit=ID_LIMIT)
    last_token: int = _header("int", "last committed token", minimum=0, limit=TOKEN_LIMIT)
    block_size: int = _header("int", "draft tokens wanted", minimum=1, limit=TOKEN_LIMIT)
    features: Optional[WireTensor] = _tensor(2, "[n, F] drafter context features of positions pos-n .. pos-1")
    save_prefix: Optional[list[int]] = _header(
        "int_list", "on a drafter-only daemon: once the rows joined the context, keep its first save_lengths[i] rows "
        "as this client's prefix entry save_prefix[i]; the reply says which were kept (prefix_saved)",
        minimum=0, limit=ID_LIMIT, default=None)
    save_lengths: Optional[list[int]] = _header(
        "int_list", "the context rows each save_prefix entry keeps: ascending, at most pos", minimum=1,
        limit=ID_LIMIT, default=None)


@dataclass(frozen=True)
class Rows(_SequenceRequest):
    """One FORWARD's output rows, sent by its shard straight to the next one (its --relay-to) under the
    coordinator's ticket, for the next shard's FORWARD of the same ticket (field rows_ticket); or, `refused`,
    word that the FORWARD was refused or failed, so the waiting one is refused too and changes nothing."""

    type: ClassVar[MessageType] = MessageType.ROWS
    pos: int = _header("int", "the FORWARD's pos", minimum=0, limit=ID_LIMIT)
    ticket: int = _header("int", "the FORWARD's send_rows: the next shard's rows_ticket", minimum=0, limit=ID_LIMIT)
    refused: bool = _header("bool", "the FORWARD was refused or failed: no rows", default=False)
    hidden: Optional[WireTensor] = _tensor(2, "[n, H] the FORWARD's output rows (absent with refused or slot)")
    slot: Optional[int] = _header("int", "the rows are in this slot of the receiving shard's device ring (RING) "
                                  "instead of tensor hidden; a batch's items end to end in one slot", minimum=0,
                                  limit=RING_SLOTS_LIMIT, default=None)
    slot_rows: Optional[int] = _header("int", "with slot: this sequence's rows in the slot", minimum=1,
                                       limit=ID_LIMIT, default=None)
    slot_gen: Optional[int] = _header("int", "with slot: the writer's count of puts into the slot since its RING, "
                                      "this one's included (the flag a device wait waits for)", minimum=1,
                                      limit=ID_LIMIT, default=None)
    carried: Optional[WireTensor] = _tensor(2, "[n, k * H] the drafter's feature rows the FORWARD passed on (its "
                                               "carry), for the next shard's carried_layers")
    carries: Optional[bool] = _header("bool", "with tensor carried or slot_carried: these rows come with carried rows "
                                      "(a batch's items: which of them take rows of tensor carried)", default=None)
    slot_carried: Optional[int] = _header("int", "with slot and carries: the carried rows are in the slot too, k "
                                          "rows of H per row of this sequence, after every item's hidden rows, "
                                          "in item order (no tensor carried)", minimum=1, limit=ID_LIMIT,
                                          default=None)


@dataclass(frozen=True)
class Ring(_Request):
    """A shard asks its next shard (its --relay-to) for the device ring that its ROWS may name slots of
    (PROTOCOL.md, "Rows on the device"); the reply carries the ring's CUDA IPC handles."""

    type: ClassVar[MessageType] = MessageType.RING
    rows: int = _header("int", "rows one slot should hold (the reply says what it holds)", minimum=1, limit=ID_LIMIT)
    pid: int = _header("int", "the asking daemon's process id: the ring's reader stops waiting for rows in flight "
                       "once that process is gone", minimum=0, limit=1 << 31, default=0)
    gpu: Optional[str] = _header("str", "the UUID of the GPU the asking daemon's rows come from: a reader on that same "
                                 "GPU waits for them on the host (a device wait would contend with the writer's "
                                 "kernels)", limit=128, default=None)


Request = Union[Hello, Open, Close, Forward, Capture, Rollback, Snapshot, Restore, Propose, Stats, Shutdown, Rows,
                Ring]


# --- batches: several sequences in one FORWARD, CAPTURE or ROLLBACK (PROTOCOL.md, "Batches") ----------------

@dataclass(frozen=True)
class Batch(_Request):
    """Several sequences in one request: per item the one-sequence record (its `id` unused), or, after decoding,
    the ProtocolError that refused that item alone. On the wire the items travel in header field `items`, their
    hidden rows end to end in one `hidden` frame (each item says its `rows`)."""

    items: tuple = ()

    @property
    def rows(self) -> int:
        """Token rows of the whole batch (0 for ROLLBACK)."""
        return sum(item.n_tokens for item in self.items if isinstance(item, Forward))


@dataclass(frozen=True)
class ForwardBatch(Batch):
    type: ClassVar[MessageType] = MessageType.FORWARD
    # Rows from shard to shard for the whole batch (PROTOCOL.md, "Rows from shard to shard"): `send_rows` sends
    # the rows of every item that ran to the next shard as one batched ROWS under this ticket; `rows_ticket` takes
    # each item's rows from the ROWS of this ticket (on the wire each item says its `rows`; decoded, each item
    # carries the ticket and its ticket_rows as the one-sequence FORWARD would).
    send_rows: Optional[int] = None
    rows_ticket: Optional[int] = None


@dataclass(frozen=True)
class CaptureBatch(Batch):
    type: ClassVar[MessageType] = MessageType.CAPTURE


@dataclass(frozen=True)
class RollbackBatch(Batch):
    type: ClassVar[MessageType] = MessageType.ROLLBACK


@dataclass(frozen=True)
class RowsBatch(Batch):
    """The rows of a batched FORWARD's items that ran, under one ticket (every item's); an item that did not run
    has no entry (the next shard refuses it alone). A batch none of whose items ran sends one refused `Rows`."""

    type: ClassVar[MessageType] = MessageType.ROWS

    @property
    def ticket(self) -> int:
        return self.items[0].ticket

    refused = False


BatchRequest = Union[ForwardBatch, CaptureBatch, RollbackBatch, RowsBatch]
BATCH_RECORD_TYPES: dict[MessageType, type] = {record.type: record for record in get_args(BatchRequest)}
# Fields of a one-sequence request that a batch item may not carry: a batch's rows go from shard to shard under
# the batch's own tickets.
BATCH_REFUSED_FIELDS = frozenset({"send_rows", "rows_ticket", "ticket_rows"})
# The tensor frames of a batch, one per name for all its items (their rows end to end, in item order).
BATCH_TENSORS: dict[MessageType, tuple[str, ...]] = {
    MessageType.FORWARD: ("hidden", "carried", "token_mask"),  # a FORWARD batch's item with `layers` is a CAPTURE
    MessageType.CAPTURE: ("hidden", "carried", "token_mask"),
    MessageType.ROLLBACK: (),
    MessageType.ROWS: ("hidden", "carried"),
}

RECORD_TYPES: dict[MessageType, type] = {record.type: record for record in get_args(Request)}


# --- the schema, derived from the records ------------------------------------------------

def _field_spec(f: Field) -> FieldSpec:
    required = f.default is MISSING
    return FieldSpec(f.name, required=required, default=None if required else f.default, **f.metadata["header"])


REQUEST_FIELDS: dict[MessageType, tuple[FieldSpec, ...]] = {
    mtype: tuple(_field_spec(f) for f in fields(record) if "header" in f.metadata)
    for mtype, record in RECORD_TYPES.items()
}
REQUEST_TENSORS: dict[MessageType, tuple[TensorSpec, ...]] = {
    mtype: tuple(TensorSpec(f.name, **f.metadata["tensor"]) for f in fields(record) if "tensor" in f.metadata)
    for mtype, record in RECORD_TYPES.items()
}
