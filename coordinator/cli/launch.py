"""`shardctl launch`: start shard daemons (and a drafter daemon) here, print their endpoints, serve until
Ctrl-C or SIGTERM, then stop them all."""

from __future__ import annotations

import signal
import sys
import time

import click

from coordinator.cli.dry_run import daemon_plans, plans_summary, plans_table
from coordinator.cli.options import EXIT_FAILURE, daemon_args_from, daemon_options, devices_option, quantize_option
from coordinator.cli.output import emit_json, format_table, progress
from coordinator.cli.plan import DEFAULT_DRAFT_PLACEMENT, DRAFT_PLACEMENTS, make_plan, model_config, quantization_scheme
from coordinator.launch import READY_TIMEOUT_S, TRANSPORTS, launched_sets
from coordinator.supervise import ShardLost


class _Stop(Exception):
    """SIGTERM: stop serving the way Ctrl-C does."""


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model_dir", metavar="DIR|ORG/NAME", help="Checkpoint directory or Hugging Face model id.")
@click.option("--synthetic", metavar="PRESET[:SEED]", help="Synthetic model instead of a checkpoint.")
@quantize_option
@click.option("--split", type=click.IntRange(1), help="This many shards, the layers split so that each holds about as many weight bytes.")
@click.option("--layers", "layer_spec", metavar="B:E,B:E,...", help="One shard per layer range.")
@devices_option
@click.option("--transport", type=click.Choice(TRANSPORTS), default="tcp", show_default=True)
@daemon_options
@click.option("--draft", metavar="DIR|synthetic[:LAYERS]", help="Also host this DFlash drafter (see --draft-placement).")
@click.option("--draft-placement", type=click.Choice(DRAFT_PLACEMENTS), default=DEFAULT_DRAFT_PLACEMENT, show_default=True,
              help="Where the drafter runs: its own daemon, or beside the first or the last shard's layers.")
@click.option("--ready-timeout", type=click.FloatRange(0, min_open=True), default=READY_TIMEOUT_S, show_default=True,
              help="Seconds to wait for the shards to load.")
@click.option("--dry-run", is_flag=True,
              help="Start nothing: print each daemon's layers and memory plan (weights by part, sequence state, the "
                   "rest, against --max-gpu-memory) from the model's config alone; exit 1 if one does not fit.")
@click.option("--json", "as_json", is_flag=True, help="Print the endpoints (with --dry-run, the plans) as JSON.")
def launch(model_dir, synthetic, quantize, split, layer_spec, devices, transport, draft, draft_placement, ready_timeout,
           dry_run, as_json, **daemon_values):
    """Start shard daemons (and the drafter with --draft, by default beside the last shard) on this machine, print their
    endpoints, serve until Ctrl-C or SIGTERM, then stop them all. Each daemon binds a free
    loopback port itself (or an ipc:// socket in a private directory). A daemon that dies or hangs is restarted on
    its endpoint (a few times, with backoff); one that cannot come back stops them all (exit 1).

    \b
    Examples:
      shardctl launch --synthetic small --split 2 --device cpu --json
      shardctl launch --synthetic qwen3.5-397b-a17b --quantize fp8-block --split 8 \
          --devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7 --max-gpu-memory 80GiB --dry-run
    """
    plan = make_plan(None, model_dir, synthetic, split, layer_spec, devices, transport, daemon_args_from(**daemon_values),
                     allow_endpoints=False, quantize=quantize, max_context=daemon_values["max_context"],
                     allow_long_context=daemon_values["allow_long_context"])
    if dry_run:
        print_dry_run(plan, synthetic, quantize, as_json, daemon_values, draft, draft_placement)
        return
    sets, draft_at = plan.sets_with_drafter(draft, draft_placement)

    def stop(signum, frame):
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        lost: list[str] = []  # the supervisor's line for a daemon that could not come back
        with launched_sets(sets, ready_timeout_s=ready_timeout, progress=progress, on_lost=lost.append) as started_sets:
            layer_shards = started_sets[0]
            drafters = started_sets[1] if len(started_sets) > 1 else []
            shards = layer_shards + drafters
            endpoints = [shard.endpoint for shard in layer_shards]
            draft_endpoint = started_sets[draft_at[0]][draft_at[1]].endpoint if draft_at else None
            if as_json:
                emit_json({"endpoints": endpoints, "draft_endpoint": draft_endpoint, "shards": [
                    {"endpoint": s.endpoint, "layers": None if s.layers is None else list(s.layers), "pid": s.process.pid,
                     "log": str(s.log_path)}
                    for s in shards]})
            else:
                click.echo(format_table(
                    ["LAYERS", "ENDPOINT", "PID", "LOG"],
                    [["drafter" if s.layers is None else f"{s.layers[0]}:{s.layers[1]}"
                      + (" + drafter" if s.layers is not None and s.endpoint == draft_endpoint else ""),
                      s.endpoint, s.process.pid, s.log_path]
                     for s in shards],
                ))
                click.echo(f"\n--shards {','.join(endpoints)}" + (f" --draft-shard {draft_endpoint}" if draft_endpoint else ""))
            sys.stdout.flush()
            progress("serving; Ctrl-C stops every shard")
            try:
                while True:
                    if lost:  # a daemon that died is restarted by the supervisor; this one could not be
                        raise ShardLost(f"{lost[0]}; stopping the others")
                    time.sleep(0.5)
            except (KeyboardInterrupt, _Stop):
                pass  # a requested stop: leave the block normally so the logs go too
        progress("stopped all shards")
    except (KeyboardInterrupt, _Stop):
        progress("interrupted while starting; stopped all shards")
    finally:
        signal.signal(signal.SIGTERM, previous)


def print_dry_run(plan, synthetic, quantize, as_json, daemon_values, draft=None, draft_placement="last") -> None:
    """Each daemon's memory plan, as `launch` would start them (the drafter where `draft_placement` puts it); exit 1
    when one does not fit its cap."""
    config = model_config(plan.model_dir, synthetic)
    scheme = quantization_scheme(plan.model_dir, quantize)
    limits = {name: daemon_values[name] for name in
              ("max_sequences", "max_context", "max_tokens_per_request", "max_verify_tokens", "rollback_mode")}
    plans = daemon_plans(config, plan.splits, scheme=scheme, model_dir=plan.model_dir, devices=plan.devices,
                         dtype=daemon_values["dtype"], max_gpu_memory=daemon_values["max_gpu_memory"], draft=draft,
                         draft_placement=draft_placement, **limits)
    model = plan.model_dir or synthetic
    quantization = scheme.layout if scheme is not None else None
    if as_json:
        emit_json({"model": model, "quantization": quantization, "moe": config.moe is not None,
                   "daemons": [daemon.describe() for daemon in plans]})
    else:
        click.echo(f"{model}: {config.num_layers} layers over {len(plans)} daemons"
                   + (f", linears {quantization}" if quantization else "") + "; GiB per daemon (dry run: nothing started)")
        click.echo(plans_table(plans))
        click.echo(plans_summary(plans))
    if not all(daemon.plan.fits() for daemon in plans):
        sys.exit(EXIT_FAILURE)
