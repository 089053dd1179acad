"""`shardctl bench`: A/B/A comparison of two rollback modes, each run a fresh `shardctl generate --json`
in a child process (see `coordinator.benchstats` for the method)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Sequence

import click

from coordinator import benchstats
from coordinator.cli.generate import ORACLE_NOTE
from coordinator.cli.options import (
    EXIT_DIFFER,
    check_mean_commit,
    busy_poll_option,
    curve_args,
    daemon_args_from,
    load_curve,
    parse_list,
    quantize_option,
    shard_source_options,
)
from coordinator.cli.output import emit_json, fmt, fmt_percent, format_table, progress
from coordinator.cli.plan import connect_pipeline, make_plan, mode_daemon_args
from coordinator.launch import child_env
from coordinator.relay.shards import PipelineError
from protocol.layout import CHECKPOINT, REPLAY, ROLLBACK_MODES


class BenchError(RuntimeError):
    """A benchmark run failed."""


def shardctl_command() -> list[str]:
    """How to run this CLI in a fresh process (installed or not)."""
    return [sys.executable, "-c", "from coordinator.cli import main; main()"]


def run_generate_subprocess(args: Sequence[str]) -> dict:
    command = [*shardctl_command(), "generate", *args, "--json"]
    completed = subprocess.run(command, capture_output=True, text=True, env=child_env())
    if completed.returncode != 0:
        tail = "\n".join(completed.stderr.strip().splitlines()[-10:])
        raise BenchError(f"`shardctl generate` exited with code {completed.returncode}:\n{tail}")
    return json.loads(completed.stdout)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@shard_source_options
@quantize_option
@click.option("--ab", "ab_spec", default=f"{REPLAY},{CHECKPOINT}", show_default=True, metavar="A,B",
              help="The two rollback modes to compare, run in blocks A1, B, A2.")
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True,
              help="Measured runs per block (plus one discarded warm-up).")
@click.option("--drafter", type=click.Choice(("ngram", "oracle")), default="oracle", show_default=True)
@click.option("--block-size", type=click.IntRange(2), default=16, show_default=True)
@click.option("--mean-commit", type=float, default=6.0, show_default=True, help="oracle: tokens committed per step.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=1, show_default=True,
              help="Streams per run, batched by the scheduler: the table adds their aggregate tok/s.")
@busy_poll_option("auto")
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-ids", help="Prompt token ids (default: a fixed 32-token prompt).")
@click.option("--json", "json_file", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              type=click.Path(dir_okay=False, allow_dash=True),
              help="Print the full record as JSON instead of the table (--json FILE: write it there, table on stdout).")
def bench(shards, model_dir, synthetic, split, layer_spec, devices, transport, dtype, timeout, curve_server_key,
          curve_client_key, quantize, ab_spec, runs, drafter, block_size, mean_commit, max_new_tokens, concurrency,
          busy_poll_ms, prompt, prompt_ids, json_file):
    """A/B/A benchmark of two rollback modes: each run a fresh `shardctl generate --json`.

    Launched shards are started afresh per block with that block's rollback mode.
    Exit 3 when any run's output differs.

    \b
    Examples:
      shardctl bench --synthetic small --split 2 --ab replay,checkpoint --runs 3
      shardctl bench --synthetic small --split 2 --runs 1 --json > bench.json
    """
    modes = parse_list(ab_spec)
    if len(modes) != 2 or any(mode not in ROLLBACK_MODES for mode in modes):
        raise click.BadParameter(f"expected two of {', '.join(ROLLBACK_MODES)}, e.g. replay,checkpoint", param_hint="--ab")
    if prompt is not None and prompt_ids is not None:
        raise click.UsageError("give at most one of --prompt and --prompt-ids")
    check_mean_commit(drafter, mean_commit, block_size)
    prompt_args = ["--prompt", prompt] if prompt is not None else ["--prompt-ids", prompt_ids or ",".join(
        str(i) for i in benchmark_prompt())]
    plan = make_plan(shards, model_dir, synthetic, split, layer_spec, devices, transport,
                     # as many sequences as streams: the fast step holds their rows (one stream: one sequence's)
                     daemon_args_from(dtype=dtype, max_sequences=concurrency,
                                      busy_poll_ms="auto" if busy_poll_ms is None else busy_poll_ms),
                     curve=curve_server_key or curve_client_key, quantize=quantize)
    curve = load_curve(curve_server_key, curve_client_key)
    if not plan.launches:
        with connect_pipeline(plan.endpoints, timeout, curve) as pipeline:
            for mode in modes:
                try:
                    pipeline.check_speculation(mode, block_size)
                except PipelineError as error:
                    raise click.UsageError(f"--ab {ab_spec} on these shards: {error}") from None
    generate_args = [
        *prompt_args, "--max-new-tokens", str(max_new_tokens), "--drafter", drafter, "--block-size", str(block_size),
        "--mean-commit", str(mean_commit), "--ignore-eos", "--timeout", str(timeout), "--concurrency", str(concurrency),
        "--busy-poll-ms", "auto" if busy_poll_ms is None else str(busy_poll_ms),
        *curve_args(curve_server_key, curve_client_key),
        *(["--tokenizer", plan.model_dir] if plan.model_dir else []),
    ]
    blocks = []
    for name, mode in (("A1", modes[0]), ("B", modes[1]), ("A2", modes[0])):
        with plan.running(mode_daemon_args(mode, block_size, True)) as endpoints:
            block = {"name": name, "mode": mode, "warmup": None, "runs": []}
            for index in range(runs + 1):
                label = "warm-up" if index == 0 else f"run {index}/{runs}"
                progress(f"block {name} ({mode}): {label}")
                record = run_generate_subprocess(["--shards", ",".join(endpoints), "--rollback-mode", mode, *generate_args])
                record.pop("commits", None)
                if index == 0:
                    block["warmup"] = record
                else:
                    block["runs"].append(record)
            block["summary"] = benchstats.summarize_runs(block["runs"])
            if concurrency > 1:
                block["summary"]["aggregate_tok_s"] = median(run["aggregate_tok_s"] for run in block["runs"])
            blocks.append(block)
    report = bench_report(blocks, modes, drafter, block_size, mean_commit, max_new_tokens)
    if json_file == "-":
        emit_json(report)
    else:
        print_bench(report)
    if json_file and json_file != "-":
        Path(json_file).write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {json_file}")
    if not report["identical"]:
        sys.exit(EXIT_DIFFER)


def benchmark_prompt() -> list[int]:
    """A fixed byte-level prompt, so runs and machines compare."""
    return list(b"The shard daemon verifies a block ")[:32]


def bench_report(blocks: list[dict], modes: list[str], drafter: str, block_size: int, mean_commit: float,
                 max_new_tokens: int) -> dict:
    summaries = {block["name"]: block["summary"] for block in blocks}
    records = [run for block in blocks for run in [block["warmup"], *block["runs"]]]
    hashes = [run["sha256"] for run in records]
    a1, b, a2 = (summaries[name]["decode_tok_s"] for name in ("A1", "B", "A2"))
    drift = benchstats.drift(a1, a2) if a1 is not None and a2 is not None else None
    a_mean = (a1 + a2) / 2 if a1 is not None and a2 is not None else None
    return {
        "method": "A/B/A",
        "modes": {"A": modes[0], "B": modes[1]},
        "config": {"drafter": drafter, "block_size": block_size, "mean_commit": mean_commit if drafter == "oracle" else None,
                   "max_new_tokens": max_new_tokens},
        "drafter_note": ORACLE_NOTE if drafter == "oracle" else None,
        "blocks": blocks,
        "drift_decode_tok_s": drift,
        "b_vs_a_decode_tok_s": (b / a_mean - 1) if b is not None and a_mean else None,
        "identical": benchstats.all_identical(hashes) and all(run.get("streams_identical", True) for run in records),
        "sha256": sorted(set(hashes)),
    }


def print_bench(report: dict) -> None:
    rows = []
    batched = any("aggregate_tok_s" in block["summary"] for block in report["blocks"])
    for block in report["blocks"]:
        s = block["summary"]
        rows.append([block["name"], block["mode"], s["runs"], fmt(s["decode_tok_s"]), fmt(s["wall_seconds"], 3),
                     fmt(s["prefill_tok_s"]), fmt_percent(s["acceptance_rate"]),
                     fmt(s["avg_commit"], 2), *([fmt(s["aggregate_tok_s"])] if batched else [])])
    click.echo(format_table(["BLOCK", "MODE", "RUNS", "DECODE TOK/S", "WALL S", "PREFILL TOK/S", "ACCEPT", "AVG COMMIT",
                             *(["AGGREGATE TOK/S"] if batched else [])], rows))
    drift, change = report["drift_decode_tok_s"], report["b_vs_a_decode_tok_s"]
    click.echo(f"A1/A2 drift (decode tok/s): {'-' if drift is None else f'{100 * drift:.1f}%'}")
    verdict = ""
    if drift is not None and change is not None and abs(change) <= drift:
        verdict = " (within the A1/A2 drift: not a measurable difference)"
    click.echo(f"B vs A (decode tok/s): {'-' if change is None else f'{100 * change:+.1f}%'}{verdict}")
    runs = sum(1 + len(block["runs"]) for block in report["blocks"])
    if report["identical"]:
        click.echo(f"outputs identical: yes, all {runs} runs (sha256 {report['sha256'][0][:16]})")
    else:
        click.echo(f"outputs identical: NO, {len(report['sha256'])} different outputs over {runs} runs: {', '.join(h[:16] for h in report['sha256'])}")
    if report["drafter_note"]:
        click.echo(f"note: {report['drafter_note']}")
