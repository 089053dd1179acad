"""Log-probabilities of head rows, the few numbers a client asked for (never the whole row).

As vLLM reports them by default (`logprobs_mode` "raw_logprobs"): the log-softmax of the model's raw logits,
before penalties, temperature, top-k and top-p. A committed token's logprob therefore depends only on its row
of logits, which a speculative verify computes as plain decoding does, so it is the number plain decoding
reports whichever way the token was accepted or sampled."""

from __future__ import annotations

from typing import Sequence

import torch

from shardd.engine.head.sampling import chunked

TOP_LOGPROBS = 20  # the most a request may ask for; every row computes this many (one shape whatever the batch)


def _chunk_logprobs(logits: torch.Tensor, tokens: torch.Tensor):
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, min(TOP_LOGPROBS, logprobs.shape[-1]))
    return logprobs.gather(1, tokens[:, None]).squeeze(1), values, ids


def rows_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows [A, V] and a token per row [A] (on the logits' device, no sync): the token's logprob [A], and
    the TOP_LOGPROBS most likely tokens' logprobs and ids [A, K], most likely first."""
    return chunked(_chunk_logprobs, logits, tokens)


def entry(token_logprob: float, top_values: list, top_ids: list, top: int) -> list:
    """One answered row as the wire carries it: [logprob of the token, [[id, logprob], ...] of the `top` most
    likely tokens]."""
    return [token_logprob, [[int(i), v] for i, v in zip(top_ids[:top], top_values[:top])]]


def row_logprobs(logits: torch.Tensor, token: int, top: int) -> list:
    """[logprob of `token`, [[id, logprob], ...] of the `top` most likely tokens, most likely first] of one
    row [V] (a batch of one of `rows_logprobs`)."""
    chosen, values, ids = rows_logprobs(logits[None], torch.tensor([token], device=logits.device))
    return entry(float(chosen[0]), values[0].tolist(), ids[0].tolist(), top)


def _chunk_scored(logits: torch.Tensor, tokens: torch.Tensor):
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, min(TOP_LOGPROBS, logprobs.shape[-1]))
    chosen = logprobs.gather(1, tokens[:, None])
    # vLLM's rank: the tokens at least as likely as this one, itself included (1: the most likely)
    return chosen.squeeze(1), (logprobs >= chosen).sum(dim=-1), values, ids


def scored_rows(items: Sequence[tuple[torch.Tensor, Sequence[int], int]]) -> list[list]:
    """Prompt logprobs: for each (logits [n, V], next tokens [m <= n], top) of a batch, one entry per row of its
    first m, `[logprob of the row's next token, [[id, logprob], ...top], rank of the next token]`; all the batch's
    rows as one batched computation on the logits' device and one copy back."""
    if not items:
        return []
    device = items[0][0].device
    rows = torch.cat([logits[:len(tokens)] for logits, tokens, _ in items])
    tokens = torch.tensor([int(t) for _, next_tokens, _ in items for t in next_tokens], device=device)
    chosen, rank, values, ids = chunked(_chunk_scored, rows, tokens)
    top = values.shape[-1]
    count = chosen.numel()
    flat = torch.cat([chosen.double(), rank.double(), values.double().flatten(), ids.double().flatten()]).tolist()
    chosen, rank, values, ids = (flat[:count], flat[count:2 * count], flat[2 * count:count * (2 + top)],
                                 flat[count * (2 + top):])
    answers, row = [], 0
    for _, next_tokens, wanted in items:
        entries = []
        for r in range(row, row + len(next_tokens)):
            entries.append(entry(chosen[r], values[r * top:(r + 1) * top], ids[r * top:(r + 1) * top], wanted)
                           + [int(rank[r])])
        answers.append(entries)
        row += len(next_tokens)
    return answers
