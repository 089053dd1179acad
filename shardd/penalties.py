"""Presence, frequency and repetition penalties on one row of logits, as vLLM defines them.

vLLM (`vllm/model_executor/layers/utils.py`, `apply_penalties`) applies, in this order, before temperature:
- repetition penalty r over every token seen in the prompt or the output: a positive logit is divided by r,
  a negative one multiplied by r;
- frequency penalty f: the logit minus f times the token's count in the output;
- presence penalty p: the logit minus p for every token present in the output.

Row-wise: under speculation row j of a verify sees the output committed so far plus the drafts before it
(drafts 0..j-1), which is the output plain decoding would have had at that token if those drafts are kept,
so the rejection rule compares against the penalised distribution plain decoding samples from. The function
takes one row and its context, so a batched scheduler can call it per row as well."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0


def penalise(logits: torch.Tensor, penalties: Penalties, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """One row [V] with the penalties applied (float32, a new tensor); `output`: the generated tokens this row
    follows (committed and earlier drafts), `prompt`: the prompt (only the repetition penalty reads it)."""
    row = logits.float().clone()
    vocab = row.shape[-1]
    if penalties.repetition != 1.0:
        seen = sorted({t for t in list(prompt) + list(output) if 0 <= t < vocab})
        if seen:
            index = torch.tensor(seen, dtype=torch.long, device=row.device)
            values = row[index]
            row[index] = torch.where(values > 0, values / penalties.repetition, values * penalties.repetition)
    if (penalties.frequency or penalties.presence) and output:
        counts = Counter(t for t in output if 0 <= t < vocab)
        index = torch.tensor(list(counts), dtype=torch.long, device=row.device)
        count = torch.tensor(list(counts.values()), dtype=torch.float32, device=row.device)
        row[index] -= penalties.frequency * count + penalties.presence
    return row
