"""The relay of a step through every shard in layer order, and the relays under way (one, or a batch's groups)."""

from __future__ import annotations

import secrets
from typing import Optional, Sequence

from coordinator.relay.client import ShardClient, forward_record
from coordinator.relay.failures import SHARD_FAILURES, SequenceInconsistent, as_sequence_lost, shard_refused
from coordinator.relay.rollbacks import PendingRollbacks
from coordinator.relay.rows import join_rows
from coordinator.relay.shards import ShardInfo
from coordinator.relay.steps import Captured, Step, head_request
from coordinator.sampling import TokenIds
from protocol import ErrorCode, ForwardBatch, ProtocolError, Reply, Request, WireTensor


class StepRelay:
    """Relays steps through the shards, in layer order: one request per shard a tick, the replies checked, a
    failure undone where it can be. Built once per `Pipeline`, over its shards and connections."""

    def __init__(self, shards: list[ShardInfo], clients: list[ShardClient], hidden_size: int,
                 rollbacks: PendingRollbacks) -> None:
        self.shards, self.clients, self.hidden_size = shards, clients, hidden_size
        self.rollbacks = rollbacks  # the pipeline's ROLLBACKs still unread, read once a step's requests are out

    def run(self, steps: list[Step], direct_rows: bool):
        """A generator (driven by `Relaying`) that pauses once, where the rows go from shard to shard, after every
        shard's request was sent: each step through every shard; per step its (ids, captured layer outputs, the head shard's result) or
        the exception that failed it, one step's failure changing nothing for the others. A shard gets one
        request a tick: the step's own FORWARD (CAPTURE) for one step, one FORWARD batch of their records for
        several, so a single sequence is a batch of one on the same wire as ever.

        The rows go from shard to shard where the daemons are chained (`direct_rows`; PROTOCOL.md, "Rows from
        shard to shard"): every shard's request goes out at once, each next shard waiting for its rows under a
        fresh ticket, and the replies are read in shard order (only the head's carries more than a length). A
        step a shard refuses (it changed nothing there) is refused by the shards after it too and undone before
        it; after any other failure the shards after it may have run: it is inconsistent. Otherwise the rows come
        back here and go on with the next shard's request, which leaves out the steps that failed; a long input
        (several chunks, one step alone) goes as a wavefront, shard k taking chunk t-k at tick t so that all
        shards compute at once. Chunks need the earlier shards' replies before the later requests are built: they
        always come back here. Captures the head takes along (`carried_layers`) ride with the rows where those go
        shard to shard (`carry`), else come back here into the head's `carried`."""
        last = len(self.shards) - 1
        ticks = len(steps[0].chunks)  # > 1 only for one step alone
        direct = direct_rows and ticks == 1
        starts = [[step.pos + sum(map(len, step.chunks[:c])) for c in range(len(step.chunks))] for step in steps]
        # per step and shard the capture layers it owns: CAPTURE there, FORWARD (None) where it owns none
        owned = [[[layer for layer in step.capture if shard.begin <= layer < shard.end] or None if step.capture
                   else None for shard in self.shards] for step in steps]
        parts: list[dict[int, list[WireTensor]]] = [{layer: [] for layer in step.capture or ()} for step in steps]
        ids = [TokenIds() for _ in steps]
        heads: list[Optional[dict]] = [None] * len(steps)
        results: list = [None] * len(steps)
        live = list(range(len(steps)))  # the steps every shard so far has run
        carry: dict[tuple[int, int], WireTensor] = {}  # (step, shard) -> the rows that shard takes next
        refused_rollback: dict[int, Exception] = {}  # step -> why its pending ROLLBACK failed
        every = list(range(len(steps)))
        sent: list = [None] * len(self.shards)

        # rows shard to shard with layers the head takes along (`carried_layers`): from the first shard that
        # captures one of them, each shard passes them on with its rows (`carry`), the later ones capturing none
        # passing on what they took in; the head takes them from its ROWS
        carrying = [direct and step.head is not None and bool(step.head.get("carried_layers")) for step in steps]
        first_carrier = [min((k for k in range(last) if owned[i][k]), default=last) for i in range(len(steps))]

        def layers_and_carry(i: int, k: int) -> tuple[Optional[list[int]], Optional[bool]]:
            if carrying[i] and first_carrier[i] <= k < last:
                return owned[i][k] or list(steps[i].head["carried_layers"]), True
            return owned[i][k], None

        def answered_layers(i: int, k: int, result: dict) -> Sequence[int]:
            # the layer.<id> frames shard k answers for step i: none where they went on with the rows (`carry`) or
            # joined the drafter's context (a proposal in the head's reply); all the drafter's where that failed
            if carrying[i] and first_carrier[i] <= k < last:
                return ()
            if k == last and steps[i].head is not None and "propose" in steps[i].head:
                proposal = result.get("proposal")
                if isinstance(proposal, dict) and "error" not in proposal:
                    return ()
                if isinstance(proposal, dict) and carrying[i]:
                    return sorted([*(owned[i][k] or ()), *steps[i].head["carried_layers"]])
            return owned[i][k] or ()

        def request(k: int, c: int, members: list[int], inputs) -> Request:
            shard, records = self.shards[k], []
            for i in members:
                step = steps[i]
                head = head_request(step, parts[i], starts[i][c] - step.pos, len(step.chunks[c]),
                                    carried_by_rows=carrying[i]) if shard.owns_head else None
                save = step.save_prefix if c == len(step.chunks) - 1 else None
                layers, carry = layers_and_carry(i, k)
                records.append(forward_record(step.seq, starts[i][c], checkpoint=step.checkpoint, layers=layers,
                                              sampling=head, save_prefix=save, carry=carry, **inputs(i, k, c)))
            if len(records) == 1:
                return records[0]
            batch = {} if not direct else {"send_rows": tickets[k] if k < last else None,
                                           "rows_ticket": tickets[k - 1] if k > 0 else None}
            return ForwardBatch(id=0, items=tuple(records), **batch)

        def send(k: int, record: Request) -> Request:
            # a batch is not checked here: the daemon refuses a bad item alone (a local check would fail them all)
            return self.clients[k].send(record, validate=not isinstance(record, ForwardBatch))

        if direct:
            tickets = [secrets.randbits(62) for _ in range(last)]

            def inputs(i: int, k: int, c: int) -> dict:
                n = len(steps[i].chunks[c])
                fields = {"tokens": steps[i].chunks[c]} if k == 0 else {"rows_ticket": tickets[k - 1], "ticket_rows": n}
                if len(steps) == 1 and k < last:  # a batch says it for all its items
                    fields["send_rows"] = tickets[k]
                return fields

            # one step: the shards that wait are waiting before the first one computes; a batch: the first
            # computes while the later ones' batches are built
            order = range(last, -1, -1) if len(steps) == 1 else range(last + 1)
            for k in order:
                try:
                    sent[k] = send(k, request(k, 0, every, inputs))
                except SHARD_FAILURES as error:
                    for other, record in enumerate(sent):  # they take the step, or wait for rows that will not all come
                        if record is not None:
                            self.clients[other].forget(record)
                    took = 0 if len(steps) == 1 else k  # the shards before k in the order sent took the step
                    return [self._failure(step, took, error, tick=took) for step in steps]
            yield  # the shards compute; the replies are read when the caller needs them
            # the requests are on their way behind any ROLLBACK of their sequences: now read those
            refused_rollback = self.rollbacks.settle_items(steps, every)
        else:
            def inputs(i: int, k: int, c: int) -> dict:
                return {"tokens": steps[i].chunks[c]} if k == 0 else {"hidden": carry.pop((i, k))}

        for tick in range(ticks + last):
            in_flight = []  # (shard, chunk, steps, request) of this tick
            if direct:
                in_flight.append((tick, 0, every, sent[tick]))
            else:
                for k in range(last + 1):
                    c = tick - k
                    members = [i for i in live if 0 <= c < len(steps[i].chunks) and (k == 0 or (i, k) in carry)]
                    if not members:
                        continue
                    try:
                        in_flight.append((k, c, members, send(k, request(k, c, members, inputs))))
                    except SHARD_FAILURES as error:
                        for i in members:
                            results[i] = self._failure(steps[i], k, error, tick=tick)
                            live.remove(i)
                if tick == 0:  # the first requests are on their way behind any ROLLBACK of their sequences
                    refused_rollback = self.rollbacks.settle_items(steps, live)
            for k, c, members, sent_k in in_flight:
                shard, failures = self.shards[k], []
                for i, answer in zip(members, self._answers(k, sent_k, len(members))):
                    if i not in live:  # failed before (a refused item, or an earlier chunk this tick)
                        continue
                    step, n = steps[i], len(steps[i].chunks[c])
                    try:
                        if isinstance(answer, Exception):
                            raise answer
                        rows = self._check_reply(answer, shard, step.seq, starts[i][c] + n, n,
                                                 rows_sent=direct and k < last)
                        outputs = self._check_captured(answer, shard, answered_layers(i, k, answer.result), n)
                    except SHARD_FAILURES as error:
                        failures.append(error)
                        results[i] = refused_rollback.get(i) or self._failure(step, k, error, tick=tick,
                                                                              shard_to_shard=direct)
                        live.remove(i)
                        continue
                    if i in refused_rollback:  # the sequence is re-filled: what the shards did is moot
                        results[i] = refused_rollback[i]
                        live.remove(i)
                        continue
                    for layer, output in outputs.items():
                        parts[i][layer].append(output)
                    if rows is not None:
                        carry[(i, k + 1)] = rows
                    elif not (direct and k < last):  # the head's ids (of each chunk in turn)
                        ids[i].extend(answer.result["ids"])
                        ids[i].logprobs = answer.result.get("logprobs")
                        if "prompt_logprobs" in answer.result:  # each chunk scores its own rows
                            ids[i].prompt_logprobs = (ids[i].prompt_logprobs or []) + answer.result["prompt_logprobs"]
                        heads[i] = answer.result
                if direct and not live:  # (no failure here: the steps left for a refused ROLLBACK of theirs)
                    self._end_later(sent, k, bool(failures) and all(shard_refused(error) for error in failures))
                    break
            if not live:
                break
        for i in live:
            results[i] = (ids[i], {layer: join_rows(pieces) for layer, pieces in parts[i].items() if pieces}, heads[i])
        return results

    def _answers(self, k: int, sent: Request, n: int) -> list:
        """Shard k's reply to `sent` as a list of its n items' answers (a Reply or the exception that failed it);
        a whole reply that failed fails every item with it."""
        client = self.clients[k]
        try:
            return client.receive_items(sent) if isinstance(sent, ForwardBatch) else [client.receive(sent)]
        except SHARD_FAILURES as error:
            return [error] * n

    def _end_later(self, sent: list, failed: int, refused: bool) -> None:
        """After shard `failed` failed a step relayed shard to shard: the later shards' requests are read when it
        refused (told by its refused ROWS, their refusals come at once), else forgotten (they may have run: rows
        sent before its reply was lost; a wait ends with its connection's next request)."""
        for later in range(failed + 1, len(sent)):
            if refused:
                try:
                    self.clients[later].receive(sent[later])
                except SHARD_FAILURES:
                    pass
            else:
                self.clients[later].forget(sent[later])

    def _check_reply(self, reply: Reply, shard: ShardInfo, seq: int, length: int, n: int, *,
                     rows_sent: bool = False) -> Optional[WireTensor]:
        """The next shard's input (None where the shard sent it on itself: `rows_sent`, or the head's ids);
        ProtocolError when the reply is not what this step needs."""
        result = reply.result
        if result.get("length") != length:
            raise ProtocolError(
                ErrorCode.INTERNAL, f"{shard} reports length {result.get('length')} for sequence {seq}, expected {length}"
            )
        if rows_sent:
            if result.get("rows_sent") is not True:
                raise ProtocolError(ErrorCode.INTERNAL, f"{shard} did not send its rows on to the next shard")
            return None
        if shard.owns_head:
            ids = result.get("ids")
            if not isinstance(ids, list) or len(ids) != n:
                raise ProtocolError(ErrorCode.INTERNAL, f"{shard} returned {ids!r} as ids for {n} tokens")
            return None
        hidden = reply.tensors.get("hidden")
        if hidden is None or hidden.shape != (n, self.hidden_size):
            shape = None if hidden is None else list(hidden.shape)
            raise ProtocolError(ErrorCode.INTERNAL, f"{shard} returned hidden {shape}, expected [{n}, {self.hidden_size}]")
        return hidden

    def _check_captured(self, reply: Reply, shard: ShardInfo, layers: Sequence[int], n: int) -> dict[int, WireTensor]:
        outputs = {}
        for layer in layers:
            output = reply.tensors.get(f"layer.{layer}")
            if output is None or output.shape != (n, self.hidden_size):
                shape = None if output is None else list(output.shape)
                raise ProtocolError(ErrorCode.INTERNAL, f"{shard} returned layer.{layer} {shape}, expected [{n}, {self.hidden_size}]")
            outputs[layer] = output
        return outputs

    def _undo(self, seq: int, pos: int, failed: int, undoable: bool, error: Exception) -> None:
        """Shards before `failed` took the step; put them back so every shard is at `pos`.
        Only a single checkpointed step can be taken back (ROLLBACK keep=0), and only when
        the failed shard itself changed nothing: an error reply other than INTERNAL. After a
        timeout, an INTERNAL error, a malformed reply or a chunk of a longer input the
        sequence is inconsistent."""
        if undoable and shard_refused(error):
            try:
                for client in self.clients[:failed]:
                    client.rollback(seq, 0)
                return
            except SHARD_FAILURES:
                pass
        raise SequenceInconsistent(
            f"{error}; sequence {seq} is now inconsistent across shards (some took tokens from position {pos} on): "
            f"close it and re-fill it from the committed history"
        ) from error

    def _failure(self, step: Step, failed: int, error: Exception, *, tick: int,
                 shard_to_shard: bool = False) -> Exception:
        """What `forward` raises for one step that failed at shard `failed` at `tick` of its relay: where shards
        took (some of) its tokens (a later tick; or, the rows going on from shard to shard, any failure but a
        refusal, which the shards after `failed` may have stepped past) they are put back where they can be
        (`_undo`), else SequenceInconsistent; a lost sequence is SequenceLost."""
        if tick > 0 or (shard_to_shard and not shard_refused(error)):
            try:
                self._undo(step.seq, step.pos, failed, step.checkpoint and len(step.chunks) == 1, error)
            except SequenceInconsistent as inconsistent:
                return inconsistent
        return as_sequence_lost(error, step.seq)


class Relaying:
    """A `StepRelay.run` under way: started at once (its requests sent where the rows go from shard to shard),
    its outcomes read by `outcomes()`."""

    def __init__(self, run) -> None:
        self._run, self._outcomes = run, None
        self._advance()

    def _advance(self) -> None:
        try:
            next(self._run)
        except StopIteration as done:
            self._outcomes = done.value

    def outcomes(self) -> list:
        if self._outcomes is None:
            self._advance()
        return self._outcomes


class BatchInFlight:
    """A `forward_batch` under way (`Pipeline.start_forward_batch`): `result()` reads the shards' replies and answers
    as `forward_batch` does, once."""

    def __init__(self, relay: StepRelay, direct_rows: bool, results: list, steps: dict,
                 groups: list[list[int]]) -> None:
        self._relay, self._direct_rows, self._results, self._steps = relay, direct_rows, results, steps
        self._groups = groups  # the items of each request in turn (the chunked ones alone, after the batches)
        # the batches' requests go out now; a chunked step, whose relay waits for each reply, by result()
        self._relays = [Relaying(relay.run([steps[index] for index in group], direct_rows))
                        for group in groups if len(steps[group[0]].chunks) == 1]
        self._done = False

    def result(self) -> list:
        if not self._done:
            self._done = True
            relays = iter(self._relays)
            for group in self._groups:
                steps = [self._steps[index] for index in group]
                relaying = (next(relays) if len(steps[0].chunks) == 1
                            else Relaying(self._relay.run(steps, self._direct_rows)))
                _relay_into(self._results, self._steps, group, relaying.outcomes())
        return self._results


def _relay_into(results: list, steps: dict, indices: list[int], outcomes: list) -> None:
    """The outcomes of the steps `indices` relayed together (`StepRelay.run`) into `results`: its ids, or, where it
    captured, a `Captured`; or the exception that failed it."""
    for index, outcome in zip(indices, outcomes):
        if isinstance(outcome, Exception) or steps[index].capture is None:
            results[index] = outcome if isinstance(outcome, Exception) else outcome[0]
            continue
        ids, outputs, head = outcome
        results[index] = Captured(ids, outputs, (head or {}).get("proposal"))
