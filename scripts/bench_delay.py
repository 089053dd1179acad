"""The `delay` part of scripts/bench_gpu.py (`--parts delay`): two hosts, simulated by a delaying relay
(scripts/delay_proxy.py) in front of each daemon: a step's time against the one-way delay."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_daemons import ROOT, e2e_devices, free_port, halves_and_prompt, start_daemons, stop_processes
from bench_measure import BLOCK, MEAN_COMMIT, token_hash

DELAYS_MS = (0.0, 0.1, 0.5, 2.0)
DELAY_BLOCKS = (4, 8, 16)
DELAY_REPEATS = 3


def start_proxy(target_port: int, delay_ms: float) -> tuple[subprocess.Popen, int]:
    """scripts/delay_proxy.py in front of a daemon's port: (process, the port to connect to)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "delay_proxy.py"), "--listen", f"127.0.0.1:{port}",
                                "--to", f"127.0.0.1:{target_port}", "--delay-ms", str(delay_ms)],
                               stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise RuntimeError("the delay proxy did not start")
    return process, port


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def run_relay_vs_delay(args) -> dict:
    """The two daemons on tcp loopback, each behind a relay that adds a one-way delay to everything it carries
    (0, 0.1, 0.5, 2 ms: a second host on a fast, an ordinary and a slow link); greedy and checkpoint speculative
    decoding at block sizes 4, 8, 16 (oracle drafter at the same commit fraction). The step time's slope against
    the one-way delay, halved, is the number of round trips a step waits for."""
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import OracleDrafter
    from coordinator.relay.pipeline import Pipeline
    from common.presets import preset_config

    ranges, prompt = halves_and_prompt(args)
    ports = [free_port(), free_port()]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-delay-"))
    processes, endpoints = start_daemons(args, ranges, "checkpoint", run_dir, devices=e2e_devices(args), tag="-tcp",
                                         tcp_ports=ports)
    greedy_ms, step_ms, tok_s, hashes = [], {b: [] for b in DELAY_BLOCKS}, {b: [] for b in DELAY_BLOCKS}, {}
    try:
        with Pipeline.connect(endpoints, timeout_s=600) as pipeline:
            greedy_decode(pipeline, 98, prompt[:32], 4)  # warm-up: capture the graphs
            reference = greedy_decode(pipeline, 1, prompt, args.tokens).tokens
        for delay in DELAYS_MS:
            proxies = [start_proxy(port, delay) for port in ports]
            try:
                with Pipeline.connect([f"tcp://127.0.0.1:{port}" for _, port in proxies], timeout_s=600) as pipeline:
                    greedy_decode(pipeline, 97, prompt[:8], 2)  # the connections' first requests
                    # the least disturbed of `repeats` runs (a shared host adds noise, never removes time)
                    runs = [greedy_decode(pipeline, 1, prompt, args.tokens) for _ in range(DELAY_REPEATS)]
                    greedy = min(runs, key=lambda r: r.decode_seconds / r.steps)
                    greedy_ms.append(round(greedy.decode_seconds / greedy.steps * 1e3, 3))
                    hashes[f"delay{delay}/greedy"] = token_hash(greedy.tokens)
                    for block in DELAY_BLOCKS:
                        drafter = OracleDrafter.with_mean_commit(reference, len(prompt), block_size=block,
                                                                 mean_commit=block * MEAN_COMMIT / BLOCK)
                        runs = [speculative_decode(pipeline, 2, prompt, drafter, block_size=block,
                                                   rollback="checkpoint", max_new_tokens=args.tokens)
                                for _ in range(DELAY_REPEATS)]
                        result = min(runs, key=lambda r: r.decode_seconds / r.steps)
                        step_ms[block].append(round(result.decode_seconds / result.steps * 1e3, 3))
                        tok_s[block].append(round(len(result.tokens) / result.decode_seconds, 2))
                        hashes[f"delay{delay}/block{block}"] = token_hash(result.tokens)
                print(f"delay {delay} ms: greedy {greedy_ms[-1]} ms/token, tok/s by block "
                      f"{ {b: tok_s[b][-1] for b in DELAY_BLOCKS} }", flush=True)
            finally:
                for process, _ in proxies:
                    process.kill()
                    process.wait()
    finally:
        stop_processes(processes)
    delays = list(DELAYS_MS)
    return {"relay_vs_delay": {
        "delays_ms_one_way": delays,
        "blocks": list(DELAY_BLOCKS),
        "greedy_ms_per_token": greedy_ms,
        "step_ms": {str(b): v for b, v in step_ms.items()},
        "tok_s": {str(b): v for b, v in tok_s.items()},
        # d(step)/d(one-way delay) / 2: round trips a step waits for (two shards: 2 when nothing else waits)
        "round_trips_per_step": {"greedy": round(slope(delays, greedy_ms) / 2, 2),
                                 **{str(b): round(slope(delays, v) / 2, 2) for b, v in step_ms.items()}},
        "hidden_bytes_per_row": preset_config(args.preset).hidden_size * (2 if args.e2e_dtype == "bfloat16" else 4),
    }, "hashes": hashes}
