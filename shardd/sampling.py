"""Sampling on the head shard, lossless under speculation, for every row of a batch at once.

`verify_rows` samples any number of rows (several sequences, each with its own temperature, top_p, top_k,
seed, positions and drafts) as a few batched torch ops on the logits' device, with no host sync: the daemon's
head (shardd.head.answer_batch) calls it on `ShardOutput.logits`, for the reference `ShardModel` and the GPU
fast path alike, and copies the final ids back once. Temperature 0 never gets here: the argmax ids the shard
computed are the answer, exactly as before sampling existed.

The target distribution of a row is softmax(logits / temperature), cut to the `top_k` most likely tokens and
to the smallest set holding `top_p` of the mass, renormalised (the order vLLM and transformers apply them);
a cut is by value, so tokens tied with the last one kept stay. Only rows with a top-p cut are sorted (once).

Randomness: a row at absolute position p of a request with seed s reads its uniforms from a counter-based
hash (splitmix64) of (s, p, draw), where draw is 0 for a sample from p (the last row of a forward, the bonus
row of a verify), 1 for the accept test of a draft and 2 for the residual sample after a rejection. The hash
is integer arithmetic, the same on the CPU and on CUDA, so a seed reproduces the output whatever the batch,
the rollback mode, chunking or engine. The draw is an inverse-CDF lookup in vocabulary order, done in
62-bit fixed point (an exact integer cumulative sum), so no rounding of a parallel scan can move it.
This stream replaced the one of `random.Random(f"{seed}:{pos}")` per row (issue 20): a seed gives different
tokens than before that change, equally distributed.

Batch invariance: a row's result depends on its own logits and parameters alone. The top-k, sort, softmax
and cumulative sums run on chunks of exactly `CHUNK_ROWS` rows (the last padded), so the same kernels run
whatever the batch, every other op is elementwise or a per-row reduction, and a cut another row of the
chunk needs leaves a row without one bit for bit unchanged.

Speculation: the drafters are deterministic (ngram, oracle, dflash's argmax), so the draft distribution q is
one-hot and standard speculative rejection sampling (accept with min(1, p/q), else sample the normalised
residual max(0, p - q)) becomes: accept draft d with probability p(d); on rejection sample from p with d
removed, renormalised; when every draft is accepted, sample the bonus token from p at the last row. Every
draft row's accept test runs at once; the first rejection is found with a cumulative product. The committed
tokens then follow exactly the distribution of plain sampling (tests/test_sampling.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


CHUNK_ROWS = 16  # rows per sort/softmax/scan call: one fixed shape, whatever the batch
SAMPLE, ACCEPT, RESIDUAL = 0, 1, 2  # the draw index of a row's uniform (see the module docstring)
FIXED_POINT = 62  # 2^62 per unit of mass: a row's total (about 1) fits int64; a weight under 2^-62 counts as 0

_MASK64 = (1 << 64) - 1


def as_int64(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_GOLDEN = as_int64(0x9E3779B97F4A7C15)
_MIX1 = as_int64(0xBF58476D1CE4E5B9)
_MIX2 = as_int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (multiplication wraps mod 2^64 on every device)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniforms(seed: torch.Tensor, position: torch.Tensor, draw) -> torch.Tensor:
    """The uniform in [0, 1) (float64) of draw `draw` at absolute `position` for `seed` (int64 tensors or ints,
    broadcast together)."""
    key = _mix(seed + _GOLDEN)
    counter = position * 3 + draw
    bits = _mix(key + (counter + 1) * _GOLDEN)
    return _shift_right(bits, 11).double() * 2.0 ** -53  # the top 53 bits: exact in a float64


def residual(probs: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """p [C, V] with each row's rejected (one-hot) draft removed: max(0, p - q) up to normalisation; a row
    without a draft (-1) unchanged."""
    index = draft.clamp_min(0)[:, None]
    return probs.scatter(1, index, torch.where(draft[:, None] >= 0, 0.0, probs.gather(1, index)))


def _truncated_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                     top_k_max: int, any_top_p: bool) -> torch.Tensor:
    """The sampling distributions [C, V] (vocabulary order, float32) of logits [C, V]: softmax(logits / T) cut
    to the top_k by value (ties with the k-th stay), then to the tokens of probability at least that of the
    last token of the smallest prefix, most likely first, holding top_p of the mass, renormalised.

    `top_k_max` (the largest top_k < V of the rows, 0: none) and `any_top_p` (some row's top_p < 1) come from
    the host; a row without a cut comes out bit for bit the same whether or not another row has one."""
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature[:, None]
    if top_k_max:
        cut = (top_k > 0) & (top_k < vocab)
        largest = torch.topk(scaled, top_k_max, dim=-1).values  # exact values: the k-th is whatever k_max
        kth = largest.gather(1, (torch.where(cut, top_k, 1).clamp_max(top_k_max) - 1)[:, None])
        scaled = scaled.masked_fill(cut[:, None] & (scaled < kth), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any_top_p:
        ranked = torch.sort(probs, dim=-1, descending=True).values  # the same values as probs, ranked
        before = torch.cumsum(ranked, dim=-1) - ranked  # mass of the tokens ranked above
        kept = (before < top_p[:, None]).sum(dim=-1).clamp_min(1)  # top_p 0 keeps the most likely token
        smallest = torch.where(top_p < 1.0, ranked.gather(1, (kept - 1)[:, None]).squeeze(1), 0.0)
        probs = probs.masked_fill(probs < smallest[:, None], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative interval holds u * total, for weights [C, V] and u [C] in [0, 1).

    Exact: the weights become integers (2^FIXED_POINT per unit of mass), so the cumulative sum has no rounding
    on any device, and a token with zero weight is never chosen (its interval is empty)."""
    cdf = torch.cumsum((weights.double() * float(1 << FIXED_POINT)).long(), dim=-1)
    total = cdf[:, -1]
    target = torch.minimum((u * total.double()).long(), total - 1).clamp_min(0)
    return torch.searchsorted(cdf, target[:, None], right=True).clamp_max(weights.shape[-1] - 1).squeeze(1)


def _verify_chunk(logits, floats, ints, *, top_k_max, any_top_p):
    """One chunk of `verify_rows`: floats [C, 5] (temperature, top_p, the three uniforms), ints [C, 2] (top_k,
    draft)."""
    top_k, draft = ints.unbind(1)
    probs = _truncated_probs(logits, floats[:, 0].float(), floats[:, 1].float(), top_k, top_k_max, any_top_p)
    has_draft = draft >= 0
    p_draft = probs.gather(1, draft.clamp_min(0)[:, None]).squeeze(1)
    accept = has_draft & (floats[:, 2 + ACCEPT] < p_draft.double())
    u = torch.where(has_draft, floats[:, 2 + RESIDUAL], floats[:, 2 + SAMPLE])
    sampled = _draw(residual(probs, draft), u)
    return torch.where(accept, draft, sampled), accept


def _cuts(vocab: int, top_p: Sequence[float], top_k: Sequence[int]) -> dict:
    """The host's flags for `_truncated_probs` over some rows."""
    return dict(top_k_max=max((k for k in top_k if 0 < k < vocab), default=0), any_top_p=any(p < 1.0 for p in top_p))


def verify_rows(
    logits: torch.Tensor, temperature: Sequence[float], top_p: Sequence[float], top_k: Sequence[int],
    seed: Sequence[int], position: Sequence[int], draft: Sequence[int], *, chunk_rows: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [A], accepted [A] bool, on the logits' device) for rows of logits [A, V], each with its own
    parameters (host lists: temperature > 0, top_p, top_k, seed, absolute position, draft or -1).

    A row with a draft accepts it with probability p(draft) (token = draft, accepted) or else samples the
    residual (p without the draft); a row without one samples from p. One host-to-device copy, no sync."""
    vocab = logits.shape[-1]
    top_k = [min(int(k), vocab) for k in top_k]  # past the vocabulary: every token (and int64 whatever it was)
    columns = to_device(logits.device, [float(t) for t in temperature], [float(p) for p in top_p], top_k,
                        [as_int64(s) for s in seed], [int(p) for p in position], [int(d) for d in draft],
                        [SAMPLE, ACCEPT, RESIDUAL])
    temperature_d, top_p_d, top_k_d, seed_d, position_d, draft_d, draws = columns
    u = uniforms(seed_d[:, None], position_d[:, None], draws)  # [A, 3]: SAMPLE, ACCEPT, RESIDUAL
    floats = torch.cat([temperature_d[:, None], top_p_d[:, None], u], dim=1)
    ints = torch.stack([top_k_d, draft_d], dim=1)
    return chunked(_verify_chunk, logits, floats, ints, chunk_rows=chunk_rows,
                   options=lambda start, stop: _cuts(vocab, top_p[start:stop], top_k[start:stop]))


def chunked(function, *columns: torch.Tensor, chunk_rows: Optional[int] = None,
            options=None) -> tuple[torch.Tensor, ...]:
    """`function` over chunks of exactly `chunk_rows` rows of the columns (the last padded with copies of its
    first row, whose results are dropped), its outputs concatenated: the same kernels whatever the row count.
    `options(start, stop)`: keyword arguments for the chunk of rows start..stop-1."""
    chunk_rows = chunk_rows or CHUNK_ROWS
    rows = columns[0].shape[0]
    if rows == 0:
        raise ValueError("no rows")
    outputs = []
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        chunk = [column[start:stop] for column in columns]
        if stop - start < chunk_rows:
            pad = chunk_rows - (stop - start)
            chunk = [torch.cat([part, part[:1].expand(pad, *part.shape[1:])]) for part in chunk]
        results = function(*chunk, **(options(start, stop) if options else {}))
        outputs.append([output[:stop - start] for output in results])
    return tuple(torch.cat(parts) for parts in zip(*outputs))


def leading_accepted(accepted: torch.Tensor, group: torch.Tensor, index: torch.Tensor, groups: int,
                     width: int) -> torch.Tensor:
    """How many rows each group accepted before its first rejection: row r is row `index[r]` of group
    `group[r]` (< width); rows never given (and a group's last row) count as rejections. [groups] int64."""
    grid = torch.zeros(groups, width, dtype=torch.long, device=accepted.device)
    grid[group, index] = accepted.long()
    return torch.cumprod(grid, dim=1).sum(dim=1)


def to_device(device: torch.device, *columns: Sequence) -> list[torch.Tensor]:
    """Host lists as int64 (ints) or float64 (floats) tensors on `device`, in one copy that does not wait
    for the device (pinned memory, non-blocking)."""
    host = []
    for column in columns:
        floats = any(isinstance(value, float) for value in column)
        host.append(torch.tensor(list(column), dtype=torch.float64 if floats else torch.int64))
    if not host:
        return []
    packed = torch.cat([tensor.view(torch.int64) for tensor in host])
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    out, start = [], 0
    for tensor in host:
        part = packed[start:start + tensor.numel()]
        out.append(part.view(torch.float64) if tensor.dtype == torch.float64 else part)
        start += tensor.numel()
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of one row of logits [V] in vocabulary order, float32 on the logits' device."""
    top_k = min(int(params.top_k), logits.shape[-1])
    temperature, top_p, top_k_d = to_device(logits.device, [float(params.temperature)], [float(params.top_p)],
                                            [top_k])
    return _truncated_probs(logits[None], temperature.float(), top_p.float(), top_k_d,
                            **_cuts(logits.shape[-1], [params.top_p], [top_k]))[0]


def sample_rows(
    logits: torch.Tensor, ids: Sequence[int], pos: int, params: SamplingParams, drafts: Optional[Sequence[int]] = None,
) -> tuple[list[int], int]:
    """Sampled ids for a forward's rows, and how many drafts were accepted (one sequence; the head shard
    answers a whole batch with shardd.head.answer_batch, which calls `verify_rows` the same way).

    `logits` [n, V] and `ids` (the argmax per row) of a forward at `pos`. Without drafts only the last row is
    sampled (the prompt rows of a prefill answer nothing anyone reads). With drafts (the last len(drafts) input
    tokens) the rows before them verify them in order: row r accepts drafts[j] or replaces it with a residual
    sample and stops; rows after a rejection keep their argmax (the coordinator commits up to the first
    mismatch, and a residual sample never equals its draft). All accepted: the last row samples the bonus."""
    drafts = list(drafts or ())
    n = logits.shape[0]
    if len(drafts) >= n:
        raise ValueError(f"{len(drafts)} drafts for {n} rows")
    first = n - 1 - len(drafts)
    answered = len(drafts) + 1
    token, accept = verify_rows(logits[first:], [params.temperature] * answered, [params.top_p] * answered,
                                [params.top_k] * answered, [params.seed] * answered,
                                range(pos + first, pos + n), drafts + [-1])
    zeros = torch.zeros(answered, dtype=torch.long, device=logits.device)
    accepted = leading_accepted(accept, zeros, torch.arange(answered, device=logits.device), 1, answered)
    values = torch.cat([token, accepted]).tolist()  # the one device-to-host copy
    tokens, count = values[:answered], values[answered]
    out = [int(i) for i in ids]
    out[first:first + count + 1] = tokens[:count + 1]
    return out, count
