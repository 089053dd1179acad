"""The coordinator's `Target` in one process: the same shards the daemons run, no sockets.

The single-process reference that tests compare the pipeline with, and the one-process arm of the benchmarks
(scripts/bench_gpu.py, bench_batch.py). A request the shards refuse raises their own `ModelError`; a rollback that
cannot be done raises `RollbackFailed`, as the pipeline does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from coordinator.relay.target import RollbackFailed
from protocol import ErrorCode, ProtocolError
from protocol.layout import CHECKPOINT, coverage_problems
from shardd.weights.loading import ModelSource, build_shard
from shardd.engine.reference.errors import ModelError
from shardd.engine.reference.rollback import RollbackStorage
from shardd.engine.reference.state import SequenceState

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
        self._deferred: dict[int, Exception] = {}  # seq -> why its last rollback_batch item failed (raised next)

    @property
    def verify_row_bytes(self) -> int:
        """What one verify row writes of the shards' rollback storage (`--block-size auto` weighs it)."""
        return sum(shard.checkpoint_bytes_per_sequence() // shard.storage.max_verify_tokens
                   for shard in self.shards if shard.storage.enabled and shard.storage.max_verify_tokens)

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
        self._deferred.pop(seq, None)
        for shard, state in zip(self.shards, self.states.pop(seq, [])):
            shard.release_state(state)

    def forward(self, seq: int, pos: int, tokens: list[int], *, checkpoint: bool = False, sampling=None,
                drafts=None, token_mask=None) -> list[int]:
        """A batch of one (`forward_batch`): its ids, or the error that refused it raised."""
        from coordinator.relay.pipeline import BatchForward

        (ids,) = self.forward_batch([BatchForward(seq, pos, list(tokens), checkpoint, sampling, drafts,
                                                  token_mask=token_mask)])
        if isinstance(ids, Exception):
            raise ids
        return ids

    @torch.inference_mode()
    def capture(
        self, seq: int, pos: int, tokens: list[int], layers: Sequence[int], *, checkpoint: bool = False
    ) -> tuple[list[int], dict[int, torch.Tensor]]:
        """A forward that also returns the output of each decoder layer in `layers`."""
        self._raise_deferred(seq)
        states = self._states(seq)
        hidden, captured = None, {}
        for shard, state in zip(self.shards, states):
            inputs = {"tokens": list(tokens)} if shard.owns_embedding else {"hidden": hidden}
            out = shard.forward(state, pos, checkpoint=checkpoint, capture_layers=tuple(layers), **inputs)
            captured.update(out.captured)
            hidden = out.hidden
        return out.ids.tolist(), captured

    def _raise_deferred(self, seq: int) -> None:
        error = self._deferred.pop(seq, None)
        if error is not None:
            raise error

    @torch.inference_mode()
    def forward_batch(self, items: Sequence) -> list:
        """`forward` for several sequences (`coordinator.relay.pipeline.BatchForward`s), each shard running them as one
        batch (the engine's `forward_batch`), as the daemons do: per item its ids (TokenIds) or the error `forward`
        raises for it (a shard's ModelError, NO_SUCH_SEQUENCE, ValueError, RollbackFailed of an earlier
        `rollback_batch`); a refused item changes nothing and is dropped from the later shards (a checkpointed one
        is taken back where it ran)."""
        from coordinator.sampling import TokenIds
        from shardd.engine.batch import BatchItem
        from shardd.engine.head.answer import answer_batch
        from shardd.engine.head.logprobs import scored_rows

        items = list(items)
        results: list = [None] * len(items)
        live, seen = [], set()
        for index, item in enumerate(items):
            try:
                self._raise_deferred(item.seq)
                self._states(item.seq)
                if not item.tokens:
                    raise ValueError("forward needs at least one token")
                if item.seq in seen:
                    raise ValueError(f"sequence {item.seq} appears twice in one batch")
                seen.add(item.seq)
            except (ProtocolError, RollbackFailed, ValueError) as error:
                results[index] = error
                continue
            live.append(index)
        hidden: dict[int, torch.Tensor] = {}
        answered = [(item.sampling is not None and not item.sampling.plain) or item.token_mask is not None
                    for item in items]  # the head answers more than the argmax
        for k, shard in enumerate(self.shards):
            batch = [BatchItem(self.states[items[i].seq][k], items[i].pos, checkpoint=items[i].checkpoint,
                               logits=answered[i] or bool(items[i].next_tokens),
                               **({"tokens": list(items[i].tokens)} if shard.owns_embedding else {"hidden": hidden.pop(i)}))
                     for i in live]
            survivors, heads, scoring = [], [], []
            for index, out in zip(live, shard.forward_batch(batch)):
                item = items[index]
                if isinstance(out, ModelError):
                    if item.checkpoint:  # the shards before took the step: take it back
                        for before, state in zip(self.shards, self.states[item.seq][:k]):
                            before.rollback(state, 0)
                    results[index] = out
                elif out.ids is None:
                    hidden[index] = out.hidden
                    survivors.append(index)
                else:
                    results[index] = TokenIds(out.ids.tolist())
                    if answered[index]:
                        heads.append((index, out))
                    if item.next_tokens:
                        scoring.append((index, out))
            if heads:  # what the head shard's daemon does (shardd.engine.head.answer)
                from coordinator.relay.pipeline import head_fields
                from protocol.messages import Forward
                from shardd.server.handlers.forward import head_request

                rows = []
                for index, out in heads:
                    item = items[index]
                    head = head_fields(item.sampling, item.drafts, item.token_mask) or {}
                    record = Forward(id=0, seq=item.seq, pos=item.pos, tokens=list(item.tokens), **head)
                    rows.append((out.logits, results[index], item.pos, head_request(record)))
                for (index, _), (ids, _, logprobs) in zip(heads, answer_batch(rows)):
                    results[index] = TokenIds(ids)
                    results[index].logprobs = logprobs
            if scoring:  # prompt logprobs, as the head shard's daemon scores them
                asked = [(out.logits, items[index].next_tokens, items[index].prompt_logprobs) for index, out in scoring]
                for (index, _), entries in zip(scoring, scored_rows(asked)):
                    results[index].prompt_logprobs = entries
            live = survivors
        return results

    def rollback_batch(self, items: Sequence[tuple[int, int]]) -> None:
        """`rollback` for each (seq, keep); a refusal is raised (RollbackFailed) by the next call about that seq, as
        the `Pipeline`, which does not wait for the shards' replies, raises it."""
        for seq, keep in items:
            try:
                self.rollback(seq, keep)
            except (RollbackFailed, ProtocolError) as error:
                self._deferred[seq] = error if isinstance(error, RollbackFailed) else RollbackFailed(str(error))

    def rollback(self, seq: int, keep: int) -> None:
        self._raise_deferred(seq)
        for shard, state in zip(self.shards, self._states(seq)):
            try:
                shard.rollback(state, keep)
            except ModelError as error:
                raise RollbackFailed(str(error)) from error

    def snapshot(self, seq: int) -> None:
        for shard, state in zip(self.shards, self._states(seq)):
            shard.snapshot(state)

    def restore(self, seq: int) -> None:
        for shard, state in zip(self.shards, self._states(seq)):
            shard.restore(state)
