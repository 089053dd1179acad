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
    peek_type,
)
from .errors import ErrorCode, ProtocolError, RemoteError
from .geometry import check_verify_geometry, pure_chain
from .limits import Limits
from .messages import (
    PROTOCOL_VERSION,
    RECORD_TYPES,
    REQUEST_FIELDS,
    REQUEST_TENSORS,
    Capture,
    Close,
    FieldSpec,
    Forward,
    Hello,
    MessageType,
    Open,
    Propose,
    Request,
    Restore,
    Rollback,
    Shutdown,
    Snapshot,
    Stats,
    TensorSpec,
)
from .tensors import DTYPE_SIZES, WireTensor

__all__ = [
    "PROTOCOL_VERSION", "MessageType", "Request", "RECORD_TYPES", "REQUEST_FIELDS", "REQUEST_TENSORS",
    "FieldSpec", "TensorSpec",
    "Hello", "Open", "Close", "Forward", "Capture", "Rollback", "Snapshot", "Restore", "Propose",
    "Stats", "Shutdown",
    "encode_request", "decode_request", "encode_reply", "encode_error", "decode_reply", "Reply",
    "pack_message", "peek_id", "peek_type",
    "ErrorCode", "ProtocolError", "RemoteError",
    "check_verify_geometry", "pure_chain",
    "Limits", "WireTensor", "DTYPE_SIZES",
]
