"""Micro-batches in flight on the CPU: two reference daemons of a small preset (one torch thread each, the first
sending its rows to the second, --relay-to), the coordinator alongside, greedy streams through the scheduler with one
group (each step waits for the one before) and with one group per shard. Reports the aggregate tok/s of each, whether
every stream's tokens are identical, each daemon's busy fraction (STATS compute_seconds over the wall time; the second daemon's counts its FORWARDs'
wait for rows too), and a
step-time model for N stages and a one-way network delay d with the expected aggregate at 2, 4 and 8 GPUs.

    python scripts/bench_groups.py --out bench/results/cpu_groups.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.relay.pipeline import Pipeline  # noqa: E402
from coordinator.scheduler.requests import Request  # noqa: E402
from coordinator.scheduler.scheduler import Scheduler  # noqa: E402
from tests.support.daemons import Daemon, free_tcp_endpoint, stop_all  # noqa: E402

DELAYS_S = (0.0, 50e-6, 500e-6)  # one-way: the same host, a rack, across hosts


def busy_seconds(pipeline) -> list[float]:
    return [sum(stats["compute_seconds"].values()) for stats in pipeline.stats()]


def run(pipeline, prompts, tokens: int, groups: int) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/cpu_groups.json")
    args = parser.parse_args()

    from common.presets import preset_config

    layers = preset_config(args.preset).num_layers
    vocab = preset_config(args.preset).vocab_size
    prompts = [[(7 * i + 13 * j) % vocab for j in range(args.prompt_len)] for i in range(args.streams)]
    workdir = Path(tempfile.mkdtemp(prefix="bench-groups-"))
    binds = [free_tcp_endpoint(), free_tcp_endpoint()]
    split = [f"0:{layers // 2}", f"{layers // 2}:{layers}"]
    daemons = [Daemon(f"shard{k}", binds[k], ["--synthetic", args.preset, "--layers", split[k], "--threads", "1",
                                              "--max-sequences", str(args.streams + 1),
                                              *(["--relay-to", binds[1]] if k == 0 else [])], workdir)
               for k in range(2)]
    try:
        for daemon in daemons:
            daemon.wait_ready()
        with Pipeline.connect(binds) as pipeline:
            assert pipeline.direct_rows
            run(pipeline, prompts, 8, 1)  # warm
            runs = {1: [], 2: []}
            for _ in range(args.repeats):
                for groups in (1, 2):
                    runs[groups].append(run(pipeline, prompts, args.tokens, groups))
    finally:
        stop_all(daemons)
    best = {groups: max(results, key=lambda r: r["tok_s"]) for groups, results in runs.items()}
    identical = all(r["outputs"] == runs[1][0]["outputs"] for results in runs.values() for r in results)
    report = {
        "preset": args.preset, "streams": args.streams, "prompt_len": args.prompt_len, "new_tokens": args.tokens,
        "daemons": "2 x shardd serve --threads 1, --relay-to, cpu", "repeats": args.repeats,
        "without_groups": {k: v for k, v in best[1].items() if k != "outputs"},
        "with_groups": {k: v for k, v in best[2].items() if k != "outputs"},
        "all_tok_s": {str(groups): [r["tok_s"] for r in results] for groups, results in runs.items()},
        "speedup": best[2]["tok_s"] / best[1]["tok_s"],
        "outputs_identical": identical,
        "model": model(best[1], best[2], args.streams, 2),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("speedup", "outputs_identical")} |
                     {"without_tok_s": best[1]["tok_s"], "with_tok_s": best[2]["tok_s"],
                      "busy_without": best[1]["busy_fraction"], "busy_with": best[2]["busy_fraction"]}))
    if not identical:
        sys.exit(3)


if __name__ == "__main__":
    main()
