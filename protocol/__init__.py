"""Wire protocol v1 between the coordinator and shard daemons (see PROTOCOL.md).

Importing this package does not import torch.
"""

from .codec import (
    Reply,
    decode_reply,
    decode_request,
    encode_error,
    encode_reply,
    encode_request,
    pack_message,
    peek_id,
    peek_kind,
    peek_type,
    split_batch_reply,
)
from .errors import ErrorCode, ItemRefused, ProtocolError, RemoteError
from .geometry import check_verify_geometry, pure_chain
from .limits import Limits
from .messages import (
    BATCH_RECORD_TYPES,
    BATCH_TENSORS,
    Batch,
    PROTOCOL_VERSION,
    RECORD_TYPES,
    REQUEST_FIELDS,
    REQUEST_TENSORS,
    Capture,
    CaptureBatch,
    Close,
    FieldSpec,
    Forward,
    ForwardBatch,
    Hello,
    MessageType,
    Open,
    Propose,
    Request,
    Restore,
    Ring,
    Rollback,
    RollbackBatch,
    Rows,
    RowsBatch,
    SAMPLING_EPS,
    Shutdown,
    Snapshot,
    Stats,
    TensorSpec,
    samples,
)
from .tensors import DTYPE_SIZES, WireTensor

__all__ = [
    "PROTOCOL_VERSION", "SAMPLING_EPS", "samples", "MessageType", "Request", "RECORD_TYPES", "REQUEST_FIELDS", "REQUEST_TENSORS",
    "FieldSpec", "TensorSpec",
    "Hello", "Open", "Close", "Forward", "Capture", "Rollback", "Snapshot", "Restore", "Propose",
    "Rows", "Ring", "Stats", "Shutdown", "Batch", "ForwardBatch", "CaptureBatch", "RollbackBatch", "RowsBatch", "BATCH_RECORD_TYPES", "BATCH_TENSORS", "split_batch_reply",
    "encode_request", "decode_request", "encode_reply", "encode_error", "decode_reply", "Reply",
    "pack_message", "peek_id", "peek_kind", "peek_type",
    "ErrorCode", "ProtocolError", "RemoteError", "ItemRefused",
    "check_verify_geometry", "pure_chain",
    "Limits", "WireTensor", "DTYPE_SIZES",
]
