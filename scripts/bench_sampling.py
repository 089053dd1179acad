#!/usr/bin/env python3
"""Micro-benchmark of the head shard's sampling: ms per call to answer a speculative verify of R rows (R / block
sequences of `block` rows, each its own seed, temperature 0.7, top-p 0.9), a per-row sampler (one sequence at a
time, a host round trip per row) against `shardd.engine.head.answer.answer_batch` (every row at once, one copy back), on the GPU
when there is one.

Also checks, on the same device, that each sequence's answer in the batch equals its answer alone
(`batch_identical`), the share of sequences answered as on the CPU (`answers_equal_cpu`, up to 16 rows), the host
syncs per call and the torch ops per call that produce a tensor on the device (`device_ops_per_call`, about the
kernel launches; the seeded uniforms are computed on the host), on CUDA the chunks op by op against their CUDA
graphs (`batched_ms_op_by_op`, `graphs_equal_op_by_op`); with --chunk-rows several values, the batched sampler is
timed at each (rows per fixed-shape sort/softmax call).

    python3 scripts/bench_sampling.py --json $OUT/sampling.json         # about a minute at most
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from shardd.engine.head import sampling  # noqa: E402
from shardd.engine.head.answer import HeadRequest, answer_batch, answer_rows  # noqa: E402
from shardd.engine.head.sampling import SamplingParams  # noqa: E402


# ---- a per-row sampler (one sequence at a time), the batched one's baseline ---------------------------------

def legacy_target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def legacy_draw(probs: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(probs.double(), dim=-1)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device),
                                   right=True)[0])
    index = min(index, probs.shape[-1] - 1)
    while probs[index] <= 0 and index > 0:
        index -= 1
    return index


def legacy_sample_rows(logits, ids, pos, params, drafts):
    drafts = list(drafts or ())
    n = logits.shape[0]
    out = [int(i) for i in ids]
    first = n - 1 - len(drafts)
    accepted = 0
    for j in range(len(drafts) + 1):
        row = first + j
        rng = random.Random(f"{params.seed}:{pos + row}")
        probs = legacy_target_probs(logits[row], params)
        if j == len(drafts):
            out[row] = legacy_draw(probs, rng.random())
            break
        draft = drafts[j]
        if rng.random() < float(probs[draft]):
            out[row] = draft
            accepted += 1
            continue
        rest = probs.clone()
        rest[draft] = 0.0
        out[row] = legacy_draw(rest, rng.random()) if float(rest.sum()) > 0 else int(torch.argmax(probs))
        break
    return out, accepted


# ---- the benchmark --------------------------------------------------------------------------------------------

def verify_batch(rows: int, block: int, vocab: int, device: str, generator: torch.Generator) -> list:
    """R / block verifies of `block` rows: logits as a head shard's step leaves them (float32, one buffer),
    drafts that agree with the argmax of the row before (so some are accepted, some rejected)."""
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(device)
    ids = logits.argmax(-1).tolist()
    items = []
    for s in range(rows // block):
        part = slice(s * block, (s + 1) * block)
        drafts = ids[part][:-1]
        items.append((logits[part], ids[part], 100 + 37 * s,
                      HeadRequest(SamplingParams(0.7, top_p=0.9, seed=1000 + s), drafts=drafts)))
    return items


def timed(function, device: str, deadline: float, min_seconds: float = 0.3, max_calls: int = 200) -> float:
    """ms per call (after two warm-up calls), until min_seconds or max_calls."""
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(2):
        function()
    sync()
    calls, start = 0, time.perf_counter()
    while calls < max_calls and time.perf_counter() < deadline and (time.perf_counter() - start < min_seconds
                                                                     or calls < 3):
        function()
        calls += 1
    sync()
    return (time.perf_counter() - start) / max(calls, 1) * 1e3


def syncs_per_call(function, device: str) -> int:
    """Host-device synchronisations one call makes, as CUDA's sync debug mode counts them (1: the copy back)."""
    if not device.startswith("cuda"):
        return -1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            function()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def device_ops(function, device: str) -> int:
    """The torch ops of one call whose result lives on `device` (views included: they cost dispatch time too)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    target = torch.device(device)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.device.type == target.type:
                Count.ops += 1
            return out

    with Count():
        function()
    return Count.ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=248320, help="Qwen3.5's vocabulary")
    parser.add_argument("--rows", default="8,16,64,128", help="rows per verify step, comma-separated")
    parser.add_argument("--block", type=int, default=8, help="rows per sequence")
    parser.add_argument("--chunk-rows", default=f"{sampling.CHUNK_ROWS}",
                        help="rows per fixed-shape call, comma-separated; the first gives batched_ms")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for the whole run")
    args = parser.parse_args()
    deadline = time.perf_counter() + args.time_limit - 2
    generator = torch.Generator().manual_seed(0)
    chunk_rows = [int(c) for c in args.chunk_rows.split(",")]
    default_chunk = sampling.CHUNK_ROWS
    results = {"device": args.device, "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda")
               else "cpu", "torch": torch.__version__, "vocab": args.vocab, "block": args.block,
               "sampling": "temperature 0.7, top_p 0.9, drafts = argmax of the row before", "rows": {}}

    identical = True
    for rows in [int(r) for r in args.rows.split(",")]:
        if time.perf_counter() > deadline:
            results["stopped_early"] = f"time limit before {rows} rows"
            break
        items = verify_batch(rows, args.block, args.vocab, args.device, generator)
        entry = {"sequences": len(items)}
        together = answer_batch(items)
        alone = [answer_rows(*item) for item in items]
        entry["batch_identical"] = together == alone
        identical &= entry["batch_identical"]
        entry["accepted_mean"] = sum(answer[1] for answer in together) / len(together)
        entry["syncs_per_call"] = syncs_per_call(lambda: answer_batch(items), args.device)
        entry["device_ops_per_call"] = device_ops(lambda: answer_batch(items), args.device)
        if args.device != "cpu" and rows <= 16:  # the same answers from the CPU (float rounding may differ)
            on_cpu = answer_batch([(logits.cpu(), ids, pos, head) for logits, ids, pos, head in items])
            entry["answers_equal_cpu"] = sum(a[:2] == b[:2] for a, b in zip(on_cpu, together)) / len(items)
        entry["old_per_row_ms"] = timed(lambda: [legacy_sample_rows(l, i, p, h.sampling, h.drafts)
                                                 for l, i, p, h in items], args.device, deadline)
        for chunk in chunk_rows:
            sampling.CHUNK_ROWS = chunk
            entry[f"batched_ms_chunk{chunk}"] = timed(lambda: answer_batch(items), args.device, deadline)
        sampling.CHUNK_ROWS = default_chunk
        entry["batched_ms"] = entry[f"batched_ms_chunk{chunk_rows[0]}"]
        if args.device.startswith("cuda"):  # the chunks op by op instead of as CUDA graphs, and their answers
            sampling.GRAPHS = False
            entry["batched_ms_op_by_op"] = timed(lambda: answer_batch(items), args.device, deadline)
            entry["graphs_equal_op_by_op"] = answer_batch(items) == together
            identical &= entry["graphs_equal_op_by_op"]
            sampling.GRAPHS = True
        entry["speedup"] = entry["old_per_row_ms"] / entry["batched_ms"]
        results["rows"][rows] = entry
        print(f"{rows} rows: {entry}", file=sys.stderr, flush=True)
    results["batch_identical"] = identical
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"device {results['device_name']}, vocab {args.vocab}, {args.block} rows per sequence, top-p 0.9; "
          f"batch identical: {identical}")
    print(f"{'rows':>5} {'old per-row ms':>15} " + " ".join(f"{'chunk ' + str(c) + ' ms':>12}" for c in chunk_rows)
          + f" {'speedup':>8}")
    for rows, entry in results["rows"].items():
        print(f"{rows:>5} {entry['old_per_row_ms']:>15.3f} "
              + " ".join(f"{entry[f'batched_ms_chunk{c}']:>12.3f}" for c in chunk_rows) + f" {entry['speedup']:>8.1f}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
