"""The `Target` in one process: the same `ShardModel`s the daemons run, no sockets.

It is the single-process reference the tests compare the pipeline with (plain greedy
decoding of the same model in one process). A request the shards refuse raises their own
`ModelError`; a rollback that cannot be done raises `RollbackFailed`, as the pipeline does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from coordinator.target import RollbackFailed
from protocol import ErrorCode, ProtocolError
from protocol.layout import CHECKPOINT, coverage_problems
from shardd.loading import ModelSource, build_shard
from shardd.model import rollback as rb
from shardd.model.errors import ModelError
from shardd.model.rollback import RollbackStorage
from shardd.model.state import SequenceState

DEFAULT_MAX_CONTEXT = 4096


class LocalTarget:
    def __init__(
        self,
        source: ModelSource,
        splits: Optional[Sequence[tuple[int, int]]] = None,
        storage: RollbackStorage = RollbackStorage(CHECKPOINT, 16),
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_context: Optional[int] = None,
    ) -> None:
        config = source.config()
        splits = sorted(tuple(split) for split in (splits or [(0, config.num_layers)]))
        problems = coverage_problems(splits, config.num_layers)
        if problems:
            raise ValueError(f"splits {splits} do not form the {config.num_layers}-layer model: " + "; ".join(problems))
        shards = [build_shard(source, b, e, dtype=dtype, device=device, storage=storage) for b, e in splits]
        self._init(config, shards, max_context)

    @classmethod
    def from_shards(cls, shards: Sequence, max_context: Optional[int] = None) -> "LocalTarget":
        """Over shards already built (ShardModels or FastShards), in layer order."""
        target = cls.__new__(cls)
        target._init(shards[0].config, list(shards), max_context)
        return target

    def _init(self, config, shards, max_context) -> None:
        self.config = config
        self.shards = shards
        self.max_context = max_context or min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        self.states: dict[int, list[SequenceState]] = {}

    @property
    def step_rows(self) -> int | None:
        rows = [shard.step_rows for shard in self.shards if shard.step_rows]
        return min(rows) if rows else None

    def _states(self, seq: int) -> list[SequenceState]:
        if seq not in self.states:
            raise ProtocolError(ErrorCode.NO_SUCH_SEQUENCE, f"sequence {seq} is not open")
        return self.states[seq]

    def open(self, seq: int) -> None:
        if seq in self.states:
            raise ProtocolError(ErrorCode.SEQUENCE_EXISTS, f"sequence {seq} is already open")
        self.states[seq] = [shard.new_state(self.max_context) for shard in self.shards]

    def close(self, seq: int) -> None:
        for shard, state in zip(self.shards, self.states.pop(seq, [])):
            shard.release_state(state)

    def forward(self, seq: int, pos: int, tokens: list[int], *, checkpoint: bool = False, sampling=None,
                drafts=None) -> list[int]:
        ids, _ = self.capture(seq, pos, tokens, (), checkpoint=checkpoint)
        if sampling is not None and not sampling.plain:  # what the head shard's daemon does (shardd.head)
            from coordinator.sampling import TokenIds
            from protocol.messages import Forward
            from shardd.daemon import head_request
            from shardd.head import answer_rows

            record = Forward(id=0, seq=seq, pos=pos, tokens=list(tokens), **sampling.wire(),
                             drafts=list(drafts) if drafts else None)
            answered, _, logprobs = answer_rows(self._logits, ids, pos, head_request(record))
            ids = TokenIds(answered)
            ids.logprobs = logprobs
        return ids

    @torch.inference_mode()
    def capture(
        self, seq: int, pos: int, tokens: list[int], layers: Sequence[int], *, checkpoint: bool = False
    ) -> tuple[list[int], dict[int, torch.Tensor]]:
        """A forward that also returns the output of each decoder layer in `layers`."""
        states = self._states(seq)
        hidden, captured = None, {}
        for shard, state in zip(self.shards, states):
            inputs = {"tokens": list(tokens)} if shard.owns_embedding else {"hidden": hidden}
            out = shard.forward(state, pos, checkpoint=checkpoint, capture_layers=tuple(layers), **inputs)
            captured.update(out.captured)
            hidden = out.hidden
        self._logits = out.logits
        return out.ids.tolist(), captured

    def rollback(self, seq: int, keep: int) -> None:
        for state in self._states(seq):
            try:
                rb.rollback(state, keep)
            except ModelError as error:
                raise RollbackFailed(str(error)) from error

    def snapshot(self, seq: int) -> None:
        for state in self._states(seq):
            rb.snapshot(state)

    def restore(self, seq: int) -> None:
        for state in self._states(seq):
            rb.restore(state)
