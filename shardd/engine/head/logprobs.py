"""Log-probabilities of head rows, the few numbers a client asked for (never the whole row).

As vLLM reports them by default (`logprobs_mode` "raw_logprobs"): the log-softmax of the model's raw logits,
before penalties, temperature, top-k and top-p. A committed token's logprob therefore depends only on its row
of logits, which a speculative verify computes as plain decoding does, so it is the number plain decoding
reports whichever way the token was accepted or sampled."""

from __future__ import annotations

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
