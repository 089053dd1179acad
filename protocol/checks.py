"""The rules between a request's fields (token source, sizes, geometry, capture layers), checked on a record."""

from __future__ import annotations

from .errors import _bad, _too_large
from .geometry import check_verify_geometry
from .limits import Limits
from .messages import SAMPLING_EPS, Capture, Forward, Propose, Request, Rows, samples

PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _check_request(record: Request, limits: Limits) -> None:
    """Rules that span fields: token source, sizes, checkpoint geometry, capture layers."""
    if isinstance(record, Forward):
        kind = record.type  # its .value only in a refusal's message
        if (record.tokens is not None) + (record.hidden is not None) + (record.rows_ticket is not None) != 1:
            raise _bad(f"{kind.value} needs exactly one of field 'tokens', tensor 'hidden' or field 'rows_ticket'")
        if (record.rows_ticket is None) != (record.ticket_rows is None):
            raise _bad(f"fields 'rows_ticket' and 'ticket_rows' of {kind.value} go together")
        n = record.n_tokens
        if n < 1:
            raise _bad(f"{kind.value} needs at least one token")
        if n > limits.max_tokens_per_request:
            raise _too_large(f"{n} tokens in one request, limit {limits.max_tokens_per_request}")
        if record.hidden is not None and record.hidden.shape[1] < 1:
            raise _bad(f"tensor 'hidden' has zero width: shape {list(record.hidden.shape)}")
        if record.checkpoint:
            check_verify_geometry(record.parents, n)
        elif record.parents is not None:
            raise _bad("field 'parents' is only allowed with checkpoint: true")
        if record.save_prefix is not None and record.checkpoint:
            raise _bad(f"field 'save_prefix' of {kind.value} needs a step that stays (not checkpoint: true)")
        # PENALTY_FIELDS spelt out: a generator of getattrs cost more than the rest of these checks
        penalised = (record.presence_penalty is not None or record.frequency_penalty is not None
                     or record.repetition_penalty is not None)
        if record.repetition_penalty is not None and record.repetition_penalty <= 0:
            raise _bad(f"field 'repetition_penalty' = {record.repetition_penalty} must be > 0")
        if not penalised:
            for name in ("output_tokens", "prompt_tokens"):
                if getattr(record, name) is not None:
                    raise _bad(f"field '{name}' of {kind.value} is only read by a penalty "
                               f"({', '.join(PENALTY_FIELDS)})")
        masked = record.token_mask is not None
        if masked != (record.mask_rows is not None):
            raise _bad(f"field 'mask_rows' and tensor 'token_mask' of {kind.value} go together")
        if masked:
            answered = len(record.drafts or ()) + 1
            if record.mask_rows != answered or record.token_mask.shape[0] != answered:
                raise _bad(f"tensor 'token_mask' of {kind.value} has {record.token_mask.shape[0]} rows (mask_rows "
                           f"{record.mask_rows}); the answered rows are len(drafts) + 1 = {answered}")
            if record.token_mask.shape[1] < 1:
                raise _bad(f"tensor 'token_mask' has zero width: shape {list(record.token_mask.shape)}")
        if record.drafts is not None:
            proposing = isinstance(record, Capture) and record.propose is not None
            if not (samples(record.temperature) or penalised or record.logprobs is not None or proposing or masked):
                raise _bad(f"field 'drafts' of {kind.value} needs temperature > 0, a penalty, logprobs, a token mask or "
                           f"propose "
                           f"(a temperature below {SAMPLING_EPS:g} is greedy, and greedy drafts are compared with "
                           f"the argmax ids by the coordinator)")
            if len(record.drafts) >= n:
                raise _bad(f"{len(record.drafts)} drafts for {n} rows: a verify has one row more than drafts")
        if (record.prompt_logprobs is None) != (record.next_tokens is None):
            raise _bad(f"fields 'prompt_logprobs' and 'next_tokens' of {kind.value} go together")
        if record.next_tokens is not None and not 1 <= len(record.next_tokens) <= n:
            raise _bad(f"field 'next_tokens' holds {len(record.next_tokens)} tokens for {n} rows: 1 to {n}, one per "
                       "row scored from the first")
    if isinstance(record, Capture):
        layers = record.layers
        if not layers:
            raise _bad("field 'layers' of CAPTURE must not be empty")
        if len(layers) > limits.max_capture_layers:
            raise _too_large(f"{len(layers)} capture layers, limit {limits.max_capture_layers}")
        if len(set(layers)) != len(layers):
            raise _bad(f"field 'layers' of CAPTURE repeats a layer: {layers}")
        if record.carried is not None and record.carried_layers is None:
            raise _bad("field 'carried_layers' and tensor 'carried' of CAPTURE go together")
        if record.carried_layers is not None and record.carried is None and record.rows_ticket is None:
            raise _bad("field 'carried_layers' of CAPTURE needs tensor 'carried', or field 'rows_ticket' (the "
                       "previous shard's ROWS bring the carried rows)")
        if record.carried_layers is not None and record.propose is None:
            raise _bad("field 'carried_layers' of CAPTURE goes with field 'propose'")
        if record.carried_layers is not None:
            if len(set(record.carried_layers)) != len(record.carried_layers) or not record.carried_layers:
                raise _bad(f"field 'carried_layers' must be distinct and non-empty, got {record.carried_layers}")
            if record.carried is not None and record.carried.shape[0] != record.n_tokens:
                raise _bad(f"tensor 'carried' has {record.carried.shape[0]} rows for {record.n_tokens} tokens")
        if record.propose is not None:
            if record.drafts is None:  # a prompt chunk: all its rows join the drafter's context
                if record.checkpoint:
                    raise _bad("field 'propose' of a checkpointed CAPTURE needs the block's drafts: field 'drafts' "
                               "of n - 1 tokens (without drafts, a prompt chunk, it is not checkpointed)")
            elif len(record.drafts) != record.n_tokens - 1:
                raise _bad("field 'propose' of CAPTURE needs the block's drafts: field 'drafts' of n - 1 tokens")
    if isinstance(record, Rows):
        if record.refused + (record.hidden is not None) + (record.slot is not None) != 1:
            raise _bad("ROWS carries tensor 'hidden', field 'refused' or field 'slot', exactly one")
        if (record.slot is None) != (record.slot_rows is None):
            raise _bad("fields 'slot' and 'slot_rows' of ROWS go together")
        if record.slot_gen is not None and record.slot is None:
            raise _bad("field 'slot_gen' of ROWS goes with 'slot'")
        n = record.hidden.shape[0] if record.hidden is not None else record.slot_rows or 0
        if n > limits.max_tokens_per_request:
            raise _too_large(f"{n} rows, limit {limits.max_tokens_per_request}")
        if record.carried is not None and (record.refused or record.carried.shape[0] != n):
            raise _bad(f"tensor 'carried' of ROWS goes with the rows, one per row ({n}), got "
                       f"{list(record.carried.shape)}")
        if record.slot_carried is not None and (record.slot is None or not record.carries or
                                                 record.carried is not None):
            raise _bad("field 'slot_carried' of ROWS goes with 'slot' and 'carries', without tensor 'carried'")
        if bool(record.carries) != (record.carried is not None or record.slot_carried is not None):
            raise _bad("field 'carries' of ROWS goes with tensor 'carried' or field 'slot_carried'")
    if isinstance(record, Propose):
        if record.block_size > limits.max_tokens_per_request:
            raise _too_large(f"block_size {record.block_size}, limit {limits.max_tokens_per_request}")
        features = record.features
        if features is not None:
            if features.shape[1] < 1:
                raise _bad(f"tensor 'features' has zero width: shape {list(features.shape)}")
            if features.shape[0] > limits.max_tokens_per_request:
                raise _too_large(f"{features.shape[0]} feature rows, limit {limits.max_tokens_per_request}")
        _check_propose_saves(record)


def _check_propose_saves(record: Propose) -> None:
    ids, lengths = record.save_prefix, record.save_lengths
    if (ids is None) != (lengths is None):
        raise _bad("fields 'save_prefix' and 'save_lengths' of PROPOSE go together")
    if ids is None:
        return
    if not ids or len(ids) != len(lengths):
        raise _bad(f"fields 'save_prefix' and 'save_lengths' of PROPOSE need as many items, at least one "
                   f"(got {len(ids)} and {len(lengths)})")
    if len(set(ids)) != len(ids):
        raise _bad(f"field 'save_prefix' of PROPOSE repeats an entry id: {ids}")
    if any(b <= a for a, b in zip(lengths, lengths[1:])) or lengths[-1] > record.pos:
        raise _bad(f"field 'save_lengths' of PROPOSE must ascend and end at most at pos {record.pos}: {lengths}")
