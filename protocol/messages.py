"""Message types, the request schema table, and one typed record per request type.

The schema table (`REQUEST_FIELDS`, `REQUEST_TENSORS`) is the single description of what a
request header may carry; `codec.decode_request` validates against it and `PROTOCOL.md`
documents it. Record field names equal header field names (tensor records: frame names).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from .tensors import FLOAT_DTYPES, WireTensor

PROTOCOL_VERSION = 1

ID_LIMIT = 1 << 63      # ids and sequence numbers: 0 <= x < 2**63
TOKEN_LIMIT = 1 << 31   # token ids: 0 <= t < 2**31


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

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FieldSpec:
    """One header field of a request type. Integer bounds are `minimum <= x < limit`."""

    name: str
    kind: str                     # "int", "bool" or "int_list"
    required: bool = True
    default: Any = None           # value when an optional field is absent
    minimum: Optional[int] = None  # for "int", or each item of "int_list"
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

_SEQ = FieldSpec("seq", "int", minimum=0, limit=ID_LIMIT, doc="client-chosen sequence id")
_FORWARD_FIELDS: tuple[FieldSpec, ...] = (
    _SEQ,
    FieldSpec("pos", "int", minimum=0, limit=ID_LIMIT, doc="must equal the committed length"),
    FieldSpec("tokens", "int_list", required=False, minimum=0, limit=TOKEN_LIMIT,
              doc="token ids; exactly one of tokens / tensor hidden"),
    FieldSpec("checkpoint", "bool", required=False, default=False,
              doc="make the step pending so one ROLLBACK may follow"),
    FieldSpec("parents", "int_list", required=False,
              doc="verify geometry, one entry per token; required with checkpoint, rejected without"),
    FieldSpec("return_logits", "bool", required=False, default=False,
              doc="head shard also returns float32 logits [n, V]"),
)

REQUEST_FIELDS: dict[MessageType, tuple[FieldSpec, ...]] = {
    MessageType.HELLO: (),
    MessageType.OPEN: (_SEQ,),
    MessageType.CLOSE: (_SEQ,),
    MessageType.FORWARD: _FORWARD_FIELDS,
    MessageType.CAPTURE: _FORWARD_FIELDS + (
        FieldSpec("layers", "int_list", minimum=0, limit=ID_LIMIT,
                  doc="non-empty, distinct layer indices whose outputs to return"),
    ),
    MessageType.ROLLBACK: (
        _SEQ,
        FieldSpec("keep", "int", minimum=0, limit=ID_LIMIT, doc="tokens of the pending step to keep"),
    ),
    MessageType.SNAPSHOT: (_SEQ,),
    MessageType.RESTORE: (_SEQ,),
    MessageType.PROPOSE: (
        _SEQ,
        FieldSpec("pos", "int", minimum=0, limit=ID_LIMIT,
                  doc="committed length: the position of last_token; the features are the rows just before it"),
        FieldSpec("last_token", "int", minimum=0, limit=TOKEN_LIMIT, doc="last committed token"),
        FieldSpec("block_size", "int", minimum=1, limit=TOKEN_LIMIT, doc="draft tokens wanted"),
    ),
    MessageType.STATS: (),
    MessageType.SHUTDOWN: (),
}

_HIDDEN = TensorSpec("hidden", 2, FLOAT_DTYPES, doc="[n, H] activations from the previous shard")
REQUEST_TENSORS: dict[MessageType, tuple[TensorSpec, ...]] = {
    mtype: () for mtype in MessageType
}
REQUEST_TENSORS[MessageType.FORWARD] = (_HIDDEN,)
REQUEST_TENSORS[MessageType.CAPTURE] = (_HIDDEN,)
REQUEST_TENSORS[MessageType.PROPOSE] = (
    TensorSpec("features", 2, FLOAT_DTYPES, doc="[n, F] drafter context features of positions pos-n .. pos-1"),
)


# --- records -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    type: ClassVar[MessageType] = MessageType.HELLO
    id: int


@dataclass(frozen=True)
class Stats:
    type: ClassVar[MessageType] = MessageType.STATS
    id: int


@dataclass(frozen=True)
class Shutdown:
    type: ClassVar[MessageType] = MessageType.SHUTDOWN
    id: int


@dataclass(frozen=True)
class Open:
    type: ClassVar[MessageType] = MessageType.OPEN
    id: int
    seq: int


@dataclass(frozen=True)
class Close:
    type: ClassVar[MessageType] = MessageType.CLOSE
    id: int
    seq: int


@dataclass(frozen=True)
class Snapshot:
    type: ClassVar[MessageType] = MessageType.SNAPSHOT
    id: int
    seq: int


@dataclass(frozen=True)
class Restore:
    type: ClassVar[MessageType] = MessageType.RESTORE
    id: int
    seq: int


@dataclass(frozen=True)
class Forward:
    """Append n tokens (or n rows of hidden state) at `pos`; n = len(tokens) or hidden.shape[0]."""

    type: ClassVar[MessageType] = MessageType.FORWARD
    id: int
    seq: int
    pos: int
    tokens: Optional[list[int]] = None
    hidden: Optional[WireTensor] = None
    checkpoint: bool = False
    parents: Optional[list[int]] = None
    return_logits: bool = False

    @property
    def n_tokens(self) -> int:
        if self.tokens is not None:
            return len(self.tokens)
        return self.hidden.shape[0] if self.hidden is not None else 0


@dataclass(frozen=True)
class Capture(Forward):
    """A FORWARD that also returns the outputs of `layers` owned by the shard."""

    type: ClassVar[MessageType] = MessageType.CAPTURE
    layers: list[int] = field(kw_only=True)


@dataclass(frozen=True)
class Rollback:
    type: ClassVar[MessageType] = MessageType.ROLLBACK
    id: int
    seq: int
    keep: int


@dataclass(frozen=True)
class Propose:
    """Append the feature rows of positions pos-n .. pos-1 to the drafter's context (cropping rows at or past
    pos-n first: their tokens were rolled back), then draft `block_size` tokens after `last_token` at `pos`."""

    type: ClassVar[MessageType] = MessageType.PROPOSE
    id: int
    seq: int
    pos: int
    last_token: int
    block_size: int
    features: Optional[WireTensor] = None


Request = Union[Hello, Open, Close, Forward, Capture, Rollback, Snapshot, Restore, Propose, Stats, Shutdown]

RECORD_TYPES: dict[MessageType, type] = {
    MessageType.HELLO: Hello,
    MessageType.OPEN: Open,
    MessageType.CLOSE: Close,
    MessageType.FORWARD: Forward,
    MessageType.CAPTURE: Capture,
    MessageType.ROLLBACK: Rollback,
    MessageType.SNAPSHOT: Snapshot,
    MessageType.RESTORE: Restore,
    MessageType.PROPOSE: Propose,
    MessageType.STATS: Stats,
    MessageType.SHUTDOWN: Shutdown,
}
