"""Real `shardd serve` processes for integration tests, and a plain DEALER client that speaks the wire protocol.

Nothing here uses coordinator code: a client is a pyzmq DEALER socket plus `protocol`'s codec, so the
tests see exactly the bytes another implementation would send.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from protocol import RECORD_TYPES, MessageType, Reply, decode_reply, encode_request

# Seconds for a daemon to import torch, build its weights and answer HELLO: a bound, never waited out when the
# daemon comes up (~3 s idle); generous because on a loaded machine (two test workers, other jobs) the import
# alone has taken over 60 s.
READY_TIMEOUT = 120.0
REPLY_TIMEOUT = 30.0


# Ports handed out in this test run, across its xdist workers: one marker file per port, created exclusively, so two
# workers never get the same port (a port the kernel freed after one probe may be its next probe's answer, and
# a daemon of one test then answered another test's HELLO).
_PORTS = Path(tempfile.gettempdir()) / f"shardd-test-ports-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}"


def free_port() -> int:
    """A loopback port that was free a moment ago and that no other test of this run was given."""
    _PORTS.mkdir(exist_ok=True)
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            (_PORTS / str(port)).touch(exist_ok=False)
        except FileExistsError:
            continue
        return port


def free_tcp_endpoint() -> str:
    """A loopback endpoint on a free_port."""
    return f"tcp://127.0.0.1:{free_port()}"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, so no daemon outlives a killed run."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def serve_command(bind: str, *args: str, synthetic: str = "tiny") -> list[str]:
    # One torch thread each: several daemons share the machine's few cores, and spinning thread pools
    # competing for them cost far more than they gain on a tiny model.
    return [sys.executable, "-m", "shardd", "serve", "--synthetic", synthetic, "--bind", bind, "--threads", "1", *args]


class Client:
    """A DEALER socket to one daemon. Requests get increasing ids; every reply's id is checked."""

    _ids = itertools.count(1)

    def __init__(self, endpoint: str, context: zmq.Context | None = None, **socket_options):
        self.endpoint = endpoint
        self.socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A DEALER blocks a send while it has no peer (e.g. after a refused CURVE handshake): never forever.
        self.socket.setsockopt(zmq.SNDTIMEO, int(REPLY_TIMEOUT * 1000))
        for name, value in socket_options.items():
            setattr(self.socket, name, value)
        self.socket.connect(endpoint)
        self.opened: set[int] = set()  # sequences this connection opened and has not closed

    def close(self) -> None:
        """Closes the sequences this connection left open first (their replies unread): a daemon owns them by
        connection, so nothing else could, and a module's shared daemons would fill up until the idle lease."""
        if self.socket.closed:
            return
        for seq in sorted(self.opened):
            try:
                self.send_frames(encode_request(RECORD_TYPES[MessageType.CLOSE](id=self.next_id(), seq=seq)))
            except zmq.ZMQError:  # no peer within the send timeout, or the daemon is gone
                break
        self.socket.close(linger=500 if self.opened else 0)
        self.opened.clear()

    def send_frames(self, frames: list) -> None:
        """Raises zmq.Again when no peer takes the message within the socket's send timeout."""
        self.socket.send_multipart(frames, copy=False)

    def receive(self, timeout: float = REPLY_TIMEOUT) -> Reply | None:
        """The next reply, or None when none arrives within `timeout` seconds."""
        if not self.socket.poll(timeout * 1000, zmq.POLLIN):
            return None
        return decode_reply(self.socket.recv_multipart(copy=True))

    def exchange(self, frames: list, timeout: float = REPLY_TIMEOUT) -> Reply:
        self.send_frames(frames)
        reply = self.receive(timeout)
        if reply is None:
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout}s")
        return reply

    def next_id(self) -> int:
        return next(self._ids)

    def request(self, mtype: MessageType | str, *, validate: bool = True, timeout: float = REPLY_TIMEOUT, **fields) -> Reply:
        """Build a typed record, encode it (optionally unvalidated, to put a bad request on the wire), exchange."""
        mtype = MessageType(mtype)
        request_id = fields.pop("id", None)
        request_id = self.next_id() if request_id is None else request_id
        record = RECORD_TYPES[mtype](id=request_id, **fields)
        reply = self.exchange(encode_request(record, validate=validate), timeout)
        assert reply.id == request_id, f"reply id {reply.id} for request {request_id}"
        assert reply.type == mtype, f"reply type {reply.type} for a {mtype.value} request"
        if reply.ok and mtype in (MessageType.OPEN, MessageType.CLOSE) and "seq" in fields:
            (self.opened.add if mtype is MessageType.OPEN else self.opened.discard)(fields["seq"])
        return reply

    def call(self, mtype: MessageType | str, **fields) -> Reply:
        """A request that must succeed."""
        reply = self.request(mtype, **fields)
        assert reply.ok, f"{MessageType(mtype).value} {fields} failed: {reply.error_code} {reply.error_message}"
        return reply

    def wait_ready(self, process: subprocess.Popen | None = None, timeout: float = READY_TIMEOUT, log: Path | None = None) -> dict:
        """Send one HELLO (a DEALER may connect before the daemon binds) and wait for its reply."""
        request_id = self.next_id()
        self.send_frames(encode_request(RECORD_TYPES[MessageType.HELLO](id=request_id)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"daemon exited with {process.returncode} before it was ready:\n{read_log(log)}")
            reply = self.receive(0.1)
            if reply is not None:
                assert reply.ok and reply.id == request_id, reply
                if process is not None and reply.result.get("pid") != process.pid:
                    # a free_tcp_endpoint port taken since by another test's daemon: that one answered
                    raise RuntimeError(f"process {reply.result.get('pid')} answered HELLO at {self.endpoint}, not the "
                                       f"daemon started there ({process.pid}): its port was taken:\n{read_log(log)}")
                return reply.result
        raise TimeoutError(f"daemon at {self.endpoint} did not answer HELLO within {timeout}s:\n{read_log(log)}")


def read_log(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return log.read_text(errors="replace")[-4000:]


class Daemon:
    """One `shardd serve` process; its stderr goes to a log file that failure messages quote."""

    def __init__(self, name: str, bind: str, args: list[str], workdir: Path, env: dict | None = None):
        self.name = name
        self.bind = bind
        self.log = workdir / f"{name}.log"
        self.command = serve_command(bind, *args)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.hello: dict | None = None
        self._clients: list[Client] = []

    @property
    def ipc_path(self) -> Path | None:
        return Path(self.bind[len("ipc://") :]) if self.bind.startswith("ipc://") else None

    def client(self, **socket_options) -> Client:
        client = Client(self.bind, **socket_options)
        self._clients.append(client)
        return client

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict:
        self.hello = self.client().wait_ready(self.process, timeout, self.log)
        return self.hello

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return read_log(self.log)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`; closes this daemon's clients.

        Returns the exit status (0 for a clean stop); calling it again is harmless.
        """
        for client in self._clients:
            client.close()
        self._clients.clear()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_daemons(specs: dict[str, tuple[str, list[str]]], workdir: Path, env: dict | None = None) -> dict[str, Daemon]:
    """Start every daemon at once (they load in parallel), then wait until each answers HELLO.

    If any fails to come up, all are stopped before the error propagates.
    """
    daemons: dict[str, Daemon] = {}
    try:
        for name, (bind, args) in specs.items():
            daemons[name] = Daemon(name, bind, args, workdir, env)
        for daemon in daemons.values():
            daemon.wait_ready()
    except BaseException:
        stop_all(daemons.values())
        raise
    return daemons


PAIR_ARGS = [["--layers", "0:3"], ["--layers", "3:6"]]  # the tiny model's six layers, split in two


def start_pair(workdir: Path, extra=()) -> tuple[list[str], list[Daemon]]:
    """Two daemons of the tiny model (PAIR_ARGS, `extra` to both) on free loopback tcp endpoints, ready:
    (binds, daemons). If one fails to come up, both are stopped before the error propagates."""
    binds = [free_tcp_endpoint(), free_tcp_endpoint()]
    daemons = start_daemons({f"shard{i}": (binds[i], [*PAIR_ARGS[i], *extra]) for i in range(2)}, workdir)
    return binds, list(daemons.values())


def kill_and_replace(daemons: list, index: int, name: str, args: list[str], workdir: Path) -> None:
    """SIGKILL daemons[index], then start `name` with `args` on the same endpoint in its place, ready."""
    old = daemons[index]
    old.signal(signal.SIGKILL)
    old.wait(10)
    daemons[index] = Daemon(name, old.bind, args, workdir)
    daemons[index].wait_ready()


def stop_all(daemons) -> None:
    """SIGTERM to every daemon first, so they stop in parallel, then wait for (or kill) each."""
    daemons = list(daemons)
    for daemon in daemons:
        if daemon.alive():
            daemon.signal(signal.SIGTERM)
    for daemon in daemons:
        daemon.stop()


def receive_until(notify: socket.socket, wanted: str, timeout: float) -> list[str]:
    """Datagrams on a daemon's NOTIFY_SOCKET until one carries the line `wanted` (sd_notify's READY=1, ...); all of
    them, in order."""
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        notify.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            messages.append(notify.recv(4096).decode())
        except socket.timeout:
            raise AssertionError(f"no {wanted!r} within {timeout}s; got {messages}") from None
        if wanted in messages[-1].split("\n"):
            return messages
