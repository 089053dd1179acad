"""`shardctl demo`: two local shards of the `small` synthetic model; greedy decoding, then every drafter
in every rollback mode, all of which must give the greedy output token for token (exit 3 if not)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click

from common.model_config import load_config
from common.synthetic_tokenizer import write_tokenizer
from coordinator import benchstats
from coordinator.cli.generate import GREEDY, ORACLE_NOTE, generation_record, run_generation
from coordinator.cli.make_model import write_model
from coordinator.cli.options import EXIT_DIFFER, check_mean_commit
from coordinator.cli.output import emit_json, fmt, fmt_percent, format_table, progress
from coordinator.cli.plan import mode_daemon_args, model_config, split_by_bytes
from coordinator.drafting.drafters import DRAFTERS
from coordinator.launch import TRANSPORTS, ShardSet, drafter_set, launched_sets
from coordinator.relay.client import ShardClient
from coordinator.relay.pipeline import Pipeline
from coordinator.tokenizer import load_tokenizer
from protocol.layout import CHECKPOINT, REPLAY, REPLAY_SSM, SHARD_ROLLBACK_MODES


DEMO_PROMPT = "Speculative decoding over layer-split shards: "


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardd"


def demo_model(seed: int = 0) -> Path:
    """The `small` synthetic checkpoint in the cache, written once (atomically) and reused."""
    target = cache_dir() / f"small-seed{seed}"
    if (target / "model.safetensors.index.json").is_file():
        progress(f"using the cached demo model in {target}")
        if not (target / "tokenizer.json").is_file():  # cached by a version that wrote no tokenizer
            write_tokenizer(target, model_vocab_size(target))
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"writing the small synthetic model to {target}")
    staging = Path(tempfile.mkdtemp(prefix=".small-", dir=target.parent))
    write_model("small", seed, "float32", staging)
    shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier attempt
    try:
        staging.rename(target)
    except OSError:  # another demo got there first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def model_vocab_size(model_dir: Path) -> int:
    return load_config(str(model_dir)).vocab_size


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--max-new-tokens", type=click.IntRange(1), default=96, show_default=True)
@click.option("--block-size", type=click.IntRange(2), default=16, show_default=True)
@click.option("--mean-commit", type=float, default=6.0, show_default=True, help="oracle: tokens committed per step.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="tcp", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(max_new_tokens, block_size, mean_commit, transport, as_json):
    """Two local shards of a small synthetic model: greedy and speculative decoding with every
    drafter (ngram, oracle, and dflash on a drafter daemon) in every rollback mode give identical
    outputs (exit 3 if not). The synthetic drafter is untrained: its acceptance is near zero.
    The daemons stop when it ends.

    \b
    Example:
      shardctl demo --max-new-tokens 48 --json
    """
    check_mean_commit("oracle", mean_commit, block_size)
    started = time.perf_counter()
    model_dir = demo_model()
    splits = split_by_bytes(model_config(str(model_dir), None), 2, None, on_gpu=False)
    source = ("--model", str(model_dir))
    # The rollback mode is a daemon setting: one shard pair per mode that the shards do.
    sets = [ShardSet(source, splits, transport, tuple(mode_daemon_args(mode, block_size, True)))
            for mode in SHARD_ROLLBACK_MODES]
    sets.append(drafter_set(source, "synthetic", transport))
    progress(f"launching 2 x 2 shards ({', '.join(f'{b}:{e}' for b, e in splits)}) for checkpoint and replay-ssm, "
             f"and a dflash drafter daemon")
    tokenizer = load_tokenizer(str(model_dir), model_vocab_size(model_dir))
    prompt = tokenizer.encode(DEMO_PROMPT)
    rows = []
    with launched_sets(sets, progress=progress) as (checkpoint_shards, ssm_shards, (drafter_daemon,)):
        with Pipeline.connect([s.endpoint for s in checkpoint_shards]) as checkpointing, \
                Pipeline.connect([s.endpoint for s in ssm_shards]) as logging_ssm, \
                ShardClient(drafter_daemon.endpoint) as draft_client:
            progress("greedy decoding (the reference)")
            greedy = run_generation(checkpointing, prompt, drafter=GREEDY, rollback=REPLAY, block_size=block_size,
                                    max_new_tokens=max_new_tokens)
            rows.append(generation_record(greedy, tokenizer, checkpointing.shards))
            for drafter in DRAFTERS:
                for mode, pipeline in ((CHECKPOINT, checkpointing), (REPLAY_SSM, logging_ssm), (REPLAY, checkpointing)):
                    progress(f"{drafter} drafter, {mode} rollback")
                    generation = run_generation(
                        pipeline, prompt, drafter=drafter, rollback=mode, block_size=block_size,
                        max_new_tokens=max_new_tokens, mean_commit=mean_commit, reference=greedy.result.tokens,
                        draft_client=draft_client,
                    )
                    rows.append(generation_record(generation, tokenizer, pipeline.shards))
    identical = benchstats.all_identical(row["sha256"] for row in rows)
    record = {
        "model": str(model_dir), "prompt": DEMO_PROMPT, "prompt_tokens": len(prompt), "shards": [list(s) for s in splits],
        "runs": rows, "identical": identical, "seconds": time.perf_counter() - started, "drafter_note": ORACLE_NOTE,
    }
    if as_json:
        emit_json(record)
    else:
        print_demo(record)
    if not identical:
        sys.exit(EXIT_DIFFER)


def print_demo(record: dict) -> None:
    reference = record["runs"][0]["sha256"]
    rows = []
    for run in record["runs"]:
        rows.append([
            run["drafter"], run["rollback"] or "-", run["new_tokens"], run["steps"],
            fmt_percent(run["acceptance_rate"]),
            fmt(run["avg_commit"], 2), fmt(run["decode_tok_s"]),
            f"{run['rollbacks']['fast']}/{run['rollbacks']['fallback']}/{run['rollbacks']['replays']}",
            run["sha256"][:16], "yes" if run["sha256"] == reference else "NO",
        ])
    click.echo(f"model: {record['model']} (synthetic `small`: random weights, so its text is gibberish, often one "
               f"token repeated; its tokens are what count)")
    click.echo(f"shards: {', '.join(f'{b}:{e}' for b, e in record['shards'])}; prompt: {record['prompt']!r} "
               f"({record['prompt_tokens']} tokens)")
    click.echo(f"text: {record['prompt'] + record['runs'][0]['text']!r}\n")
    click.echo(format_table(
        ["DRAFTER", "ROLLBACK", "TOKENS", "STEPS", "ACCEPT", "AVG COMMIT", "DECODE TOK/S", "FAST/FALLBACK/REPLAY",
         "SHA256", "SAME"], rows))
    verdict = "identical to greedy" if record["identical"] else "NOT IDENTICAL: a rollback mode changed the output"
    click.echo(f"\nall {len(rows)} outputs {verdict}; {record['seconds']:.1f} s in all")
    click.echo(f"note: {record['drafter_note']}")
