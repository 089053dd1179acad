"""The batch calls for a target without them: a loop of single-sequence calls, the `replay` baseline batched."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from coordinator.relay.pipeline import BatchForward
from coordinator.relay.target import ReplayTarget, RollbackFailed, SequenceLost


class Answered:
    """The answer of a step that ran as it started (a target without `start_forward_batch`)."""

    def __init__(self, outputs: list) -> None:
        self.outputs = outputs

    def result(self) -> list:
        return self.outputs


class LoopBatches:
    """`forward_batch` / `rollback_batch` as a loop over a target that has only the single-sequence calls (the
    `replay` baseline's `ReplayTarget`, a test's target): per item its ids or its exception."""

    def __init__(self, target) -> None:
        self.target = target

    def forward_batch(self, items: Sequence[BatchForward]) -> list:
        results = []
        for item in items:
            extra = {key: value for key, value in (("sampling", item.sampling), ("drafts", item.drafts),
                                                   ("token_mask", item.token_mask)) if value is not None}
            try:
                results.append(self.target.forward(item.seq, item.pos, item.tokens, checkpoint=item.checkpoint,
                                                   **extra))
            except Exception as error:  # noqa: BLE001 - handed back per item, as Pipeline.forward_batch does
                results.append(error)
        return results

    def rollback_batch(self, items: Sequence[tuple[int, int]]) -> dict[int, Exception]:
        failures = {}
        for seq, keep in items:
            try:
                self.target.rollback(seq, keep)
            except (RollbackFailed, SequenceLost) as error:
                failures[seq] = error
        return failures


class ReplayBatches:
    """The `replay` baseline (`ReplayTarget`) a batch at a time: a checkpointed item snapshots its sequence and
    runs as a plain forward in the batch; the step's rollbacks restore their snapshots and forward the kept
    tokens again, together as one more batch."""

    def __init__(self, replay: ReplayTarget, batches) -> None:
        self.replay = replay
        self.batches = batches  # the wrapped target's batch calls

    def forward_batch(self, items: Sequence[BatchForward]) -> list:
        results: list = [None] * len(items)
        plain = []
        for index, item in enumerate(items):
            self.replay.pending.pop(item.seq, None)
            if item.checkpoint:
                try:
                    self.replay.target.snapshot(item.seq)
                except Exception as error:  # noqa: BLE001 - this item's failure, as forward would raise it
                    results[index] = error
                    continue
            plain.append(index)
        # a plain forward leaves the shards no pending step to propose after: the next block comes by PROPOSE
        outputs = self.batches.forward_batch([replace(items[index], checkpoint=False, propose=None) for index in plain])
        for index, output in zip(plain, outputs):
            results[index] = output
            if items[index].checkpoint and not isinstance(output, BaseException):
                self.replay.pending[items[index].seq] = (items[index].pos, list(items[index].tokens))
        return results

    def rollback_batch(self, items: Sequence[tuple[int, int]]) -> dict[int, Exception]:
        failures: dict[int, Exception] = {}
        again = []
        for seq, keep in items:
            if seq not in self.replay.pending:
                failures[seq] = RollbackFailed(f"sequence {seq} has no checkpointed step to roll back")
                continue
            pos, tokens = self.replay.pending.pop(seq)
            try:
                self.replay.target.restore(seq)
            except (RollbackFailed, SequenceLost) as error:
                failures[seq] = error
                continue
            if keep:
                again.append(BatchForward(seq, pos, tokens[:keep]))
        for item, output in zip(again, self.batches.forward_batch(again) if again else []):
            if isinstance(output, (RollbackFailed, SequenceLost)):
                failures[item.seq] = output
            elif isinstance(output, BaseException):
                failures[item.seq] = RollbackFailed(f"replaying the kept tokens of sequence {item.seq}: {output}")
        return failures
