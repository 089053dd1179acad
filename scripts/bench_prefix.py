"""The `prefix` part of scripts/bench_gpu.py: prefix caching over two `shardd serve` daemons (layers 0:L/2, L/2:L; both
on cuda:0 when there is one GPU), through the scheduler as `shardctl serve` runs it.

- `prefix_turn`: a chat's second turn. Turn one is a --prefix-history-token prompt (seeded) and 32 new tokens; turn two
  is that prompt, its answer and 64 more tokens. Time to first token of turn two, cold (prefix caching off, the same
  prompt chunk) and resuming from the entries turn one left; the cold run also with the scheduler's chunk when
  caching is off (`ttft_cold_long_chunk_ms`): what the finer chunk costs a prefill.
- `prefix_shared`: --prefix-streams requests sharing a --prefix-system-token system prompt, each with its own 64-token
  question, arriving together: the prompt tokens of all of them over the time until the last one's first token, cold
  and with the system prompt cached (one request before them, untimed, left its entries).
- `prefix_flood`: distinct prompts through daemons with a small cache (--prefix-flood-gib): the hit rate of a
  repeated subset, evictions, and each daemon's bytes against its budget and its device memory against its plan.

Every output is compared with the cold run's: `prefix_outputs_identical`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench_daemons import e2e_devices, halves_and_prompt, start_daemons, stop_processes

TURN_ONE_NEW = 32
TURN_TWO_EXTRA = 64
QUESTION = 64


def _prompts(args, vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import torch

    return [torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed + i)).tolist()
            for i in range(count)]


def _scheduler(pipeline, caching: bool, chunk):
    from coordinator.scheduler.scheduler import Scheduler

    return Scheduler(pipeline, max_sequences=pipeline.max_batch_items, prefill_chunk=chunk, prefix_caching=caching)


def _run(scheduler, prompts, new_tokens: int):
    """The prompts together: their results, and the seconds from submitting them to the last one's first token."""
    from coordinator.scheduler.requests import Request

    firsts: list[list[float]] = []

    requests = []
    for prompt in prompts:
        stamp: list[float] = []
        requests.append(Request(prompt, new_tokens, on_commit=lambda ids, stamp=stamp: stamp or stamp.append(
            time.perf_counter())))
        firsts.append(stamp)
    started = time.perf_counter()
    done = scheduler.run_all(requests)
    results = [r.outcome() for r in done]
    return results, max(stamp[0] for stamp in firsts) - started


def turn_two(pipeline, args, vocab: int, checks: dict) -> dict:
    from coordinator.scheduler.scheduler import PREFIX_CHUNK

    [history] = _prompts(args, vocab, 1, args.prefix_history, args.seed + 1000)
    out: dict = {"history_tokens": args.prefix_history}
    samples: dict[str, list[float]] = {"cold": [], "hit": [], "cold_long_chunk": []}
    tokens = {}
    for repeat in range(args.prefix_repeats):
        first = history[:len(history) - TURN_TWO_EXTRA - TURN_ONE_NEW] + [repeat]  # each repeat a new conversation
        warm = _scheduler(pipeline, True, None)
        [answer], _ = _run(warm, [first], TURN_ONE_NEW)
        second = first + answer.tokens + history[-TURN_TWO_EXTRA:]
        [hit], hit_s = _run(warm, [second], 1)
        [cold], cold_s = _run(_scheduler(pipeline, False, PREFIX_CHUNK), [second], 1)
        [long_chunk], long_s = _run(_scheduler(pipeline, False, None), [second], 1)
        samples["hit"].append(hit_s * 1e3)
        samples["cold"].append(cold_s * 1e3)
        samples["cold_long_chunk"].append(long_s * 1e3)
        out["cached_tokens"] = hit.cached_tokens
        out["prompt_tokens"] = len(second)
        tokens[repeat] = (hit.tokens, cold.tokens)
    checks["turn_two_identical"] = all(a == b for a, b in tokens.values())
    for name, values in samples.items():
        out[f"ttft_{name}_ms"] = round(statistics.median(values), 2)
    out["ttft_ratio"] = round(out["ttft_hit_ms"] / out["ttft_cold_ms"], 4)
    out["long_chunk_vs_chunk"] = round(out["ttft_cold_long_chunk_ms"] / out["ttft_cold_ms"], 4)
    return out


def shared_system(pipeline, args, vocab: int, checks: dict) -> dict:
    from coordinator.scheduler.scheduler import PREFIX_CHUNK

    n = args.prefix_streams
    out: dict = {"streams": n, "system_tokens": args.prefix_system}
    ratios, cold_rates, hit_rates = [], [], []
    for repeat in range(args.prefix_repeats):
        [system] = _prompts(args, vocab, 1, args.prefix_system, args.seed + 2000 + repeat)
        questions = _prompts(args, vocab, n + 1, QUESTION, args.seed + 3000 + 100 * repeat)
        prompts = [system + q for q in questions[:n]]
        total = sum(map(len, prompts))
        cold_results, cold_s = _run(_scheduler(pipeline, False, PREFIX_CHUNK), prompts, 1)
        warm = _scheduler(pipeline, True, None)
        _run(warm, [system + questions[n]], 1)  # leaves the system prompt's entries
        hit_results, hit_s = _run(warm, prompts, 1)
        checks.setdefault("shared_identical", True)
        checks["shared_identical"] &= [r.tokens for r in cold_results] == [r.tokens for r in hit_results]
        cold_rates.append(total / cold_s)
        hit_rates.append(total / hit_s)
        ratios.append(cold_s / hit_s)
        out["cached_tokens_per_request"] = statistics.median(r.cached_tokens for r in hit_results)
    out["prompt_tok_s_cold"] = round(statistics.median(cold_rates), 1)
    out["prompt_tok_s_hit"] = round(statistics.median(hit_rates), 1)
    out["ratio"] = round(statistics.median(ratios), 3)
    return out


def flood(args, ranges, run_dir: Path, vocab: int, checks: dict) -> dict:
    from coordinator.relay.pipeline import Pipeline

    extra = ["--prefix-cache-gib", str(args.prefix_flood_gib)]
    processes, endpoints = start_daemons(args, ranges, "replay-ssm", run_dir, devices=e2e_devices(args),
                                         max_sequences=9, extra=extra, direct_rows=True, tag="-flood")
    try:
        with Pipeline.connect(endpoints, timeout_s=600) as pipeline:
            prompts = _prompts(args, vocab, args.prefix_flood_prompts, args.prefix_flood_length, args.seed + 4000)
            scheduler = _scheduler(pipeline, True, None)
            repeated = prompts[:4]
            hits = total = 0
            for start in range(0, len(prompts), 8):
                results, _ = _run(scheduler, prompts[start:start + 8] + repeated, 1)
                hits += sum(1 for r in results[-len(repeated):] if r.cached_tokens)
                total += len(repeated)
            shards = []
            for client, stats in zip(pipeline.clients, pipeline.stats()):
                hello = client.hello()
                cache = stats["prefix_cache"]
                shards.append({"budget_bytes": cache["budget_bytes"], "bytes": cache["bytes"],
                               "evictions": cache["evictions"], "entries": cache["entries"],
                               "process_bytes": hello["device_memory"]["process_bytes"],
                               "plan_bytes": hello["memory"]["total_bytes"]})
            checks["flood_within_budget"] = all(s["bytes"] <= s["budget_bytes"] for s in shards)
            checks["flood_within_plan"] = all(s["process_bytes"] <= s["plan_bytes"] for s in shards)
            return {"prompts": len(prompts), "prompt_tokens": args.prefix_flood_length,
                    "repeated_hit_rate": round(hits / total, 3), "shards": shards}
    finally:
        stop_processes(processes)


def run_prefix(args) -> dict:
    from common.presets import preset_config
    from coordinator.relay.pipeline import Pipeline

    ranges, _ = halves_and_prompt(args)
    vocab = preset_config(args.preset).vocab_size
    run_dir = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    checks: dict = {}
    out: dict = {"prefix_devices": e2e_devices(args)}
    context = max(args.prefix_history, args.prefix_system + QUESTION) + 64
    extra = ["--prefix-cache-gib", str(args.prefix_cache_gib), "--max-context", str(context)]
    processes, endpoints = start_daemons(args, ranges, "replay-ssm", run_dir, devices=e2e_devices(args),
                                         max_sequences=args.prefix_streams + 2, extra=extra, direct_rows=True)
    try:
        with Pipeline.connect(endpoints, timeout_s=600) as pipeline:
            out["prefix_turn"] = turn_two(pipeline, args, vocab, checks)
            out["prefix_shared"] = shared_system(pipeline, args, vocab, checks)
            out["prefix_cache_stats"] = [stats["prefix_cache"] for stats in pipeline.stats()]
    finally:
        stop_processes(processes)
    try:
        out["prefix_flood"] = flood(args, ranges, run_dir, vocab, checks)
    except Exception as error:  # noqa: BLE001 - the figures above stand
        out["prefix_flood"] = {"error": f"{type(error).__name__}: {error}"}
    out["prefix_checks"] = checks
    out["prefix_outputs_identical"] = all(v for k, v in checks.items() if k.endswith("identical"))
    print(f"prefix: TTFT turn two {out['prefix_turn']['ttft_hit_ms']} ms hit vs {out['prefix_turn']['ttft_cold_ms']} "
          f"ms cold ({out['prefix_turn']['ttft_ratio']}); shared prompt {out['prefix_shared']['ratio']}x; "
          f"checks {checks}", flush=True)
    return out
