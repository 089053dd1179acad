"""The `Target` over shard daemons: token ids in at the first shard, each shard's hidden
state relayed as-is to the next (or sent there by the shard itself, where the daemons were started
with --relay-to: PROTOCOL.md, "Rows from shard to shard"), argmax ids back from the head shard.

Construction says HELLO to every shard and refuses a set that cannot form the model
(`coordinator.relay.shards`). Every error names the shard. The `Pipeline` keeps the sequences'
operations; each step's way through the shards is `coordinator.relay.step_relay`.

Threads: a `Pipeline` (its `ShardClient` sockets) belongs to one thread. To decode
several sequences at once through the same daemons, each thread builds its own
`Pipeline.connect(endpoints)` and uses its own `seq` ids; the daemons keep the
sequences apart and serve requests in arrival order.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from coordinator.relay.client import CurveKeys, ShardClient, ShardError, ShardTimeout
from coordinator.relay.failures import (
    SHARD_FAILURES,
    CheckpointUnavailable,
    PrefixMissing,
    SequenceInconsistent,
    ShardReplaced,
    as_sequence_lost,
)
from coordinator.relay.liveness import LIVENESS_TIMEOUT_S
from coordinator.relay.rollbacks import PendingRollbacks, SharedReply
from coordinator.relay.rows import join_rows, side_by_side
from coordinator.relay.shards import PipelineError, ShardInfo, identity_changes, order_shards
from coordinator.relay.step_relay import BatchInFlight, Relaying, StepRelay
from coordinator.relay.steps import BatchForward, Captured, Step, head_fields
from coordinator.relay.target import RollbackFailed, SequenceLost
from coordinator.sampling import TokenIds
from protocol import Close, ErrorCode, Open, ProtocolError, Request, Rollback, RollbackBatch, WireTensor
from protocol.layout import REPLAY, SHARD_ROLLBACK_MODES

__all__ = [
    "SHARD_FAILURES", "BatchForward", "BatchInFlight", "Captured", "CheckpointUnavailable", "Pipeline", "PrefixMissing",
    "SequenceInconsistent", "ShardReplaced", "as_sequence_lost", "head_fields", "join_rows", "side_by_side",
]


class Pipeline:
    """Implements `coordinator.relay.target.Target` over shard daemons, in layer order."""

    def __init__(self, clients: Sequence[ShardClient]) -> None:
        clients = list(clients)
        infos = [ShardInfo(client.endpoint, client.hello()) for client in clients]
        drafter_only = [str(info) for info in infos if not info.owns_layers]
        if drafter_only:
            raise PipelineError(
                f"{', '.join(drafter_only)} own no target layers: a drafter daemon is not a pipeline shard "
                f"(give it as the draft shard, e.g. shardctl generate --draft-shard)"
            )
        self.shards = order_shards(infos)
        by_endpoint = {id(info): client for info, client in zip(infos, clients)}
        self.clients = [by_endpoint[id(info)] for info in self.shards]
        self.num_layers = self.shards[0].model["num_layers"]
        self.hidden_size = self.shards[0].model["hidden_size"]
        self.vocab_size = self.shards[0].model["vocab_size"]
        # Longer non-checkpointed inputs are split into chunks of this many tokens.
        self.max_tokens_per_request = min(s.max_tokens_per_request for s in self.shards)
        self.max_context = min(s.hello["limits"]["max_context"] for s in self.shards)
        # Every shard sees every checkpointed step, so the smallest storage decides.
        self.max_verify_tokens = min(min(s.max_verify_tokens for s in self.shards), self.max_tokens_per_request)
        # Inputs of at most this many tokens take every fast-engine shard's fixed-shape step (None: no such shard).
        # Sequences in one batched request: every shard holds at most max_sequences open (PROTOCOL.md, "Batches").
        self.max_batch_items = min(s.hello["limits"]["max_sequences"] for s in self.shards)
        rows = [s.hello.get("step_rows") for s in self.shards if s.hello.get("step_rows")]
        self.step_rows = min(rows) if rows else None
        # The prefill piece P every layer shard graphs (None: they disagree, or none does): prompt chunks in
        # multiples of P run as whole pieces everywhere.
        pieces = {s.hello.get("prefill_rows") for s in self.shards if s.owns_layers}
        self.prefill_rows = pieces.pop() if len(pieces) == 1 and None not in pieces and 0 not in pieces else None
        # Prompt prefixes resume from the shards' prefix entries only where every shard keeps them (HELLO
        # `prefix_cache`; PROTOCOL.md, "Prefix caching").
        self.prefix_cache = all(s.hello.get("prefix_cache") for s in self.shards)
        # OPEN says whether a sequence keeps a drafter context only where a shard hosts the drafter (HELLO `drafter`)
        self.hosts_drafter = any(s.hello.get("drafter") for s in self.shards)
        # Rows go from shard to shard (PROTOCOL.md, "Rows from shard to shard") where every shard but the head
        # sends them to the next one as this coordinator reaches it (HELLO `relay_to`, `shardd serve --relay-to`).
        self.direct_rows = len(self.shards) > 1 and all(
            shard.hello.get("relay_to") == following.endpoint for shard, following in zip(self.shards, self.clients[1:]))
        self._rollbacks = PendingRollbacks()  # ROLLBACKs sent and not yet read, per sequence
        self._step_relay = StepRelay(self.shards, self.clients, self.hidden_size, self._rollbacks)

    @classmethod
    def connect(cls, endpoints: Iterable[str], timeout_s: float = 120.0, curve: Optional[CurveKeys] = None,
                liveness_timeout_s: float = LIVENESS_TIMEOUT_S, busy_poll_s: Optional[float] = 0.0) -> "Pipeline":
        """`busy_poll_s` None: each client polls as its daemon does (HELLO `busy_poll_ms`, on a host with the CPUs
        for it: common.busy_poll.follow_busy_poll)."""
        clients = [ShardClient(endpoint, timeout_s=timeout_s, curve=curve, liveness_timeout_s=liveness_timeout_s,
                               busy_poll_s=busy_poll_s) for endpoint in endpoints]
        try:
            return cls(clients)
        except BaseException:
            for client in clients:
                client.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [shard.endpoint for shard in self.shards]

    def disconnect(self) -> None:
        """Close the sockets (the daemons' sequences stay as they are)."""
        for client in self.clients:
            client.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc_info) -> None:
        self.disconnect()

    # ---- what the shard set can do -------------------------------------------------------

    def check_speculation(self, rollback: str, block_size: int) -> None:
        """PipelineError unless these shards can verify blocks of `block_size` tokens with
        `rollback` ("checkpoint", "replay-ssm": done by the shards; "replay": by the
        coordinator, which works on any shard set)."""
        if rollback == REPLAY:
            return
        if rollback not in SHARD_ROLLBACK_MODES:
            raise PipelineError(f"unknown rollback mode {rollback!r}")
        without = [str(s) for s in self.shards if s.max_verify_tokens == 0]
        if without:
            raise PipelineError(
                f"--rollback {rollback} needs rollback storage on every shard, but {', '.join(without)} "
                f"were started without it (--max-verify-tokens 0); use --rollback replay, or restart them "
                f"with --max-verify-tokens {block_size} --rollback-mode {rollback}"
            )
        # Shards without GDN layers roll back by truncating their KV cache, whatever their mode.
        other = [f"{s} uses {s.rollback_mode}" for s in self.shards if s.has_gdn_layers and s.rollback_mode != rollback]
        if other:
            raise PipelineError(
                f"--rollback {rollback} was asked but {'; '.join(other)}: the rollback mode is a daemon "
                f"setting (--rollback-mode); ask for that mode or restart the shards"
            )
        small = [f"{s} holds {s.max_verify_tokens}" for s in self.shards if s.max_verify_tokens < block_size]
        if small:
            raise PipelineError(
                f"--block-size {block_size} is larger than a checkpointed step can be: {'; '.join(small)} "
                f"tokens (--max-verify-tokens); use a smaller block"
            )
        if block_size > self.max_tokens_per_request:
            raise PipelineError(
                f"--block-size {block_size} exceeds the shards' max_tokens_per_request {self.max_tokens_per_request}"
            )

    def _check_context(self, pos: int, n: int) -> None:
        # Refused up front: a chunked prefill must not run into the limit half-way.
        if pos + n > self.max_context:
            limits = ", ".join(f"{s}: {s.hello['limits']['max_context']}" for s in self.shards)
            raise PipelineError(f"{pos} + {n} tokens exceed the context the shards hold ({limits})")

    def _check_checkpointed(self, n: int) -> None:
        if n > self.max_verify_tokens:
            limits = ", ".join(
                f"{s}: {s.max_verify_tokens} (max_tokens_per_request {s.max_tokens_per_request})" for s in self.shards
            )
            raise CheckpointUnavailable(f"a checkpointed step of {n} tokens does not fit every shard ({limits})")

    # ---- Target --------------------------------------------------------------------------

    def check_same_shards(self) -> None:
        """HELLO every shard; ShardReplaced when one is no longer the shard this pipeline was built on
        (a different daemon restarted on its endpoint). Called before every OPEN, so a re-fill never
        lands on another model or layer range."""
        for shard, client in zip(self.shards, self.clients):
            changes = identity_changes(shard.hello, client.hello())
            if changes:
                raise ShardReplaced(
                    f"{shard.endpoint} is no longer the shard this generation started on: it now serves "
                    f"{', '.join(changes)}; refusing to re-fill it"
                )

    def open(self, seq: int, prefix: Optional[int] = None, *, draft_context: bool = False) -> int:
        """OPEN on every shard at once, empty or (`prefix`) from that prefix entry; the length it starts at. When one
        fails, the shards it opened on are closed again (PrefixMissing: a shard no longer holds the entry).
        `draft_context`: a shard hosting the drafter keeps the sequence's drafter context (DFlash proposes there);
        without it the sequence resumes from prefix entries that hold none."""
        self._rollbacks.settle(seq, quiet=True)
        try:
            self.check_same_shards()
            answers = self._on_every_shard(Open(id=0, seq=seq, prefix=prefix,
                                                draft_context=draft_context if self.hosts_drafter else None))
            failures = [answer for answer in answers if isinstance(answer, Exception)]
            if failures:
                for client, answer in zip(self.clients, answers):
                    if not isinstance(answer, Exception):
                        _close_quietly(client, seq)
                missing = [f for f in failures if isinstance(f, ShardError) and f.code is ErrorCode.PREFIX_MISSING]
                if missing and len(missing) == len(failures):
                    raise PrefixMissing(str(missing[0]))
                raise failures[0]
            lengths = {answer["length"] for answer in answers}
            if len(lengths) != 1:  # cannot be: every shard saved the entry after the same forward
                self.close(seq)
                raise PrefixMissing(f"the shards hold prefix entry {prefix} at different lengths {sorted(lengths)}")
            return lengths.pop()
        except ShardTimeout as error:  # a shard still restarting: the loop may try again
            raise as_sequence_lost(error, seq) from error

    def close(self, seq: int) -> None:
        """Close on every shard (at once), whatever state each is in; a shard that does not know the
        sequence is fine. Other failures are raised after every shard was tried."""
        self._rollbacks.settle(seq, quiet=True)  # a last ROLLBACK's failure does not matter to a closed sequence
        failures, unexpected = [], []
        for answer in self._on_every_shard(Close(id=0, seq=seq)):
            if isinstance(answer, ShardError):
                if answer.code is not ErrorCode.NO_SUCH_SEQUENCE:
                    failures.append(answer)
            elif isinstance(answer, (ShardTimeout, ProtocolError)):
                failures.append(answer)
            elif isinstance(answer, Exception):
                unexpected.append(answer)
        if unexpected:
            raise unexpected[0]
        if failures:
            raise PipelineError(f"closing sequence {seq} failed: " + "; ".join(map(str, failures)))

    def _on_every_shard(self, record: Request) -> list:
        """`record` sent to every shard before any reply is awaited (a batch's OPENs and CLOSEs: the shards
        answer together instead of in turn); per shard its reply's result, or the exception its send or reply
        raised. A reply not awaited (Ctrl-C on the way) is forgotten, not left for a later receive."""
        sent: list = []
        for client in self.clients:
            try:
                sent.append(client.send(record))
            except Exception as error:  # noqa: BLE001 - that shard's answer; the others were sent theirs
                sent.append(error)
        answers: list = []
        try:
            for client, record_sent in zip(self.clients, sent):
                if isinstance(record_sent, Exception):
                    answers.append(record_sent)
                    continue
                try:
                    answers.append(client.receive(record_sent).result)
                except Exception as error:  # noqa: BLE001 - as above
                    answers.append(error)
        finally:
            for client, record_sent in list(zip(self.clients, sent))[len(answers):]:
                if not isinstance(record_sent, Exception):
                    client.forget(record_sent)
        return answers

    def forward(
        self, seq: int, pos: int, tokens: list[int], *, checkpoint: bool = False, sampling=None, drafts=None,
        token_mask: Optional[WireTensor] = None,
    ) -> list[int]:
        """Longer inputs than every shard takes at once (not checkpointed) go in chunks,
        pipelined: shard k works on chunk c while shard k+1 works on chunk c-1.

        With `sampling` (a `coordinator.sampling.Sampling`, temperature > 0) the head shard samples the ids
        instead of taking the argmax; `drafts` (the block's last tokens, a speculative verify) it accepts or
        replaces by rejection sampling, so the ids agree with the drafts up to the first rejection."""
        ids, _, _ = self._relay_one(self._step(seq, pos, tokens, checkpoint, head_fields(sampling, drafts, token_mask)))
        return ids

    def capture(
        self, seq: int, pos: int, tokens: list[int], layers: Sequence[int], *, checkpoint: bool = False,
        sampling=None, drafts=None,
    ) -> tuple[list[int], dict[int, WireTensor]]:
        """A forward that also returns the output of each decoder layer in `layers`
        (`WireTensor` [n, hidden_size] in the shards' dtype), for feature drafters. The shards
        that own one of `layers` get CAPTURE, the others FORWARD; a long input is chunked as in
        `forward`, and each layer's chunks are joined."""
        item = BatchForward(seq, pos, list(tokens), checkpoint, sampling, drafts, capture=list(layers))
        ids, outputs, _ = self._relay_one(self._batch_step(item))
        return ids, outputs

    def _batch_step(self, item: BatchForward) -> Step:
        """`item`'s `Step`; ValueError / PipelineError (nothing sent) when the shards cannot take it. With `propose`,
        a verify [t0, drafts...] or a prompt chunk (not checkpointed, one request) whose head shard hosts the drafter
        proposes the next block in its reply (PROTOCOL.md, "Proposing in the verify reply"); the layers earlier
        shards capture ride along to it as `carried`."""
        head, layers = head_fields(item.sampling, item.drafts, item.token_mask), None
        if item.next_tokens:
            if not len(item.next_tokens) <= len(item.tokens):
                raise ValueError(f"{len(item.next_tokens)} next tokens scored for {len(item.tokens)} rows")
            head = {**(head or {}), "prompt_logprobs": item.prompt_logprobs, "next_tokens": list(item.next_tokens)}
        if item.capture is not None:
            layers = sorted(set(item.capture))
            if not layers or not all(0 <= layer < self.num_layers for layer in layers):
                raise ValueError(f"capture layers must be a non-empty subset of 0..{self.num_layers - 1}, got {layers}")
        if item.propose is not None:
            head_layers = [layer for layer in layers or () if self.shards[-1].begin <= layer < self.shards[-1].end]
            if not head_layers:
                raise ValueError("proposing in the verify reply needs the head shard to capture one of the layers")
            if not item.checkpoint and len(item.tokens) > self.max_tokens_per_request:
                raise ValueError("a prompt chunk proposing in its reply must fit one request")
            # a verify's drafts are its tokens after the first; a prompt chunk (not checkpointed) has none
            drafts = {"drafts": list(item.tokens[1:])} if item.checkpoint else {}
            head = {**(head or {}), **drafts, "propose": item.propose,
                    "carried_layers": [layer for layer in layers if layer not in head_layers]}
        return self._step(item.seq, item.pos, item.tokens, item.checkpoint, head, capture=layers,
                          save_prefix=item.save_prefix)

    def _step(self, seq: int, pos: int, tokens: list[int], checkpoint: bool, head: Optional[dict],
              capture: Optional[list[int]] = None, save_prefix: Optional[int] = None) -> Step:
        """One sequence's `Step`; ValueError / PipelineError (nothing sent) when the shards cannot take it."""
        chunks = self._chunks(pos, list(tokens), checkpoint, head is not None and head.get("drafts") is not None)
        return Step(seq, pos, chunks, checkpoint, capture, head, save_prefix)

    def _relay_one(self, step: Step) -> tuple[TokenIds, dict[int, WireTensor], dict]:
        """A batch of one through `StepRelay.run`: its outcome, or the exception that failed it raised."""
        outcome = Relaying(self._step_relay.run([step], self.direct_rows)).outcomes()[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _chunks(self, pos: int, tokens: list[int], checkpoint: bool, drafts: bool) -> list[list[int]]:
        """`tokens` as the requests that carry them: one for a checkpointed step, else pieces of at most
        `max_tokens_per_request`; ValueError / PipelineError (nothing sent) when the shards cannot take them."""
        if not tokens:
            raise ValueError("forward needs at least one token")
        self._check_context(pos, len(tokens))
        if checkpoint:
            self._check_checkpointed(len(tokens))
            return [tokens]
        step = self.max_tokens_per_request
        chunks = [tokens[start:start + step] for start in range(0, len(tokens), step)]
        if drafts and len(chunks) > 1:
            raise ValueError("a speculative verify with drafts must fit one request")
        return chunks

    def forward_batch(self, items: Sequence[BatchForward]) -> list:
        """`forward` for several sequences at once: per item, in order, its ids (`TokenIds`, as `forward` returns;
        a `Captured` for an item with `capture`) or the exception `forward` would have raised for it alone
        (SequenceLost, RollbackFailed, CheckpointUnavailable, a ShardError such as POSITION_MISMATCH, ValueError,
        ...); one item's failure changes nothing for the others.

        One batched request per shard carries every item (the hidden rows of all of them in one frame); an item a
        shard refuses is dropped from the later shards and undone where it ran, as `forward` undoes one sequence.
        Items go in groups of at most `max_tokens_per_request` rows and `max_batch_items` sequences; an item longer
        than `max_tokens_per_request` (not checkpointed) runs alone through `forward`'s chunked relay afterwards.
        A sequence named twice is refused (ValueError) for its second item."""
        return self.start_forward_batch(items).result()

    def start_forward_batch(self, items: Sequence[BatchForward]) -> "BatchInFlight":
        """`forward_batch` begun: where the rows go from shard to shard (`direct_rows`), every shard's request is
        sent now and `result()` reads the replies, so several batches of disjoint sequences (micro-batches) can be
        in flight at once, each shard computing one while the next shard computes another (PROTOCOL.md,
        "Micro-batches"). A batch whose rows come back through the coordinator runs by `result()` alone."""
        items = list(items)
        results: list = [None] * len(items)
        steps: dict[int, Step] = {}
        seen = set()
        for index, item in enumerate(items):
            try:
                if item.seq in seen:
                    raise ValueError(f"sequence {item.seq} appears twice in one batch")
                seen.add(item.seq)
                steps[index] = self._batch_step(item)
            except (PipelineError, ValueError) as error:
                results[index] = error
        ready = [index for index, step in steps.items() if len(step.chunks) == 1]
        alone = [index for index, step in steps.items() if len(step.chunks) > 1]  # chunked, after the batch
        groups, group, rows = [], [], 0
        for index in ready:
            n = len(items[index].tokens)
            if group and (rows + n > self.max_tokens_per_request or len(group) == self.max_batch_items):
                groups.append(group)
                group, rows = [], 0
            group.append(index)
            rows += n
        if group:
            groups.append(group)
        groups += [[index] for index in alone]
        return BatchInFlight(self._step_relay, self.direct_rows, results, steps, groups)

    def rollback_batch(self, items: Sequence[tuple[int, int]]) -> None:
        """`rollback(seq, keep)` for each (seq, keep), one batched ROLLBACK per shard, sent and not waited for;
        each sequence's refusal surfaces as `rollback`'s does, from the next call about that sequence."""
        items = list(items)
        if len(items) == 1:
            self.rollback(*items[0])
            return
        if len({seq for seq, _ in items}) != len(items):
            raise ValueError(f"a sequence appears twice in one rollback batch: {[seq for seq, _ in items]}")
        live = []
        for seq, keep in items:
            try:
                self._rollbacks.settle(seq)
            except (RollbackFailed, SequenceLost) as error:  # raised by the next call about seq, as rollback would
                self._rollbacks[seq] = (keep, [], [error])
                continue
            live.append((seq, keep))
        if not live:
            return
        sent: list[list] = [[] for _ in live]
        failures: list[list] = [[] for _ in live]
        batch = RollbackBatch(id=0, items=tuple(Rollback(id=0, seq=seq, keep=keep) for seq, keep in live))
        for client in self.clients:
            try:
                answer = SharedReply(client, client.send(batch, validate=False))  # each item checked by the daemon
            except SHARD_FAILURES as error:
                for failed in failures:
                    failed.append(error)
                continue
            for position, pending in enumerate(sent):
                pending.append((answer, position))
        for (seq, keep), pending, failed in zip(live, sent, failures):
            self._rollbacks[seq] = (keep, pending, failed)

    def rollback(self, seq: int, keep: int) -> None:
        """ROLLBACK on every shard, sent back to back and not waited for: the replies are read before anything
        else is asked about `seq`, and the next FORWARD goes out first, right behind its shard's ROLLBACK on the
        same connection (the daemon serves them in order; PROTOCOL.md, "Ordering"). A refused ROLLBACK is then
        raised as RollbackFailed by that next call; the FORWARD behind it was refused by its pos, or the
        sequence is re-filled anyway."""
        self._rollbacks.settle(seq)
        sent, failures = [], []
        for client in self.clients:
            try:
                sent.append((SharedReply(client, client.send(Rollback(id=0, seq=seq, keep=keep))), None))
            except SHARD_FAILURES as error:
                failures.append(error)
        self._rollbacks[seq] = (keep, sent, failures)

    def snapshot(self, seq: int) -> None:
        self._rollbacks.settle(seq)
        try:
            for client in self.clients:
                client.snapshot(seq)
        except SHARD_FAILURES as error:
            raise as_sequence_lost(error, seq) from error

    def restore(self, seq: int) -> None:
        self._rollbacks.settle(seq)
        try:
            lengths = {client.endpoint: client.restore(seq)["length"] for client in self.clients}
        except SHARD_FAILURES as error:
            raise as_sequence_lost(error, seq) from error
        if len(set(lengths.values())) > 1:
            raise SequenceInconsistent(f"after RESTORE the shards disagree on the length of sequence {seq}: {lengths}")

    # ---- operations ----------------------------------------------------------------------

    def stats(self) -> list[dict]:
        """Each shard's STATS result, in layer order."""
        return [client.stats() for client in self.clients]


def _close_quietly(client: ShardClient, seq: int) -> None:
    try:
        client.close(seq)
    except SHARD_FAILURES:
        pass
