"""Start shard daemons (and drafter daemons) on this machine as child processes, wait until
they serve, stop them.

Each daemon is `python -m shardd serve ...` on `tcp://127.0.0.1:*` (the daemon binds a free
port itself, before it loads its weights, and writes the endpoint it got to a file: no
probing for free ports, which races) or on an ipc:// socket in a private temporary
directory. Its log goes to a file, so a daemon that exits early is reported with the tail
of what it said.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from coordinator.relay.client import CurveKeys, ShardClient, ShardTimeout, ShardUnavailable
from coordinator.supervise import Supervisor
from protocol import Hello

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TRANSPORTS = ("tcp", "ipc")
Progress = Callable[[str], None]


class LaunchError(RuntimeError):
    """A daemon could not be started or did not become ready. `log_path` names its log; `launched_sets` moves it to
    the cache before the run directory goes, so the message names a file that still exists."""

    def __init__(self, reason: str, log_path: Optional[Path] = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.log_path = log_path

    def __str__(self) -> str:
        return self.reason if self.log_path is None else f"{self.reason} (log: {self.log_path})"


READY_TIMEOUT_S = 600.0  # loading 27B of weights from a slow disk takes minutes


@dataclass
class ShardProcess:
    endpoint: str  # as asked (tcp://127.0.0.1:*) until `wait_bound` reads the one the daemon got
    layers: Optional[tuple[int, int]]  # None: a drafter-only daemon
    process: subprocess.Popen
    log_path: Path
    endpoint_file: Optional[Path] = None
    command: tuple[str, ...] = ()  # how it was started: a restart runs it again on the endpoint it got
    env: Optional[dict] = None

    def restart(self) -> None:
        """Start the daemon again on the endpoint it bound (its log appended to)."""
        command = list(self.command)
        command[command.index("--bind") + 1] = self.endpoint
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env)

    @property
    def label(self) -> str:
        return "drafter" if self.layers is None else f"shard {self.layers[0]}:{self.layers[1]}"

    def last_error(self) -> str:
        """What the daemon said last about why it stopped: its last ERROR line without the log's prefix, else its
        last line (a traceback's last line names the exception)."""
        try:
            lines = self.log_path.read_text(errors="replace").rstrip().splitlines()
        except OSError:
            return "(no log)"
        errors = [line for line in lines if " ERROR " in line or line.startswith("Error:")]
        last = (errors or lines or ["(empty log)"])[-1]
        return last.split(" ERROR ", 1)[-1].strip()[:400]

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


def child_env(threads_hint: Optional[int] = None) -> dict:
    """Environment for a child that imports this checkout (daemons, `shardctl` runs)."""
    env = dict(os.environ)
    # The children import this checkout's packages, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    if threads_hint and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads_hint)
    return env


@dataclass(frozen=True)
class ShardSet:
    """Daemons for one model: one per split. `devices` and `shard_args` are per shard
    (`devices` may also name one device for all); `extra_args` go to every daemon. A split of
    None is a daemon without layers (`--layers none`): a drafter, see `drafter_set`."""

    source_args: tuple[str, ...]
    splits: tuple[Optional[tuple[int, int]], ...]
    transport: str = "tcp"
    extra_args: tuple[str, ...] = ()
    devices: Optional[tuple[str, ...]] = None
    shard_args: Optional[tuple[tuple[str, ...], ...]] = None
    # each shard sends its rows straight to the one whose layers follow (shardd serve --relay-to-file: PROTOCOL.md,
    # "Rows from shard to shard"); the daemons of a set run on this host and listen on loopback
    direct_rows: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "source_args", tuple(self.source_args))
        object.__setattr__(self, "splits", tuple(None if split is None else tuple(split) for split in self.splits))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        devices = tuple(self.devices) if self.devices else ("cpu",)
        if len(devices) == 1:
            devices *= len(self.splits)
        if len(devices) != len(self.splits):
            raise ValueError(f"{len(devices)} devices for {len(self.splits)} shards; give one device, or one per shard")
        object.__setattr__(self, "devices", devices)
        shard_args = tuple(tuple(args) for args in self.shard_args) if self.shard_args else ((),) * len(self.splits)
        if len(shard_args) != len(self.splits):
            raise ValueError(f"{len(shard_args)} shard argument lists for {len(self.splits)} shards")
        object.__setattr__(self, "shard_args", shard_args)


def drafter_set(
    source_args: Sequence[str], draft: str, transport: str = "tcp", extra_args: Sequence[str] = (), device: str = "cpu"
) -> ShardSet:
    """One drafter-only daemon (`--layers none --draft DRAFT`) for the model of `source_args`."""
    return ShardSet(tuple(source_args), (None,), transport, (*extra_args, "--draft", draft), (device,))


def write_relay_key(path: Path) -> Path:
    """A fresh relay key (`shardd serve --relay-key`) in a new file at `path` that only this user may read."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(secrets.token_hex(32) + "\n")
    return path


def start_shards(shard_set: ShardSet, run_dir: Path, threads_hint: Optional[int] = None) -> list[ShardProcess]:
    """Spawn the set's daemons (not yet bound, not yet ready). Logs, ipc sockets and the set's relay key live in
    `run_dir`: each shard takes rows only from the one before it (the key stays while they run, so a restarted
    daemon presents and requires the same one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    shards: list[ShardProcess] = []
    following = {split[0]: index for index, split in enumerate(shard_set.splits) if split is not None}
    chained = shard_set.direct_rows and any(split is not None and split[1] in following for split in shard_set.splits)
    relay_key = ["--relay-key", str(write_relay_key(run_dir / "relay.key"))] if chained else []
    try:
        for index, (split, device) in enumerate(zip(shard_set.splits, shard_set.devices)):
            after = following.get(split[1]) if split is not None and shard_set.direct_rows else None
            relay = [] if after is None else ["--relay-to-file", str(run_dir / f"shard{after}.endpoint")]
            if split is not None:
                relay += relay_key
            if shard_set.transport == "tcp":
                endpoint = "tcp://127.0.0.1:*"
            else:
                endpoint = f"ipc://{run_dir / f'shard{index}.sock'}"
            endpoint_file = run_dir / f"shard{index}.endpoint"
            layers = "none" if split is None else f"{split[0]}:{split[1]}"
            command = [
                sys.executable, "-m", "shardd", "serve", *shard_set.source_args,
                "--layers", layers, "--bind", endpoint, "--endpoint-file", str(endpoint_file), "--device", device,
                *relay, *shard_set.extra_args, *shard_set.shard_args[index],
            ]
            log_path = run_dir / f"shard{index}-{layers.replace(':', '-')}.log"
            env = child_env(threads_hint if device == "cpu" else None)
            with open(log_path, "wb") as log:
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           env=env)
            shards.append(ShardProcess(endpoint, split, process, log_path, endpoint_file, tuple(command), env))
    except BaseException:
        stop_shards(shards)
        raise
    return shards


def wait_bound(shard: ShardProcess, deadline: float) -> None:
    """Until the daemon has bound its socket and written the endpoint it got (`shard.endpoint` becomes it)."""
    while shard.endpoint_file is not None:
        if shard.endpoint_file.exists():
            shard.endpoint = shard.endpoint_file.read_text().strip()
            shard.endpoint_file = None
            return
        _check_alive(shard, "before it bound its socket")
        if time.monotonic() > deadline:
            raise LaunchError(f"{shard.label} did not bind {shard.endpoint} in time: {shard.last_error()}", shard.log_path)
        time.sleep(0.05)


def _check_alive(shard: ShardProcess, when: str) -> None:
    code = shard.process.poll()
    if code is not None:
        raise LaunchError(f"{shard.label} exited with code {code} {when}: {shard.last_error()}", shard.log_path)


def wait_ready(
    shards: Sequence[ShardProcess],
    timeout_s: float = READY_TIMEOUT_S,
    progress: Optional[Progress] = None,
    curve: Optional[CurveKeys] = None,
) -> None:
    """Until every daemon answers HELLO; LaunchError (with its log tail) if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    for shard in shards:
        wait_bound(shard, deadline)
    if progress is not None:
        progress(f"waiting for {len(shards)} daemon(s) to load their weights: "
                 + ", ".join(f"{shard.label} at {shard.endpoint}" for shard in shards))
    for shard in shards:
        with ShardClient(shard.endpoint, timeout_s=timeout_s, curve=curve) as client:
            # One HELLO, answered once the weights are loaded (the socket is bound before); meanwhile watch the
            # process, so a daemon that exits is reported with its own reason, not as a silent endpoint.
            sent = None
            while True:
                _check_alive(shard, "before it was ready")
                if time.monotonic() > deadline:
                    raise LaunchError(f"{shard.label} at {shard.endpoint} did not answer HELLO within {timeout_s:g} s: "
                                      f"{shard.last_error()}", shard.log_path)
                try:
                    if sent is None:
                        sent = client.send(Hello(id=0), 0.25)
                    client.receive(sent, timeout_s=0.25)
                    break
                except ShardUnavailable:
                    sent = None  # no connection (yet, or any more): ask again once there is one
                except ShardTimeout:
                    continue  # still loading weights
        if progress is not None:
            progress(f"{shard.label} ready at {shard.endpoint}")


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
def launched_sets(
    shard_sets: Sequence[ShardSet],
    *,
    ready_timeout_s: float = READY_TIMEOUT_S,
    progress: Optional[Progress] = None,
    curve: Optional[CurveKeys] = None,
    supervise: bool = True,
    on_lost: Optional[Callable[[str], None]] = None,
) -> Iterator[list[list[ShardProcess]]]:
    """Start every set's daemons at once (they load in parallel), wait until all serve,
    yield the `ShardProcess`es per set, stop them all on exit. The run directory (logs, ipc:// sockets) is
    always removed, so nothing is left in the temp dir; when a daemon failed (the start, or a crash) its logs
    are first copied to the cache (`failed_logs_dir`) and the error messages quote their tails.
    `curve`: the client keys readiness checks use, for daemons started with CurveZMQ keys. Once ready the daemons
    are supervised (`coordinator.supervise`, unless `supervise` is False): one that dies or hangs is restarted on
    its endpoint; `on_lost` hears of one that cannot come back."""
    # Short prefix under the temp dir: an ipc:// path must fit a unix socket address (~107 bytes).
    run_dir = Path(tempfile.mkdtemp(prefix="shardd-"))
    # CPU daemons started together share this machine's cores; unhinted, each would take them all.
    cpu_shards = sum(device == "cpu" for shard_set in shard_sets for device in shard_set.devices)
    threads_hint = max(1, (os.cpu_count() or 1) // cpu_shards) if cpu_shards else None
    started: list[list[ShardProcess]] = []
    failed = True
    launch_error: Optional[LaunchError] = None
    supervisor: Optional[Supervisor] = None
    try:
        for index, shard_set in enumerate(shard_sets):
            started.append(start_shards(shard_set, run_dir / f"set{index}", threads_hint))
        every = [shard for shards in started for shard in shards]
        wait_ready(every, ready_timeout_s, progress, curve)
        failed = False
        if supervise:
            supervisor = Supervisor(every, progress or _to_stderr, on_lost=on_lost).__enter__()
        yield started
    except (KeyboardInterrupt, SystemExit):  # a requested stop (Ctrl-C, SIGTERM) is no failure
        failed = False
        raise
    except LaunchError as error:
        launch_error = error
        raise
    finally:
        if supervisor is not None:
            supervisor.__exit__(None, None, None)  # before the stop: a stopped daemon is not restarted
        every = [shard for shards in started for shard in shards]
        crashed = [shard for shard in every if shard.process.poll() not in (None, 0)]
        stop_shards(every)
        if failed or crashed or (supervisor is not None and supervisor.restarted):
            kept = keep_logs(run_dir)
            if kept is not None:
                named = launch_error.log_path if launch_error is not None else None
                if named is not None and named.is_relative_to(run_dir):  # name the kept copy: run_dir goes now
                    launch_error.log_path = kept / named.relative_to(run_dir)
                if progress is not None:
                    progress(f"shard logs kept in {kept}")
        shutil.rmtree(run_dir, ignore_errors=True)


def _to_stderr(line: str) -> None:
    print(f"[shardctl] {line}", file=sys.stderr, flush=True)


def failed_logs_dir() -> Path:
    """Where the logs of failed launches are kept: the user's cache, not the temp dir."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardd" / "logs"


def keep_logs(run_dir: Path) -> Optional[Path]:
    logs = sorted(run_dir.rglob("*.log"))
    if not logs:
        return None
    kept = failed_logs_dir() / time.strftime(f"%Y%m%d-%H%M%S-{run_dir.name}")
    for log in logs:
        target = kept / log.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, target)
    return kept
