"""Start shard daemons on this machine as child processes, wait until they serve, stop them.

Each daemon is `python -m shardd serve ...` on a free loopback TCP port (or an ipc://
socket in a private temporary directory). Its log goes to a file, so a daemon that
exits early is reported with the tail of what it said.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from coordinator.client import ShardClient, ShardTimeout

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TRANSPORTS = ("tcp", "ipc")
Progress = Callable[[str], None]


class LaunchError(RuntimeError):
    """A daemon could not be started or did not become ready."""


def split_layers(num_layers: int, n: int) -> list[tuple[int, int]]:
    """`n` contiguous ranges covering [0, num_layers), sizes differing by at most one
    (the earlier shards take the extra layers: the last one also carries the head)."""
    if not 1 <= n <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {n} shards (need 1 <= shards <= layers)")
    size, extra = divmod(num_layers, n)
    splits, begin = [], 0
    for index in range(n):
        end = begin + size + (1 if index < extra else 0)
        splits.append((begin, end))
        begin = end
    return splits


def parse_splits(spec: str) -> list[tuple[int, int]]:
    """'0:3,3:8' -> [(0, 3), (3, 8)] (coverage is the pipeline's to check)."""
    splits = []
    for part in spec.split(","):
        try:
            begin, end = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"layer ranges look like 0:3,3:8; got {spec!r}") from None
        if not 0 <= begin < end:
            raise ValueError(f"layer range {part!r} must have 0 <= BEGIN < END")
        splits.append((begin, end))
    return splits


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ShardProcess:
    endpoint: str
    layers: tuple[int, int]
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


def _child_env(threads_hint: Optional[int]) -> dict:
    env = dict(os.environ)
    # The children import this checkout's shardd, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    if threads_hint and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads_hint)
    return env


def start_shards(
    source_args: Sequence[str],
    splits: Sequence[tuple[int, int]],
    *,
    transport: str = "tcp",
    extra_args: Sequence[str] = (),
    devices: Optional[Sequence[str]] = None,
    shard_args: Optional[Sequence[Sequence[str]]] = None,
    run_dir: Path,
) -> list[ShardProcess]:
    """Spawn one daemon per split (not yet ready). `devices` and `shard_args` are per
    shard; `extra_args` go to every daemon. Logs and ipc sockets live in `run_dir`."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    devices = list(devices) if devices else ["cpu"] * len(splits)
    if len(devices) != len(splits):
        raise ValueError(f"{len(devices)} devices for {len(splits)} shards; give one device per shard")
    shard_args = list(shard_args) if shard_args else [()] * len(splits)
    # CPU daemons on one machine share its cores; without a hint each would take them all.
    cpu_shards = sum(1 for device in devices if device == "cpu")
    threads = max(1, (os.cpu_count() or 1) // cpu_shards) if cpu_shards else None
    shards: list[ShardProcess] = []
    ports: set[int] = set()
    try:
        for index, ((begin, end), device) in enumerate(zip(splits, devices)):
            if transport == "tcp":
                port = free_tcp_port()
                while port in ports:  # the OS may hand a just-probed port out again
                    port = free_tcp_port()
                ports.add(port)
                endpoint = f"tcp://127.0.0.1:{port}"
            else:
                endpoint = f"ipc://{run_dir / f'shard{index}.sock'}"
            command = [
                sys.executable, "-m", "shardd", "serve", *source_args,
                "--layers", f"{begin}:{end}", "--bind", endpoint, "--device", device,
                *extra_args, *shard_args[index],
            ]
            log_path = run_dir / f"shard{index}-{begin}-{end}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=_child_env(threads if device == "cpu" else None),
                )
            shards.append(ShardProcess(endpoint, (begin, end), process, log_path))
    except BaseException:
        stop_shards(shards)
        raise
    return shards


def wait_ready(shards: Sequence[ShardProcess], timeout_s: float = 300.0, progress: Optional[Progress] = None) -> None:
    """Until every daemon answers HELLO; LaunchError (with its log tail) if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    clients = {shard.endpoint: ShardClient(shard.endpoint, timeout_s=timeout_s) for shard in shards}
    try:
        for shard in shards:
            client = clients[shard.endpoint]
            while True:
                code = shard.process.poll()
                if code is not None:
                    raise LaunchError(
                        f"shard {shard.layers[0]}:{shard.layers[1]} at {shard.endpoint} exited with code {code} "
                        f"before it was ready; its log ({shard.log_path}) ends:\n{shard.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"shard {shard.layers[0]}:{shard.layers[1]} at {shard.endpoint} did not answer HELLO "
                        f"within {timeout_s:g} s; its log ({shard.log_path}) ends:\n{shard.log_tail()}"
                    )
                try:
                    client.hello(timeout_s=0.25)
                    break
                except ShardTimeout:
                    continue  # not bound yet, or still loading weights
            if progress is not None:
                progress(f"shard {shard.layers[0]}:{shard.layers[1]} ready at {shard.endpoint}")
    finally:
        for client in clients.values():
            client.close()


def stop_shards(shards: Sequence[ShardProcess], timeout_s: float = 10.0) -> None:
    """SIGTERM every daemon, wait for them together, SIGKILL what is left."""
    for shard in shards:
        if shard.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                shard.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for shard in shards:
        try:
            shard.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            shard.process.kill()
            shard.process.wait()


@contextlib.contextmanager
def launched_shards(
    source_args: Sequence[str],
    splits: Sequence[tuple[int, int]],
    transport: str = "tcp",
    extra_args: Sequence[str] = (),
    *,
    devices: Optional[Sequence[str]] = None,
    shard_args: Optional[Sequence[Sequence[str]]] = None,
    ready_timeout_s: float = 300.0,
    progress: Optional[Progress] = None,
    keep_logs: bool = False,
) -> Iterator[list[str]]:
    """Daemons for `splits` of the model named by `source_args` (`["--synthetic", "tiny"]`
    or `["--model", DIR]`), ready to serve; yields their endpoints in split order and
    stops them on exit. Logs are removed with the run directory unless `keep_logs` or
    something failed."""
    with launched_shard_processes(
        source_args, splits, transport, extra_args, devices=devices, shard_args=shard_args,
        ready_timeout_s=ready_timeout_s, progress=progress, keep_logs=keep_logs,
    ) as shards:
        yield [shard.endpoint for shard in shards]


@contextlib.contextmanager
def launched_shard_processes(
    source_args: Sequence[str],
    splits: Sequence[tuple[int, int]],
    transport: str = "tcp",
    extra_args: Sequence[str] = (),
    *,
    devices: Optional[Sequence[str]] = None,
    shard_args: Optional[Sequence[Sequence[str]]] = None,
    ready_timeout_s: float = 300.0,
    progress: Optional[Progress] = None,
    keep_logs: bool = False,
) -> Iterator[list[ShardProcess]]:
    """As `launched_shards`, yielding the `ShardProcess`es (endpoint, process, log path)."""
    # Short prefix and /tmp: an ipc:// path must fit in a unix socket address (~107 bytes).
    run_dir = Path(tempfile.mkdtemp(prefix="shardd-"))
    shards: list[ShardProcess] = []
    failed = True
    try:
        shards = start_shards(
            source_args, splits, transport=transport, extra_args=extra_args, devices=devices,
            shard_args=shard_args, run_dir=run_dir,
        )
        wait_ready(shards, ready_timeout_s, progress)
        yield shards
        failed = False
    finally:
        stop_shards(shards)
        # After a failure the logs stay: error messages point at them.
        if not keep_logs and not failed:
            shutil.rmtree(run_dir, ignore_errors=True)
