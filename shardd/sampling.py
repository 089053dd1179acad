"""Sampling on the head shard, lossless under speculation.

One function, `sample_rows`, used for every engine: the daemon calls it on `ShardOutput.logits` after
`shard.forward` (reference `ShardModel` and the GPU fast path alike). Temperature 0 never gets here: the
argmax ids the shard computed are the answer, exactly as before sampling existed.

The target distribution of a row is softmax(logits / temperature), cut to the `top_k` most likely tokens and
to the smallest set holding `top_p` of the mass, renormalised (the order vLLM and transformers apply them).

Randomness: row i of a request at `pos` draws from `random.Random(f"{seed}:{pos + i}")`, so a seed reproduces
the output whatever the rollback mode, chunking or engine. The draw is an inverse-CDF lookup of a uniform in
the cumulative distribution, which runs the same on any device.

Speculation: the drafters are deterministic (ngram, oracle, dflash's argmax), so the draft distribution q is
one-hot and standard speculative rejection sampling (accept with min(1, p/q), else sample the normalised
residual max(0, p - q)) becomes: accept draft d with probability p(d); on rejection sample from p with d
removed, renormalised; when every draft is accepted, sample the bonus token from p at the last row. The
committed tokens then follow exactly the distribution of plain sampling (tests/test_sampling.py checks it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of one row of logits [V], float32 on the logits' device."""
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
        drop = before >= params.top_p  # keeps the smallest prefix reaching top_p
        drop[..., 0] = False  # and always the most likely token (top_p 0 is greedy-like, not empty)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def draw(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative-probability interval holds u * total (inverse CDF); never a zero-mass token."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device),
                                   right=True)[0])
    index = min(index, probs.shape[-1] - 1)
    while probs[index] <= 0 and index > 0:  # u * total landed on the very end: step back to a real token
        index -= 1
    return index


def residual(probs: torch.Tensor, draft: int) -> torch.Tensor:
    """p with the rejected (one-hot) draft removed: max(0, p - q) up to normalisation."""
    rest = probs.clone()
    rest[draft] = 0.0
    return rest


def row_rng(seed: int, position: int) -> random.Random:
    return random.Random(f"{seed}:{position}")  # str seeds hash with SHA-512: stable across runs


def sample_rows(
    logits: torch.Tensor, ids: Sequence[int], pos: int, params: SamplingParams, drafts: Optional[Sequence[int]] = None,
    adjust: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
) -> tuple[list[int], int]:
    """Sampled ids for a forward's rows, and how many drafts were accepted.

    `logits` [n, V] and `ids` (the argmax per row) of a forward at `pos`. Without drafts only the last row is
    sampled (the prompt rows of a prefill answer nothing anyone reads). With drafts (the last len(drafts) input
    tokens) the rows before them verify them in order: row r accepts drafts[j] or replaces it with a residual
    sample and stops; rows after a rejection keep their argmax (the coordinator commits up to the first
    mismatch, and a residual sample never equals its draft). All accepted: the last row samples the bonus."""
    drafts = list(drafts or ())
    n = logits.shape[0]
    if len(drafts) >= n:
        raise ValueError(f"{len(drafts)} drafts for {n} rows")
    out = [int(i) for i in ids]
    first = n - 1 - len(drafts)
    accepted = 0
    for j in range(len(drafts) + 1):
        row = first + j
        rng = row_rng(params.seed, pos + row)
        probs = target_probs(logits[row] if adjust is None else adjust(j, logits[row]), params)
        if j == len(drafts):
            out[row] = draw(probs, rng.random())
            break
        draft = drafts[j]
        if rng.random() < float(probs[draft]):
            out[row] = draft
            accepted += 1
            continue
        rest = residual(probs, draft)
        out[row] = draw(rest, rng.random()) if float(rest.sum()) > 0 else int(torch.argmax(probs))
        break
    return out, accepted
