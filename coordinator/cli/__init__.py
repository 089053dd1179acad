"""`shardctl`: make models, launch shards, generate, inspect, benchmark, demo; one module per command.

Results go to stdout (a table, streamed text, or one JSON document with `--json`);
progress and diagnostics go to stderr. Exit codes are in `EXIT_CODES` (shown by `shardctl --help`).
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
from coordinator.cli.options import EXIT_FAILURE, EXIT_START, MissingExtra, vllm_flag_refusals
from coordinator.cli.plan import ShardUnreachable
from coordinator.cli.serve import serve
from coordinator.cli.status import status
from coordinator.launch import LaunchError
from coordinator.relay.client import ShardTimeout
from coordinator.relay.shards import PipelineError
from coordinator.relay.target import RollbackFailed, SequenceLost
from coordinator.supervise import ShardLost
from protocol import ProtocolError

RUNTIME_ERRORS = (ProtocolError, ShardTimeout, ShardUnreachable, PipelineError, LaunchError, BenchError, SequenceLost,
                  RollbackFailed, MissingExtra, MakeModelFailed, ShardLost)


# What failed to start, as against what failed while running.
START_ERRORS = (LaunchError, MissingExtra)


class ShardctlGroup(click.Group):
    """Failures become one line on stderr and the exit code of their cause, not a traceback."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Python hands bytes that are not UTF-8 in as lone surrogates; refused here, before any command sees them.
        for arg in args:
            if any("\udc80" <= char <= "\udcff" for char in arg):
                shown = arg.encode("utf-8", "surrogateescape")
                raise click.UsageError(f"argument {str(shown)[1:]} is not UTF-8 text: pass text as UTF-8 "
                                       f"(a prompt's token ids as --prompt-ids)")
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RUNTIME_ERRORS as error:
            click.echo(f"shardctl: error: {error}", err=True)
            ctx.exit(EXIT_START if isinstance(error, START_ERRORS) else EXIT_FAILURE)


@click.group(cls=ShardctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="shardctl")
def cli():
    """Drive shard daemons: layer-split speculative decoding of Qwen3.5 hybrid models.

    \b
    Example:
      shardctl demo
      shardctl generate --synthetic small --split 2 --prompt "hello" --drafter oracle

    \b
    Exit codes:
      0  ok
      1  a shard lost or failing while running (down past --recovery-timeout, an error, a timeout)
      2  a usage error (a flag, a value, a combination the shards cannot serve)
      3  outputs differ (demo, bench: speculative output not identical to greedy)
      4  a start-up failure (a launched daemon exited or never became ready, a port in use, a missing extra)
    """


for command in (make_model, launch, generate, serve, status, bench, demo):
    click.version_option(__version__, "-V", "--version", prog_name="shardctl")(command)
    cli.add_command(command)
for command in (launch, generate, serve, bench):
    vllm_flag_refusals(command)


def main() -> None:
    # SIGTERM unwinds like Ctrl-C: open sequences are closed on the shards, launched daemons stopped.
    signal.signal(signal.SIGTERM, _terminate)
    cli(prog_name="shardctl")


def _terminate(signum, frame):
    raise SystemExit(128 + signum)
