"""Refusals: the one place an engine's ModelError becomes a wire error code, and where every refusal (of a request,
or of one item of a batch) is counted and logged."""

from __future__ import annotations

import logging

from protocol import ErrorCode, encode_error
from protocol.codec import clip_message
from shardd.engine.reference.errors import (
    BadInput,
    CapacityExceeded,
    ModelError,
    NoPendingStep,
    NoSnapshot,
    PositionMismatch,
    RollbackUnavailable,
)
from shardd.server.stats import Counters

log = logging.getLogger("shardd")

MODEL_ERROR_CODES: dict[type[ModelError], ErrorCode] = {
    BadInput: ErrorCode.BAD_REQUEST,
    PositionMismatch: ErrorCode.POSITION_MISMATCH,
    CapacityExceeded: ErrorCode.CAPACITY,
    RollbackUnavailable: ErrorCode.ROLLBACK_UNAVAILABLE,
    NoPendingStep: ErrorCode.NO_PENDING_STEP,
    NoSnapshot: ErrorCode.NO_SNAPSHOT,
}


def code_and_message(error: Exception) -> tuple[ErrorCode, str]:
    """A refusal's wire code and message: a ModelError's by its type, a ProtocolError's (or ItemRefused's) own."""
    if isinstance(error, ModelError):
        return MODEL_ERROR_CODES[type(error)], str(error)
    return error.code, error.message


class Refusals:
    """Counts and logs each refusal; the message as the reply quotes it."""

    def __init__(self, counters: Counters):
        self.counters = counters

    def note(self, mtype, code: ErrorCode, message: str, seq) -> str:
        message = clip_message(message)  # the reply and the log quote a bad value's prefix only
        type_name = getattr(mtype, "value", mtype)
        self.counters.errors[ErrorCode(code).value] += 1
        self.counters.errors_by_type[(type_name, ErrorCode(code).value)] += 1
        log.warning("error seq=%s type=%s code=%s: %s", seq, type_name, ErrorCode(code).value, message)
        return message

    def reply(self, request_id, mtype, code: ErrorCode, message: str, seq) -> list:
        """The frames of an error reply."""
        return encode_error(request_id, mtype, code, self.note(mtype, code, message, seq))
