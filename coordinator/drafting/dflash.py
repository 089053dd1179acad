"""DFlash drafting from the coordinator: target-layer features go from the shards that CAPTURE
them to the daemon that hosts the drafter, as PROPOSE's `features` (or, with the drafter beside
the head shard, into its context by the verify itself, which proposes the next block in its reply).

`DFlashDrafterClient` implements `Drafter`. Every forward of its sequence is a capture of the
drafter's target layers (prefill chunks, verify steps, replay and re-fill forwards alike): the
shards that own one of those layers answer CAPTURE, the others FORWARD, and the rows wait in
`CapturedRows` by position (except those a proposal in the reply took into the drafter context
on the head shard: they stay there). `prepare` turns a forward into that capture (`BatchForward.capture`,
and `propose` where the head can propose in its reply); `collect` takes the rows and the
proposal out of its answer (`Captured`). The scheduler puts the prepared forward in the step's
one batch (`coordinator.scheduler`); `target` does the same for one sequence (the reference loop
in `coordinator.decoding`, and the scheduler's OPEN, CLOSE and re-fill, which the drafter must
follow). `propose(history, n)` knows the committed length (`len(history) - 1`), so it sends
exactly the rows committed since its last call; rows of rejected tokens are never sent, and the
next forward at their position drops them.

Feature rows travel as one `features` tensor [n, k * H], the k layers side by side in
`target_layer_ids` order (PROTOCOL.md), built here by one numpy copy of the k captured frames'
rows (no torch): n * k * H * itemsize bytes per PROPOSE.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from coordinator.relay.client import ShardClient, ShardError
from coordinator.relay.pipeline import (SHARD_FAILURES, BatchForward, Captured, Pipeline, PrefixMissing,
                                        as_sequence_lost, side_by_side)
from coordinator.relay.shards import PipelineError
from coordinator.sampling import TokenIds
from protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError, WireTensor
from protocol.tensors import concat_rows


@dataclass
class _Segment:
    """Rows captured by one forward: `parts[j]` holds layer_ids[j]'s output for positions base.. ."""

    base: int
    lo: int  # positions [lo, hi) are still wanted
    hi: int
    parts: list[WireTensor]


class CapturedRows:
    """One sequence's captured target-layer outputs by position, until the drafter takes them."""

    def __init__(self, layer_ids: Sequence[int]) -> None:
        self.layer_ids = list(layer_ids)
        self.segments: list[_Segment] = []

    def record(self, pos: int, captured: dict[int, WireTensor]) -> None:
        """The outputs of a forward at `pos`. Rows from `pos` on that an earlier forward left
        belong to tokens that were rolled back: they are dropped."""
        missing = [layer for layer in self.layer_ids if layer not in captured]
        if missing:
            raise ValueError(f"capture lacks target layer {missing[0]}")
        parts = [captured[layer] for layer in self.layer_ids]
        n = parts[0].shape[0]
        self._keep(lambda segment: (segment.lo, min(segment.hi, pos)))
        self.segments.append(_Segment(pos, pos, pos + n, parts))

    def take(self, begin: int, end: int) -> WireTensor:
        """Features [end - begin, k * H] of positions begin .. end-1; rows before `end` are then dropped."""
        if not self.segments:
            raise ValueError(f"features of positions {begin}..{end - 1} were never captured")
        pieces, at = [], begin
        for segment in self.segments:
            lo, hi = max(segment.lo, at), min(segment.hi, end)
            if lo >= hi:
                continue
            if lo != at:
                break
            pieces.append(side_by_side(segment.parts, slice(lo - segment.base, hi - segment.base)))
            at = hi
        if at != end:
            raise ValueError(f"features of positions {at}..{end - 1} were never captured")
        self.drop_before(end)
        return concat_rows(pieces)

    def drop_before(self, end: int) -> None:
        """Rows of positions before `end` are in the drafter's context: no longer wanted."""
        self._keep(lambda segment: (max(segment.lo, end), segment.hi))

    def _keep(self, bounds) -> None:
        kept = []
        for segment in self.segments:
            segment.lo, segment.hi = bounds(segment)
            if segment.lo < segment.hi:
                kept.append(segment)
        self.segments = kept


class DFlashDrafterClient:
    """A DFlash drafter hosted by a daemon (`shardd serve --draft`), fed with features the
    pipeline captures. Decode with `speculative_decode(drafter.target, seq, prompt, drafter)`, or as a
    scheduler `Request`'s drafter.

    One sequence per instance; `fresh()` is another instance for another sequence, on the same
    connections (all on the thread that owns the pipeline). When the drafter daemon is one of the
    pipeline's shards, the pipeline's OPEN and CLOSE open and close the drafter state too."""

    name = "dflash"

    def __init__(self, client: ShardClient, pipeline: Pipeline) -> None:
        hello = client.hello()
        info = hello.get("drafter")
        where = client.endpoint
        if not info or info.get("name") != "dflash":
            raise PipelineError(f"{where} hosts no dflash drafter (its HELLO says drafter: {info!r})")
        if hello.get("protocol_version") != PROTOCOL_VERSION:
            raise PipelineError(f"{where} speaks protocol version {hello.get('protocol_version')!r}, not {PROTOCOL_VERSION}")
        target = pipeline.shards[0]
        problems = []
        if hello["model"]["fingerprint"] != target.model["fingerprint"]:
            problems.append(f"it drafts for {hello['model']['fingerprint']}, the shards are {target.model['fingerprint']}")
        if hello["dtype"] != target.hello["dtype"]:
            problems.append(f"its dtype is {hello['dtype']}, the shards' {target.hello['dtype']}")
        outside = [layer for layer in info["target_layer_ids"] if not 0 <= layer < pipeline.num_layers]
        if outside:
            problems.append(f"it reads target layer {outside[0]}, outside 0..{pipeline.num_layers - 1}")
        if problems:
            raise PipelineError(f"refusing the drafter at {where}: " + "; ".join(problems))
        # A sequence belongs to the connection that opened it: on a pipeline shard, use the pipeline's own.
        self.shares_pipeline_daemon = where in pipeline.endpoints
        self.endpoint = where  # the daemon that drafts (named when it fails)
        # a drafter daemon of its own that keeps prefix entries of its context (saved by PROPOSE)
        self.keeps_prefixes = not self.shares_pipeline_daemon and bool(hello.get("prefix_cache"))
        # PROPOSE goes on a connection of its own (the same owner as the pipeline's, on a pipeline shard): behind the
        # pipeline's, it would wait for the rows of other micro-batches' steps in flight there
        self.client = pipeline.clients[pipeline.endpoints.index(where)].sibling() if self.shares_pipeline_daemon \
            else client
        self.pipeline = pipeline
        self.layer_ids: list[int] = list(info["target_layer_ids"])
        self.max_draft_tokens: int = info["max_draft_tokens"]
        self.max_rows_per_request: int = hello["limits"]["max_tokens_per_request"]
        # On the head shard, the drafter proposes the next block inside the verify's reply (no PROPOSE round trip)
        # when that shard captures one of the drafter's layers.
        head = pipeline.shards[-1]
        self.proposes_in_reply = (self.shares_pipeline_daemon and where == pipeline.endpoints[-1]
                                  and any(head.begin <= layer < head.end for layer in self.layer_ids))
        self._start()

    def _start(self) -> None:
        """This instance's own sequence state (nothing opened yet)."""
        self.target = FeatureCapture(self.pipeline, self)
        self.seq: Optional[int] = None
        self.rows = CapturedRows(self.layer_ids)
        self.context_length = 0  # rows the daemon's drafter context holds (its PROPOSE replies say so)
        self.next_block: Optional[int] = None  # drafts the next verify's reply should propose
        self.pending: Optional[dict] = None  # the proposal of the last verify's reply
        self.proposals_in_reply = 0  # blocks taken from a verify reply (no PROPOSE sent)
        # a drafter daemon of its own: (entry id, length) of the prefix entries the pipeline saved, which the next
        # PROPOSE that brings their rows saves there too
        self.saves: list[tuple[int, int]] = []

    def fresh(self) -> "DFlashDrafterClient":
        """A drafter for another sequence: the same checked daemon and connections, a state of its own."""
        other = copy.copy(self)
        other._start()
        return other

    @property
    def max_block_size(self) -> int:
        """The largest verify block (last committed token + drafts) this drafter fills."""
        return self.max_draft_tokens + 1

    def propose(self, history: list[int], n: int) -> list[int]:
        if n <= 0:
            return []
        if n > self.max_draft_tokens:
            raise ValueError(f"the dflash drafter drafts at most {self.max_draft_tokens} tokens per block, asked for {n}")
        if self.seq is None:
            raise RuntimeError("propose before the target opened a sequence")
        committed = len(history) - 1  # the target's state holds history[:-1]
        self.next_block = n
        pending, self.pending = self.pending, None
        if (pending is not None and pending["pos"] == committed and pending["last_token"] == history[committed]
                and len(pending["tokens"]) >= n):
            self.proposals_in_reply += 1
            return list(pending["tokens"][:n])  # fewer near the token budget: the block's first n guesses
        # else (the coordinator committed less than the head shard assumed: eos, the token budget) PROPOSE, which
        # crops the context back to what was committed
        begin = self.context_length
        while True:
            # A drafter takes at most max_rows_per_request rows at once: earlier chunks ask for one
            # throw-away draft token at their own end position.
            end = min(committed, begin + self.max_rows_per_request)
            features = self.rows.take(begin, end) if end > begin else None
            last = end == committed
            saves = [save for save in self.saves if save[1] <= end]
            try:
                result = self.client.propose(self.seq, end, history[end], n if last else 1, features, saves)
            except SHARD_FAILURES as error:  # a restarted drafter daemon: the loop re-fills, which resets us
                raise as_sequence_lost(error, self.seq) from error
            finally:  # sent once: a refused save leaves that entry cold on the drafter (it refuses OPEN from it)
                self.saves = [save for save in self.saves if save[1] > end]
            if result.get("context_length") != end:
                raise ProtocolError(
                    ErrorCode.INTERNAL,
                    f"{self.client.endpoint}: drafter context holds {result.get('context_length')} rows, expected {end}",
                )
            self.context_length = end
            if last:
                return list(result["tokens"])
            begin = end

    # ---- its sequence's forwards -----------------------------------------------------------

    def prepare(self, forward: BatchForward) -> BatchForward:
        """`forward` of this drafter's sequence as a capture of its target layers. Where the head shard hosts the
        drafter and its context holds the rows before the forward, it also asks for the next block in the reply: a
        checkpointed verify (greedy or sampled; its committed rows join the context), and a prompt chunk of one
        request (all its rows join there, so the prompt's features are not sent back in PROPOSE; the chunk that
        ends the prompt brings the first block)."""
        propose = None
        if self.proposes_in_reply and self.context_length >= forward.pos:
            if forward.checkpoint and len(forward.tokens) > 1 and self.next_block is not None:
                propose = self.next_block
            elif (not forward.checkpoint and self.context_length == forward.pos
                  and len(forward.tokens) <= self.pipeline.max_tokens_per_request):
                propose = self.next_block or self.max_draft_tokens
        if forward.save_prefix is not None and self.keeps_prefixes:
            self.saves = [save for save in self.saves if save[1] <= forward.pos]
            self.saves.append((forward.save_prefix, forward.pos + len(forward.tokens)))
        return replace(forward, capture=list(self.layer_ids), propose=propose)

    def collect(self, forward: BatchForward, answer) -> TokenIds:
        """The ids of a prepared forward's answer (a `Captured`); its proposal for `propose`, else (or where the
        proposal failed) its rows, waiting by position for the PROPOSE that brings them. A proposal's rows joined
        the drafter context on the head shard: they do not come back."""
        if not isinstance(answer, Captured):
            raise PipelineError(f"the target answered {type(answer).__name__} for a capture of layers "
                                f"{self.layer_ids}: the dflash drafter needs the shards' captured layers")
        if answer.proposal is None or "error" in answer.proposal:
            self.captured(forward.pos, answer.outputs)
        if answer.proposal is not None:
            self.proposed(answer.proposal)
        return answer.ids

    # ---- driven by FeatureCapture ----------------------------------------------------------

    def opened(self, seq: int, length: int = 0, prefix: Optional[int] = None) -> None:
        """The target opened `seq` at `length`, from prefix entry `prefix` if not None: the daemon hosting the
        drafter restored its context rows too (PrefixMissing where a drafter daemon of its own lacks the entry)."""
        if self.seq is not None and self.seq != seq:
            raise RuntimeError(f"the dflash drafter serves sequence {self.seq}; sequence {seq} needs its own client")
        if not self.shares_pipeline_daemon:
            try:
                opened = self.client.open(seq, prefix)
            except ShardError as error:
                if error.code is ErrorCode.PREFIX_MISSING:
                    raise PrefixMissing(str(error), held=True) from error
                raise
            if opened["length"] != length:  # cannot be: both kept the prefix's rows at its length
                with contextlib.suppress(ShardError):
                    self.client.close(seq)
                raise PrefixMissing(f"{self.endpoint} holds prefix entry {prefix} at {opened['length']} rows, "
                                    f"the shards at {length}", held=True)
        self.seq, self.rows, self.context_length = seq, CapturedRows(self.layer_ids), length
        self.next_block, self.pending, self.saves = None, None, []

    def closed(self, seq: int) -> None:
        self.seq = None
        self.rows = CapturedRows(self.layer_ids)
        self.next_block, self.pending, self.saves = None, None, []
        if not self.shares_pipeline_daemon:
            with contextlib.suppress(ShardError):  # already gone (a restarted daemon) is closed enough
                self.client.close(seq)

    def captured(self, pos: int, outputs: dict[int, WireTensor]) -> None:
        self.rows.record(pos, outputs)

    def proposed(self, proposal: dict) -> None:
        """The head shard's proposal after a verify: its context now holds the rows up to proposal["pos"]. A
        proposal that failed (`error`: the verify ran, the drafter did not) left the context at the verify's pos:
        the next `propose` sends PROPOSE with the rows since."""
        if "error" in proposal:
            return
        if proposal.get("context_length") != proposal.get("pos"):
            raise ProtocolError(ErrorCode.INTERNAL, f"{self.client.endpoint}: a proposal at {proposal.get('pos')} "
                                                    f"with a context of {proposal.get('context_length')} rows")
        self.pending = proposal
        self.context_length = proposal["context_length"]
        self.rows.drop_before(self.context_length)


class FeatureCapture:
    """The pipeline as a `Target` whose every forward captures the drafter's target layers."""

    def __init__(self, pipeline: Pipeline, drafter: DFlashDrafterClient) -> None:
        self.pipeline = pipeline
        self.drafter = drafter

    @property
    def prefix_cache(self) -> bool:
        """Prompts resume from prefix entries where the drafter's context is in them: the pipeline shard's that hosts
        the drafter, or a drafter daemon of its own that keeps entries too (its HELLO `prefix_cache`)."""
        return self.pipeline.prefix_cache and (self.drafter.shares_pipeline_daemon or self.drafter.keeps_prefixes)

    def open(self, seq: int, prefix: Optional[int] = None) -> int:
        opening = {"prefix": prefix} if prefix is not None else {}
        if self.drafter.shares_pipeline_daemon:  # the drafter proposes on a pipeline shard: its context opens there
            opening["draft_context"] = True
        length = self.pipeline.open(seq, **opening) or 0
        try:
            if prefix is not None and not self.drafter.shares_pipeline_daemon:  # its own daemon resumes it too
                self.drafter.opened(seq, length, prefix)
            else:
                self.drafter.opened(seq, length)
        except BaseException:
            with contextlib.suppress(Exception):
                self.pipeline.close(seq)
            raise
        return length

    def close(self, seq: int) -> None:
        try:
            self.pipeline.close(seq)
        finally:
            self.drafter.closed(seq)

    def forward(self, seq: int, pos: int, tokens: list[int], *, checkpoint: bool = False, sampling=None,
                drafts=None) -> list[int]:
        forward = self.drafter.prepare(BatchForward(seq, pos, list(tokens), checkpoint, sampling, drafts))
        (answer,) = self.pipeline.forward_batch([forward])
        if isinstance(answer, Exception):
            raise answer
        return self.drafter.collect(forward, answer)

    def rollback(self, seq: int, keep: int) -> None:
        self.pipeline.rollback(seq, keep)

    def snapshot(self, seq: int) -> None:
        self.pipeline.snapshot(seq)

    def restore(self, seq: int) -> None:
        self.pipeline.restore(seq)
