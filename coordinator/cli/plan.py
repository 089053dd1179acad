"""Where a command's shards come from: endpoints of running daemons (`--shards`), or daemons to
launch here for a model (`--model`/`--synthetic` with `--split`/`--layers`), and the drafter daemon."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import click

from common.endpoints import endpoint_problem, ipc_file, ipc_in_use
from common.hub import ModelNotFound, resolve_model
from common.model_config import ModelConfig, check_quantization, context_problem, load_config, read_config_json
from common.presets import parse_synthetic, preset_config
from common.quantization import Fp8Scheme, synthetic_scheme
from common.shapes import layer_split_costs
from coordinator.cli.options import parse_list, seconds
from coordinator.cli.output import progress
from coordinator.launch import ShardSet, drafter_set, launched_sets
from coordinator.relay.client import CurveKeys, ShardClient, ShardTimeout, ShardUnavailable
from coordinator.relay.liveness import LIVENESS_TIMEOUT_S
from coordinator.relay.pipeline import Pipeline
from coordinator.relay.shards import PipelineError
from protocol import Hello
from protocol.layout import REPLAY, balanced_split, check_layer_range, coverage_problems, parse_layer_ranges


# Where a launched DFlash drafter runs: its own daemon, or beside the first or the last shard's layers (`--draft` on
# that shard's daemon: no third process, and it borrows that shard's embedding or head instead of loading one).
# Beside the last shard it proposes inside the verify reply (no PROPOSE round trip per step), hence the default;
# `scripts/bench_gpu.py --parts dflash` measures every placement (docs/performance.md).
DRAFT_PLACEMENTS = ("own", "first", "last")
DEFAULT_DRAFT_PLACEMENT = "last"


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
    draft_placement: str = DEFAULT_DRAFT_PLACEMENT  # where a launched drafter runs (--draft-placement)

    @property
    def launches(self) -> bool:
        return not self.endpoints

    def shard_set(self, mode_args: Sequence[str] = ()) -> ShardSet:
        return ShardSet(self.source_args, self.splits, self.transport, (*self.daemon_args, *mode_args), self.devices or None)

    def sets_with_drafter(self, draft: Optional[str], placement: str = DEFAULT_DRAFT_PLACEMENT,
                          mode_args: Sequence[str] = ()) -> tuple[list[ShardSet], Optional[tuple[int, int]]]:
        """The sets to launch and where the drafter's endpoint will be: (set index, daemon index), None without
        a drafter. `placement` "first" / "last" gives that shard `--draft`; "own" adds a drafter-only daemon."""
        if draft is None:
            return [self.shard_set(mode_args)], None
        if placement == "own":
            return [self.shard_set(mode_args), self.drafter_set(draft)], (1, 0)
        if placement not in DRAFT_PLACEMENTS:
            raise ValueError(f"draft placement must be one of {', '.join(DRAFT_PLACEMENTS)}, got {placement!r}")
        index = 0 if placement == "first" else len(self.splits) - 1
        shard_args = tuple(("--draft", draft) if i == index else () for i in range(len(self.splits)))
        shards = ShardSet(self.source_args, self.splits, self.transport, (*self.daemon_args, *mode_args),
                          self.devices or None, shard_args)
        return [shards], (0, index)

    def drafter_set(self, draft: str) -> ShardSet:
        """A drafter-only daemon for this model, on the last shard's device."""
        return drafter_set(self.source_args, draft, self.transport, self.daemon_args, self.devices[-1] if self.devices else "cpu")

    @contextlib.contextmanager
    def running(self, mode_args: Sequence[str] = ()) -> Iterator[list[str]]:
        """The endpoints to talk to: the given ones, or freshly launched daemons (stopped on exit)."""
        with self.running_with_drafter(mode_args) as (endpoints, _):
            yield endpoints

    @contextlib.contextmanager
    def running_with_drafter(self, mode_args: Sequence[str] = (), on_lost: Optional[Callable[[str], None]] = None
                             ) -> Iterator[tuple[list[str], Optional[str]]]:
        """The shard endpoints and the drafter's endpoint (None without a drafter). Launched shards get the
        plan's --draft where its placement says: its own daemon, or beside the first or the last shard; they are
        supervised (restarted when they die or hang), and `on_lost` hears of one that cannot come back."""
        if not self.launches:
            yield list(self.endpoints), self.draft_endpoint
            return
        sets, draft_at = self.sets_with_drafter(self.draft, self.draft_placement, mode_args)
        drafter_note = f" and a drafter ({self.draft}, {self.draft_placement})" if self.draft is not None else ""
        progress(f"launching {len(self.splits)} shard(s) {', '.join(f'{b}:{e}' for b, e in self.splits)}{drafter_note} "
                 f"({' '.join(self.source_args)})")
        started = time.perf_counter()
        with launched_sets(sets, progress=progress, on_lost=on_lost) as started_sets:
            progress(f"shards ready in {time.perf_counter() - started:.1f} s")
            draft_endpoint = started_sets[draft_at[0]][draft_at[1]].endpoint if draft_at is not None else None
            yield [shard.endpoint for shard in started_sets[0]], draft_endpoint


def model_config(model_dir: Optional[str], synthetic: Optional[str]) -> ModelConfig:
    try:
        if model_dir is not None:
            return load_config(model_dir)
        return preset_config(parse_synthetic(synthetic)[0])
    except ValueError as error:
        raise click.UsageError(str(error)) from None


def quantization_scheme(model_dir: Optional[str], quantize: Optional[str]) -> Optional[Fp8Scheme]:
    """How the launched daemons' linears are stored: the checkpoint's FP8 scheme, --quantize's, or None."""
    try:
        if model_dir is not None:
            return check_quantization(read_config_json(model_dir), model_dir)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    return synthetic_scheme(quantize) if quantize else None


def split_by_bytes(config: ModelConfig, parts: int, scheme: Optional[Fp8Scheme], on_gpu: bool) -> list[tuple[int, int]]:
    """--split N: the ranges whose heaviest holds the fewest weight bytes (MoE layers, attention and GDN layers,
    the embedding and the head weigh differently). Only the ratios matter: FP8 linears stay FP8 beside 16-bit
    embedding and head on a GPU, and are dequantized to the weight dtype on the CPU, as the daemons load them."""
    return balanced_split(layer_split_costs(config, dtype_bytes=2, scheme=scheme if on_gpu else None), parts)


def checked_endpoint(endpoint: str, option: str) -> str:
    """`endpoint` as `option` gave it, or a usage error naming what is wrong with it."""
    problem = endpoint_problem(endpoint)
    if problem is not None:
        raise click.BadParameter(problem, param_hint=option)
    return endpoint


def shard_endpoints(shards: str) -> list[str]:
    """--shards EP,EP,... as endpoints, each well formed (a usage error naming the first that is not)."""
    endpoints = parse_list(shards)
    if not endpoints:
        raise click.BadParameter("name at least one endpoint", param_hint="--shards")
    return [checked_endpoint(endpoint, "--shards") for endpoint in endpoints]


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
    quantize: Optional[str] = None,
    max_context: Optional[int] = None,
    allow_long_context: bool = False,
) -> ShardPlan:
    given = [name for name, value in (("--shards", shards), ("--model", model_dir), ("--synthetic", synthetic)) if value]
    choices = "--shards EP,EP,... or --model DIR or --synthetic PRESET" if allow_endpoints else "--model DIR or --synthetic PRESET"
    if len(given) != 1 or (given == ["--shards"] and not allow_endpoints):
        raise click.UsageError(f"give exactly one of {choices}" + (f" (got {', '.join(given)})" if given else ""))
    if quantize and not synthetic:
        raise click.UsageError("--quantize goes with --synthetic (it sets the launched daemons' synthetic weights); "
                               "a checkpoint's config.json says how it is quantized")
    if shards:
        if split or layer_spec or devices:
            raise click.UsageError("--split, --layers and --devices launch shards; with --shards the shards already run")
        return ShardPlan(endpoints=shard_endpoints(shards))
    if curve:
        raise click.UsageError("CurveZMQ keys are for --shards off loopback; launched shards listen on loopback")
    if (split is None) == (layer_spec is None):
        raise click.UsageError("launching shards needs exactly one of --split N or --layers 0:3,3:8")
    if model_dir is not None:
        try:  # a hub id becomes its snapshot directory here, once: the daemons get the directory
            model_dir = resolve_model(model_dir)
        except ModelNotFound as error:
            raise click.UsageError(str(error)) from None
    config = model_config(model_dir, synthetic)
    num_layers = config.num_layers
    problem = context_problem(max_context or 0, config.max_position_embeddings, bool(allow_long_context))
    if problem is not None:  # before any daemon starts, as the daemons would refuse it
        raise click.BadParameter(problem, param_hint="--max-context")
    device_list = tuple(parse_list(devices))
    try:
        on_gpu = any(device.startswith("cuda") for device in device_list)
        splits = split_by_bytes(config, split, quantization_scheme(model_dir, quantize), on_gpu) if split else \
            parse_layer_ranges(layer_spec)
        for begin, end in splits:
            check_layer_range(begin, end, num_layers)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    # Refused before any daemon starts. `shardctl launch` may start a contiguous part of a model; shards a command
    # drives itself must form all of it.
    low, high = (0, num_layers) if allow_endpoints else (min(b for b, _ in splits), max(e for _, e in splits))
    problems = coverage_problems([(b - low, e - low) for b, e in splits], high - low,
                                 [f"layers {b}:{e}" for b, e in splits])
    if problems:
        raise click.BadParameter(f"the shards must form the model's {num_layers} layers: {'; '.join(problems)}",
                                 param_hint="--layers")
    if device_list and len(device_list) not in (1, len(splits)):
        raise click.UsageError(f"--devices lists {len(device_list)} devices for {len(splits)} shards: give one, or one per shard")
    source_args = ("--model", str(model_dir)) if model_dir else ("--synthetic", synthetic)
    if quantize:
        source_args += ("--quantize", quantize)
    return ShardPlan(
        source_args=source_args, model_dir=model_dir, splits=tuple(splits), transport=transport,
        devices=device_list, daemon_args=tuple(daemon_args),
    )


def mode_daemon_args(rollback: str, block_size: int, speculating: bool) -> list[str]:
    """Daemon options a launched shard set needs for this rollback mode."""
    if speculating and rollback != REPLAY:
        return ["--rollback-mode", rollback, "--max-verify-tokens", str(max(16, block_size))]
    return ["--max-verify-tokens", "0"]  # replay (and plain greedy) needs no rollback storage


def dflash_daemon(plan: ShardPlan, draft_shard: Optional[str], draft: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(running drafter endpoint, drafter to launch) for --drafter dflash; one of them is None."""
    if not plan.launches:
        if draft:
            raise click.UsageError("--draft launches a drafter daemon; with --shards give the running one as --draft-shard")
        if not draft_shard:
            raise click.UsageError("--drafter dflash with --shards needs --draft-shard EP (a daemon started with --draft)")
        return checked_endpoint(draft_shard, "--draft-shard"), None
    if draft_shard:
        raise click.UsageError("--draft-shard names a running drafter daemon; launched shards get one from --draft")
    if draft is None:
        if plan.model_dir is not None:
            if not (Path(plan.model_dir) / "draft" / "config.json").is_file():
                raise click.UsageError(
                    f"{plan.model_dir} has no draft/ (shardctl make-model --with-drafter writes one): give --draft DIR|synthetic"
                )
            draft = str(Path(plan.model_dir) / "draft")
        else:
            draft = "synthetic"
    return None, draft


class ShardUnreachable(ConnectionError):
    """Nothing listens at a shard's endpoint: no point waiting for a reply."""


def not_listening(endpoint: str) -> Optional[str]:
    """Why nothing can be listening at `endpoint` (refused, no socket file), or None when something may be."""
    path = ipc_file(endpoint)
    if path is not None:
        if not os.path.exists(path):
            return f"no socket file {path}"
        return None if ipc_in_use(path) else f"{path} is a stale socket file: no process serves it"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
        except ConnectionRefusedError:
            return "connection refused"
        except (OSError, ValueError):
            return None  # unreachable or slow: the HELLO's timeout decides
    return None


# A daemon binds its socket within seconds of starting (before it loads weights): a shard with nothing
# listening for this long is down, not starting, so a dead shard is reported within seconds.
START_GRACE_S = 10.0


def handshake_refusal(endpoint: str, curve: Optional[CurveKeys], wait_s: float = 1.0) -> Optional[str]:
    """Why the daemon at a tcp:// endpoint refuses this client's ZeroMQ handshake (CurveZMQ wanted and not given,
    or the other way round), read from the security mechanism in its ZMTP greeting; None when the mechanisms
    agree or nothing is said within `wait_s`. A refused handshake otherwise looks like a daemon that is silent.
    (libzmq's monitor events race with the connection reset the refusal causes; the greeting does not.)"""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=wait_s) as probe:
            probe.sendall(ZMTP_SIGNATURE + bytes((3, 1)))  # ZMTP 3.1: the daemon answers with its whole greeting
            greeting = b""
            while len(greeting) < 32:
                chunk = probe.recv(64 - len(greeting))
                if not chunk:
                    break
                greeting += chunk
    except (OSError, ValueError):
        return None
    if len(greeting) < 32 or greeting[:1] != b"\xff":
        return None
    mechanism = greeting[12:32].rstrip(b"\0").decode("ascii", "replace")
    if mechanism == "CURVE" and curve is None:
        return ("the shard wants CurveZMQ keys: give --curve-server-key (the shard's NAME.key) and "
                "--curve-client-key (this client's NAME.key_secret, allowed by the daemon)")
    if mechanism == "NULL" and curve is not None:
        return "the shard does not use CurveZMQ: leave out --curve-server-key and --curve-client-key"
    return None


# A ZMTP 3 greeting starts with this signature, then the version (major, minor) and the mechanism name (RFC 23).
ZMTP_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"


def hello_or_wait(client: ShardClient, timeout: float, *, wait_to_start: bool = True,
                  curve: Optional[CurveKeys] = None) -> dict:
    """HELLO. A shard that is not up yet, or does not answer within a second, is named on stderr at once;
    one that is not listening is waited for up to START_GRACE_S (a daemon just started), one that is
    listening but silent (loading its weights) up to `timeout`. With `wait_to_start=False` (status: a
    snapshot) nothing listening fails at once."""
    started = time.monotonic()
    deadline = started + timeout
    reason = not_listening(client.endpoint)
    if reason is not None and wait_to_start:
        grace = min(timeout, START_GRACE_S)
        progress(f"waiting for the shard at {client.endpoint} to start: nothing is listening yet ({reason}); "
                 f"giving up after {grace:g} s")
        while reason is not None and time.monotonic() < started + grace:
            time.sleep(0.2)
            reason = not_listening(client.endpoint)
    if reason is not None:
        waited = f" after {time.monotonic() - started:.0f} s" if wait_to_start else ""
        raise ShardUnreachable(f"{client.endpoint}: nothing is listening ({reason}){waited}; is the daemon running?")
    try:
        sent = client.send(Hello(id=0), max(0.001, min(1.0, deadline - time.monotonic())))
    except ShardUnavailable:  # listening, but no handshake within a second: a refused one, or a busy daemon
        refusal = handshake_refusal(client.endpoint, curve)
        if refusal is not None:
            raise ShardUnreachable(f"{client.endpoint}: {refusal}") from None
        if time.monotonic() >= deadline:
            raise
        sent = client.send(Hello(id=0), max(0.001, min(client.liveness_timeout_s, deadline - time.monotonic())))
    try:
        return client.receive(sent, max(0.001, min(1.0, deadline - time.monotonic()))).result
    except ShardTimeout:
        refusal = handshake_refusal(client.endpoint, curve)
        if refusal is not None:
            raise ShardUnreachable(f"{client.endpoint}: {refusal}") from None
        if time.monotonic() >= deadline:
            raise ShardTimeout(client.endpoint, "HELLO", timeout) from None
    progress(f"waiting for the shard at {client.endpoint}: no answer to HELLO yet (still loading its weights?); "
             f"giving up after {timeout:g} s")
    try:
        return client.receive(sent, max(0.001, deadline - time.monotonic())).result
    except ShardTimeout:
        raise ShardTimeout(client.endpoint, "HELLO", timeout) from None


def connect_pipeline(endpoints: Sequence[str], timeout: float, curve: Optional[CurveKeys] = None,
                     liveness_timeout: float = LIVENESS_TIMEOUT_S, busy_poll_ms: Optional[float] = 0.0) -> Pipeline:
    """`busy_poll_ms` None: each client follows its daemon's polling (common.busy_poll.follow_busy_poll)."""
    for endpoint in endpoints:
        with ShardClient(endpoint, timeout_s=timeout, curve=curve, liveness_timeout_s=liveness_timeout) as client:
            hello_or_wait(client, timeout, curve=curve)
    try:
        return Pipeline.connect(endpoints, timeout_s=timeout, curve=curve, liveness_timeout_s=liveness_timeout,
                                busy_poll_s=seconds(busy_poll_ms))
    except PipelineError as error:
        raise click.UsageError(str(error)) from None
