"""Restart launched shard daemons that die or hang, as systemd's Restart=on-failure does for shardd@.service.

A `Supervisor` watches the daemons a command launched (`coordinator.launch.launched_sets`): one that exits, or
whose libzmq stops answering heartbeats (stopped, hung) for `hang_s`, is killed and started again on the
endpoint it had, after a backoff, at most `max_restarts` times in `window_s`; each restart is one line. The
coordinator's recovery then re-fills its sequences from their committed history (coordinator/scheduler/
recovery.py), so the output does not change. A daemon that cannot come back is reported once through `on_lost`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Callable, Optional, Sequence

import zmq

from coordinator.relay.liveness import ConnectionWatch, enable_heartbeats

MAX_RESTARTS = 5  # in WINDOW_S: more is a daemon that cannot run here, not a crash
WINDOW_S = 300.0
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
HANG_S = 10.0  # no heartbeat answered (the process alive) for this long: hung or stopped
POLL_S = 0.2


class ShardLost(RuntimeError):
    """A launched daemon that died or hung could not be brought back."""


class Supervisor:
    def __init__(self, shards: Sequence, progress: Callable[[str], None], *, on_lost: Optional[Callable[[str], None]] = None,
                 max_restarts: int = MAX_RESTARTS, window_s: float = WINDOW_S, hang_s: float = HANG_S,
                 backoff_s: Sequence[float] = BACKOFF_S) -> None:
        self.shards = list(shards)
        self.progress = progress
        self.on_lost = on_lost
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.hang_s = hang_s
        self.backoff_s = tuple(backoff_s)
        self.restarts: dict[int, list[float]] = {index: [] for index in range(len(self.shards))}
        self.lost: list[str] = []  # one line per daemon that could not come back
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-supervisor", daemon=True)

    @property
    def restarted(self) -> bool:
        return any(self.restarts.values()) or bool(self.lost)

    def __enter__(self) -> "Supervisor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        context = zmq.Context()
        watches: dict[int, tuple[zmq.Socket, ConnectionWatch]] = {}
        silent_since: dict[int, Optional[float]] = {}
        given_up: set[int] = set()
        try:
            while not self._stop.wait(POLL_S):
                for index, shard in enumerate(self.shards):
                    if index in given_up:
                        continue
                    if index not in watches:
                        watches[index] = self._watch(context, shard.endpoint)
                    code = shard.process.poll()
                    reason = None
                    if code is not None:
                        reason = (f"was killed by {signal.Signals(-code).name}" if code < 0 else
                                  f"exited with code {code}: {shard.last_error()}")
                    else:
                        watch = watches[index][1]
                        watch.update()
                        now = time.monotonic()
                        if watch.up:
                            silent_since[index] = None
                        elif silent_since.get(index) is None:
                            silent_since[index] = now
                        elif now - silent_since[index] > self.hang_s / 2:  # libzmq waited the other half
                            reason = f"answered no heartbeat for {self.hang_s:g} s (stopped or hung): killed"
                            with contextlib.suppress(ProcessLookupError):
                                shard.process.send_signal(signal.SIGKILL)
                            shard.process.wait()
                    if reason is None:
                        continue
                    silent_since[index] = None
                    if not self._restart(index, shard, reason):
                        given_up.add(index)
                    socket, watch = watches.pop(index)  # a fresh connection to the new process
                    watch.close()
                    socket.close(linger=0)
        finally:
            for socket, watch in watches.values():
                watch.close()
                socket.close(linger=0)
            context.term()

    def _watch(self, context: zmq.Context, endpoint: str) -> tuple[zmq.Socket, "ConnectionWatch"]:
        socket = context.socket(zmq.DEALER)
        enable_heartbeats(socket, self.hang_s / 2)
        watch = ConnectionWatch(socket)
        socket.connect(endpoint)
        return socket, watch

    def _restart(self, index: int, shard, reason: str) -> bool:
        """Start `shard` again after its backoff; False (and `on_lost`) when it has used its restarts."""
        now = time.monotonic()
        recent = [t for t in self.restarts[index] if now - t < self.window_s]
        self.restarts[index] = recent
        if len(recent) >= self.max_restarts:
            line = (f"{shard.label} at {shard.endpoint} {reason}; not restarting it: {len(recent)} restarts in "
                    f"{self.window_s:g} s (log: {shard.log_path})")
            self.lost.append(line)
            self.progress(line)
            if self.on_lost is not None:
                self.on_lost(line)
            return False
        delay = self.backoff_s[min(len(recent), len(self.backoff_s) - 1)]
        self.progress(f"{shard.label} at {shard.endpoint} {reason}; restarting it in {delay:g} s "
                      f"(restart {len(recent) + 1} of {self.max_restarts})")
        if self._stop.wait(delay):
            return True  # stopping: the launcher stops every daemon now
        self.restarts[index].append(time.monotonic())
        shard.restart()
        return True
