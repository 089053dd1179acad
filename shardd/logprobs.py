"""Log-probabilities of a head row, the few numbers a client asked for (never the whole row).

As vLLM reports them by default (`logprobs_mode` "raw_logprobs"): the log-softmax of the model's raw logits,
before penalties, temperature, top-k and top-p. A committed token's logprob therefore depends only on its row
of logits, which a speculative verify computes as plain decoding does, so it is the number plain decoding
reports whichever way the token was accepted or sampled."""

from __future__ import annotations

import torch

def row_logprobs(logits: torch.Tensor, token: int, top: int) -> list:
    """[logprob of `token`, [[id, logprob], ...] of the `top` most likely tokens, most likely first]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    entry = [float(logprobs[token]), []]
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        entry[1] = [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist())]
    return entry
