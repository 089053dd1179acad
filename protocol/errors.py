"""Error codes carried in `ok: false` replies, the exception that carries them locally, and its messages."""

from __future__ import annotations

import enum
from typing import Any


class ErrorCode(str, enum.Enum):
    """Why a request failed. The value is the string sent on the wire."""

    BAD_REQUEST = "BAD_REQUEST"                  # malformed message: bytes, types, fields, frames
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"  # header `v` is not the version this side speaks
    UNKNOWN_TYPE = "UNKNOWN_TYPE"                # header `type` names no message type
    NO_SUCH_SEQUENCE = "NO_SUCH_SEQUENCE"        # `seq` is not open
    SEQUENCE_EXISTS = "SEQUENCE_EXISTS"          # OPEN of a `seq` that is already open
    POSITION_MISMATCH = "POSITION_MISMATCH"      # FORWARD/CAPTURE `pos` != committed length
    NO_PENDING_STEP = "NO_PENDING_STEP"          # ROLLBACK with no pending checkpointed step
    ROLLBACK_UNAVAILABLE = "ROLLBACK_UNAVAILABLE"  # `checkpoint: true` on a shard without rollback storage, or n too large for it
    GEOMETRY_REJECTED = "GEOMETRY_REJECTED"      # `parents` is not the root-inclusive pure chain
    CAPACITY = "CAPACITY"                        # out of sequences, context or memory
    TOO_LARGE = "TOO_LARGE"                      # request exceeds a size limit
    SEQUENCE_FAILED = "SEQUENCE_FAILED"          # sequence is failed after an INTERNAL error; only CLOSE works
    INTERNAL = "INTERNAL"                        # bug or device error inside the daemon
    NO_DRAFTER = "NO_DRAFTER"                    # PROPOSE on a shard that hosts no drafter
    NO_SNAPSHOT = "NO_SNAPSHOT"                  # RESTORE of a sequence that has no snapshot
    FORBIDDEN = "FORBIDDEN"                      # SHUTDOWN from a peer the daemon cannot trust (plain TCP, abstract ipc)
    ROWS_MISSING = "ROWS_MISSING"                # a FORWARD's rows_ticket got no rows: the previous shard refused, a later
                                                 # request of the connection came first, or the wait timed out
    PREFIX_MISSING = "PREFIX_MISSING"            # OPEN from a prefix entry this client does not hold (never saved, evicted,
                                                 # another client's): open the sequence cold

    def __str__(self) -> str:
        return self.value


class ProtocolError(Exception):
    """A request or reply that cannot be served or understood, with the code to report."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        self.code = ErrorCode(code)
        self.message = str(message)
        super().__init__(f"{self.code.value}: {self.message}")


class RemoteError(ProtocolError):
    """An error the daemon reported in an `ok: false` reply (see `Reply.raise_for_error`)."""


class ItemRefused(ProtocolError):
    """One item of a batched request that failed to decode: the other items still run (PROTOCOL.md, "Batches")."""

    def __init__(self, code: ErrorCode | str, message: str, seq: int) -> None:
        super().__init__(code, message)
        self.seq = seq


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def _too_large(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.TOO_LARGE, message)


MAX_ERROR_MESSAGE = 400  # characters of an error message: a hostile value is quoted by its prefix only


def clip_message(message: str) -> str:
    """`message` cut to MAX_ERROR_MESSAGE characters, saying how much was left out."""
    message = str(message)
    if len(message) <= MAX_ERROR_MESSAGE:
        return message
    return f"{message[:MAX_ERROR_MESSAGE]}... ({len(message) - MAX_ERROR_MESSAGE} more characters)"


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
