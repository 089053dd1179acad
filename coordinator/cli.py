"""`shardctl`: make models, launch shards, generate, inspect, benchmark, demo.

Results go to stdout (a table, streamed text, or one JSON document with `--json`);
progress and diagnostics go to stderr. Exit codes: 0 ok, 1 runtime failure (a shard
error, timeout or crash), 2 usage error (including options the shard set cannot
serve), 3 outputs differ (speculative output not identical to greedy).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import click

from coordinator import benchstats
from coordinator.client import CurveKeys, ShardClient, ShardError, ShardTimeout
from coordinator.decoding import DecodeResult, greedy_decode, speculative_decode
from coordinator.drafters import DRAFTERS as DRAFTER_NAMES
from coordinator.drafters import make_drafter
from coordinator.launch import TRANSPORTS, LaunchError, ShardSet, child_env, drafter_set, launched_sets
from coordinator.pipeline import Pipeline, PipelineError, ShardInfo, order_shards
from coordinator.target import Target
from coordinator.tokenizer import load_tokenizer
from protocol import ProtocolError
from protocol.layout import (
    CHECKPOINT,
    REPLAY,
    REPLAY_SSM,
    ROLLBACK_MODES,
    SHARD_ROLLBACK_MODES,
    check_layer_range,
    even_split,
    parse_layer_ranges,
)
from shardd.config import load_config
from shardd.presets import PRESETS, parse_synthetic, preset_config

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_DIFFER = 0, 1, 2, 3
DRAFTERS = ("none", *DRAFTER_NAMES)
DTYPES = ("float32", "bfloat16", "float16")
ORACLE_NOTE = (
    "oracle is a benchmark drafter: it was handed the target's own greedy continuation, "
    "computed first through the same shards, and errs on a seeded schedule"
)
MiB = 1 << 20


class BenchError(RuntimeError):
    """A benchmark run failed."""


RUNTIME_ERRORS = (ProtocolError, ShardTimeout, PipelineError, LaunchError, BenchError)


class ShardctlGroup(click.Group):
    """Runtime failures become one line on stderr and exit code 1, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RUNTIME_ERRORS as error:
            click.echo(f"shardctl: error: {error}", err=True)
            ctx.exit(EXIT_FAILURE)


def progress(message: str) -> None:
    click.echo(f"[shardctl] {message}", err=True)


def emit_json(record: dict) -> None:
    click.echo(json.dumps(record))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def fmt(value: Optional[float], digits: int = 1, suffix: str = "") -> Optional[str]:
    return None if value is None else f"{value:.{digits}f}{suffix}"


def fmt_bytes(value: Optional[int]) -> Optional[str]:
    return None if value is None else f"{value / MiB:.1f} MiB"


def parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=what) from None
    if not ids or any(i < 0 for i in ids):
        raise click.BadParameter("expected at least one non-negative integer", param_hint=what)
    return ids


def parse_list(text: Optional[str]) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


# ---- where the shards come from ----------------------------------------------------------

@dataclass
class ShardPlan:
    """Either running shards (`endpoints`) or shards to launch for a model."""

    endpoints: list[str] = field(default_factory=list)
    source_args: tuple[str, ...] = ()
    model_dir: Optional[str] = None
    splits: tuple[tuple[int, int], ...] = ()
    transport: str = "tcp"
    devices: tuple[str, ...] = ()
    daemon_args: tuple[str, ...] = ()
    draft_endpoint: Optional[str] = None  # a running drafter daemon (--draft-shard)
    draft: Optional[str] = None  # the drafter daemon to launch: DIR or synthetic[:LAYERS] (--draft)

    @property
    def launches(self) -> bool:
        return not self.endpoints

    def shard_set(self, mode_args: Sequence[str] = ()) -> ShardSet:
        return ShardSet(self.source_args, self.splits, self.transport, (*self.daemon_args, *mode_args), self.devices or None)

    def drafter_set(self, draft: str) -> ShardSet:
        """A drafter-only daemon for this model, on the last shard's device."""
        return drafter_set(self.source_args, draft, self.transport, self.daemon_args, self.devices[-1] if self.devices else "cpu")

    @contextlib.contextmanager
    def running(self, mode_args: Sequence[str] = ()) -> Iterator[list[str]]:
        """The endpoints to talk to: the given ones, or freshly launched daemons (stopped on exit)."""
        with self.running_with_drafter(mode_args) as (endpoints, _):
            yield endpoints

    @contextlib.contextmanager
    def running_with_drafter(self, mode_args: Sequence[str] = ()) -> Iterator[tuple[list[str], Optional[str]]]:
        """The shard endpoints and the drafter daemon's endpoint (None without a drafter). Launched
        shards get a drafter-only daemon beside them when the plan names a --draft."""
        if not self.launches:
            yield list(self.endpoints), self.draft_endpoint
            return
        sets = [self.shard_set(mode_args)] + ([self.drafter_set(self.draft)] if self.draft is not None else [])
        drafter_note = f" and a drafter ({self.draft})" if self.draft is not None else ""
        progress(f"launching {len(self.splits)} shard(s) {', '.join(f'{b}:{e}' for b, e in self.splits)}{drafter_note} "
                 f"({' '.join(self.source_args)})")
        started = time.perf_counter()
        with launched_sets(sets, progress=progress) as started_sets:
            progress(f"shards ready in {time.perf_counter() - started:.1f} s")
            draft_endpoint = started_sets[1][0].endpoint if self.draft is not None else None
            yield [shard.endpoint for shard in started_sets[0]], draft_endpoint


def model_num_layers(model_dir: Optional[str], synthetic: Optional[str]) -> int:
    try:
        if model_dir is not None:
            return load_config(model_dir).num_layers
        return preset_config(parse_synthetic(synthetic)[0]).num_layers
    except ValueError as error:
        raise click.UsageError(str(error)) from None


def make_plan(
    shards: Optional[str],
    model_dir: Optional[str],
    synthetic: Optional[str],
    split: Optional[int],
    layer_spec: Optional[str],
    devices: Optional[str],
    transport: str,
    daemon_args: Sequence[str] = (),
    allow_endpoints: bool = True,
    curve: bool = False,
) -> ShardPlan:
    given = [name for name, value in (("--shards", shards), ("--model", model_dir), ("--synthetic", synthetic)) if value]
    choices = "--shards EP,EP,... or --model DIR or --synthetic PRESET" if allow_endpoints else "--model DIR or --synthetic PRESET"
    if len(given) != 1 or (given == ["--shards"] and not allow_endpoints):
        raise click.UsageError(f"give exactly one of {choices}" + (f" (got {', '.join(given)})" if given else ""))
    if shards:
        if split or layer_spec or devices:
            raise click.UsageError("--split, --layers and --devices launch shards; with --shards the shards already run")
        endpoints = parse_list(shards)
        if not endpoints:
            raise click.BadParameter("name at least one endpoint", param_hint="--shards")
        return ShardPlan(endpoints=endpoints)
    if curve:
        raise click.UsageError("CurveZMQ keys are for --shards off loopback; launched shards listen on loopback")
    if (split is None) == (layer_spec is None):
        raise click.UsageError("launching shards needs exactly one of --split N or --layers 0:3,3:8")
    num_layers = model_num_layers(model_dir, synthetic)
    try:
        splits = even_split(num_layers, split) if split else parse_layer_ranges(layer_spec)
        for begin, end in splits:  # coverage is the pipeline's to check: `shardctl launch` may start part of a model
            check_layer_range(begin, end, num_layers)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    device_list = tuple(parse_list(devices))
    if device_list and len(device_list) not in (1, len(splits)):
        raise click.UsageError(f"--devices lists {len(device_list)} devices for {len(splits)} shards: give one, or one per shard")
    source_args = ("--model", str(model_dir)) if model_dir else ("--synthetic", synthetic)
    return ShardPlan(
        source_args=source_args, model_dir=model_dir, splits=tuple(splits), transport=transport,
        devices=device_list, daemon_args=tuple(daemon_args),
    )


def mode_daemon_args(rollback: str, block_size: int, speculating: bool) -> list[str]:
    """Daemon options a launched shard set needs for this rollback mode."""
    if speculating and rollback != REPLAY:
        return ["--rollback-mode", rollback, "--max-verify-tokens", str(max(16, block_size))]
    return ["--max-verify-tokens", "0"]  # replay (and plain greedy) needs no rollback storage


def shard_source_options(func):
    """--shards | --model/--synthetic with --split/--layers, for commands that use shards."""
    options = [
        click.option("--shards", metavar="EP,EP,...", help="Endpoints of running shard daemons."),
        click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False),
                     help="Checkpoint directory: launch local shards for it."),
        click.option("--synthetic", metavar="PRESET[:SEED]", help="Synthetic model: launch local shards for it."),
        click.option("--split", type=click.IntRange(1), help="Launch this many shards, layers split evenly."),
        click.option("--layers", "layer_spec", metavar="B:E,B:E,...", help="Launch shards for these layer ranges."),
        click.option("--devices", metavar="DEV,DEV,...", help="Device of each launched shard (one value: all). Default cpu."),
        click.option("--transport", type=click.Choice(TRANSPORTS), default="tcp", show_default=True,
                     help="Endpoints of launched shards: loopback TCP or ipc:// sockets."),
        click.option("--dtype", type=click.Choice(DTYPES), default=None, help="Weight dtype of launched shards."),
        click.option("--timeout", type=click.FloatRange(0, min_open=True), default=120.0, show_default=True,
                     help="Seconds to wait for a shard's reply."),
        *curve_options,
    ]
    for option in reversed(options):
        func = option(func)
    return func


curve_options = [
    click.option("--curve-server-key", type=click.Path(exists=True, dir_okay=False), envvar="SHARDCTL_CURVE_SERVER_KEY",
                 help="CurveZMQ: the shards' public key file (NAME.key from `shardd keygen`), for --shards off loopback."),
    click.option("--curve-client-key", type=click.Path(exists=True, dir_okay=False), envvar="SHARDCTL_CURVE_CLIENT_KEY",
                 help="CurveZMQ: this client's secret key file (NAME.key_secret); its public key must be allowed."),
]


def load_curve(server_key: Optional[str], client_key: Optional[str]) -> Optional[CurveKeys]:
    if (server_key is None) != (client_key is None):
        raise click.UsageError("CurveZMQ needs both --curve-server-key and --curve-client-key")
    if server_key is None:
        return None
    try:
        return CurveKeys.load(server_key, client_key)
    except (ValueError, OSError) as error:
        raise click.UsageError(f"cannot read CurveZMQ keys: {error}") from None


def curve_args(server_key: Optional[str], client_key: Optional[str]) -> list[str]:
    return ["--curve-server-key", server_key, "--curve-client-key", client_key] if server_key else []


def connect_pipeline(endpoints: Sequence[str], timeout: float, curve: Optional[CurveKeys] = None) -> Pipeline:
    try:
        return Pipeline.connect(endpoints, timeout_s=timeout, curve=curve)
    except PipelineError as error:
        raise click.UsageError(str(error)) from None


# ---- generation --------------------------------------------------------------------------

class TextStream:
    """Prints committed tokens as text (or ids) as they arrive, never half a character."""

    def __init__(self, tokenizer, ids: bool) -> None:
        self.tokenizer = tokenizer
        self.ids = ids
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, committed: list[int]) -> None:
        self.tokens.extend(committed)
        if self.ids:
            click.echo(" ".join(map(str, committed)) + " ", nl=False)
            sys.stdout.flush()
            return
        text = self.tokenizer.decode(self.tokens)
        stable = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence may still be completed
        if stable.startswith(self.printed) and len(stable) > len(self.printed):
            click.echo(stable[len(self.printed):], nl=False)
            sys.stdout.flush()
            self.printed = stable

    def finish(self) -> None:
        if not self.ids:
            text = self.tokenizer.decode(self.tokens)
            if text.startswith(self.printed):
                click.echo(text[len(self.printed):], nl=False)
        click.echo("")


def check_mean_commit(drafter: str, mean_commit: float, block_size: int) -> None:
    # Checked before any shard starts: the oracle takes 1 .. block_size tokens per step.
    if drafter == "oracle" and not 1 <= mean_commit <= block_size:
        raise click.BadParameter(f"must be within [1, --block-size {block_size}], got {mean_commit:g}", param_hint="--mean-commit")


@dataclass
class Generation:
    result: DecodeResult
    reference: Optional[DecodeResult]  # the oracle's greedy pass
    drafter: str
    rollback: Optional[str]
    block_size: Optional[int]


def run_generation(
    target: Target,
    prompt: list[int],
    *,
    drafter: str,
    rollback: str,
    block_size: int,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    mean_commit: float = 6.0,
    oracle_seed: int = 0,
    on_commit: Optional[Callable[[list[int]], None]] = None,
    reference: Optional[list[int]] = None,
    draft_client: Optional[ShardClient] = None,
) -> Generation:
    """One generation through `target` with fresh random sequence ids. `oracle` first
    decodes greedily through the same target, unless `reference` (those ids) is given.
    `dflash` drafts on the daemon behind `draft_client`; `target` is then a Pipeline."""
    seq = secrets.randbelow(1 << 62)
    if drafter == "none":
        result = greedy_decode(target, seq, prompt, max_new_tokens, eos_ids, on_commit)
        return Generation(result, None, drafter, None, None)
    reference_result = None
    if drafter == "oracle" and reference is None:
        reference_result = greedy_decode(target, secrets.randbelow(1 << 62), prompt, max_new_tokens, eos_ids)
        reference = reference_result.tokens
    if drafter == "dflash" and draft_client is None:
        raise click.UsageError("--drafter dflash needs a drafter daemon (--draft-shard, or --draft when launching)")
    try:
        chosen = make_drafter(drafter, prompt_len=len(prompt), reference=reference, block_size=block_size,
                              mean_commit=mean_commit, seed=oracle_seed, draft_client=draft_client, pipeline=target)
    except PipelineError as error:  # a drafter daemon that does not fit these shards
        raise click.UsageError(str(error)) from None
    except ValueError as error:  # the oracle's schedule
        raise click.BadParameter(str(error), param_hint="--mean-commit") from None
    if drafter == "dflash":
        if block_size > chosen.max_block_size:
            raise click.BadParameter(
                f"the dflash drafter fills blocks of at most {chosen.max_block_size} tokens, got {block_size}",
                param_hint="--block-size",
            )
        target = chosen.target  # every forward captures the drafter's target layers
    result = speculative_decode(
        target, seq, prompt, chosen, block_size=block_size, rollback=rollback,
        max_new_tokens=max_new_tokens, eos_ids=eos_ids, on_commit=on_commit,
    )
    return Generation(result, reference_result, drafter, rollback, block_size)


def generation_record(generation: Generation, tokenizer, shards: Sequence[ShardInfo] = ()) -> dict:
    result = generation.result
    summary = result.summary()
    record = {
        "tokens": result.tokens,
        "text": tokenizer.decode(result.tokens),
        # sha256 over the comma-joined decimal ids (benchstats.tokens_digest)
        "sha256": benchstats.tokens_digest(result.tokens),
        "drafter": generation.drafter,
        "rollback": generation.rollback,
        "block_size": generation.block_size,
        **summary,
        "rollbacks": {"fast": result.rollbacks_fast, "fallback": result.rollbacks_fallback, "replays": result.replays},
        "commits": result.commits,
        "shards": [{"endpoint": s.endpoint, "layers": [s.begin, s.end]} for s in shards],
    }
    if generation.drafter == "oracle":
        record["drafter_note"] = ORACLE_NOTE
        if generation.reference is not None:
            reference = generation.reference.summary()
            record["reference"] = {key: reference[key] for key in ("new_tokens", "prefill_tok_s", "decode_tok_s", "wall_seconds")}
            # The greedy pass doubles as the exactness check: speculation must reproduce it token for token.
            record["reference"]["sha256"] = benchstats.tokens_digest(generation.reference.tokens)
            record["matches_greedy"] = generation.reference.tokens == result.tokens
    return record


def describe_generation(record: dict) -> str:
    def pct(value):
        return "-" if value is None else f"{100 * value:.1f}%"

    parts = [
        f"{record['new_tokens']} tokens",
        f"{record['steps']} steps",
        f"acceptance {pct(record['acceptance_rate'])}",
        f"avg commit {fmt(record['avg_commit'], 2) or '-'}",
        f"prefill {fmt(record['prefill_tok_s']) or '-'} tok/s",
        f"decode {fmt(record['decode_tok_s']) or '-'} tok/s",
        f"rollbacks fast {record['rollbacks']['fast']} fallback {record['rollbacks']['fallback']} replays {record['rollbacks']['replays']}",
        f"sha256 {record['sha256'][:16]}",
    ]
    return ", ".join(parts)


# ---- the commands ------------------------------------------------------------------------

@click.group(cls=ShardctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """Drive shard daemons: layer-split speculative decoding of Qwen3.5 hybrid models."""


@cli.command("make-model")
@click.option("--preset", type=click.Choice(tuple(PRESETS)), required=True, help="Model shape.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory to write.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--force", is_flag=True, help="Overwrite a model already in --out.")
@click.option("--with-drafter", is_flag=True, help="Also write a matched synthetic DFlash drafter to OUT/draft/.")
@click.option("--draft-layers", type=click.IntRange(1), default=None, help="Layers of that drafter (default 2).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def make_model(preset, out_dir, seed, dtype, force, with_drafter, draft_layers, as_json):
    """Write a synthetic checkpoint (config.json, *.safetensors, index) in the Qwen3.5 layout;
    with --with-drafter also a DFlash draft checkpoint in OUT/draft/ (`--draft OUT/draft`)."""
    if draft_layers is not None and not with_drafter:
        raise click.UsageError("--draft-layers goes with --with-drafter")
    out = Path(out_dir)
    if (out / "config.json").exists() and not force:
        raise click.UsageError(f"{out} already holds a model (config.json); pass --force to overwrite it")
    progress(f"writing synthetic {preset} (seed {seed}, {dtype}) to {out}")
    started = time.perf_counter()
    path = write_synthetic_model(preset, seed, dtype, out)
    draft = write_synthetic_drafter(path, preset, seed, dtype, draft_layers) if with_drafter else None
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    size = sum((path / name).stat().st_size for name in files)
    record = {"path": str(path), "preset": preset, "seed": seed, "dtype": dtype, "files": files, "bytes": size,
              "draft": None if draft is None else str(draft), "seconds": time.perf_counter() - started}
    if as_json:
        emit_json(record)
    else:
        click.echo(f"{path}: {len(files)} files, {size / MiB:.1f} MiB ({preset}, seed {seed}, {dtype})")


def write_synthetic_model(preset: str, seed: int, dtype: str, out: Path) -> Path:
    import torch

    from shardd.synthetic import write_checkpoint

    return write_checkpoint(out, preset_config(preset), seed, dtype=getattr(torch, dtype))


def write_synthetic_drafter(model_dir: Path, preset: str, seed: int, dtype: str, layers: Optional[int]) -> Path:
    """MODEL/draft/: the drafter `--draft synthetic[:LAYERS]` builds in memory for this model, on disk."""
    import torch

    from shardd.draft.synthetic import synthetic_draft_config, write_draft_checkpoint
    from shardd.loading import DEFAULT_SYNTHETIC_DRAFT_LAYERS

    config = synthetic_draft_config(preset_config(preset), num_layers=layers or DEFAULT_SYNTHETIC_DRAFT_LAYERS)
    return write_draft_checkpoint(model_dir / "draft", config, seed, dtype=getattr(torch, dtype))


def daemon_options(func):
    """Options passed through to every launched daemon (only when given)."""
    options = [
        click.option("--dtype", type=click.Choice(DTYPES), default=None, help="Weight dtype."),
        click.option("--max-verify-tokens", type=click.IntRange(0), default=None,
                     help="Rollback storage per sequence, in tokens (0: none)."),
        click.option("--rollback-mode", type=click.Choice(SHARD_ROLLBACK_MODES), default=None),
        click.option("--max-sequences", type=click.IntRange(1), default=None),
        click.option("--max-context", type=click.IntRange(1), default=None),
        click.option("--max-tokens-per-request", type=click.IntRange(1), default=None),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def daemon_args_from(**values) -> list[str]:
    args = []
    for name, value in values.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def dflash_daemon(plan: ShardPlan, draft_shard: Optional[str], draft: Optional[str], model_dir: Optional[str]):
    """(running drafter endpoint, drafter to launch) for --drafter dflash; one of them is None."""
    if not plan.launches:
        if draft:
            raise click.UsageError("--draft launches a drafter daemon; with --shards give the running one as --draft-shard")
        if not draft_shard:
            raise click.UsageError("--drafter dflash with --shards needs --draft-shard EP (a daemon started with --draft)")
        return draft_shard, None
    if draft_shard:
        raise click.UsageError("--draft-shard names a running drafter daemon; launched shards get one from --draft")
    if draft is None:
        if model_dir is not None:
            if not (Path(model_dir) / "draft" / "config.json").is_file():
                raise click.UsageError(
                    f"{model_dir} has no draft/ (shardctl make-model --with-drafter writes one): give --draft DIR|synthetic"
                )
            draft = str(Path(model_dir) / "draft")
        else:
            draft = "synthetic"
    return None, draft


class _Stop(Exception):
    pass


@cli.command()
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), help="Checkpoint directory.")
@click.option("--synthetic", metavar="PRESET[:SEED]", help="Synthetic model instead of a checkpoint.")
@click.option("--split", type=click.IntRange(1), help="This many shards, layers split evenly.")
@click.option("--layers", "layer_spec", metavar="B:E,B:E,...", help="One shard per layer range.")
@click.option("--devices", metavar="DEV,DEV,...", help="Device of each shard (one value: all). Default cpu.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="tcp", show_default=True)
@daemon_options
@click.option("--draft", metavar="DIR|synthetic[:LAYERS]", help="Also start a drafter-only daemon hosting this DFlash drafter.")
@click.option("--ready-timeout", type=click.FloatRange(0, min_open=True), default=600.0, show_default=True,
              help="Seconds to wait for the shards to load.")
@click.option("--json", "as_json", is_flag=True, help="Print the endpoints as JSON once ready.")
def launch(model_dir, synthetic, split, layer_spec, devices, transport, draft, ready_timeout, as_json, **daemon_values):
    """Start shard daemons (and a drafter daemon with --draft) on this machine, print their
    endpoints, stop them on Ctrl-C."""
    plan = make_plan(None, model_dir, synthetic, split, layer_spec, devices, transport, daemon_args_from(**daemon_values),
                     allow_endpoints=False)
    sets = [plan.shard_set()] + ([plan.drafter_set(draft)] if draft is not None else [])

    def stop(signum, frame):
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with launched_sets(sets, ready_timeout_s=ready_timeout, progress=progress) as started_sets:
            layer_shards = started_sets[0]
            drafters = started_sets[1] if draft is not None else []
            shards = layer_shards + drafters
            endpoints = [shard.endpoint for shard in layer_shards]
            if as_json:
                emit_json({"endpoints": endpoints, "draft_endpoint": drafters[0].endpoint if drafters else None, "shards": [
                    {"endpoint": s.endpoint, "layers": None if s.layers is None else list(s.layers), "pid": s.process.pid,
                     "log": str(s.log_path)}
                    for s in shards]})
            else:
                click.echo(format_table(
                    ["LAYERS", "ENDPOINT", "PID", "LOG"],
                    [["drafter" if s.layers is None else f"{s.layers[0]}:{s.layers[1]}", s.endpoint, s.process.pid, s.log_path]
                     for s in shards],
                ))
                click.echo(f"\n--shards {','.join(endpoints)}" + (f" --draft-shard {drafters[0].endpoint}" if drafters else ""))
            sys.stdout.flush()
            progress("serving; Ctrl-C stops every shard")
            try:
                while True:
                    for shard in shards:
                        code = shard.process.poll()
                        if code is not None:
                            raise LaunchError(
                                f"{shard.label} at {shard.endpoint} exited with code "
                                f"{code}; stopping the others. Its log ends:\n{shard.log_tail()}"
                            )
                    time.sleep(0.5)
            except (KeyboardInterrupt, _Stop):
                pass  # a requested stop: leave the block normally so the logs go too
        progress("stopped all shards")
    except (KeyboardInterrupt, _Stop):
        progress("interrupted while starting; stopped all shards")
    finally:
        signal.signal(signal.SIGTERM, previous)


@cli.command()
@shard_source_options
@click.option("--prompt", help="Prompt text (tokenized with the model's tokenizer.json, else bytes).")
@click.option("--prompt-ids", help="Prompt as token ids: 1,2,3.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False),
              help="Directory with tokenizer.json (default: --model's).")
@click.option("--max-new-tokens", type=click.IntRange(0), default=64, show_default=True)
@click.option("--drafter", type=click.Choice(DRAFTERS), default="ngram", show_default=True,
              help="none: plain greedy; ngram: prompt lookup; oracle: benchmark drafter; dflash: the DFlash "
                   "block drafter on a drafter daemon, fed with features the shards capture.")
@click.option("--draft-shard", metavar="EP", help="dflash with --shards: endpoint of the daemon hosting the drafter.")
@click.option("--draft", metavar="DIR|synthetic[:LAYERS]",
              help="dflash when launching shards: the drafter daemon to launch beside them "
                   "(default: MODEL/draft for --model when it exists, synthetic for --synthetic).")
@click.option("--block-size", type=click.IntRange(2), default=16, show_default=True, help="Tokens per verify step.")
@click.option("--rollback", type=click.Choice(ROLLBACK_MODES), default=CHECKPOINT, show_default=True)
@click.option("--mean-commit", type=float, default=6.0, show_default=True,
              help="oracle: tokens committed per step on average.")
@click.option("--oracle-seed", type=int, default=0, show_default=True, help="oracle: seed of its error schedule.")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly --max-new-tokens tokens.")
@click.option("--ids", "print_ids", is_flag=True, help="Stream token ids instead of text.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end instead of streaming.")
def generate(shards, model_dir, synthetic, split, layer_spec, devices, transport, dtype, timeout, curve_server_key,
             curve_client_key, prompt, prompt_ids, tokenizer_dir, max_new_tokens, drafter, draft_shard, draft, block_size,
             rollback, mean_commit, oracle_seed, ignore_eos, print_ids, as_json):
    """Generate greedily, speculating with a drafter; stream the text as tokens commit."""
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    ids = parse_ids(prompt_ids, "--prompt-ids") if prompt_ids is not None else None
    check_mean_commit(drafter, mean_commit, block_size)
    speculating = drafter != "none"
    plan = make_plan(shards, model_dir, synthetic, split, layer_spec, devices, transport,
                     daemon_args_from(dtype=dtype), curve=curve_server_key or curve_client_key)
    if drafter == "dflash":
        plan.draft_endpoint, plan.draft = dflash_daemon(plan, draft_shard, draft, model_dir)
    elif draft_shard or draft:
        raise click.UsageError("--draft-shard and --draft go with --drafter dflash")
    curve = load_curve(curve_server_key, curve_client_key)
    with plan.running_with_drafter(mode_daemon_args(rollback, block_size, speculating)) as (endpoints, draft_endpoint), \
            contextlib.ExitStack() as stack:
        draft_client = None
        if draft_endpoint is not None:
            draft_client = stack.enter_context(ShardClient(draft_endpoint, timeout_s=timeout, curve=curve))
        with connect_pipeline(endpoints, timeout, curve) as pipeline:
            if speculating:
                try:
                    pipeline.check_speculation(rollback, block_size)
                except PipelineError as error:
                    raise click.UsageError(str(error)) from None
            tokenizer = load_tokenizer(tokenizer_dir or plan.model_dir, pipeline.vocab_size)
            if ids is None:
                ids = tokenizer.encode(prompt)
                if not ids:
                    raise click.BadParameter("the prompt is empty after tokenization", param_hint="--prompt")
            bad = [i for i in ids if i >= pipeline.vocab_size]
            if bad:
                raise click.BadParameter(f"token id {bad[0]} is outside the vocabulary 0..{pipeline.vocab_size - 1}",
                                         param_hint="--prompt-ids")
            eos_ids = () if ignore_eos else tuple(tokenizer.eos_ids) or tuple(pipeline.shards[-1].model.get("eos_token_ids") or ())
            if drafter == "oracle":
                progress(f"{ORACLE_NOTE}; running that greedy pass now")
            stream = None if as_json else TextStream(tokenizer, print_ids)
            generation = run_generation(
                pipeline, ids, drafter=drafter, rollback=rollback, block_size=block_size,
                max_new_tokens=max_new_tokens, eos_ids=eos_ids, mean_commit=mean_commit, oracle_seed=oracle_seed,
                on_commit=stream, draft_client=draft_client,
            )
            record = generation_record(generation, tokenizer, pipeline.shards)
    if as_json:
        emit_json(record)
    else:
        stream.finish()
        progress(describe_generation(record))


@cli.command()
@click.option("--shards", metavar="EP,EP,...", required=True, help="Endpoints of running shard daemons.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for each shard.")
@curve_options[0]
@curve_options[1]
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def status(shards, timeout, curve_server_key, curve_client_key, as_json):
    """Each shard's layers, device, rollback storage, memory and counters (HELLO + STATS).
    Exit 1 when a shard does not answer."""
    curve = load_curve(curve_server_key, curve_client_key)
    entries, infos = [], []
    endpoints = parse_list(shards)
    if not endpoints:
        raise click.BadParameter("name at least one endpoint", param_hint="--shards")
    for endpoint in endpoints:
        entry = {"endpoint": endpoint, "ok": False, "hello": None, "stats": None, "error": None}
        with ShardClient(endpoint, timeout_s=timeout, curve=curve) as client:
            try:
                entry["hello"] = client.hello()
                entry["stats"] = client.stats()
                entry["ok"] = True
                infos.append(ShardInfo(endpoint, entry["hello"]))
            except (ShardError, ShardTimeout, ProtocolError) as error:
                entry["error"] = str(error)
        entries.append(entry)
    pipeline = {"ok": False, "message": "not every shard answered"}
    if infos and len(infos) == len(entries):
        try:
            ordered = order_shards(infos)
            drafters = sum(1 for info in infos if not info.owns_layers)
            pipeline = {"ok": True, "message": f"{len(ordered)} shard(s) cover all {ordered[0].model['num_layers']} layers "
                                               f"of {ordered[0].model['fingerprint']}"
                                               + (f"; {drafters} drafter-only daemon(s)" if drafters else "")}
        except PipelineError as error:
            pipeline = {"ok": False, "message": str(error)}
    if as_json:
        emit_json({"shards": entries, "pipeline": pipeline})
    else:
        print_status(entries, pipeline)
    if not all(entry["ok"] for entry in entries):
        sys.exit(EXIT_FAILURE)


def print_status(entries: list[dict], pipeline: dict) -> None:
    rows = []
    for entry in entries:
        hello, stats = entry["hello"] or {}, entry["stats"] or {}
        if not entry["ok"]:
            rows.append([entry["endpoint"], "DOWN"] + [None] * 10)
            continue
        storage = hello.get("rollback") or {}
        limits = hello.get("limits") or {}
        rows.append([
            entry["endpoint"],
            serving_label(hello),
            hello.get("device"),
            hello.get("dtype"),
            f"{storage.get('mode') or 'none'}/{storage.get('max_verify_tokens')}",
            f"{stats.get('open_sequences', '-')}/{limits.get('max_sequences', '-')}",
            fmt_bytes(stats.get("weight_bytes")),
            fmt_bytes(stats.get("state_bytes")),
            fmt_bytes(stats.get("checkpoint_bytes")),
            fmt_bytes(storage.get("checkpoint_bytes_per_sequence")),
            stats.get("forwards"),
            sum((stats.get("errors") or {}).values()) if isinstance(stats.get("errors"), dict) else stats.get("errors"),
        ])
    click.echo(format_table(
        ["ENDPOINT", "LAYERS", "DEVICE", "DTYPE", "ROLLBACK", "OPEN", "WEIGHTS", "STATE", "CKPT", "CKPT/SEQ",
         "FORWARDS", "ERRORS"], rows))
    for entry in entries:
        stats = entry["stats"]
        if entry["error"]:
            click.echo(f"\n{entry['endpoint']}: DOWN: {entry['error']}")
        if not stats:
            continue
        counters = ", ".join(f"{key}={_compact(value)}" for key, value in stats.items() if value not in ({}, None))
        click.echo(f"\n{entry['endpoint']}: {counters}")
    click.echo(f"\npipeline: {'ok' if pipeline['ok'] else 'NOT USABLE'}: {pipeline['message']}")


def serving_label(hello: dict) -> str:
    """'0:3', '3:6+head', '3:6+head+dflash', 'dflash' (a drafter-only daemon)."""
    parts = [] if hello.get("layers") is None else [f"{hello['layers'][0]}:{hello['layers'][1]}"]
    parts += ["head"] if hello.get("owns_head") else []
    parts += [hello["drafter"].get("name", "drafter")] if hello.get("drafter") else []
    return "+".join(parts)


def _compact(value) -> str:
    if isinstance(value, dict):
        return "{" + " ".join(f"{k}:{_compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


# ---- bench -------------------------------------------------------------------------------

def shardctl_command() -> list[str]:
    """How to run this CLI in a fresh process (installed or not)."""
    return [sys.executable, "-c", "from coordinator.cli import main; main()"]


def run_generate_subprocess(args: Sequence[str], timeout: Optional[float] = None) -> dict:
    command = [*shardctl_command(), "generate", *args, "--json"]
    completed = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=timeout)
    if completed.returncode != 0:
        tail = "\n".join(completed.stderr.strip().splitlines()[-10:])
        raise BenchError(f"`shardctl generate` exited with code {completed.returncode}:\n{tail}")
    return json.loads(completed.stdout)


@cli.command()
@shard_source_options
@click.option("--ab", "ab_spec", default=f"{REPLAY},{CHECKPOINT}", show_default=True, metavar="A,B",
              help="The two rollback modes to compare, run in blocks A1, B, A2.")
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True,
              help="Measured runs per block (plus one discarded warm-up).")
@click.option("--drafter", type=click.Choice(("ngram", "oracle")), default="oracle", show_default=True)
@click.option("--block-size", type=click.IntRange(2), default=16, show_default=True)
@click.option("--mean-commit", type=float, default=6.0, show_default=True, help="oracle: tokens committed per step.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-ids", help="Prompt token ids (default: a fixed 32-token prompt).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write the full record to this file (- for stdout).")
def bench(shards, model_dir, synthetic, split, layer_spec, devices, transport, dtype, timeout, curve_server_key,
          curve_client_key, ab_spec, runs, drafter, block_size, mean_commit, max_new_tokens, prompt, prompt_ids, json_file):
    """A/B/A benchmark of two rollback modes: each run a fresh `shardctl generate --json`.

    Launched shards are started afresh per block with that block's rollback mode.
    Exit 3 when any run's output differs."""
    modes = parse_list(ab_spec)
    if len(modes) != 2 or any(mode not in ROLLBACK_MODES for mode in modes):
        raise click.BadParameter(f"expected two of {', '.join(ROLLBACK_MODES)}, e.g. replay,checkpoint", param_hint="--ab")
    if prompt is not None and prompt_ids is not None:
        raise click.UsageError("give at most one of --prompt and --prompt-ids")
    check_mean_commit(drafter, mean_commit, block_size)
    prompt_args = ["--prompt", prompt] if prompt is not None else ["--prompt-ids", prompt_ids or ",".join(
        str(i) for i in benchmark_prompt())]
    plan = make_plan(shards, model_dir, synthetic, split, layer_spec, devices, transport, daemon_args_from(dtype=dtype),
                     curve=curve_server_key or curve_client_key)
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
        "--mean-commit", str(mean_commit), "--ignore-eos", "--timeout", str(timeout),
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
                record = run_generate_subprocess(["--shards", ",".join(endpoints), "--rollback", mode, *generate_args])
                record.pop("commits", None)
                if index == 0:
                    block["warmup"] = record
                else:
                    block["runs"].append(record)
            block["summary"] = benchstats.summarize_runs(block["runs"])
            blocks.append(block)
    report = bench_report(blocks, modes, drafter, block_size, mean_commit, max_new_tokens)
    print_bench(report)
    if json_file == "-":
        emit_json(report)
    elif json_file:
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
    hashes = [run["sha256"] for block in blocks for run in [block["warmup"], *block["runs"]]]
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
        "identical": benchstats.all_identical(hashes),
        "sha256": sorted(set(hashes)),
    }


def print_bench(report: dict) -> None:
    rows = []
    for block in report["blocks"]:
        s = block["summary"]
        rows.append([block["name"], block["mode"], s["runs"], fmt(s["decode_tok_s"]), fmt(s["wall_seconds"], 3),
                     fmt(s["prefill_tok_s"]), fmt(None if s["acceptance_rate"] is None else 100 * s["acceptance_rate"], 1, "%"),
                     fmt(s["avg_commit"], 2)])
    click.echo(format_table(["BLOCK", "MODE", "RUNS", "DECODE TOK/S", "WALL S", "PREFILL TOK/S", "ACCEPT", "AVG COMMIT"], rows))
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


# ---- demo --------------------------------------------------------------------------------

DEMO_PROMPT = "Speculative decoding over layer-split shards: "


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardd"


def demo_model(seed: int = 0) -> Path:
    """The `small` synthetic checkpoint in the cache, written once (atomically) and reused."""
    target = cache_dir() / f"small-seed{seed}"
    if (target / "model.safetensors.index.json").is_file():
        progress(f"using the cached demo model in {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"writing the small synthetic model to {target}")
    staging = Path(tempfile.mkdtemp(prefix=".small-", dir=target.parent))
    write_synthetic_model("small", seed, "float32", staging)
    shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier attempt
    try:
        staging.rename(target)
    except OSError:  # another demo got there first
        shutil.rmtree(staging, ignore_errors=True)
    return target


@cli.command()
@click.option("--max-new-tokens", type=click.IntRange(1), default=96, show_default=True)
@click.option("--block-size", type=click.IntRange(2), default=16, show_default=True)
@click.option("--mean-commit", type=float, default=6.0, show_default=True, help="oracle: tokens committed per step.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="tcp", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(max_new_tokens, block_size, mean_commit, transport, as_json):
    """Two local shards of a small synthetic model: greedy and speculative decoding with every
    drafter (ngram, oracle, and dflash on a drafter daemon) in every rollback mode give identical
    outputs (exit 3 if not). The synthetic drafter is untrained: its acceptance is near zero."""
    check_mean_commit("oracle", mean_commit, block_size)
    started = time.perf_counter()
    model_dir = demo_model()
    num_layers = model_num_layers(str(model_dir), None)
    splits = even_split(num_layers, 2)
    source = ("--model", str(model_dir))
    # The rollback mode is a daemon setting: one shard pair per mode that the shards do.
    sets = [ShardSet(source, splits, transport, tuple(mode_daemon_args(mode, block_size, True)))
            for mode in SHARD_ROLLBACK_MODES]
    sets.append(drafter_set(source, "synthetic", transport))
    progress(f"launching 2 x 2 shards ({', '.join(f'{b}:{e}' for b, e in splits)}) for checkpoint and replay-ssm, "
             f"and a dflash drafter daemon")
    tokenizer = load_tokenizer(str(model_dir), 256)
    prompt = tokenizer.encode(DEMO_PROMPT)
    rows = []
    with launched_sets(sets, progress=progress) as (checkpoint_shards, ssm_shards, (drafter_daemon,)):
        with Pipeline.connect([s.endpoint for s in checkpoint_shards]) as checkpointing, \
                Pipeline.connect([s.endpoint for s in ssm_shards]) as logging_ssm, \
                ShardClient(drafter_daemon.endpoint) as draft_client:
            progress("greedy decoding (the reference)")
            greedy = run_generation(checkpointing, prompt, drafter="none", rollback=REPLAY, block_size=block_size,
                                    max_new_tokens=max_new_tokens)
            rows.append(generation_record(greedy, tokenizer, checkpointing.shards))
            for drafter in DRAFTER_NAMES:
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
            fmt(None if run["acceptance_rate"] is None else 100 * run["acceptance_rate"], 1, "%"),
            fmt(run["avg_commit"], 2), fmt(run["decode_tok_s"]),
            f"{run['rollbacks']['fast']}/{run['rollbacks']['fallback']}/{run['rollbacks']['replays']}",
            run["sha256"][:16], "yes" if run["sha256"] == reference else "NO",
        ])
    click.echo(f"model: {record['model']} (synthetic `small`: its text is noise, its tokens are what count)")
    click.echo(f"shards: {', '.join(f'{b}:{e}' for b, e in record['shards'])}; prompt: {record['prompt']!r} "
               f"({record['prompt_tokens']} tokens)\n")
    click.echo(format_table(
        ["DRAFTER", "ROLLBACK", "TOKENS", "STEPS", "ACCEPT", "AVG COMMIT", "DECODE TOK/S", "FAST/FALLBACK/REPLAY",
         "SHA256", "SAME"], rows))
    verdict = "identical to greedy" if record["identical"] else "NOT IDENTICAL: a rollback mode changed the output"
    click.echo(f"\nall {len(rows)} outputs {verdict}; {record['seconds']:.1f} s in all")
    click.echo(f"note: {record['drafter_note']}")


def main() -> None:
    cli(prog_name="shardctl")


if __name__ == "__main__":
    main()
