"""`ShardEngine`: what a daemon asks of the engine serving its layer range.

Two engines implement it: the readable reference (`ShardModel`, shardd/engine/reference/shard.py, any device) and the
fixed-shape GPU step (`FastShard`, shardd/engine/fast/shard.py). A daemon holds one and knows nothing else of it:
what an engine can do is a declared attribute here, never probed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from shardd.engine.batch import BatchItem
    from common.model_config import ModelConfig
    from shardd.engine.reference.errors import ModelError
    from shardd.engine.reference.rollback import RollbackStorage
    from shardd.engine.reference.shard import ShardOutput
    from shardd.engine.reference.state import SequenceState


@runtime_checkable
class ShardEngine(Protocol):
    """Layers [begin, end) of a model, run over per-sequence states the engine allocates.

    Every method that changes a state validates first: it raises a ModelError and changes nothing, or succeeds.
    """

    engine: str  # "reference" or "fast" (HELLO's `engine`)
    config: ModelConfig
    fingerprint: str  # the weights' identity (ModelSource.fingerprint)
    begin: int
    end: int
    dtype: torch.dtype
    device: torch.device
    owns_embedding: bool
    owns_head: bool
    gdn_layers: list[int]
    attention_layers: list[int]
    storage: RollbackStorage  # the rollback mode and the most tokens one checkpointed step may carry
    step_rows: int | None  # T: the most rows of one sequence that take the fixed step (None: no fixed step)
    batch_rows: int | None  # R: the rows of every batched step, shared by its sequences (None: no fixed step)
    prefill_rows: int | None  # P: the GPU prefill's piece replayed from graphs (None: no such prefill)
    # a non-head step's output rows may stay on the device (for the next shard's device ring) when
    # `rows_out_on_device` is set; an engine without it leaves the flag False and its rows on the host
    supports_device_rows: bool
    rows_out_on_device: bool

    # ---- sizes -----------------------------------------------------------------------------------

    def weight_bytes(self) -> int: ...

    def state_bytes_per_sequence(self, max_context: int) -> int: ...

    def checkpoint_bytes_per_sequence(self) -> int: ...

    # ---- a sequence's state ----------------------------------------------------------------------

    def new_state(self, max_context: int) -> SequenceState:
        """Open: a fresh state of length 0 (MemoryError when none is left)."""
        ...

    def release_state(self, state: SequenceState) -> None:
        """Close: give the state's memory back."""
        ...

    # ---- forward ---------------------------------------------------------------------------------

    def check_rollback_storage(self, n: int = 0) -> None:
        """Raises RollbackUnavailable unless a checkpointed step of `n` tokens can be rolled back."""
        ...

    def check_forward(self, state: SequenceState, pos: int, *, tokens: list[int] | None = None,
                      hidden: torch.Tensor | None = None, checkpoint: bool = False) -> int:
        """Validation only; returns the number of new tokens."""
        ...

    def forward(self, state: SequenceState, pos: int, *, tokens: list[int] | None = None,
                hidden: torch.Tensor | None = None, checkpoint: bool = False,
                capture_layers: Sequence[int] = ()) -> ShardOutput:
        """Append n tokens at `pos` (== the committed length); with `checkpoint` the step stays pending."""
        ...

    def forward_batch(self, items: Sequence[BatchItem]) -> list[ShardOutput | ModelError]:
        """Per item its output, or the ModelError that refused it (that sequence unchanged; the others run).
        The head shard's logits stay valid until the next call; an item with `logits=False` gets none."""
        ...

    # ---- rollback --------------------------------------------------------------------------------

    def rollback(self, state: SequenceState, keep: int) -> None:
        """Keep the first `keep` tokens of the pending step: the state of forwarding only those."""
        ...

    def snapshot(self, state: SequenceState) -> None:
        """Save the recurrent state and length (ends a pending step, all of it kept)."""
        ...

    def restore(self, state: SequenceState) -> None:
        """Back to the last snapshot (NoSnapshot without one)."""
        ...

    def settle(self, state: SequenceState) -> None:
        """Make the state's tensors hold what the last rollback left, for a reader outside the engine's own
        step (an engine may defer a rollback's work to the sequence's next step)."""
        ...

    # ---- observability ---------------------------------------------------------------------------

    def describe(self) -> dict:
        """What STATS reports of the engine itself (`engine` there): e.g. the fast engine's prefill graphs, per
        set of captured layers whether they replay or run eagerly and why."""
        ...
