"""One sequence's part of a batched forward (`ShardEngine.forward_batch`).

A batch runs each item as the one-sequence `forward` would, validated first: an item the engine refuses
(a `ModelError`: bad input, a position that no longer matches, capacity) gets that error in its place and
changes nothing; the other items run. The fast engine runs them together in fixed-shape steps of R rows;
the reference engine one after another, which gives the same results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from shardd.engine.reference.state import SequenceState


@dataclass
class BatchItem:
    """One sequence's part of a batched forward: the arguments of `shard.forward` for it."""

    state: SequenceState
    pos: int
    tokens: Optional[list[int]] = None  # on the shard that owns the embedding
    hidden: Optional[torch.Tensor] = None  # [n, hidden] on the others
    checkpoint: bool = False
    capture_layers: tuple[int, ...] = ()
    logits: bool = True  # the head shard's logits rows wanted (sampling, penalties, logprobs); else ids only

    @property
    def n(self) -> int:
        return len(self.tokens) if self.tokens is not None else int(self.hidden.shape[0])
