"""Several sequences in one request to a shard: what each asks, and the loop any engine runs.

A batch runs each item as the one-sequence `forward` would, validated first: an item the shard refuses
(a `ModelError`: bad input, a position that no longer matches, capacity) gets that error in its place and
changes nothing; the other items run. An engine with a batched step (`FastShard.forward_batch`, one
fixed-shape step of R rows shared by the items) runs them together; any other engine (the reference
`ShardModel`) runs them one after another, which gives the same results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from shardd.model.errors import ModelError
from shardd.model.shard import ShardOutput
from shardd.model.state import SequenceState


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


def forward_batch(shard, items: Sequence[BatchItem]) -> list[ShardOutput | ModelError]:
    """Run `items` on `shard`: per item its `ShardOutput`, or the `ModelError` that refused it (nothing of that
    item's sequence changed). The head shard's `logits` of an item stay valid until the next call; an item with
    `logits=False` gets none (ids only: nothing of its [n, vocab] rows is kept or copied)."""
    batched = getattr(type(shard), "forward_batch", None)
    if batched is not None:
        return batched(shard, items)
    results: list[ShardOutput | ModelError] = []
    for item in items:
        try:
            out = shard.forward(item.state, item.pos, tokens=item.tokens, hidden=item.hidden,
                                checkpoint=item.checkpoint, capture_layers=item.capture_layers)
            if not item.logits:
                out.logits = None
            elif out.logits is not None:  # the next item's step may reuse the buffer the logits view
                out.logits = out.logits.clone()
        except ModelError as error:
            out = error
        results.append(out)
    return results
