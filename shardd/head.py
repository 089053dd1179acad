"""What the head shard answers for a forward's rows beyond the argmax: penalties, sampling, logprobs.

The rows answered are the last `len(drafts) + 1` (a prefill or a decode: the last row; a verify: the row of
the last committed token and one per draft). Row j of them follows the output so far plus drafts 0..j-1, so
its penalised logits are those plain decoding would see at that token; sampling (shardd.sampling) and greedy
alike read them. Each function here works on one row, so a batched step can call them per row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from shardd.logprobs import row_logprobs
from shardd.penalties import Penalties, penalise
from shardd.sampling import SamplingParams, sample_rows


@dataclass(frozen=True)
class HeadRequest:
    sampling: Optional[SamplingParams] = None  # None: greedy (the argmax of the penalised row)
    penalties: Penalties = Penalties()
    prompt: Sequence[int] = ()  # read by the repetition penalty only
    output: Sequence[int] = ()  # the tokens generated before the first answered row
    drafts: Sequence[int] = ()
    logprobs: Optional[int] = None  # top logprobs per answered row; None: none at all

    @property
    def needed(self) -> bool:
        """Whether the shard's argmax ids are not already the whole answer."""
        return self.sampling is not None or self.penalties.active or self.logprobs is not None


def answer_rows(logits: torch.Tensor, ids: Sequence[int], pos: int, head: HeadRequest) -> tuple[list[int], int, Optional[list]]:
    """(ids, drafts accepted, logprobs of the answered rows or None) for the logits [n, V] of a forward at `pos`."""
    drafts = list(head.drafts)
    n = logits.shape[0]
    if len(drafts) >= n:
        raise ValueError(f"{len(drafts)} drafts for {n} rows")
    first = n - 1 - len(drafts)

    def adjusted(j: int, row: torch.Tensor) -> torch.Tensor:
        if not head.penalties.active:
            return row
        return penalise(row, head.penalties, head.prompt, list(head.output) + drafts[:j])

    out = [int(i) for i in ids]
    if head.sampling is not None:
        out, accepted = sample_rows(logits, out, pos, head.sampling, drafts, adjust=adjusted)
    else:
        accepted = 0
        for j in range(len(drafts) + 1):
            if head.penalties.active:
                out[first + j] = int(torch.argmax(adjusted(j, logits[first + j])))
            if j == len(drafts) or out[first + j] != drafts[j]:
                break
            accepted += 1
    logprobs = None
    if head.logprobs is not None:
        logprobs = [row_logprobs(logits[row], out[row], head.logprobs) for row in range(first, n)]
    return out, accepted, logprobs


def answer_batch(rows: Sequence[tuple[torch.Tensor, Sequence[int], int, HeadRequest]]) -> list[tuple[list[int], int, Optional[list]]]:
    """`answer_rows` for each item of a batched forward: per (logits [n, V], ids, pos, head) its (ids, drafts
    accepted, logprobs or None), in order."""
    return [answer_rows(logits, ids, pos, head) for logits, ids, pos, head in rows]
