"""What a shard's failure means to the pipeline: the errors it raises, and how a shard's error reads."""

from __future__ import annotations

from coordinator.relay.client import ShardError, ShardTimeout
from coordinator.relay.shards import PipelineError
from coordinator.relay.target import SequenceLost
from protocol import ErrorCode, ProtocolError

SHARD_FAILURES = (ShardError, ShardTimeout, ProtocolError)


class PrefixMissing(PipelineError):
    """OPEN from a prefix entry that a shard no longer holds (evicted, restarted): nothing stays open; open the
    sequence cold. `held`: the pipeline's shards hold it and only a drafter daemon of its own lacks it (its
    entries come with the PROPOSE after a prompt's last chunk), so it still serves streams that do not draft there."""

    def __init__(self, message: str, held: bool = False) -> None:
        super().__init__(message)
        self.held = held


class CheckpointUnavailable(PipelineError):
    """A checkpointed step the shard set cannot hold (no rollback storage, or too many tokens).
    Raised before any shard sees the request, so no state changed."""


class ShardReplaced(PipelineError):
    """The daemon now answering at a shard's endpoint is not the shard the pipeline was built on
    (other weights, layer range, dtype or protocol): re-filling it would compute something else."""


class SequenceInconsistent(PipelineError, SequenceLost):
    """A forward failed part-way down the pipeline and could not be undone: the shards now
    disagree on the sequence's length. Close it and re-fill it from the committed history."""


def shard_refused(error: Exception) -> bool:
    """Whether a shard refused (an error reply but INTERNAL): it changed nothing, and told the next shard so."""
    return isinstance(error, ShardError) and error.code is not ErrorCode.INTERNAL


def as_sequence_lost(error: Exception, seq: int) -> Exception:
    """A shard failure that means the sequence is gone from a shard (SequenceLost), else the error itself."""
    if isinstance(error, ShardTimeout) or (
        isinstance(error, ShardError) and error.code in (ErrorCode.NO_SUCH_SEQUENCE, ErrorCode.SEQUENCE_FAILED)
    ):
        lost = SequenceLost(f"sequence {seq}: {error}")
        lost.__cause__ = error
        return lost
    return error
