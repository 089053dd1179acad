"""`shardctl launch`: start shard daemons (and a drafter daemon) here, print their endpoints, serve until
Ctrl-C or SIGTERM, then stop them all."""

from __future__ import annotations

import signal
import sys
import time

import click

from coordinator.cli.options import daemon_args_from, daemon_options, devices_option, quantize_option
from coordinator.cli.output import emit_json, format_table, progress
from coordinator.cli.plan import DEFAULT_DRAFT_PLACEMENT, DRAFT_PLACEMENTS, make_plan
from coordinator.launch import READY_TIMEOUT_S, TRANSPORTS, launched_sets
from coordinator.supervise import ShardLost


class _Stop(Exception):
    """SIGTERM: stop serving the way Ctrl-C does."""


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model_dir", metavar="DIR|ORG/NAME", help="Checkpoint directory or Hugging Face model id.")
@click.option("--synthetic", metavar="PRESET[:SEED]", help="Synthetic model instead of a checkpoint.")
@quantize_option
@click.option("--split", type=click.IntRange(1), help="This many shards, layers split evenly.")
@click.option("--layers", "layer_spec", metavar="B:E,B:E,...", help="One shard per layer range.")
@devices_option
@click.option("--transport", type=click.Choice(TRANSPORTS), default="tcp", show_default=True)
@daemon_options
@click.option("--draft", metavar="DIR|synthetic[:LAYERS]", help="Also host this DFlash drafter (see --draft-placement).")
@click.option("--draft-placement", type=click.Choice(DRAFT_PLACEMENTS), default=DEFAULT_DRAFT_PLACEMENT, show_default=True,
              help="Where the drafter runs: its own daemon, or beside the first or the last shard's layers.")
@click.option("--ready-timeout", type=click.FloatRange(0, min_open=True), default=READY_TIMEOUT_S, show_default=True,
              help="Seconds to wait for the shards to load.")
@click.option("--json", "as_json", is_flag=True, help="Print the endpoints as JSON once ready.")
def launch(model_dir, synthetic, quantize, split, layer_spec, devices, transport, draft, draft_placement, ready_timeout, as_json,
           **daemon_values):
    """Start shard daemons (and the drafter with --draft, by default beside the last shard) on this machine, print their
    endpoints, serve until Ctrl-C or SIGTERM, then stop them all. Each daemon binds a free
    loopback port itself (or an ipc:// socket in a private directory). A daemon that dies or hangs is restarted on
    its endpoint (a few times, with backoff); one that cannot come back stops them all (exit 1).

    \b
    Example:
      shardctl launch --synthetic small --split 2 --device cpu --json
    """
    plan = make_plan(None, model_dir, synthetic, split, layer_spec, devices, transport, daemon_args_from(**daemon_values),
                     allow_endpoints=False, quantize=quantize, max_context=daemon_values["max_context"],
                     allow_long_context=daemon_values["allow_long_context"])
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
