"""Sampling on the head shard, lossless under speculation, for every row of a batch at once.

`verify_rows` samples any number of rows (several sequences, each with its own temperature, top_p, top_k,
seed, positions and drafts) as a few batched torch ops on the logits' device, with no host sync: the daemon's
head (shardd.engine.head.answer.answer_batch) calls it on `ShardOutput.logits`, for the reference `ShardModel` and the GPU
fast path alike, and copies the final ids back once. A temperature below `protocol.SAMPLING_EPS` (0 included)
never gets here: the argmax ids the shard computed are the answer, exactly as before sampling existed
(`shardd.server.handlers.forward.head_request`); `verify_rows` refuses one (logits / T would overflow float32).

The target distribution of a row is softmax(logits / temperature), cut to the `top_k` most likely tokens and
to the smallest set holding `top_p` of the mass, renormalised (the order vLLM and transformers apply them);
a cut is by value, so tokens tied with the last one kept stay. Only rows with a top-p cut are sorted (once).

Randomness: a row at absolute position p of a request with seed s reads its uniforms from a counter-based
hash (splitmix64) of (s, p, draw), where draw is 0 for a sample from p (the last row of a forward, the bonus
row of a verify), 1 for the accept test of a draft and 2 for the residual sample after a rejection. The hash
is integer arithmetic computed on the host (`uniform`), as are every other per-row setting the kernels read
(the k-th column of a top-k cut, which rows cut, the draft's column): they cross with one copy, and the device
runs only the ops that read the logits (about 35 per chunk). A seed reproduces the output whatever the batch,
the rollback mode, chunking or engine. The draw is an inverse-CDF lookup in vocabulary order, done in
62-bit fixed point (an exact integer cumulative sum), so no rounding of a parallel scan can move it.

Batch invariance: a row's result depends on its own logits and parameters alone. The top-k, sort, softmax
and cumulative sums run on chunks of exactly `CHUNK_ROWS` rows (the last padded), so the same kernels run
whatever the batch, every other op is elementwise or a per-row reduction, and a cut another row of the
chunk needs leaves a row without one bit for bit unchanged.

Speculation: the drafters are deterministic (ngram, oracle, dflash's argmax), so the draft distribution q is
one-hot and standard speculative rejection sampling (accept with min(1, p/q), else sample the normalised
residual max(0, p - q)) becomes: accept draft d with probability p(d); on rejection sample from p with d
removed, renormalised; when every draft is accepted, sample the bonus token from p at the last row. Every
draft row's accept test runs at once; the first rejection is found with a cumulative product. The committed
tokens then follow exactly the distribution of plain sampling (tests/unit/test_sampling.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from protocol import SAMPLING_EPS
from shardd.engine.fast.sampling import chunk_graphs


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


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def uniform(seed: int, position: int, draw: int) -> float:
    """The uniform in [0, 1) of draw `draw` at absolute `position` for `seed`: splitmix64 in Python integers on
    the host (a handful of integer ops per row, where a device computation costs some thirty kernel launches),
    the top 53 bits, exact in a float64."""
    key = _mix(as_int64(seed) + _GOLDEN)
    return (_mix(key + (position * 3 + draw + 1) * _GOLDEN) >> 11) * 2.0 ** -53


def _mix(x: int) -> int:
    """splitmix64's finaliser, mod 2^64."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


@dataclass
class _Rows:
    """The per-row settings of some rows of `verify_rows`, prepared on the host so the device only does the
    arithmetic that needs the logits. Host lists until `on_device` packs them (one copy), then tensors [C]."""

    temperature: object  # float32: the logits are divided by it
    top_p: object        # float32
    has_top_p: object    # bool: top_p < 1 (in float32)
    cut: object          # bool: 0 < top_k < V
    kth: object          # int64: top_k - 1 where cut (else 0), at most top_k_max - 1: the column of the k-th value
    draft: object        # int64: the row's draft, 0 without one (then `has_draft` is False)
    has_draft: object    # bool
    u_accept: object     # float64: the accept test's uniform; 2.0 without a draft (never below a probability)
    u_draw: object       # float64: the residual's uniform with a draft, the sample's without

    @staticmethod
    def pack(chunks: Sequence["_Rows"]) -> torch.Tensor:
        """Host rows' settings, chunk after chunk (each of the same rows), as one uint8 tensor; within a chunk
        each column starts at a multiple of 8 bytes (`unpack` reads one chunk's part)."""
        rows = len(chunks[0].temperature)
        offsets = _offsets(rows)
        packed = torch.zeros((len(chunks), offsets[-1]), dtype=torch.uint8)
        for name, dtype, offset in zip(vars(chunks[0]), _KINDS, offsets):
            values = torch.tensor([getattr(chunk, name) for chunk in chunks], dtype=dtype)
            packed[:, offset:offset + rows * dtype.itemsize] = values.view(torch.uint8)
        return packed.flatten()

    @staticmethod
    def unpack(packed: torch.Tensor, rows: int) -> "_Rows":
        """The columns of `rows` rows packed by `pack`, as views of `packed` (on any device)."""
        offsets = _offsets(rows)
        return _Rows(*(packed[offset:offset + rows * dtype.itemsize].view(dtype)
                       for dtype, offset in zip(_KINDS, offsets)))

    def on_device(self, device) -> "_Rows":
        return _Rows.unpack(_copy_to(_Rows.pack([self]), device), len(self.temperature))


_KINDS = (torch.float32, torch.float32, torch.bool, torch.bool, torch.int64, torch.int64, torch.bool, torch.float64,
          torch.float64)  # the dtypes of _Rows' columns, in order


def _offsets(rows: int) -> list[int]:
    """Byte offsets of _Rows' columns packed for `rows` rows, and the end."""
    offsets = [0]
    for dtype in _KINDS:
        offsets.append(offsets[-1] + -(-rows * dtype.itemsize // 8) * 8)
    return offsets


def _row_settings(vocab: int, temperature, top_p, top_k, draft, seed=None, position=None, *, top_k_max: int) -> _Rows:
    """`_Rows` (host lists) of rows with these settings; the uniforms only with `seed` and `position`."""
    top_p32 = torch.tensor(top_p, dtype=torch.float64).float().tolist()  # as the device compares it
    cut = [0 < k < vocab for k in top_k]
    u_accept = u_draw = [0.0] * len(top_k)
    if seed is not None:
        u_accept = [uniform(s, p, ACCEPT) if d >= 0 else 2.0 for s, p, d in zip(seed, position, draft)]
        u_draw = [uniform(s, p, RESIDUAL if d >= 0 else SAMPLE) for s, p, d in zip(seed, position, draft)]
    return _Rows(
        temperature=[float(t) for t in temperature], top_p=top_p32, has_top_p=[p < 1.0 for p in top_p32], cut=cut,
        kth=[min(k if c else 1, max(top_k_max, 1)) - 1 for k, c in zip(top_k, cut)],
        draft=[max(int(d), 0) for d in draft], has_draft=[d >= 0 for d in draft], u_accept=u_accept, u_draw=u_draw,
    )


def _truncated_probs(logits: torch.Tensor, rows: _Rows, top_k_max: int, any_top_p: bool) -> torch.Tensor:
    """The sampling distributions [C, V] (vocabulary order, float32) of logits [C, V]: softmax(logits / T) cut
    to the top_k by value (ties with the k-th stay), then to the tokens of probability at least that of the
    last token of the smallest prefix, most likely first, holding top_p of the mass, renormalised.

    `top_k_max` (the largest top_k < V of the rows, 0: none) and `any_top_p` (some row's top_p < 1) come from
    the host; a row without a cut comes out bit for bit the same whether or not another row has one."""
    scaled = logits.float() / rows.temperature[:, None]
    if top_k_max:
        largest = torch.topk(scaled, top_k_max, dim=-1).values  # exact values: the k-th is whatever k_max
        kth = largest.gather(1, rows.kth[:, None])
        scaled = scaled.masked_fill(rows.cut[:, None] & (scaled < kth), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any_top_p:
        ranked = torch.sort(probs, dim=-1, descending=True).values  # the same values as probs, ranked
        before = torch.cumsum(ranked, dim=-1) - ranked  # mass of the tokens ranked above
        kept = (before < rows.top_p[:, None]).sum(dim=-1).clamp_min(1)  # top_p 0 keeps the most likely token
        smallest = torch.where(rows.has_top_p, ranked.gather(1, (kept - 1)[:, None]).squeeze(1), 0.0)
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


def _verify_chunk(logits: torch.Tensor, rows: _Rows, top_k_max: int, any_top_p: bool):
    """One chunk of `verify_rows`: (token, accepted) of logits [C, V] with the chunk's settings `rows`.

    A draft d is accepted when its uniform is below p(d); the residual (p without d, renormalised by `_draw`)
    is sampled otherwise, p itself for a row without a draft (u_accept 2.0 never passes the test)."""
    probs = _truncated_probs(logits, rows, top_k_max, any_top_p)
    p_draft = probs.gather(1, rows.draft[:, None])
    accept = rows.u_accept < p_draft.squeeze(1).double()
    return torch.where(accept, rows.draft, _draw(residual(probs, rows, p_draft), rows.u_draw)), accept


def residual(probs: torch.Tensor, rows: _Rows, p_draft: torch.Tensor) -> torch.Tensor:
    """p [C, V] with each row's rejected (one-hot) draft removed: max(0, p - q) up to normalisation; a row
    without a draft unchanged. `p_draft` [C, 1]: each row's p at its draft column."""
    return probs.scatter(1, rows.draft[:, None], torch.where(rows.has_draft[:, None], 0.0, p_draft))


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
    residual (p without the draft); a row without one samples from p. The settings of every row are worked out
    on the host (the uniforms, the cuts) and cross in one copy; no sync.

    Rows run in chunks of exactly `chunk_rows` (the last padded with copies of its first row, whose results are
    dropped): the same kernels whatever the row count."""
    rows, vocab = logits.shape
    if rows == 0:
        raise ValueError("no rows")
    if min(temperature) < SAMPLING_EPS:
        raise ValueError(f"temperature {min(temperature)} is below {SAMPLING_EPS:g}: greedy, not sampled")
    chunk_rows = chunk_rows or CHUNK_ROWS
    top_k = [min(int(k), vocab) for k in top_k]  # past the vocabulary: every token (and int64 whatever it was)
    chunks, settings = [], []  # per chunk: (start, stop, its flags), its rows' settings
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)

        def padded(column: Sequence) -> list:
            part = list(column[start:stop])
            return part + part[:1] * (chunk_rows - len(part))

        cuts = _cuts(vocab, top_p[start:stop], top_k[start:stop])
        settings.append(_row_settings(vocab, *map(padded, (temperature, top_p, top_k, draft, seed, position)),
                                      top_k_max=cuts["top_k_max"]))
        chunks.append((start, stop, cuts))
    size = _offsets(chunk_rows)[-1]
    packed = _copy_to(_Rows.pack(settings), logits.device)  # every chunk's settings, one copy
    tokens, accepted = [], []
    for index, (start, stop, cuts) in enumerate(chunks):
        part = _padded_rows(logits[start:stop], chunk_rows)
        token, accept = _run_chunk(part, packed[index * size:(index + 1) * size], cuts)
        tokens.append(token)
        accepted.append(accept)
    if len(chunks) == 1:
        return tokens[0][:rows], accepted[0][:rows]
    return torch.cat(tokens)[:rows], torch.cat(accepted)[:rows]


GRAPHS = True  # on CUDA, each chunk shape's ops replay as one CUDA graph (shardd/engine/fast/sampling.py)


def _run_chunk(logits: torch.Tensor, packed: torch.Tensor, cuts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`_verify_chunk` of one chunk whose settings are `packed` (on the logits' device): on CUDA as a graph
    replay (the same kernels, one launch), elsewhere op by op."""
    if GRAPHS and logits.is_cuda:
        replayed = chunk_graphs(logits.device).run(logits, packed, _verify_packed, _packed_bytes, **cuts)
        if replayed is not None:
            return replayed
    return _verify_chunk(logits, _Rows.unpack(packed, logits.shape[0]), **cuts)


def _verify_packed(logits: torch.Tensor, packed: torch.Tensor, **cuts) -> tuple[torch.Tensor, torch.Tensor]:
    """`_verify_chunk` of rows whose settings are packed (views of `packed`: nothing is copied)."""
    return _verify_chunk(logits, _Rows.unpack(packed, logits.shape[0]), **cuts)


def _packed_bytes(rows: int) -> int:
    return _offsets(rows)[-1]


def chunked(function, *columns: torch.Tensor, chunk_rows: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """`function` over chunks of exactly `chunk_rows` rows of the columns (the last padded with copies of its
    first row, whose results are dropped), its outputs concatenated: the same kernels whatever the row count."""
    chunk_rows = chunk_rows or CHUNK_ROWS
    rows = columns[0].shape[0]
    if rows == 0:
        raise ValueError("no rows")
    outputs = []
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        chunk = [_padded_rows(column[start:stop], chunk_rows) for column in columns]
        outputs.append([output[:stop - start] for output in function(*chunk)])
    return tuple(torch.cat(parts) for parts in zip(*outputs))


def _padded_rows(part: torch.Tensor, rows: int) -> torch.Tensor:
    """`part` (at most `rows` rows) padded to `rows` with copies of its first row (results there are dropped)."""
    if part.shape[0] == rows:
        return part
    return torch.cat([part, part[:1].expand(rows - part.shape[0], *part.shape[1:])])


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
    packed = _copy_to(torch.cat([tensor.view(torch.int64) for tensor in host]), device)
    out, start = [], 0
    for tensor in host:
        part = packed[start:start + tensor.numel()]
        out.append(part.view(torch.float64) if tensor.dtype == torch.float64 else part)
        start += tensor.numel()
    return out


def _copy_to(host: torch.Tensor, device) -> torch.Tensor:
    """`host` on `device` without waiting for it (through pinned memory, non-blocking, on CUDA)."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of one row of logits [V] in vocabulary order, float32 on the logits' device."""
    vocab = logits.shape[-1]
    top_k = [min(int(params.top_k), vocab)]
    cuts = _cuts(vocab, [params.top_p], top_k)
    rows = _row_settings(vocab, [params.temperature], [params.top_p], top_k, [-1], top_k_max=cuts["top_k_max"])
    return _truncated_probs(logits[None], rows.on_device(logits.device), **cuts)[0]


def sample_rows(
    logits: torch.Tensor, ids: Sequence[int], pos: int, params: SamplingParams, drafts: Optional[Sequence[int]] = None,
) -> tuple[list[int], int]:
    """Sampled ids for a forward's rows, and how many drafts were accepted (one sequence; the head shard
    answers a whole batch with shardd.engine.head.answer.answer_batch, which calls `verify_rows` the same way).

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
