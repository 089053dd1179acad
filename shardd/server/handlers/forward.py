"""FORWARD and CAPTURE: one sequence's step, or several sequences' in one batch, through the engine; on the head
shard the answers beyond the argmax (sampling, penalties, logprobs); rows in from the previous shard and out to the
next (shardd/server/relay.py)."""

from __future__ import annotations

import dataclasses
import logging
import operator
import traceback

import torch

from protocol import (ErrorCode, ForwardBatch, ItemRefused, MessageType, ProtocolError, RowsBatch, WireTensor,
                      samples)
from protocol.codec import new_record
from protocol.layout import CHECKPOINT
from protocol.timing import DAEMON as PHASES
from shardd.engine.batch import BatchItem
from shardd.engine.head.answer import HeadRequest, answer_batch, answer_rows
from shardd.engine.head.logprobs import scored_rows
from shardd.engine.head.penalties import Penalties
from shardd.engine.head.sampling import SamplingParams
from shardd.server.errors import Refusals
from shardd.server.handlers.common import batch_reply, layers_of
from shardd.server.handlers.propose import Propose
from shardd.server.peer import Peer
from shardd.server.relay import Relay, RowsLost, WaitsForRows, check_landed, rows_go_on_device
from shardd.server.sequences import Sequence, SequenceTable
from shardd.server.stats import Counters
from shardd.server.tensors import check_finite, hidden_of, on_host

log = logging.getLogger("shardd")


class Forward:
    """The FORWARD/CAPTURE handlers over `shard`, the daemon's engine (None: drafter only, refused)."""

    def __init__(self, shard, sequences: SequenceTable, counters: Counters, relay: Relay, proposer: Propose,
                 refusals: Refusals):
        self.shard, self.sequences, self.counters = shard, sequences, counters
        self.relay, self.proposer, self.refusals = relay, proposer, refusals

    # ---- one sequence ----------------------------------------------------------------------------

    def forward(self, request, peer: Peer):
        shard = layers_of(self.shard, request)
        self.relay.check_send_rows(request)
        check_carry(request, request.send_rows)
        if request.rows_ticket is not None:
            request = self._with_rows(request, shard, peer)  # or WaitsForRows: the rows are not here yet
        entry, head, layers = self._check(request, shard, peer)
        PHASES.lap("lookup")
        wait = getattr(request.hidden, "wait", None)  # rows copied out of the ring behind a device wait (DeviceWait)
        out = shard.forward(  # validates everything (shard.check_forward) before it changes the state
            entry.state, request.pos, tokens=request.tokens, hidden=hidden_of(request),
            checkpoint=request.checkpoint, capture_layers=layers)
        if wait is not None and not rows_go_on_device(request, out.hidden):
            check_landed([wait])  # else their wait's outcome goes on with them (or is checked before the host)
        answer = scored = None
        if out.ids is not None and head.needed:  # on out.logits now: the fast path's buffer is valid until the next step
            answer = answer_rows(out.logits, out.ids.tolist(), request.pos, head)
        if out.ids is not None and request.next_tokens is not None:
            (scored,) = scored_rows([(out.logits, request.next_tokens, request.prompt_logprobs)])
        result, tensors = self._result(request, entry, out, answer, scored)
        self._save_prefix(request, entry, result, peer)
        if proposing(request):
            self._propose_after([(0, request, entry, out)], [(result, tensors)])
        if request.send_rows is not None:  # the rows go on to the next shard first: they are what it waits for
            self.relay.send(request, tensors.pop("hidden"), wait, carried_on(request, tensors))
            result["rows_sent"] = True
            if request.carry:  # the captured layers went on with them, towards the drafter
                drop_captured(result, tensors)
        return result, {name: WireTensor.from_torch(t) for name, t in zip(tensors, on_host(list(tensors.values())))}

    def _with_rows(self, request, shard, peer: Peer):
        """A FORWARD with `rows_ticket` as if its rows had come in tensor `hidden`; WaitsForRows while they have
        not come (checked first as far as it can be without them: a FORWARD that cannot run is refused now)."""
        rows = self.relay.rows_for(request.rows_ticket)
        if rows is None:
            entry, _, _ = self._check(request, shard, peer)
            placeholder = torch.empty((request.ticket_rows, shard.config.hidden_size), dtype=shard.dtype, device="meta")
            shard.check_forward(entry.state, request.pos, hidden=placeholder, checkpoint=request.checkpoint)
            raise WaitsForRows
        if rows.refused:
            self.counters.rows_missing += 1
            raise ProtocolError(ErrorCode.ROWS_MISSING, f"the previous shard refused or failed this step (ticket "
                                                        f"{request.rows_ticket}): nothing changed here")
        if isinstance(rows, RowsBatch):  # a batch's ROWS: one sequence's FORWARD takes it only if it is that one's
            if len(rows.items) != 1:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"the ROWS of ticket {request.rows_ticket} are a batch of "
                                                           f"{len(rows.items)} sequences; this FORWARD is for one")
            rows = rows.items[0]
        rows_n = rows.hidden.shape[0]
        if (rows.seq, rows.pos, rows_n) != (request.seq, request.pos, request.ticket_rows):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the ROWS of ticket {request.rows_ticket} are for sequence "
                                                       f"{rows.seq} at {rows.pos}, {rows_n} rows; this FORWARD is for "
                                                       f"{request.seq} at {request.pos}, {request.ticket_rows} rows")
        # built as the decoder builds records (no dataclass __init__ over a FORWARD's ~25 fields)
        return new_record(type(request), {**request.__dict__, **with_carried(request, rows), "hidden": rows.hidden,
                                          "rows_ticket": None, "ticket_rows": None})

    def _check(self, request, shard, peer: Peer):
        """What a FORWARD/CAPTURE (one sequence, alone or an item of a batch) needs before it runs: its sequence,
        its head-shard extras and the capture layers this shard owns, and the drafter's part of a `propose`;
        ProtocolError when it cannot run here."""
        entry = self.sequences.get(peer.owner, request.seq)
        layers = list(request.layers) if request.type == MessageType.CAPTURE else []
        bad = [layer for layer in layers if layer >= shard.config.num_layers]
        if bad:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"capture layer {bad[0]} is outside 0..{shard.config.num_layers - 1}")
        if request.return_logits and not shard.owns_head:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "return_logits asks for logits from a shard without the head")
        if request.token_mask is not None:
            check_token_mask(request.token_mask, shard)
        head = head_request(request)
        if (head.needed or request.next_tokens is not None) and not shard.owns_head:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "sampling (temperature >= 1e-5), penalties, logprobs or prompt "
                                                       "logprobs ask a shard without the head")
        vocab = shard.config.vocab_size
        for name in ("drafts", "next_tokens"):  # read as indices into a row: an id past the vocabulary must not reach it
            outside = [token for token in getattr(request, name) or () if token >= vocab]
            if outside:
                what = "draft token" if name == "drafts" else "next token"
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} {outside[0]} is outside the vocabulary "
                                                           f"0..{vocab - 1}")
        check_finite("hidden", request.hidden)
        if request.save_prefix is not None:
            self.sequences.prefix_cache.check_new(peer.owner, request.save_prefix)
        if request.carry and request.rows_ticket is None and getattr(request, "carried", None) is None \
                and not any(shard.begin <= layer < shard.end for layer in layers):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "carry asks for feature rows this shard neither took in nor "
                                                       "captures")
        if proposing(request):
            check_finite("carried", request.carried)
            self.proposer.check(request, shard, entry)
        return entry, head, [layer for layer in layers if shard.begin <= layer < shard.end]

    def _save_prefix(self, request, entry: Sequence, result: dict, peer: Peer) -> None:
        """A forward that ran and asked for it (`save_prefix`): its state becomes a prefix entry, if the cache
        can hold it (the reply's `prefix_saved`)."""
        if request.save_prefix is not None:
            result["prefix_saved"] = self.sequences.save_prefix(peer.owner, entry, request.save_prefix)

    def _result(self, request, entry: Sequence, out, answer, scored=None) -> tuple[dict, dict]:
        """The result and the tensors (torch, by frame name) of a forward that ran; `answer` is the head's
        (ids, accepted, logprobs) when the request asked for more than the argmax, `scored` its prompt logprobs
        when it asked for them. Counts it."""
        shard, counters = self.shard, self.counters
        n = request.n_tokens
        counters.forwards += 1
        counters.tokens_forwarded += n
        if request.checkpoint:
            counters.checkpointed_steps += 1
            if shard.storage.mode == CHECKPOINT:
                counters.checkpoint_writes += n * len(shard.gdn_layers)
            else:
                counters.recurrence_log_tokens += n * len(shard.gdn_layers)
        result = {"seq": request.seq, "length": entry.state.length}
        tensors = {}
        if out.ids is not None:
            result["ids"] = out.ids.tolist()
            if answer is not None:
                result["ids"], accepted, logprobs = answer
                if request.drafts is not None:
                    result["accepted"] = accepted
                if logprobs is not None:
                    result["logprobs"] = logprobs
            if scored is not None:
                result["prompt_logprobs"] = scored
            if request.return_logits:
                # float32 on the wire, copied: the GPU step's logits are a view of a buffer its next step reuses
                tensors["logits"] = out.logits.to("cpu", torch.float32, copy=True)
        else:
            tensors["hidden"] = out.hidden
        if request.type == MessageType.CAPTURE:
            counters.captures += 1
            counters.captured_rows += n * len(out.captured)
            result["captured_layers"] = sorted(out.captured)
            for layer in sorted(out.captured):
                tensors[f"layer.{layer}"] = out.captured[layer]
        return result, tensors

    # ---- a batch ---------------------------------------------------------------------------------

    def forward_batch(self, request, peer: Peer):
        """A FORWARD/CAPTURE naming several sequences: each item is checked as the one-sequence request would be,
        the items that pass run together (the engine's forward_batch), and each gets its result or its own error;
        a refused item changes nothing. An exception during the step fails the sequences that were in it."""
        shard = layers_of(self.shard, request)
        if isinstance(request, ForwardBatch):
            self.relay.check_send_rows(request)
            if request.rows_ticket is not None:
                request = self._batch_with_rows(request)  # or WaitsForRows: the rows are not here yet
        items = request.items
        counters = self.counters
        counters.batches += 1
        counters.batch_items += len(items)
        counters.batch_rows += request.rows
        answers: list = [None] * len(items)  # per item: (result, tensors) or the error that refused it
        runs = []  # (index, request, entry, head)
        batch = []
        for index, item in enumerate(items):
            try:
                if isinstance(item, ProtocolError):
                    raise item
                check_carry(item, getattr(request, "send_rows", None))
                entry, head, layers = self._check(item, shard, peer)
            except ProtocolError as error:
                answers[index] = error
                continue
            runs.append((index, item, entry, head))
            batch.append(BatchItem(entry.state, item.pos, tokens=item.tokens, hidden=hidden_of(item),
                                   checkpoint=item.checkpoint, capture_layers=tuple(layers),
                                   logits=head.needed or bool(item.return_logits) or item.next_tokens is not None))
            # (without logits: ids only, no copies)
        PHASES.lap("lookup")
        waits = {id(w): w for w in (getattr(item.hidden, "wait", None) for _, item, _, _ in runs) if w is not None}

        def compute():
            outputs = shard.forward_batch(batch)
            if waits and not rows_go_on_device(request, next((o.hidden for o in outputs
                                                                 if not isinstance(o, Exception)), None)):
                check_landed(waits.values())  # a step that ran on no rows fails its sequences
            return outputs

        outputs = self._run_items(runs, compute)
        heads = [(i, out) for i, out in enumerate(outputs)
                 if not isinstance(out, Exception) and out.ids is not None and runs[i][3].needed]
        head_answers = {}
        if heads:
            rows = [(out.logits, out.ids.tolist(), runs[i][1].pos, runs[i][3]) for i, out in heads]
            answered = self._run_items([runs[i] for i, _ in heads], lambda: answer_batch(rows))
            head_answers = {i: answer for (i, _), answer in zip(heads, answered)}
        scoring = [(i, out) for i, out in enumerate(outputs) if not isinstance(out, Exception) and out.ids is not None
                   and runs[i][1].next_tokens is not None and not isinstance(head_answers.get(i), Exception)]
        prompt_scores = {}
        if scoring:
            asked = [(out.logits, runs[i][1].next_tokens, runs[i][1].prompt_logprobs) for i, out in scoring]
            scored = self._run_items([runs[i] for i, _ in scoring], lambda: scored_rows(asked))
            prompt_scores = {i: entries for (i, _), entries in zip(scoring, scored)}
        verified = []  # (index, item, entry, output) of the items whose reply brings the next block
        for i, (index, item, entry, head) in enumerate(runs):
            out = head_answers.get(i, outputs[i])
            if isinstance(out, Exception) or isinstance(prompt_scores.get(i), Exception):
                answers[index] = out if isinstance(out, Exception) else prompt_scores[i]
                continue
            answers[index] = self._result(item, entry, outputs[i], head_answers.get(i), prompt_scores.get(i))
            self._save_prefix(item, entry, answers[index][0], peer)
            if proposing(item):
                verified.append((index, item, entry, outputs[i]))
        if verified:
            self._propose_after(verified, answers)
        if getattr(request, "send_rows", None) is not None:  # the rows go on first: they are what the next shard waits for
            self._send_batch_rows(request, answers, peer)
        return batch_reply(request, answers, self.refusals)

    def _propose_after(self, verified: list[tuple], answers: list) -> None:
        """The `proposal` of each verified item (index into `answers`, item, entry, output), drafted together in
        the drafter's shared steps. The verifies ran and stand: when the drafter fails, each of them answers
        `proposal: {"error": ...}` and its drafter context is cropped back to the verify's pos (rows it may have
        half-written are dropped), so the client sends PROPOSE next; the daemon logs it in one line."""
        try:
            proposals = self.proposer.after_verify_batch(
                [(item, entry, answers[index][0]["ids"], out.captured) for index, item, entry, out in verified])
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            log.error("the drafter failed proposing after the verify of sequences %s (they go on; their drafter "
                      "contexts are cropped to the verify): %s\n%s", [item.seq for _, item, _, _ in verified],
                      message, traceback.format_exc())
            self.counters.proposal_failures += 1
            for index, item, entry, _ in verified:
                self.proposer.drafter.model.crop(entry.draft, min(entry.draft.length, item.pos))
                answers[index][0]["proposal"] = {"error": {"code": ErrorCode.INTERNAL.value, "message": message}}
                carried = self.proposer.carried_frames(item)  # with its own: the rows the client's PROPOSE brings
                answers[index][1].update(carried)
                answers[index][0]["captured_layers"] = sorted({*answers[index][0]["captured_layers"],
                                                               *(int(name.split(".", 1)[1]) for name in carried)})
            return
        for (index, _, _, _), proposal in zip(verified, proposals):
            answers[index][0]["proposal"] = proposal
            drop_captured(*answers[index])  # the rows are in the drafter's context: the client needs them no more

    def _batch_with_rows(self, request):
        """A batched FORWARD with `rows_ticket`, each item as if its rows had come in tensor `hidden`; an item the
        ROWS has no rows for (the previous shard refused or failed it) is refused alone with ROWS_MISSING, one whose
        rows do not match with BAD_REQUEST, each changing nothing. WaitsForRows while the ROWS has not come."""
        rows = self.relay.rows_for(request.rows_ticket)
        if rows is None:
            raise WaitsForRows
        ticket = request.rows_ticket
        sent = {} if rows.refused else {part.seq: part for part in (rows.items if isinstance(rows, RowsBatch) else (rows,))}
        items = []
        for item in request.items:
            if isinstance(item, ProtocolError):
                items.append(item)
                continue
            part = sent.get(item.seq)
            if part is None:
                self.counters.rows_missing += 1
                items.append(ItemRefused(ErrorCode.ROWS_MISSING, f"the previous shard refused or failed this step of "
                                                                 f"sequence {item.seq} (ticket {ticket}): nothing "
                                                                 "changed here", item.seq))
            elif (part.pos, part.hidden.shape[0]) != (item.pos, item.ticket_rows):
                items.append(ItemRefused(ErrorCode.BAD_REQUEST, f"the ROWS of ticket {ticket} has sequence {item.seq} "
                                                                f"at {part.pos}, {part.hidden.shape[0]} rows; this item "
                                                                f"is at {item.pos}, {item.ticket_rows} rows", item.seq))
            else:
                try:
                    carried = with_carried(item, part)
                except ProtocolError as error:
                    items.append(ItemRefused(error.code, error.message, item.seq))
                    continue
                # built as the decoder builds records (no dataclass __init__ per item)
                items.append(new_record(type(item), {**item.__dict__, **carried, "hidden": part.hidden,
                                                     "rows_ticket": None, "ticket_rows": None}))
        return dataclasses.replace(request, items=tuple(items), rows_ticket=None)

    def _send_batch_rows(self, request, answers: list, peer: Peer) -> None:
        """A batched FORWARD's `send_rows`: the rows of its items that ran go to the next shard as one ROWS (each
        item's reply then carries `rows_sent` and no rows); none ran: a refused ROWS."""
        answered = [(item, answer) for item, answer in zip(request.items, answers) if not isinstance(answer, Exception)]
        ran = [(item, answer[0], answer[1].pop("hidden"), carried_on(item, answer[1])) for item, answer in answered]
        for item, answer in answered:
            if item.carry:  # its captured layers go on with the rows
                drop_captured(*answer)
        if not ran:
            self.relay.refuse_downstream(request)
            return
        for _, result, _, _ in ran:
            result["rows_sent"] = True
        wait = next((w for w in (getattr(item.hidden, "wait", None) for item, _, _, _ in ran) if w is not None), None)
        lost = self.relay.send_batch(request, [(item, hidden, carried) for item, _, hidden, carried in ran], wait)
        if lost is not None:
            self._fail_lost(request, [item for item, _, _, _ in ran], answers, lost, peer)

    def _fail_lost(self, request, items, answers: list, error: RowsLost, peer: Peer) -> None:
        """A batch whose step ran on no rows (its device wait ended without them): each of `items` fails (INTERNAL,
        its sequence failed), the next shard's wait is refused."""
        message = f"{type(error).__name__}: {error}"
        log.warning("a step of sequences %s ran without its rows: %s", [item.seq for item in items], error)
        failed = {item.seq for item in items}
        for index, item in enumerate(request.items):
            if item.seq in failed:
                self.sequences.fail(self.sequences.find(peer.owner, item.seq), message)
                answers[index] = ProtocolError(ErrorCode.INTERNAL, message)
        self.relay.refuse_downstream(request)

    def _run_items(self, runs: list, compute) -> list:
        """`compute()`'s per-item outputs; when it raises, every item in `runs` gets INTERNAL and its sequence is
        failed (its state may be half-updated), as a one-sequence request's would."""
        try:
            return compute()
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            seqs = [item.seq for _, item, _, _ in runs]
            if isinstance(exc, RowsLost):  # not a bug: the previous shard's rows never came (its process died)
                log.warning("a step of sequences %s ran without its rows: %s", seqs, exc)
            else:
                log.error("internal error in a batch of sequences %s: %s\n%s", seqs, message, traceback.format_exc())
            for _, _, entry, _ in runs:
                self.sequences.fail(entry, message)
            return [ProtocolError(ErrorCode.INTERNAL, message) for _ in runs]


# The fields head_request reads; with all of them absent a request wants the argmax alone.
HEAD_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "prompt_tokens", "output_tokens", "drafts", "logprobs", "token_mask")
_head_values = operator.attrgetter(*HEAD_FIELDS)
PLAIN_HEAD = HeadRequest()


def check_token_mask(mask: WireTensor, shard) -> None:
    """A token mask goes to the head shard, one int32 word per 32 tokens of the model's vocabulary (the codec
    checked its rank, dtype and rows); BAD_REQUEST otherwise."""
    if not shard.owns_head:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "tensor 'token_mask' asks a shard without the head")
    words = -(-shard.config.vocab_size // 32)
    if mask.shape[1] != words:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"tensor 'token_mask' has {mask.shape[1]} words per row; the "
                                                   f"vocabulary of {shard.config.vocab_size} tokens needs {words}")


def proposing(request) -> bool:
    """Whether a FORWARD/CAPTURE asks for the next block in its reply (PROTOCOL.md, "Proposing in the verify reply")."""
    return request.type == MessageType.CAPTURE and request.propose is not None


def head_request(request) -> HeadRequest:
    """The head-shard extras a FORWARD/CAPTURE asks for (all absent: the argmax request)."""
    if _head_values(request).count(None) == len(HEAD_FIELDS):
        return PLAIN_HEAD  # most items of a batch: one shared answer, no objects built per item
    sampling = None
    if samples(request.temperature):  # below SAMPLING_EPS (0 included): the argmax
        sampling = SamplingParams(request.temperature, 1.0 if request.top_p is None else request.top_p,
                                  request.top_k or 0, request.seed or 0)
    penalties = Penalties(request.presence_penalty or 0.0, request.frequency_penalty or 0.0,
                          1.0 if request.repetition_penalty is None else request.repetition_penalty)
    token_mask = request.token_mask.to_torch() if request.token_mask is not None else None
    return HeadRequest(sampling, penalties, request.prompt_tokens or (), request.output_tokens or (),
                       request.drafts or (), request.logprobs, token_mask)


def check_carry(request, send_rows) -> None:
    """`carry` asks for rows passed on to the next shard: only with `send_rows` (the request's or its batch's)."""
    if request.carry and send_rows is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'carry' goes with send_rows (the rows it sends the next "
                                                   "shard)")


def with_carried(request, rows) -> dict:
    """The carried rows a ROWS brought for `request` (its previous shard's `carry`), as its tensor `carried`; a
    CAPTURE takes them, a FORWARD has no such field (its shard passes nothing on)."""
    if rows.carried is None:
        return {}
    if request.type != MessageType.CAPTURE:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the ROWS of ticket {rows.ticket} carry feature rows; only a "
                                                   "CAPTURE takes them")
    return {"carried": rows.carried}


def drop_captured(result: dict, tensors: dict) -> None:
    """A reply's `layer.<id>` frames left out (its `captured_layers` names the frames it answers: none): they went on
    with the rows (`carry`) or joined the drafter's context (a proposal in the reply), so the client has no use for
    them (PROTOCOL.md, "Proposing in the verify reply")."""
    for name in [name for name in tensors if name.startswith("layer.")]:
        del tensors[name]
    result["captured_layers"] = []


def carried_on(request, tensors: dict):
    """What a forward with `carry` sends the next shard with its rows: the carried rows it took in, then its captured
    layers' outputs, ascending, side by side [n, k * H] (`tensors`: its reply's, torch, `layer.<id>` among them);
    None without `carry`. On the device where any part of it is: the relay puts them in the next shard's ring beside
    the rows, or brings them to the host."""
    if not request.carry:
        return None
    mine = [request.carried.to_torch()] if getattr(request, "carried", None) is not None else []
    mine += [tensors[name] for name in sorted((n for n in tensors if n.startswith("layer.")),
                                              key=lambda n: int(n.split(".", 1)[1]))]
    device = next((part.device for part in mine if part.device.type != "cpu"), None)
    return torch.cat([part if device is None else part.to(device) for part in mine], dim=1)
