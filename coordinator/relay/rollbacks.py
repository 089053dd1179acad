"""ROLLBACKs sent and not waited for: what is pending per sequence, read before anything else is asked about it."""

from __future__ import annotations

from typing import Optional, Sequence

from coordinator.relay.client import ShardClient
from coordinator.relay.failures import SHARD_FAILURES, as_sequence_lost
from coordinator.relay.target import RollbackFailed, SequenceLost
from protocol import Batch, Request


class PendingRollbacks(dict):
    """Per sequence, its ROLLBACKs sent and not yet read (`Pipeline.rollback`, `rollback_batch`):
    seq -> (keep, [(`SharedReply`, its item position or None)], the failures of the sends)."""

    def settle(self, seq: int, in_flight: Sequence[tuple[ShardClient, Request]] = (), quiet: bool = False) -> None:
        """Read the replies of `seq`'s ROLLBACKs still unread; RollbackFailed (unless `quiet`) when one failed
        or the shards disagree on the length, after the replies of the requests `in_flight` were read too."""
        pending = self.pop(seq, None)
        if pending is None:
            return
        keep, sent, failures = pending
        failures, lengths = list(failures), set()
        for answer, position in sent:
            try:
                lengths.add(answer.result(position)["length"])
            except SHARD_FAILURES as error:
                failures.append(error)
        if quiet or (not failures and len(lengths) <= 1):
            return
        for client, record in in_flight:  # what went out behind the ROLLBACKs: its fate no longer matters
            try:
                client.receive(record)
            except SHARD_FAILURES:
                pass
        for error in failures:  # a shard that lost the sequence (restarted, gone): as a FORWARD would report it
            lost = as_sequence_lost(error, seq)
            if isinstance(lost, SequenceLost):
                raise lost
        if failures:
            raise RollbackFailed(f"rollback of sequence {seq} to keep={keep} failed: " + "; ".join(map(str, failures)))
        raise RollbackFailed(f"after rollback the shards disagree on the length of sequence {seq}: {sorted(lengths)}")

    def settle_items(self, items: list, indices: list[int]) -> dict[int, Exception]:
        """`settle` for each item of a batch just sent: item index -> why its pending ROLLBACK failed."""
        refused: dict[int, Exception] = {}
        for index in indices:
            try:
                self.settle(items[index].seq)
            except (RollbackFailed, SequenceLost) as error:
                refused[index] = error
        return refused


class SharedReply:
    """A request sent and not yet read, whose reply several sequences may share (a batched ROLLBACK): read once,
    by the first sequence that needs it."""

    def __init__(self, client: ShardClient, sent: Request) -> None:
        self.client, self.sent = client, sent
        self._outcome = None

    def result(self, position: Optional[int]) -> dict:
        """The result of the request (`position` None) or of its item `position`; raises its failure."""
        if self._outcome is None:
            try:
                if isinstance(self.sent, Batch):
                    self._outcome = self.client.receive_items(self.sent)
                else:
                    self._outcome = self.client.receive(self.sent)
            except SHARD_FAILURES as error:
                self._outcome = error
        outcome = self._outcome if position is None or isinstance(self._outcome, Exception) else self._outcome[position]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome.result
