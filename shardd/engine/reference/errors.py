"""Why the model refused a request. A refusal changes nothing; the daemon maps each class to a wire error code."""


class ModelError(ValueError):
    """A request this model or this sequence's state cannot serve as asked. Nothing was changed."""


class BadInput(ModelError):
    """Input that does not fit the model: a token outside the vocabulary, hidden of the wrong width or dtype,
    tokens for a shard that takes hidden (or the reverse), a `keep` outside the pending step."""


class PositionMismatch(ModelError):
    """`pos` is not the sequence's committed length."""


class CapacityExceeded(ModelError):
    """The tokens would pass the sequence's context limit."""


class RollbackUnavailable(ModelError):
    """A checkpointed step on a shard without rollback storage, or longer than its storage holds."""


class NoPendingStep(ModelError):
    """A rollback with no pending checkpointed step."""


class NoSnapshot(ModelError):
    """A restore of a sequence that has no snapshot."""
