"""Frames <-> records. One message = [msgpack header, tensor frame, tensor frame, ...].

Decoding never copies a tensor frame: `WireTensor.data` is a memoryview of the frame.
Everything is validated before a record exists, so a handler only ever sees a well-formed
request; every failure is a `ProtocolError` carrying the code for the error reply.

This module is the codec's public face; its parts, one role each: `frames` (a message's frames and
header), `fields` (a field against the schema), `checks` (the rules between a request's fields),
`records`, `decode` and `encode` (requests, batches included), `replies`; error messages in `errors`.
"""

from __future__ import annotations

from .checks import PENALTY_FIELDS
from .decode import decode_request
from .encode import encode_request
from .errors import (
    MAX_ERROR_MESSAGE,
    ErrorCode,
    ItemRefused,
    ProtocolError,
    RemoteError,
    clip_message,
)
from .frames import Frames, pack_message, peek_id, peek_kind, peek_type
from .geometry import check_verify_geometry
from .limits import Limits
from .messages import (
    BATCH_RECORD_TYPES,
    BATCH_REFUSED_FIELDS,
    BATCH_TENSORS,
    COMMON_FIELDS,
    ID_LIMIT,
    PROTOCOL_VERSION,
    RECORD_TYPES,
    REQUEST_FIELDS,
    REQUEST_TENSORS,
    SAMPLING_EPS,
    TOKEN_LIMIT,
    Batch,
    Capture,
    FieldSpec,
    Forward,
    MessageType,
    Propose,
    Request,
    Rollback,
    Rows,
    TensorSpec,
    samples,
)
from .records import new_record, with_id
from .replies import Reply, decode_reply, encode_error, encode_reply, split_batch_reply
from .tensors import (
    DTYPE_SIZES,
    WireTensor,
    as_byte_view,
    concat_rows,
    expected_nbytes,
    row_slice,
)

__all__ = [
    # the codec
    "Frames", "pack_message", "peek_id", "peek_kind", "peek_type",
    "decode_request", "encode_request", "new_record", "with_id", "PENALTY_FIELDS",
    "Reply", "encode_reply", "encode_error", "decode_reply", "split_batch_reply",
    "MAX_ERROR_MESSAGE", "clip_message",
    # the records, errors, limits and tensors it handles, importable beside it
    "PROTOCOL_VERSION", "ID_LIMIT", "TOKEN_LIMIT", "SAMPLING_EPS", "samples", "MessageType", "Request",
    "RECORD_TYPES", "REQUEST_FIELDS", "REQUEST_TENSORS", "COMMON_FIELDS", "FieldSpec", "TensorSpec",
    "Forward", "Capture", "Rollback", "Rows", "Propose",
    "Batch", "BATCH_RECORD_TYPES", "BATCH_REFUSED_FIELDS", "BATCH_TENSORS",
    "ErrorCode", "ProtocolError", "RemoteError", "ItemRefused", "check_verify_geometry", "Limits",
    "WireTensor", "DTYPE_SIZES", "as_byte_view", "concat_rows", "expected_nbytes", "row_slice",
]
