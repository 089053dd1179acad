"""The `Target` over shard daemons: token ids in at the first shard, each shard's hidden
state relayed as-is to the next (or sent there by the shard itself, where the daemons were started
with --relay-to: PROTOCOL.md, "Rows from shard to shard"), argmax ids back from the head shard.

Construction says HELLO to every shard and refuses a set that cannot form the model
(`coordinator.relay.shards`). Every error names the shard.

Threads: a `Pipeline` (its `ShardClient` sockets) belongs to one thread. To decode
several sequences at once through the same daemons, each thread builds its own
`Pipeline.connect(endpoints)` and uses its own `seq` ids; the daemons keep the
sequences apart and serve requests in arrival order.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy

from coordinator.relay.client import CurveKeys, ShardClient, ShardError, ShardTimeout, forward_record
from coordinator.relay.liveness import LIVENESS_TIMEOUT_S
from coordinator.relay.shards import PipelineError, ShardInfo, identity_changes, order_shards
from coordinator.relay.target import RollbackFailed, SequenceLost
from coordinator.sampling import TokenIds
from protocol import (
    Batch,
    Close,
    ErrorCode,
    ForwardBatch,
    Open,
    ProtocolError,
    Reply,
    Request,
    Rollback,
    RollbackBatch,
    WireTensor,
)
from protocol.layout import REPLAY, SHARD_ROLLBACK_MODES
from protocol.tensors import concat_rows

SHARD_FAILURES = (ShardError, ShardTimeout, ProtocolError)


@dataclass
class BatchForward:
    """One sequence's part of `Pipeline.forward_batch`: the arguments of `Pipeline.forward` for it (and, for a
    feature drafter, of `Pipeline.capture`)."""

    seq: int
    pos: int
    tokens: list[int]
    checkpoint: bool = False
    sampling: object = None  # a coordinator.sampling.Sampling, or None for greedy
    drafts: Optional[list[int]] = None
    capture: Optional[list[int]] = None  # layers whose outputs come back: the item's answer is a `Captured`
    propose: Optional[int] = None  # a greedy verify [t0, drafts...]: the head, hosting the drafter, proposes so many
    save_prefix: Optional[int] = None  # a prompt chunk: every shard keeps its state after it as this prefix entry
    # prompt logprobs: the head scores the first len(next_tokens) rows against these, with this many top logprobs
    prompt_logprobs: Optional[int] = None
    next_tokens: Optional[list[int]] = None
    token_mask: Optional[WireTensor] = None  # int32 [len(drafts) + 1, ceil(V / 32)]: the tokens each answered row may take


@dataclass
class Captured:
    """`forward_batch`'s answer for an item that captured: the head's ids, each captured layer's outputs
    (`WireTensor` [n, hidden_size]), and the head's `proposal` when the item asked to `propose`."""

    ids: TokenIds
    outputs: dict[int, WireTensor]
    proposal: Optional[dict] = None


@dataclass
class _Step:
    """One sequence's part of a relay (`Pipeline._relay`): its request at every shard."""

    seq: int
    pos: int
    chunks: list[list[int]]  # the tokens of each request: one, or several for a long input relayed alone
    checkpoint: bool = False
    capture: Optional[list[int]] = None  # layers whose outputs come back (CAPTURE on the shards owning one)
    head: Optional[dict] = None  # the head shard's extra fields (sampling, drafts, propose, carried_layers)
    save_prefix: Optional[int] = None  # every shard keeps its state after the last chunk as this prefix entry


class PrefixMissing(PipelineError):
    """OPEN from a prefix entry that a shard no longer holds (evicted, restarted): nothing stays open; open the
    sequence cold. `held`: the pipeline's shards hold it and only a drafter daemon of its own lacks it (its
    entries come with the PROPOSE after a prompt's last chunk), so it still serves streams that do not draft there."""

    def __init__(self, message: str, held: bool = False) -> None:
        super().__init__(message)
        self.held = held


class CheckpointUnavailable(PipelineError):
    """A checkpointed step the shard set cannot hold (no rollback storage, or too many tokens).
    Raised before any shard sees the request, so no state changed."""


class ShardReplaced(PipelineError):
    """The daemon now answering at a shard's endpoint is not the shard the pipeline was built on
    (other weights, layer range, dtype or protocol): re-filling it would compute something else."""


class SequenceInconsistent(PipelineError, SequenceLost):
    """A forward failed part-way down the pipeline and could not be undone: the shards now
    disagree on the sequence's length. Close it and re-fill it from the committed history."""


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
        # ROLLBACKs sent and not yet read, per sequence: (keep, [(client, request)], send failures)
        self._rollbacks: dict[int, tuple[int, list[tuple[ShardClient, Request]], list[Exception]]] = {}

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
        self._settle(seq, quiet=True)
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
        self._settle(seq, quiet=True)  # a last ROLLBACK's failure does not matter to a closed sequence
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

    def _batch_step(self, item: BatchForward) -> "_Step":
        """`item`'s `_Step`; ValueError / PipelineError (nothing sent) when the shards cannot take it. With `propose`,
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
              capture: Optional[list[int]] = None, save_prefix: Optional[int] = None) -> "_Step":
        """One sequence's `_Step`; ValueError / PipelineError (nothing sent) when the shards cannot take it."""
        chunks = self._chunks(pos, list(tokens), checkpoint, head is not None and head.get("drafts") is not None)
        return _Step(seq, pos, chunks, checkpoint, capture, head, save_prefix)

    def _relay_one(self, step: "_Step") -> tuple[TokenIds, dict[int, WireTensor], dict]:
        """A batch of one through `_relay`: its outcome, or the exception that failed it raised."""
        outcome = _Relaying(self._relay([step])).outcomes()[0]
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
        steps: dict[int, _Step] = {}
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
        return BatchInFlight(self, results, steps, groups)

    def _relay_into(self, results: list, steps: dict, indices: list[int], outcomes: list) -> None:
        """The outcomes of the steps `indices` relayed together (`_relay`) into `results`: its ids, or, where it
        captured, a `Captured`; or the exception that failed it."""
        for index, outcome in zip(indices, outcomes):
            if isinstance(outcome, Exception) or steps[index].capture is None:
                results[index] = outcome if isinstance(outcome, Exception) else outcome[0]
                continue
            ids, outputs, head = outcome
            results[index] = Captured(ids, outputs, (head or {}).get("proposal"))

    def _failure(self, step: "_Step", failed: int, error: Exception, *, tick: int,
                 shard_to_shard: bool = False) -> Exception:
        """What `forward` raises for one step that failed at shard `failed` at `tick` of its relay: where shards
        took (some of) its tokens (a later tick; or, the rows going on from shard to shard, any failure but a
        refusal, which the shards after `failed` may have stepped past) they are put back where they can be
        (`_undo`), else SequenceInconsistent; a lost sequence is SequenceLost."""
        if tick > 0 or (shard_to_shard and not _refused(error)):
            try:
                self._undo(step.seq, step.pos, failed, step.checkpoint and len(step.chunks) == 1, error)
            except SequenceInconsistent as inconsistent:
                return inconsistent
        return as_sequence_lost(error, step.seq)

    def _settle_items(self, items: list, indices: list[int]) -> dict[int, Exception]:
        """`_settle` for each item of a batch just sent: item index -> why its pending ROLLBACK failed."""
        refused: dict[int, Exception] = {}
        for index in indices:
            try:
                self._settle(items[index].seq)
            except (RollbackFailed, SequenceLost) as error:
                refused[index] = error
        return refused

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
                self._settle(seq)
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
                answer = _Answer(client, client.send(batch, validate=False))  # each item checked by the daemon
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
        self._settle(seq)
        sent, failures = [], []
        for client in self.clients:
            try:
                sent.append((_Answer(client, client.send(Rollback(id=0, seq=seq, keep=keep))), None))
            except SHARD_FAILURES as error:
                failures.append(error)
        self._rollbacks[seq] = (keep, sent, failures)

    def _settle(self, seq: int, in_flight: Sequence[tuple[ShardClient, Request]] = (), quiet: bool = False) -> None:
        """Read the replies of `seq`'s ROLLBACKs still unread; RollbackFailed (unless `quiet`) when one failed
        or the shards disagree on the length, after the replies of the requests `in_flight` were read too."""
        pending = self._rollbacks.pop(seq, None)
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

    def snapshot(self, seq: int) -> None:
        self._settle(seq)
        try:
            for client in self.clients:
                client.snapshot(seq)
        except SHARD_FAILURES as error:
            raise as_sequence_lost(error, seq) from error

    def restore(self, seq: int) -> None:
        self._settle(seq)
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

    # ---- the relay -----------------------------------------------------------------------

    def _relay(self, steps: list["_Step"]):
        """A generator (driven by `_Relaying`) that pauses once, where the rows go from shard to shard, after every
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
        direct = self.direct_rows and ticks == 1
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
                head = self._head_request(step, parts[i], starts[i][c] - step.pos, len(step.chunks[c]),
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
            refused_rollback = self._settle_items(steps, every)
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
                    refused_rollback = self._settle_items(steps, live)
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
                    self._end_later(sent, k, bool(failures) and all(_refused(error) for error in failures))
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

    @staticmethod
    def _head_request(step: "_Step", parts: dict, offset: int, n: int, carried_by_rows: bool = False) -> Optional[dict]:
        """The head shard's extra fields for the chunk of `step` at rows `offset .. offset + n - 1`: its `head`,
        with the next tokens of that chunk's rows alone (none left: no prompt logprobs), and the layers captured
        before (`carried_layers`) side by side in `carried` (an item's `propose`: `_batch_step`), or, where the
        earlier shards pass them on with their rows (`carried_by_rows`), named alone."""
        head = step.head
        if head is not None and "next_tokens" in head:
            scored = head["next_tokens"][offset:offset + n]
            head = {key: value for key, value in head.items() if key not in ("next_tokens", "prompt_logprobs")}
            if scored:
                head.update(prompt_logprobs=step.head["prompt_logprobs"], next_tokens=scored)
            head = head or None
        if head is None or "carried_layers" not in head:
            return head
        carried = head["carried_layers"]
        fields = {key: value for key, value in head.items() if key != "carried_layers"}
        if carried:
            fields["carried_layers"] = carried
            if not carried_by_rows:
                fields["carried"] = side_by_side([parts[layer][0] for layer in carried])
        return fields

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
        if undoable and _refused(error):
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


class BatchInFlight:
    """A `forward_batch` under way (`Pipeline.start_forward_batch`): `result()` reads the shards' replies and answers
    as `forward_batch` does, once."""

    def __init__(self, pipeline: Pipeline, results: list, steps: dict, groups: list[list[int]]) -> None:
        self._pipeline, self._results, self._steps = pipeline, results, steps
        self._groups = groups  # the items of each request in turn (the chunked ones alone, after the batches)
        # the batches' requests go out now; a chunked step, whose relay waits for each reply, by result()
        self._relays = [_Relaying(pipeline._relay([steps[index] for index in group]))
                        for group in groups if len(steps[group[0]].chunks) == 1]
        self._done = False

    def result(self) -> list:
        if not self._done:
            self._done = True
            relays = iter(self._relays)
            for group in self._groups:
                steps = [self._steps[index] for index in group]
                relaying = next(relays) if len(steps[0].chunks) == 1 else _Relaying(self._pipeline._relay(steps))
                self._pipeline._relay_into(self._results, self._steps, group, relaying.outcomes())
        return self._results


class _Relaying:
    """A `Pipeline._relay` under way: started at once (its requests sent where the rows go from shard to shard),
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


class _Answer:
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


def _refused(error: Exception) -> bool:
    """Whether a shard refused (an error reply but INTERNAL): it changed nothing, and told the next shard so."""
    return isinstance(error, ShardError) and error.code is not ErrorCode.INTERNAL


def _head_ids(result: dict) -> TokenIds:
    """The head shard's ids of one sequence's step, with their logprobs when asked for."""
    ids = TokenIds(result["ids"])
    ids.logprobs = result.get("logprobs")
    return ids


def head_fields(sampling, drafts, token_mask: Optional[WireTensor] = None) -> Optional[dict]:
    """The head shard's extra FORWARD fields for a sampled or constrained step; None for plain greedy (today's argmax
    request). A token mask covers the answered rows, so its step names its drafts whether it samples or not."""
    fields = sampling.wire() if sampling is not None else {}
    if token_mask is not None:
        fields.update(mask_rows=token_mask.shape[0], token_mask=token_mask)
    if not fields:
        return None
    if drafts:
        fields["drafts"] = list(drafts)
    return fields


def side_by_side(parts: Sequence[WireTensor], rows: slice = slice(None)) -> WireTensor:
    """Tensors [n, H_i] of one dtype and the same rows as one [n, sum H_i], each row's parts end to end (their
    `rows` only: a slice of the n); one numpy copy of the bytes, whatever the dtype."""
    n = parts[0].shape[0]
    blocks = [numpy.frombuffer(part.data, dtype=numpy.uint8).reshape(n, part.shape[1] * part.itemsize)[rows]
              for part in parts]
    joined = numpy.concatenate(blocks, axis=1)
    return WireTensor(parts[0].dtype, (joined.shape[0], sum(part.shape[1] for part in parts)), joined.reshape(-1))


def join_rows(chunks: Sequence[WireTensor]) -> WireTensor:
    """Row chunks [n_i, H] of one tensor as one [sum n_i, H] (row-major: the bytes end to end)."""
    return concat_rows(list(chunks))


def as_sequence_lost(error: Exception, seq: int) -> Exception:
    """A shard failure that means the sequence is gone from a shard (SequenceLost), else the error itself."""
    if isinstance(error, ShardTimeout) or (
        isinstance(error, ShardError) and error.code in (ErrorCode.NO_SUCH_SEQUENCE, ErrorCode.SEQUENCE_FAILED)
    ):
        lost = SequenceLost(f"sequence {seq}: {error}")
        lost.__cause__ = error
        return lost
    return error


def _close_quietly(client: ShardClient, seq: int) -> None:
    try:
        client.close(seq)
    except SHARD_FAILURES:
        pass
