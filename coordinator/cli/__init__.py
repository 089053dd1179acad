"""`shardctl`: make models, launch shards, generate, inspect, benchmark, demo; one module per command.

Results go to stdout (a table, streamed text, or one JSON document with `--json`);
progress and diagnostics go to stderr. Exit codes: 0 ok, 1 runtime failure (a shard
error, timeout or crash), 2 usage error (including options the shard set cannot
serve), 3 outputs differ (speculative output not identical to greedy).
"""

from __future__ import annotations

import signal

import click

from common import __version__
from coordinator.cli.bench import BenchError, bench
from coordinator.cli.demo import demo
from coordinator.cli.generate import generate
from coordinator.cli.launch import launch
from coordinator.cli.make_model import MakeModelFailed, make_model
from coordinator.cli.options import EXIT_FAILURE, MissingExtra
from coordinator.cli.plan import ShardUnreachable
from coordinator.cli.serve import serve
from coordinator.cli.status import status
from coordinator.launch import LaunchError
from coordinator.relay.client import ShardTimeout
from coordinator.relay.shards import PipelineError
from coordinator.relay.target import RollbackFailed, SequenceLost
from protocol import ProtocolError

RUNTIME_ERRORS = (ProtocolError, ShardTimeout, ShardUnreachable, PipelineError, LaunchError, BenchError, SequenceLost,
                  RollbackFailed, MissingExtra, MakeModelFailed)


class ShardctlGroup(click.Group):
    """Runtime failures become one line on stderr and exit code 1, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RUNTIME_ERRORS as error:
            click.echo(f"shardctl: error: {error}", err=True)
            ctx.exit(EXIT_FAILURE)


@click.group(cls=ShardctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="shardctl")
def cli():
    """Drive shard daemons: layer-split speculative decoding of Qwen3.5 hybrid models.

    \b
    Example:
      shardctl demo
      shardctl generate --synthetic small --split 2 --prompt "hello" --drafter oracle
    """


for command in (make_model, launch, generate, serve, status, bench, demo):
    cli.add_command(command)


def main() -> None:
    # SIGTERM unwinds like Ctrl-C: open sequences are closed on the shards, launched daemons stopped.
    signal.signal(signal.SIGTERM, _terminate)
    cli(prog_name="shardctl")


def _terminate(signum, frame):
    raise SystemExit(128 + signum)
