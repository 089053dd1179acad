#!/usr/bin/env python3
"""The GPU fast path, measured: one command on the GPU machine, one JSON out.

    python3 scripts/bench_gpu.py --json bench/results/h200/gpu_bench.json          # every part that fits
    python3 scripts/bench_gpu.py --part local --preset small --tokens 32           # one part, quick

Parts, each in its own process (so one part's memory never weighs on the next), each in a module beside this one
(what they share: bench_measure.py, bench_daemons.py):
- `local` (scripts/bench_local.py): one process, one GPU, the whole model as one FastShard (bf16, CUDA graphs): the
  copy bandwidth and the weight-read floor, greedy decode, each rollback mode with the `oracle` drafter at a
  mean commit near 7 of 16 after a 512-token prompt (A/B/A order), the step and rollback alone, prefill of
  a 1024-token prompt, a step at a 32k-token context, and the top kernels of one step (profile).
- `transformers` (scripts/bench_local.py): `transformers`' greedy decode on the same synthetic weights, in its own
  process.
- `e2e` (scripts/bench_relay.py): two `shardd serve` daemons (layers 0:L/2 and L/2:L; one GPU each, or both on the
  one GPU there is) and the same decoding over the pipeline, the split as shardctl ships it (rows shard to shard,
  both ends polling where the host allows: SHIPPED_*).
- `relay` (scripts/bench_relay.py): the same two daemons (as shipped, and `relay_plain`: rows through the
  coordinator, nobody polling), and where each request's time goes (`relay_by_phase`: the daemons'
  STATS phases and the coordinator's client phases, protocol/timing.py, per verify step); `relay-dflash` there
  too, and `delay` in scripts/bench_delay.py.
- `prefix` (scripts/bench_prefix.py): prefix caching over two daemons: a second turn's time to first token, many
  requests sharing a system prompt, a flood of distinct prompts under a small cache.
- `batch` (`batch-local`, `batch-daemons`; scripts/bench_batch.py): many streams through the scheduler,
  aggregate tok/s by concurrency, greedy and oracle, one process and two daemons, HTTP at 8 streams, and
  `batch_identical`.
- `dflash-batch` (scripts/bench_dflash.py, beside `dflash`: `dflash-drafter`, `dflash-placements`): two daemons
  with the drafter beside the last shard, --streams concurrent streams through the
  scheduler with the oracle and with DFlash (the real drafter proposing every step, the oracle's schedule
  committing), side by side (`dflash_batch_vs_oracle`); then `shardctl serve --drafter dflash`, fixed blocks and
  `--block-size auto`, against `--drafter none` at 1 and 8 HTTP streams (`dflash_batch_http`), and
  `dflash_batch_identical`.
- `groups` (scripts/bench_groups.py): two daemons sharing the card, greedy at --streams with and without micro-batches
  in flight (`--pipeline-groups 2`), `groups_vs_none` (no loss beyond 3%) and `groups_identical`.
- `batch-step` (scripts/bench_batch_step.py): one process, the batched step by R = 16 .. 256 rows: ms per step
  filled with 16-row blocks of 1 .. R/16 sequences and with R one-row greedy sequences (`step_rows_ms`), tokens/s
  if every row commits, and a row of a full step bit-identical to its sequence alone (`batch_step_identical`).

- `moe` (scripts/bench_moe.py): one process, one GPU, the `--moe-preset` MoE shape (35B-A3B) in bf16 (with
  `--fp8`: its linears, the experts among them, weight-only FP8, the floors counting FP8 bytes) as one FastShard:
  the greedy step against the floor of the bytes a decode step reads (its row's experts, the shared expert,
  attention/GDN, head), and a 16-row checkpointed verify step against the floor of the distinct experts its rows
  select (`moe_greedy_floor_ratio`, `moe_verify_floor_ratio`, `moe_distinct_experts`), and each step's heaviest
  kernels (`moe_greedy_kernels`, `moe_verify_kernels`: ms per step and launches).

- `guided` (scripts/bench_guided.py): one process, 8 streams under the scheduler constrained to a JSON schema
  against the same streams unconstrained: `guided_step_ms`, `plain_step_ms`, `guided_step_ratio` (the masks' cost
  per step).

Every output (greedy, each mode, one process and two daemons) is hashed: `outputs_identical` says
whether they are all the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_batch import batch_table, run_batch_daemons, run_batch_local, summarize_batch  # noqa: E402
from bench_batch_step import batch_step_table, run_batch_step  # noqa: E402
from bench_delay import run_relay_vs_delay  # noqa: E402
from bench_dflash import (dflash_batch_table, dflash_table, run_dflash, run_dflash_batch,  # noqa: E402
                          run_dflash_drafter)
from bench_groups import run_groups  # noqa: E402
from bench_guided import run_guided  # noqa: E402
from bench_local import run_local, run_transformers  # noqa: E402
from bench_moe import run_moe  # noqa: E402
from bench_prefix import run_prefix  # noqa: E402
from bench_relay import RELAY_ARMS, phase_table, run_dflash_relay, run_e2e, run_relay  # noqa: E402
from bench_relay import relay_step_intervals  # noqa: E402, F401 - tests/integration/test_timeline.py reads it here

PARTS = {"local": run_local, "transformers": run_transformers, "e2e": run_e2e, "relay": run_relay,
         "delay": run_relay_vs_delay, "relay-dflash": run_dflash_relay,
         "dflash-drafter": run_dflash_drafter, "dflash-placements": run_dflash,
         "dflash-batch": run_dflash_batch,
         "batch-local": run_batch_local, "batch-daemons": run_batch_daemons, "batch-step": run_batch_step,
         "prefix": run_prefix, "guided": run_guided, "moe": run_moe, "groups": run_groups}
BUNDLES = {"batch": ("batch-local", "batch-daemons"),  # --parts batch: the throughput sweep (scripts/bench_batch.py)
           "dflash": ("dflash-drafter", "dflash-placements")}  # the drafter in process, then beside the daemons


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=sorted(PARTS), help="Run one part in this process.")
    parser.add_argument("--parts", default="local,transformers,e2e",
                        help=f"Comma-separated, of {sorted(PARTS)} and the bundles "
                             + "; ".join(f"{name}: {', '.join(parts)}" for name, parts in BUNDLES.items()) + ".")
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--moe-preset", default="qwen3.5-35b-a3b", help="The moe part's MoE shape.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128, help="New tokens per decode.")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--long-context", type=int, default=32768)
    parser.add_argument("--e2e-devices", default="cuda:0,cuda:1", help="Devices of the two daemons.")
    parser.add_argument("--e2e-dtype", default="bfloat16")
    parser.add_argument("--e2e-engine", default="fast", help="The daemons' --engine (reference: a CPU check).")
    parser.add_argument("--busy-poll-ms", type=float, default=0.0,
                        help="relay: also the runs with daemons (--busy-poll-ms) and coordinator polling without "
                             "sleeping for this long (relay_busy_poll, side by side with the shipped runs).")
    parser.add_argument("--direct-rows", action="store_true",
                        help="relay: also the runs with the rows going from daemon to daemon (--relay-to; "
                             "relay_direct, and relay_direct_busy_poll with --busy-poll-ms).")
    parser.add_argument("--relay-arms", default="",
                        help="relay: the arms to run beside the shipped runs, by name (plain, busy, direct, "
                             "direct-busy); default: as --busy-poll-ms and --direct-rows say.")
    parser.add_argument("--daemon-profile", default=None, help="relay: also a short run with the daemons under cProfile, "
                        "dumps in this directory, their top functions in the JSON.")
    parser.add_argument("--arms-only", action="store_true", help="relay: only the arms (--relay-arms) and the "
                        "profiled runs, without the shipped runs (relay_ms_per_step then comes from each arm).")
    parser.add_argument("--pyspy", default=None, help="relay: also a run of the shipped arm with each daemon under "
                        "py-spy (stacks in this directory; `relay_pyspy`: their busiest frames); dflash-batch: every "
                        "daemon under py-spy (`dflash_batch_pyspy`).")
    parser.add_argument("--timeline", action="store_true", help="relay: also a run of the shipped arm with the "
                        "daemons' GPU timelines on (SHARDD_TIMELINE): `relay_timeline`, where a step's time goes.")
    parser.add_argument("--fp8", choices=("fp8-block", "fp8-channel"), default=None,
                        help="FP8 linears in this layout (the head and embedding bf16); the floor is their bytes.")
    parser.add_argument("--fp8-pdl", action="store_true",
                        help="With --fp8: the FP8 GEMM's fixed tile configs with programmatic dependent launch.")
    parser.add_argument("--batch-rows", type=int, default=None,
                        help="The batch parts' scheduler rows per step (default: the scheduler's, as shardctl serve).")
    parser.add_argument("--daemon-step-rows", type=int, default=None,
                        help="The batch parts' fixed step R (FastShard step_rows in process, shardd serve --step-rows; "
                             "default: shardd's).")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="The batch parts' prompt chunk (default: the scheduler's, half of --batch-rows); at most "
                             "the shards' per-sequence step (16) packs prompt chunks into the batched step.")
    parser.add_argument("--prefix-history", type=int, default=4000, help="The prefix part's second-turn prompt.")
    parser.add_argument("--prefix-system", type=int, default=2000, help="The prefix part's shared system prompt.")
    parser.add_argument("--prefix-streams", type=int, default=32, help="The prefix part's requests sharing it.")
    parser.add_argument("--prefix-repeats", type=int, default=3)
    parser.add_argument("--prefix-cache-gib", type=float, default=16, help="The prefix part's daemons' cache.")
    parser.add_argument("--prefix-flood-gib", type=float, default=1, help="The prefix part's flood daemons' cache.")
    parser.add_argument("--prefix-flood-prompts", type=int, default=32)
    parser.add_argument("--prefix-flood-length", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--draft", default="synthetic:5", help="The dflash part's drafter (shardd serve --draft).")
    parser.add_argument("--commits", default="3,5,7", help="The dflash part's mean commits per step.")
    parser.add_argument("--placements", default="own,first,last,last-propose",
                        help="Where the dflash part's drafter runs: its own daemon, beside the first or the last shard "
                             "(proposing in the verify reply; last-propose: with a PROPOSE every step).")
    parser.add_argument("--dflash-device", default="cuda:0", help="The one device of every dflash-part daemon.")
    parser.add_argument("--dflash-engine", default="fast", help="The dflash-part daemons' --engine (reference: a CPU smoke run).")
    parser.add_argument("--dflash-dtype", default="bfloat16")
    parser.add_argument("--streams", default="1,8,32", help="The dflash-batch part's concurrent streams.")
    parser.add_argument("--step-rows", default="16,32,64,128,256", help="The batch-step part's R values.")
    parser.add_argument("--batch-step-device", default="cuda:0", help="The batch-step part's device (cpu: a smoke "
                        "run under TRITON_INTERPRET=1).")
    parser.add_argument("--batch-step-budget-s", type=float, default=200,
                        help="The batch-step part starts no new R after this many seconds.")
    args = parser.parse_args()

    if args.part:
        result = PARTS[args.part](args)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n") if args.json else print(json.dumps(result, indent=2))
        return 0

    merged: dict = {"hashes": {}}
    for part in [name for part in args.parts.split(",") for name in BUNDLES.get(part, (part,))]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            path = handle.name
        command = [sys.executable, __file__, "--part", part, "--json", path, "--preset", args.preset,
                   "--moe-preset", args.moe_preset, "--seed", str(args.seed),
                   "--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens), "--repeats", str(args.repeats),
                   "--long-context", str(args.long_context), "--e2e-devices", args.e2e_devices, "--e2e-dtype", args.e2e_dtype,
                   "--e2e-engine", args.e2e_engine, *(["--daemon-profile", args.daemon_profile] if args.daemon_profile else []),
                   "--busy-poll-ms", str(args.busy_poll_ms), *(["--direct-rows"] if args.direct_rows else []),
                   *(["--relay-arms", args.relay_arms] if args.relay_arms else []), *(["--timeline"] if args.timeline else []),
                   *(["--arms-only"] if args.arms_only else []), *(["--pyspy", args.pyspy] if args.pyspy else []),
                   *(["--fp8", args.fp8] if args.fp8 else []), *(["--fp8-pdl"] if args.fp8_pdl else []),
                   "--draft", args.draft, "--commits", args.commits, "--placements", args.placements,
                   "--dflash-device", args.dflash_device, "--dflash-engine", args.dflash_engine,
                   "--dflash-dtype", args.dflash_dtype, "--streams", args.streams, *(["--batch-rows", str(args.batch_rows)] if args.batch_rows else []),
                   *(["--daemon-step-rows", str(args.daemon_step_rows)] if args.daemon_step_rows else []),
                   *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []),
                   "--step-rows", args.step_rows, "--batch-step-budget-s", str(args.batch_step_budget_s),
                   "--prefix-history", str(args.prefix_history), "--prefix-system", str(args.prefix_system),
                   "--prefix-streams", str(args.prefix_streams), "--prefix-repeats", str(args.prefix_repeats),
                   "--prefix-cache-gib", str(args.prefix_cache_gib), "--prefix-flood-gib", str(args.prefix_flood_gib),
                   "--prefix-flood-prompts", str(args.prefix_flood_prompts),
                   "--prefix-flood-length", str(args.prefix_flood_length),
                   "--batch-step-device", args.batch_step_device]
        print(f"== {part}", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if part == "transformers":  # the baseline as a plain install runs it: without flash-linear-attention
            env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if "fla" not in p)
        done = subprocess.run(command, cwd=ROOT, env=env)
        if done.returncode != 0:
            merged.setdefault("failed_parts", []).append(part)
        else:
            result = json.loads(Path(path).read_text())
            merged["hashes"].update(result.pop("hashes", {}))
            merged.update(result)
        summarize(merged)
        text = json.dumps(merged, indent=2) + "\n"
        if args.json:  # after every part, so a later part's failure loses nothing
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text)
    print(text)
    if "relay_by_phase" in merged:  # the per-phase table last, where a short tail of the output shows it
        for name, top in merged.get("daemon_profile_top", {}).items():
            print(f"== cProfile of {name} (tottime)\n" + "\n".join(top[:16]))
        print("== relay by phase (ms per step)\n" + phase_table(merged["relay_by_phase"]))
    for kind, intervals in merged.get("relay_timeline", {}).items():  # microseconds, medians of a step
        print(f"== relay timeline, {kind} (us, median of {intervals.get('steps')} steps): "
              + ", ".join(f"{name} {value}" for name, value in intervals.items() if name != "steps"))
    if "dflash_runs" in merged:
        print(dflash_table(merged))
    if "dflash_batch_runs" in merged:
        print("== dflash-batch: DFlash streams beside the oracle's, and through shardctl serve\n" + dflash_batch_table(merged))
    if "batch_checks" in merged:
        print("== batch: aggregate tok/s by concurrent streams\n" + batch_table(merged))
    if "batch_step_runs" in merged:
        print("== batch-step: one step of R rows\n" + batch_step_table(merged))
    identical = merged["outputs_identical"] or not merged["hashes"]  # a part that decodes nothing hashes nothing
    return 0 if identical and merged.get("batch_step_identical", True) and "failed_parts" not in merged else 1


def summarize(merged: dict) -> None:
    """The ratios the targets are stated in, from the parts run so far."""
    if "transformers_ms_per_token" in merged and "tok_s" in merged:
        best = max(merged["tok_s"].values())
        merged["transformers_tok_s"] = round(1e3 / merged["transformers_ms_per_token"], 2)
        merged["vs_transformers"] = round(best * merged["transformers_ms_per_token"] / 1e3, 2)
        merged["greedy_vs_transformers"] = round(merged["transformers_ms_per_token"] / merged["greedy_ms_per_token"], 2)
    if "e2e_step_ms" in merged and "tok_s" in merged:
        # relay: the two-daemon step's wall time beyond the one-process step's (same mode, same schedule)
        local_step = {m: 1e3 * merged["mean_commit"][m] / merged["tok_s"][m] for m in merged["e2e_step_ms"] if m in merged["tok_s"]}
        merged["relay_ms_per_step"] = {m: round(merged["e2e_step_ms"][m] - local_step[m], 3) for m in local_step}
        merged["relay_share_of_step"] = {m: round(merged["relay_ms_per_step"][m] / merged["e2e_step_ms"][m], 3) for m in local_step}
        merged["e2e_vs_local"] = {m: round(merged["e2e_tok_s"][m] / merged["tok_s"][m], 3) for m in merged["e2e_tok_s"] if m in merged["tok_s"]}
    if "e2e_step_ms" in merged and "local_step_ms" in merged:
        # the same measure on both sides: decode_seconds / steps of a local run and of a two-daemon run
        merged["relay_ms_per_step_measured"] = {m: round(merged["e2e_step_ms"][m] - merged["local_step_ms"][m], 3)
                                                for m in merged["e2e_step_ms"] if m in merged["local_step_ms"]}
    if "e2e_greedy_ms_per_token" in merged and "greedy_ms_per_token" in merged:  # target: <= 1.05
        merged["e2e_greedy_vs_local"] = round(merged["e2e_greedy_ms_per_token"] / merged["greedy_ms_per_token"], 3)
    for key, _ in RELAY_ARMS.values():  # the same ratios for each arm
        arm = merged.get(key)
        if not arm or "tok_s" not in merged:
            continue
        for m in ("checkpoint", "replay-ssm"):
            if f"e2e_step_ms_{m}" in arm and m in merged["tok_s"]:
                local_step = 1e3 * merged["mean_commit"][m] / merged["tok_s"][m]
                arm[f"relay_ms_per_step_{m}"] = round(arm[f"e2e_step_ms_{m}"] - local_step, 3)
                arm[f"e2e_vs_local_{m}"] = round(arm[f"e2e_tok_s_{m}"] / merged["tok_s"][m], 3)
        if "e2e_greedy_ms_per_token" in arm and "greedy_ms_per_token" in merged:
            arm["e2e_greedy_vs_local"] = round(arm["e2e_greedy_ms_per_token"] / merged["greedy_ms_per_token"], 3)
    summarize_batch(merged)
    # The batch parts hash no single output: their streams are checked by batch_identical.
    merged["outputs_identical"] = (len(set(merged["hashes"].values())) <= 1 and merged.get("batch_identical", True)
                                   and merged.get("dflash_batch_identical", True))


if __name__ == "__main__":
    sys.exit(main())
