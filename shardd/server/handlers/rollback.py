"""ROLLBACK (one sequence or a batch), SNAPSHOT and RESTORE: the engine's rollback of a pending checkpointed step,
and the replay baseline's save and restore of the recurrent state."""

from __future__ import annotations

import logging
import traceback

from protocol import ErrorCode, ProtocolError
from protocol.timing import DAEMON as PHASES
from shardd.engine.reference.errors import ModelError
from shardd.server.errors import Refusals
from shardd.server.handlers.common import batch_reply, layers_of
from shardd.server.peer import Peer
from shardd.server.sequences import SequenceTable
from shardd.server.stats import Counters

log = logging.getLogger("shardd")


class Rollback:
    def __init__(self, shard, sequences: SequenceTable, counters: Counters, refusals: Refusals):
        self.shard, self.sequences, self.counters, self.refusals = shard, sequences, counters, refusals

    def rollback(self, request, peer: Peer):
        shard = layers_of(self.shard, request)
        entry = self.sequences.get(peer.owner, request.seq)
        shard.check_rollback_storage()
        PHASES.lap("lookup")
        shard.rollback(entry.state, request.keep)  # validates before it changes the state
        self.counters.rollbacks[shard.storage.mode] += 1
        self.counters.rollbacks_by_keep[request.keep] += 1
        return {"seq": request.seq, "length": entry.state.length}, {}

    def rollback_batch(self, request, peer: Peer):
        """ROLLBACK of several sequences: each item rolled back on its own, with its own result or error."""
        shard = layers_of(self.shard, request)
        shard.check_rollback_storage()
        self.counters.batches += 1
        self.counters.batch_items += len(request.items)
        answers = []
        for item in request.items:
            try:
                if isinstance(item, ProtocolError):
                    raise item
                answers.append((self.rollback(item, peer)[0], {}))
            except (ProtocolError, ModelError) as error:
                answers.append(error)
            except Exception as exc:
                message = f"{type(exc).__name__}: {exc}"
                log.error("internal error seq=%s type=ROLLBACK: %s\n%s", item.seq, message, traceback.format_exc())
                self.sequences.fail(self.sequences.find(peer.owner, item.seq), message)
                answers.append(ProtocolError(ErrorCode.INTERNAL, message))
        return batch_reply(request, answers, self.refusals)

    def snapshot(self, request, peer: Peer):
        shard = layers_of(self.shard, request)
        entry = self.sequences.get(peer.owner, request.seq)
        shard.snapshot(entry.state)
        self.counters.snapshots += 1
        return {"seq": request.seq, "length": entry.state.length}, {}

    def restore(self, request, peer: Peer):
        shard = layers_of(self.shard, request)
        entry = self.sequences.get(peer.owner, request.seq)
        shard.restore(entry.state)
        self.counters.restores += 1
        return {"seq": request.seq, "length": entry.state.length}, {}
