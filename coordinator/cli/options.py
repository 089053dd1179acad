"""Options and argument checks several shardctl commands share, and the exit codes."""

from __future__ import annotations

import os
from typing import Optional

import click

from common.dtypes import DTYPE_CHOICES, dtype_name
from coordinator.tokenizer import BYTES
from coordinator.launch import TRANSPORTS
from coordinator.relay.client import CurveKeys
from coordinator.relay.liveness import LIVENESS_TIMEOUT_S
from coordinator.scheduler.block_size import AUTO, AUTO_LARGEST_BLOCK
from coordinator.scheduler.recovery import RECOVERY_TIMEOUT_S
from protocol.layout import SHARD_ROLLBACK_MODES

# Exit codes, one per cause (the same in README.md and `shardctl --help`): a shard lost or failing while running
# (down past --recovery-timeout, an error reply, a timeout); a usage error (click's own 2); outputs that differ;
# a start-up failure (a launched daemon that exits or does not become ready, a port in use, a missing extra).
EXIT_FAILURE, EXIT_USAGE, EXIT_DIFFER, EXIT_START = 1, 2, 3, 4
# Seconds to wait for a shard's reply, the same for every command (a first step on a GPU may compile kernels).
TIMEOUT_S = 60.0


class MissingExtra(RuntimeError):
    """A command needs an optional dependency that is not installed: name it and the command that installs it."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(f"this command needs {module!r}, from shardd's {extra!r} extra: pip install 'shardd[{extra}]' "
                         f"(from a clone: pip install -e '.[{extra}]')")


recovery_timeout_option = click.option(
    "--recovery-timeout", type=click.FloatRange(0), default=RECOVERY_TIMEOUT_S, show_default=True,
    help="Seconds a lost shard is retried (restarted on its endpoint, re-filled from the history) before giving up.")


pipeline_groups_option = click.option(
    "--pipeline-groups", type=click.IntRange(1), default=1, show_default=True, metavar="N",
    help="Micro-batches in flight over shards that pass rows on themselves: the running streams in N groups, one "
         "group's step in each shard at once (N = the shards keeps each busy); outputs stay each request's alone.")


liveness_timeout_option = click.option(
    "--liveness-timeout", type=click.FloatRange(0.1), default=LIVENESS_TIMEOUT_S, show_default=True,
    help="Seconds without a heartbeat (or a connection) after which a shard counts as down, apart from compute time.")


def _busy_poll_ms(ctx, param, value) -> Optional[float]:
    """--busy-poll-ms as milliseconds, or None for auto (follow the daemons: common.busy_poll.follow_busy_poll)."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        ms = float(value)
    except ValueError:
        raise click.BadParameter(f"a number of milliseconds in [0, 1000] or auto, got {value!r}") from None
    if not 0 <= ms <= 1000:  # also refuses nan
        raise click.BadParameter(f"must be within [0, 1000], got {value!r}")
    return ms


def seconds(busy_poll_ms: Optional[float]) -> Optional[float]:
    """--busy-poll-ms's value in seconds, None (auto) kept."""
    return None if busy_poll_ms is None else busy_poll_ms / 1000


def busy_poll_option(default: str):
    return click.option(
        "--busy-poll-ms", default=default, show_default=True, callback=_busy_poll_ms, metavar="MS|auto",
        help="Poll for each shard's reply without sleeping for this long (a core kept busy, no wake-up on the reply's "
             "way in), and launched shards the same for their next request (shardd serve --busy-poll-ms). auto: "
             "as the shards do (they poll on a GPU host with at least 8 usable CPUs), when this host has 8 too. Both "
             "ends polling shorten the relay between daemons; on a small host it takes the cores the daemons need.")


class BlockSize(click.ParamType):
    """--block-size: rows of a verify block (at least 2), or `auto` (coordinator.scheduler.block_size)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or str(value).strip().lower() == AUTO:
            return value if isinstance(value, int) else AUTO
        try:
            rows = int(value)
        except ValueError:
            self.fail(f"a number of tokens (at least 2) or auto, got {value!r}", param, ctx)
        if rows < 2:
            self.fail(f"must be at least 2 (a token and a draft), got {rows}", param, ctx)
        return rows


block_size_option = click.option(
    "--block-size", type=BlockSize(), default=16, show_default=True,
    help="Tokens per verify step, or auto: per sequence and step, the block (2 to 16) with the most tokens "
         "expected per byte moved, from the sequence's acceptance rate, the rollback record each row writes and, on "
         "a MoE target, the distinct experts a block's rows select. Greedy output is the same whatever the block.")


def block_size_limit(block_size) -> int:
    """The most rows a verify block takes: the fixed size, or auto's largest."""
    return AUTO_LARGEST_BLOCK if block_size == AUTO else block_size


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


def check_mean_commit(drafter: str, mean_commit: float, block_size: int) -> None:
    # Checked before any shard starts: the oracle takes 1 .. block_size tokens per step.
    if drafter == "oracle" and not 1 <= mean_commit <= block_size:
        raise click.BadParameter(f"must be within [1, --block-size {block_size}], got {mean_commit:g}", param_hint="--mean-commit")


def _apply(options: list, func):
    for option in reversed(options):
        func = option(func)
    return func


curve_options = [
    click.option("--curve-server-key", type=click.Path(exists=True, dir_okay=False), envvar="SHARDCTL_CURVE_SERVER_KEY",
                 help="CurveZMQ: the shards' public key file (NAME.key from `shardd keygen`), for --shards off loopback."),
    click.option("--curve-client-key", type=click.Path(exists=True, dir_okay=False), envvar="SHARDCTL_CURVE_CLIENT_KEY",
                 help="CurveZMQ: this client's secret key file (NAME.key_secret); its public key must be allowed."),
]


devices_option = click.option("--device", "--devices", "devices", metavar="DEV[,DEV,...]",
                              help="Device of each launched shard, e.g. cuda:0,cuda:1 (one value: all). Default cpu.")
# `--quantize` of the daemons a command launches for --synthetic (shardd serve --quantize): FP8 without make-model.
quantize_option = click.option(
    "--quantize", type=click.Choice(("fp8-block", "fp8-channel")), default=None,
    help="With --synthetic: the launched daemons hold the linears as FP8 in this layout (fp8-block: 128x128 scales; "
         "fp8-channel: one per row), as `shardctl make-model --quantize` writes them.")
timeout_option = click.option("--timeout", type=click.FloatRange(0, min_open=True), default=TIMEOUT_S, show_default=True,
                              help="Seconds to wait for a shard's reply (a shard that is slow to answer is named at once).")


def shard_source_options(func):
    """--shards | --model/--synthetic with --split/--layers, for commands that use shards."""
    return _apply([
        click.option("--shards", metavar="EP,EP,...", help="Endpoints of running shard daemons."),
        click.option("--model", "model_dir", metavar="DIR|ORG/NAME",
                     help="Checkpoint directory or Hugging Face model id (downloaded to its cache): launch local shards for it."),
        click.option("--synthetic", metavar="PRESET[:SEED]", help="Synthetic model: launch local shards for it."),
        click.option("--split", type=click.IntRange(1), help="Launch this many shards, the layers split so that each holds about as many weight bytes."),
        click.option("--layers", "layer_spec", metavar="B:E,B:E,...", help="Launch shards for these layer ranges."),
        devices_option,
        click.option("--transport", type=click.Choice(TRANSPORTS), default="tcp", show_default=True,
                     help="Endpoints of launched shards: loopback TCP or ipc:// sockets."),
        dtype_option,
        timeout_option,
        *curve_options,
    ], func)


capacity_options = [
    click.option("--max-sequences", "--max-num-seqs", "max_sequences", type=click.IntRange(1), default=None,
                 help="Open sequences per launched shard (default: shardd's 8; generate: 1, its one sequence, so "
                      "the fast step is one sequence's rows)."),
    click.option("--max-context", "--max-model-len", "max_context", type=click.IntRange(1), default=None,
                 help="Tokens per sequence (shardd's default: 4096), at most the model's max_position_embeddings."),
    click.option("--allow-long-context", is_flag=True, default=None,
                 help="Allow --max-context past the model's max_position_embeddings (positions it was not trained on)."),
]


def launched_capacity_options(func):
    """--max-sequences/--max-context for the shards a command launches (with --shards, the daemons' own)."""
    return _apply(capacity_options, func)


max_gpu_memory_option = click.option(
    "--max-gpu-memory", metavar="SIZE|FRACTION", default=None,
    help="Each daemon's memory cap (shardd serve --max-gpu-memory: 24GiB, or 0.9 of its device); a daemon whose plan "
         "does not fit refuses to start, naming each part.")
prefix_cache_option = click.option(
    "--prefix-cache-gib", metavar="GIB|auto", default=None,
    help="Each launched daemon's prefix cache (shardd serve --prefix-cache-gib; default auto, 0: none).")


def daemon_options(func):
    """Options passed through to every launched daemon (only when given)."""
    return _apply([
        dtype_option,
        click.option("--max-verify-tokens", type=click.IntRange(0), default=None,
                     help="Rollback storage per sequence, in tokens (0: none)."),
        click.option("--rollback-mode", "--rollback", "rollback_mode", type=click.Choice(SHARD_ROLLBACK_MODES), default=None,
                     help="Rollback storage kind: checkpoint or replay-ssm."),
        *capacity_options,
        click.option("--max-tokens-per-request", type=click.IntRange(1), default=None),
        max_gpu_memory_option,
    ], func)


def daemon_args_from(**values) -> list[str]:
    """`shardd serve` arguments for the options that were given: max_context=8 -> --max-context 8, a flag that is
    set (True) -> --allow-long-context."""
    args = []
    for name, value in values.items():
        if value is True:
            args.append(f"--{name.replace('_', '-')}")
        elif value is not None and value is not False:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def _tokenizer_dir(ctx, param, value) -> Optional[str]:
    if value is None or value == BYTES:
        return value
    if not os.path.isdir(value):
        raise click.BadParameter(f"{value!r} is not a directory (give the one holding tokenizer.json, or 'bytes')")
    return value


tokenizer_option = click.option(
    "--tokenizer", "tokenizer_dir", metavar="DIR|bytes", callback=_tokenizer_dir,
    help="Directory with tokenizer.json (and the chat template); default: --model's, else the shards'. A model "
         "without one takes token ids only; 'bytes' tokenizes text as its UTF-8 bytes.")


def _dtype(ctx, param, value) -> Optional[str]:
    return None if value is None else dtype_name(value)


dtype_option = click.option(
    "--dtype", type=click.Choice(DTYPE_CHOICES, case_sensitive=False), default=None, callback=_dtype,
    help="Weight dtype of launched shards (bf16, fp16 as vLLM spells them). Default auto: on a GPU the checkpoint's "
         "dtype, bfloat16 for a float32 or synthetic model; on the CPU float32.")


# vLLM's flags whose meaning differs from any of ours, each refused with the one to use instead.
VLLM_FLAGS = {
    "--gpu-memory-utilization": "each daemon's cap is `shardd serve --max-gpu-memory SIZE|FRACTION`",
    "--max-num-batched-tokens": "the rows of one scheduler step are `shardctl serve --batch-rows ROWS`",
    "--tensor-parallel-size": "shardd splits a model by layers, one shard per GPU: --split N --devices cuda:0,...",
    "--pipeline-parallel-size": "shardd's layer split is --split N (or --layers B:E,...) with --devices",
    "--chat-template": "the chat template comes from the model directory (--tokenizer DIR names another)",
    "--trust-remote-code": "shardd runs only its own Qwen3.5 code, never a checkpoint's: drop the flag",
}


def _refuse_vllm_flag(ctx, param, value) -> None:
    if value:
        name = param.opts[0]
        raise click.UsageError(f"{name} is vLLM's flag, not shardctl's: {VLLM_FLAGS[name]}")


def vllm_flag_refusals(func):
    """vLLM's flag names that shardctl does not take, refused with a hint naming ours (not click's guess)."""
    flags = {"--trust-remote-code"}
    return _apply([click.option(name, is_flag=name in flags, hidden=True, expose_value=False, is_eager=True,
                                callback=_refuse_vllm_flag) for name in VLLM_FLAGS], func)


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
    """The same keys for a `shardctl` child process."""
    return ["--curve-server-key", server_key, "--curve-client-key", client_key] if server_key else []
