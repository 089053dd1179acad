"""Micro-batches in flight (`--pipeline-groups`): greedy streams through the scheduler over two chained daemons (the
first sending its rows to the second, as `shardctl launch` starts them) with one group (each step waits for the one
before) and with one group per shard, alternating, `--repeats` runs of each; the figures are each arm's median run.

- On the CPU (`python scripts/bench_groups.py --out bench/results/cpu_groups.json`): two reference daemons of a small
  preset, one torch thread each, the coordinator alongside. Reports the aggregate tok/s of each arm, whether every
  stream's tokens are identical, each daemon's busy fraction (STATS compute_seconds over the wall time; the second
  daemon's counts its FORWARDs' wait for rows too), and a step-time model for N stages and a one-way network delay d
  with the expected aggregate at 2, 4 and 8 GPUs.
- On one GPU (`scripts/bench_gpu.py --parts groups`, `scripts/gpu_run.sh groups`): two fast daemons of the 27B
  shape sharing the card, so groups cannot gain; at each of --streams, groups over no groups (`groups_vs_none`: no
  loss beyond 3% is the target) and `groups_identical`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_daemons import serve_processes, stop_processes  # noqa: E402

DELAYS_S = (0.0, 50e-6, 500e-6)  # one-way: the same host, a rack, across hosts
ARMS = (1, 2)  # groups: none (one step in flight), one per shard


def busy_seconds(pipeline) -> list[float]:
    return [sum(stats["compute_seconds"].values()) for stats in pipeline.stats()]


def run(pipeline, prompts, tokens: int, groups: int) -> dict:
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import Scheduler

    requests = [Request(prompt, tokens) for prompt in prompts]
    scheduler = Scheduler(pipeline, max_sequences=len(prompts), pipeline_groups=groups)
    before = busy_seconds(pipeline)
    started = time.perf_counter()
    scheduler.run_all(requests)
    wall = time.perf_counter() - started
    busy = [after - earlier for after, earlier in zip(busy_seconds(pipeline), before)]
    outputs = [request.outcome().tokens for request in requests]
    steps = scheduler.steps
    return {"groups": groups, "tok_s": sum(map(len, outputs)) / wall, "wall_seconds": wall, "steps": steps,
            "busy_fraction": [b / wall for b in busy], "stage_ms_per_step": [1000 * b / steps for b in busy],
            "outputs": outputs}


def median_run(results: list[dict]) -> dict:
    """The run whose tok/s is the median (the lower middle of an even count)."""
    ranked = sorted(results, key=lambda r: r["tok_s"])
    return ranked[(len(ranked) - 1) // 2]


def compare(pipeline, prompts, tokens: int, repeats: int) -> dict:
    """Both arms alternating, `repeats` runs each, after a short warm run of each: the median runs, every run's
    tok/s, groups over none (median run over median run) and whether every run's tokens are the first run's."""
    for groups in ARMS:  # warm: both arms' step shapes
        run(pipeline, prompts, min(tokens, 8), groups)
    runs: dict[int, list[dict]] = {groups: [] for groups in ARMS}
    for _ in range(repeats):
        for groups in ARMS:
            runs[groups].append(run(pipeline, prompts, tokens, groups))
    median = {groups: median_run(results) for groups, results in runs.items()}
    first = runs[ARMS[0]][0]["outputs"]
    return {"without_groups": {k: v for k, v in median[1].items() if k != "outputs"},
            "with_groups": {k: v for k, v in median[2].items() if k != "outputs"},
            "all_tok_s": {str(groups): [round(r["tok_s"], 2) for r in results] for groups, results in runs.items()},
            "speedup": median[2]["tok_s"] / median[1]["tok_s"],
            "outputs_identical": all(r["outputs"] == first for results in runs.values() for r in results)}


def model(without: dict, grouped: dict, streams: int, stages: int) -> dict:
    """Stage time of a step of b rows t(b) = a + beta * b (fitted from the two runs: all streams in one step, and
    streams/stages per step); the coordinator's and the hops' time per step o from the run without groups. For N
    stages splitting the same model evenly and a one-way delay d, each step crosses N + 1 hops:
    without groups  step = N * t_N(B) + (N + 1) d + o,          aggregate = B / step
    with N groups   cycle = max(N * t_N(B/N) + (N + 1) d + o, N * t_N(B/N)),  aggregate = B / cycle
    where t_N = t * measured_stages / N."""
    per_group = streams / grouped["groups"]
    # the first daemon's busy time (a later one's FORWARD counts its wait for rows too)
    t_full = without["stage_ms_per_step"][0] / 1000
    t_part = grouped["stage_ms_per_step"][0] / 1000
    beta = (t_full - t_part) / (streams - per_group)
    a = max(t_full - beta * streams, 0.0)
    o = max(without["wall_seconds"] / without["steps"] - stages * t_full, 0.0)

    def t(n: int, rows: float) -> float:
        return (a + beta * rows) * stages / n

    expected = {}
    for n in (2, 4, 8):
        for d in DELAYS_S:
            plain = n * t(n, streams) + (n + 1) * d + o
            cycle = max(n * t(n, streams / n) + (n + 1) * d + o, n * t(n, streams / n))
            expected[f"{n}_stages_d{d * 1e6:g}us"] = {"without_groups_tok_s": streams / plain,
                                                       "with_groups_tok_s": streams / cycle,
                                                       "gain": plain / cycle}
    return {"stage_seconds": {"a": a, "beta_per_row": beta}, "coordinator_seconds_per_step": o,
            "formula": model.__doc__.split("\n", 1)[1].strip(), "expected_aggregate": expected}


def two_daemons(args, max_sequences: int, extra: list[str] = ()) -> tuple[list, list[str]]:
    """The preset's two halves as chained `shardd serve` daemons on `args.dflash_device` (bench_daemons'
    serve_processes): the processes and the endpoints in layer order."""
    from common.presets import preset_config

    layers = preset_config(args.preset).num_layers
    specs = {"first": ["--layers", f"0:{layers // 2}", *extra], "last": ["--layers", f"{layers // 2}:{layers}", *extra]}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-groups-"))
    processes, endpoints = serve_processes(args, specs, run_dir, max_sequences=max_sequences, chained=True)
    return processes, [endpoints["first"], endpoints["last"]]


def run_groups(args) -> dict:
    """The GPU part: at each of --streams, that many greedy streams (bench_batch's seeded --prompt-len prompts,
    --tokens new tokens) with and without groups over two fast daemons sharing `--dflash-device`."""
    from bench_batch import stream_prompts
    from coordinator.relay.pipeline import Pipeline

    streams = [int(count) for count in args.streams.split(",")]
    repeats = max(1, min(args.repeats, 3))
    prompts = stream_prompts(args, max(streams))
    processes, endpoints = two_daemons(args, max(streams) + 1)
    out: dict = {"groups_preset": args.preset, "groups_streams": streams, "groups_repeats": repeats,
                 "groups_prompt_len": args.prompt_len, "groups_new_tokens": args.tokens, "groups_runs": {}}
    try:
        with Pipeline.connect(endpoints, timeout_s=600) as pipeline:
            out["groups_direct_rows"] = pipeline.direct_rows
            for count in streams:
                result = compare(pipeline, prompts[:count], args.tokens, repeats)
                out["groups_runs"][str(count)] = result
                print(f"groups x{count}: {result['all_tok_s']} tok/s, groups over none "
                      f"{result['speedup']:.3f}", flush=True)
    finally:
        stop_processes(processes)
    out["groups_vs_none"] = {count: round(r["speedup"], 3) for count, r in out["groups_runs"].items()}
    out["groups_identical"] = all(r["outputs_identical"] for r in out["groups_runs"].values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/cpu_groups.json")
    args = parser.parse_args()
    # the daemons as serve_processes starts them: reference engine, float32, on the CPU
    args.dflash_device, args.dflash_dtype, args.dflash_engine = "cpu", "float32", "reference"

    from common.presets import preset_config
    from coordinator.relay.pipeline import Pipeline

    vocab = preset_config(args.preset).vocab_size
    prompts = [[(7 * i + 13 * j) % vocab for j in range(args.prompt_len)] for i in range(args.streams)]
    processes, endpoints = two_daemons(args, args.streams + 1, ["--threads", "1"])
    try:
        with Pipeline.connect(endpoints) as pipeline:
            assert pipeline.direct_rows
            result = compare(pipeline, prompts, args.tokens, args.repeats)
    finally:
        stop_processes(processes)
    report = {"preset": args.preset, "streams": args.streams, "prompt_len": args.prompt_len,
              "new_tokens": args.tokens, "daemons": "2 x shardd serve --threads 1, chained (--relay-to), cpu",
              "repeats": args.repeats, **result,
              "model": model(result["without_groups"], result["with_groups"], args.streams, 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    without, grouped = result["without_groups"], result["with_groups"]
    print(json.dumps({k: report[k] for k in ("speedup", "outputs_identical")} |
                     {"without_tok_s": without["tok_s"], "with_tok_s": grouped["tok_s"],
                      "busy_without": without["busy_fraction"], "busy_with": grouped["busy_fraction"]}))
    if not result["outputs_identical"]:
        sys.exit(3)


if __name__ == "__main__":
    main()
