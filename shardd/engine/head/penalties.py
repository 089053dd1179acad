"""Presence, frequency and repetition penalties on one row of logits, as vLLM defines them.

vLLM (`vllm/model_executor/layers/utils.py`, `apply_penalties`) applies, in this order, before temperature:
- repetition penalty r over every token seen in the prompt or the output: a positive logit is divided by r,
  a negative one multiplied by r;
- frequency penalty f: the logit minus f times the token's count in the output;
- presence penalty p: the logit minus p for every token present in the output.

Row-wise: under speculation row j of a verify sees the output committed so far plus the drafts before it
(drafts 0..j-1), which is the output plain decoding would have had at that token if those drafts are kept,
so the rejection rule compares against the penalised distribution plain decoding samples from.
`penalise_rows` applies them to every row of a batch at once (several sequences, each its own penalties and
context) as a few tensor ops on the logits' device; a row without penalties comes back bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from shardd.engine.head.sampling import to_device


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0


class PenaltyRows(NamedTuple):
    """`rows` consecutive rows of one sequence; row j of them follows `output` + `drafts[:j]`."""

    penalties: Penalties
    prompt: Sequence[int]  # read by the repetition penalty only
    output: Sequence[int]
    drafts: Sequence[int]
    rows: int


def penalise_rows(logits: torch.Tensor, groups: Sequence[PenaltyRows]) -> torch.Tensor:
    """The rows [A, V] with each group's penalties applied (float32, a new tensor); the groups cover the rows
    in order. Tokens outside [0, V) are ignored. One host-to-device copy, no sync."""
    rows, vocab = logits.shape
    if sum(group.rows for group in groups) != rows:
        raise ValueError(f"penalty groups cover {sum(group.rows for group in groups)} rows of {rows}")
    penalised = logits.float().clone()
    if not any(group.penalties.active for group in groups):
        return penalised
    row_table, repetition, frequency, presence = [], [], [], []
    count_table, count_token, seen_table, seen_token, draft_row, draft_token = [], [], [], [], [], []
    row = tables = 0
    for group in groups:
        penalties = group.penalties
        if penalties.active:
            table = tables  # this group's row in the per-sequence tables
            tables += 1
            for token in group.output:
                if 0 <= token < vocab:
                    count_table.append(table)
                    count_token.append(token)
            if penalties.repetition != 1.0:
                for token in group.prompt:
                    if 0 <= token < vocab:
                        seen_table.append(table)
                        seen_token.append(token)
            for j in range(group.rows):
                for token in list(group.drafts)[:j]:
                    if 0 <= token < vocab:
                        draft_row.append(row + j)
                        draft_token.append(token)
        else:
            table = -1
        row_table += [table] * group.rows
        repetition += [float(penalties.repetition)] * group.rows
        frequency += [float(penalties.frequency)] * group.rows
        presence += [float(penalties.presence)] * group.rows
        row += group.rows
    none = tables  # the all-zero table row of the groups without penalties
    row_table = [none if table < 0 else table for table in row_table]
    (row_table, repetition, frequency, presence, count_table, count_token, seen_table, seen_token, draft_row,
     draft_token) = to_device(logits.device, row_table, repetition, frequency, presence, count_table, count_token,
                              seen_table, seen_token, draft_row, draft_token)
    counts = torch.zeros(none + 1, vocab, dtype=torch.float32, device=logits.device)
    counts.index_put_((count_table, count_token), torch.ones_like(count_token, dtype=torch.float32), accumulate=True)
    prompt_seen = torch.zeros(none + 1, vocab, dtype=torch.bool, device=logits.device)
    prompt_seen.index_put_((seen_table, seen_token), torch.ones_like(seen_token, dtype=torch.bool))
    counts = counts[row_table]  # [A, V]: the output's counts, then each row's earlier drafts
    counts.index_put_((draft_row, draft_token), torch.ones_like(draft_token, dtype=torch.float32), accumulate=True)
    present = counts > 0
    seen = prompt_seen[row_table] | present
    repetition = repetition.float()[:, None]
    penalised = torch.where(seen, torch.where(penalised > 0, penalised / repetition, penalised * repetition),
                            penalised)
    return penalised - (frequency.float()[:, None] * counts + presence.float()[:, None] * present.float())


def penalise(logits: torch.Tensor, penalties: Penalties, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """One row [V] with the penalties applied (float32, a new tensor); `output`: the generated tokens this row
    follows (committed and earlier drafts), `prompt`: the prompt (only the repetition penalty reads it)."""
    return penalise_rows(logits[None], [PenaltyRows(penalties, prompt, output, (), 1)])[0]
