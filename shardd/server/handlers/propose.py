"""PROPOSE on a daemon that hosts a DFlash drafter, and the block a CAPTURE with `propose` drafts in its reply
(the verify's committed rows join the drafter's context first)."""

from __future__ import annotations

import torch

from common.model_config import dtype_name
from protocol import ErrorCode, ProtocolError
from shardd.server.peer import Peer
from shardd.server.sequences import SequenceTable
from shardd.server.stats import Counters
from shardd.server.tensors import check_finite


class Propose:
    """The drafter's handlers; `drafter` is the hosted drafter (None: every proposal refused NO_DRAFTER),
    `hidden_size` the target's (the width of one carried layer)."""

    def __init__(self, drafter, sequences: SequenceTable, counters: Counters, hidden_size: int):
        self.drafter, self.sequences, self.counters, self.hidden_size = drafter, sequences, counters, hidden_size

    def _drafter(self):
        if self.drafter is None:
            raise ProtocolError(ErrorCode.NO_DRAFTER, "this shard hosts no drafter")
        return self.drafter

    def propose(self, request, peer: Peer):
        """Features of positions pos-n .. pos-1 into the drafter's context, then a block after `last_token`.

        Context rows at or past pos-n belong to tokens rolled back since they were sent: they are cropped first
        (the only way the context shrinks). A context shorter than pos-n misses rows: POSITION_MISMATCH.
        The target layers' state of the sequence (on a daemon that has both) is not touched."""
        model = self._drafter().model
        entry = self.sequences.get(peer.owner, request.seq)
        draft = context_of(entry, request.seq)
        check_finite("features", request.features)
        features = request.features.to_torch() if request.features is not None else None
        saves = self._check_saves(request, entry, peer)
        model.check_propose(draft, request.pos, features, request.last_token, request.block_size)
        n = features.shape[0] if features is not None else 0
        start = request.pos - n

        counters = self.counters
        if draft.length > start:
            counters.draft_crops += 1
            counters.draft_rows_cropped += draft.length - start
            model.crop(draft, start)
        if n:
            model.add_context(draft, features)
            counters.draft_context_rows += n
            self.sequences.draft_added(entry)
        kept = self.sequences.save_draft_prefixes(peer.owner, entry, saves) if saves else None
        ids, _ = model.propose(draft, request.last_token, request.block_size + 1)
        counters.proposals += 1
        counters.draft_tokens += request.block_size
        result = {"seq": request.seq, "tokens": ids.tolist(), "context_length": draft.length}
        if kept is not None:
            result["prefix_saved"] = kept
        return result, {}

    def _check_saves(self, request, entry, peer: Peer) -> list[tuple[int, int]]:
        """PROPOSE's (entry id, length) saves, checked before anything changes: a drafter-only daemon's, of new ids,
        past the entry the sequence was opened from or saved last (the codec checked the lengths ascend to pos)."""
        if request.save_prefix is None:
            return []
        if self.sequences.shard is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "save_prefix of PROPOSE is for a drafter-only daemon; a daemon "
                                                       "with layers saves entries with FORWARD's save_prefix")
        for entry_id in request.save_prefix:
            self.sequences.prefix_cache.check_new(peer.owner, entry_id)
        held = entry.prefix.length if entry.prefix is not None else 0
        if request.save_lengths[0] <= held:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"save_lengths start at {request.save_lengths[0]}, within the "
                                                       f"{held} rows of the entry this sequence resumed from or saved last")
        return list(zip(request.save_prefix, request.save_lengths))

    def check(self, request, shard, entry) -> None:
        """A CAPTURE with `propose`, before it changes anything: the drafter, the head and every feature it needs."""
        drafter = self._drafter()
        if not shard.owns_head:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "propose asks a shard without the head (it needs the verify's ids)")
        model, config = drafter.model, drafter.config
        if request.propose > model.max_draft_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST,
                                f"propose {request.propose} exceeds the drafter's {model.max_draft_tokens} draft tokens")
        own = [layer for layer in request.layers if shard.begin <= layer < shard.end]
        carried = list(request.carried_layers or ())
        missing = [layer for layer in config.target_layer_ids if layer not in own and layer not in carried]
        if missing:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"propose needs target layer {missing[0]}'s output: capture it "
                                                       f"here or carry it from its shard (carried_layers)")
        if request.carried is not None:
            width = len(carried) * self.hidden_size
            if request.carried.shape[1] != width or request.carried.dtype != dtype_name(model.dtype):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"tensor 'carried' must be {dtype_name(model.dtype)} "
                                                           f"[n, {width}], got {request.carried.dtype}{list(request.carried.shape)}")
        held = context_of(entry, request.seq).length
        if held < request.pos:
            raise ProtocolError(ErrorCode.POSITION_MISMATCH,
                                f"the drafter's context holds {held} rows, this verify starts at {request.pos}: "
                                f"send rows {held}..{request.pos - 1} with PROPOSE first")

    def carried_frames(self, request) -> dict:
        """The `layer.<id>` frames of a CAPTURE's carried layers (its tensor `carried`, column block by block): with
        its own captures, what a reply whose proposal failed answers, so the client can bring the rows in PROPOSE."""
        if request.carried is None:
            return {}
        return {f"layer.{layer}": rows.contiguous()
                for layer, rows in self._carried_by_layer(request, request.carried.to_torch()).items()}

    def _carried_by_layer(self, request, carried) -> dict:
        """`carried` [n, k * H] (a CAPTURE's tensor, on the host or moved) as its k layers' column blocks."""
        width = self.hidden_size
        return {layer: carried[:, j * width:(j + 1) * width] for j, layer in enumerate(request.carried_layers)}

    def after_verify_batch(self, verified: list[tuple]) -> list[dict]:
        """Per (request, entry, ids, captured) of CAPTUREs with `propose` that ran: their committed rows join the
        drafter's context (a verify's accepted drafts' prefix plus its first row; a prompt chunk's every row), then
        the next block is drafted after the last committed row's token (the verify's bonus token, the chunk's
        next): what PROPOSE would answer after this step. All the sequences' context rows go in shared context
        steps, all their blocks in shared block steps (the fast drafter's; the reference's one by one)."""
        model, config, counters = self.drafter.model, self.drafter.config, self.counters
        contexts, blocks, replies = [], [], []
        for request, entry, ids, captured in verified:
            drafts = request.drafts
            reply = {}
            if drafts is None:  # a prompt chunk: every row is committed
                keep = len(ids)
            else:
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == ids[accepted]:
                    accepted += 1
                keep = accepted + 1  # rows pos .. pos+accepted: the block's first token and the accepted drafts
                reply["accepted"] = accepted
            layers = dict(captured)  # (check made sure the head captures one of the drafter's layers)
            if request.carried is not None:
                carried = request.carried.to_torch()[:keep]
                device = next(iter(captured.values())).device  # a prefill's captures are on the GPU
                layers.update(self._carried_by_layer(request, carried.to(device)))  # (one copy, where it moves)
            columns = [layers[layer][:keep] for layer in config.target_layer_ids]
            draft = entry.draft
            if draft.length > request.pos:
                counters.draft_crops += 1
                counters.draft_rows_cropped += draft.length - request.pos
                model.crop(draft, request.pos)
            contexts.append((draft, torch.cat(columns, dim=1)))
            blocks.append((draft, ids[keep - 1], request.propose + 1))
            replies.append({**reply, "pos": request.pos + keep, "last_token": ids[keep - 1]})
            counters.draft_context_rows += keep
        model.add_context_batch(contexts)
        for _, entry, _, _ in verified:
            self.sequences.draft_added(entry)
        proposals = model.propose_batch(blocks)
        for reply, (request, entry, _, _), (tokens, _) in zip(replies, verified, proposals):
            reply["tokens"], reply["context_length"] = tokens.tolist(), entry.draft.length
            counters.proposals += 1
            counters.proposals_in_reply += 1
            counters.draft_tokens += request.propose
        return replies


def context_of(entry, seq: int):
    """The drafter context of an open sequence; BAD_REQUEST for one opened with `draft_context: false`."""
    if entry.draft is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"sequence {seq} was opened with draft_context false: it has no "
                                                   f"drafter context to propose from")
    return entry.draft
