"""What the head shard answers for a forward's rows beyond the argmax: penalties, sampling, logprobs.

The rows answered are the last `len(drafts) + 1` (a prefill or a decode: the last row; a verify: the row of
the last committed token and one per draft). Row j of them follows the output so far plus drafts 0..j-1, so
its penalised logits are those plain decoding would see at that token; sampling (shardd.engine.head.sampling) and greedy
alike read them. A token mask (constrained decoding: bit j of word i allows token 32 i + j) sets the logits of the
tokens a row may not take to -inf after the penalties, so the argmax and the sampler (and its rejection rule) see
the constrained distribution; logprobs stay those of the raw logits. `answer_batch` answers every row of a batch
of forwards at once, each sequence with its own settings: the rows' penalties, sampling, first rejection and logprobs are a few batched ops on the logits'
device, and the answers come back in one device-to-host copy. A row's answer depends on its own logits and
request alone, never on what else is in the batch."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import torch

from shardd.engine.head.logprobs import TOP_LOGPROBS, entry, rows_logprobs
from shardd.engine.head.penalties import Penalties, PenaltyRows, penalise_rows
from shardd.engine.head.sampling import SamplingParams, chunked, leading_accepted, to_device, verify_rows


@dataclass(frozen=True)
class HeadRequest:
    sampling: Optional[SamplingParams] = None  # None: greedy (the argmax of the penalised row)
    penalties: Penalties = Penalties()
    prompt: Sequence[int] = ()  # read by the repetition penalty only
    output: Sequence[int] = ()  # the tokens generated before the first answered row
    drafts: Sequence[int] = ()
    logprobs: Optional[int] = None  # top logprobs per answered row; None: none at all
    token_mask: Optional[torch.Tensor] = None  # int32 [answered rows, ceil(V / 32)]: the tokens each row may take

    @cached_property  # read several times per batch item; a frozen request's answer never changes
    def needed(self) -> bool:
        """Whether the shard's argmax ids are not already the whole answer."""
        return (self.sampling is not None or self.penalties.active or self.logprobs is not None
                or self.token_mask is not None)


def allowed_tokens(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] of an int32 bitmask [rows, W >= vocab / 32]: token 32 i + j where bit j of word i is set."""
    bits = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int32, device=mask.device),
                                    torch.arange(32, dtype=torch.int32, device=mask.device))
    return (mask.unsqueeze(-1) & bits).ne(0).flatten(1)[:, :vocab]


Answer = tuple[list[int], int, Optional[list]]  # (ids, drafts accepted, logprobs of the answered rows or None)


def answer_rows(logits: torch.Tensor, ids: Sequence[int], pos: int, head: HeadRequest) -> Answer:
    """(ids, drafts accepted, logprobs of the answered rows or None) for the logits [n, V] of a forward at `pos`."""
    return answer_batch([(logits, ids, pos, head)])[0]


def _argmax(rows: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.argmax(rows, dim=-1),)


def answer_batch(items: Sequence[tuple[torch.Tensor, Sequence[int], int, HeadRequest]]) -> list[Answer]:
    """`answer_rows` for each (logits [n, V], argmax ids, pos, request) of a batch, in order, as one batched
    computation on the logits' device (one host-to-device copy of the settings, one copy of the answers back).
    ValueError (nothing computed) when an item has as many drafts as rows."""
    for index, (logits, ids, pos, head) in enumerate(items):
        if len(head.drafts) >= logits.shape[0]:
            raise ValueError(f"{len(head.drafts)} drafts for {logits.shape[0]} rows"
                             + (f" (item {index})" if len(items) > 1 else ""))
    if not items:
        return []
    # one entry per answered row, items in order
    item_of_row, index_of_row, given, draft = [], [], [], []
    sampled, argmaxed, logprobbed = [], [], []  # rows sampled, rows whose answer is the penalised argmax, ...
    temperature, top_p, top_k, seed, position = [], [], [], [], []
    groups, slices = [], []
    masks, masked = [], []  # the answered rows' token masks, and their rows
    for item, (logits, ids, pos, head) in enumerate(items):
        drafts = [int(token) for token in head.drafts]
        n = logits.shape[0]
        answered = len(drafts) + 1
        first = n - answered
        row = len(given)
        item_of_row += [item] * answered
        index_of_row += range(answered)
        given += [int(i) for i in list(ids)[first:]]
        draft += drafts + [-1]
        if head.sampling is not None:
            sampled += range(row, row + answered)
            params = head.sampling
            temperature += [float(params.temperature)] * answered
            top_p += [float(params.top_p)] * answered
            top_k += [int(params.top_k)] * answered
            seed += [params.seed] * answered
            position += range(pos + first, pos + n)
        elif head.penalties.active or head.token_mask is not None:
            argmaxed += range(row, row + answered)
        if head.token_mask is not None:
            if head.token_mask.shape[0] != answered:
                raise ValueError(f"a token mask of {head.token_mask.shape[0]} rows for {answered} answered rows")
            masks.append(head.token_mask)
            masked += range(row, row + answered)
        if head.logprobs is not None:
            logprobbed += range(row, row + answered)
        groups.append(PenaltyRows(head.penalties, head.prompt, head.output, drafts, answered))
        slices.append((logits, first))
    rows = len(given)
    width = max(index_of_row) + 1

    if not (sampled or argmaxed or logprobbed):  # the shards' argmax is the answer: only drafts to compare
        answers = []
        for item, (logits, ids, pos, head) in enumerate(items):
            accepted = 0
            while accepted < len(head.drafts) and int(ids[logits.shape[0] - len(head.drafts) - 1 + accepted]) \
                    == int(head.drafts[accepted]):
                accepted += 1
            answers.append(([int(i) for i in ids], accepted, None))
        return answers

    device = slices[0][0].device
    item_rows = [part[first:] for part, first in slices]
    # [A, V]: the answered rows (one item's: a view of its logits)
    logits = (item_rows[0] if len(item_rows) == 1 else torch.cat(item_rows)).float()
    sampled_drafts = [draft[row] for row in sampled]
    every = len(sampled) == rows
    (item_of_row, index_of_row, given, draft, sampled, argmaxed, logprobbed) = to_device(
        device, item_of_row, index_of_row, given, draft, sampled, argmaxed, logprobbed)
    penalised = penalise_rows(logits, groups) if any(group.penalties.active for group in groups) else logits
    if masks:  # -inf outside each masked row's allowed tokens; a row without a mask keeps every token
        allowed = torch.ones_like(penalised, dtype=torch.bool)
        rows_masked = torch.tensor(masked, dtype=torch.long).to(device)
        allowed[rows_masked] = allowed_tokens(torch.cat(masks).to(device, non_blocking=True), penalised.shape[-1])
        penalised = penalised.masked_fill(~allowed, float("-inf"))

    if every:  # every row sampled: the sampler's answers are the candidates
        candidate, accepted_row = verify_rows(penalised, temperature, top_p, top_k, seed, position, sampled_drafts)
    else:
        candidate = given.clone()
        if argmaxed.numel():
            candidate[argmaxed] = chunked(_argmax, penalised[argmaxed])[0]
        accepted_row = (draft >= 0) & (candidate == draft)
        if sampled.numel():
            tokens, accepts = verify_rows(penalised[sampled], temperature, top_p, top_k, seed, position, sampled_drafts)
            candidate[sampled] = tokens
            accepted_row[sampled] = accepts  # a residual sample never equals its draft, but say it plainly
    accepted = leading_accepted(accepted_row, item_of_row, index_of_row, len(items), width)
    final = torch.where(index_of_row <= accepted[item_of_row], candidate, given)  # after a rejection: the argmax

    logprob_rows = logprobbed.numel()
    top = min(TOP_LOGPROBS, logits.shape[-1])
    parts = [final.double(), accepted.double()]
    if logprob_rows:
        chosen, top_values, top_ids = rows_logprobs(logits[logprobbed], final[logprobbed])
        parts += [chosen.double(), top_values.double().flatten(), top_ids.double().flatten()]
    values = torch.cat(parts).tolist()  # the one device-to-host copy
    final, accepted, values = values[:rows], values[rows:rows + len(items)], values[rows + len(items):]
    chosen, top_values, top_ids = (values[:logprob_rows], values[logprob_rows:logprob_rows * (top + 1)],
                                   values[logprob_rows * (top + 1):])
    answers, row, logprob_row = [], 0, 0
    for item, (_, ids, _, head) in enumerate(items):
        answered = len(head.drafts) + 1
        out = [int(i) for i in ids]
        out[len(out) - answered:] = [int(token) for token in final[row:row + answered]]
        logprobs = None
        if head.logprobs is not None:
            logprobs = [entry(chosen[r], top_values[r * top:(r + 1) * top], top_ids[r * top:(r + 1) * top],
                              head.logprobs) for r in range(logprob_row, logprob_row + answered)]
            logprob_row += answered
        answers.append((out, int(accepted[item]), logprobs))
        row += answered
    return answers
