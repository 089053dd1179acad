"""`shardctl serve` in a test: the process on a free loopback port, the wait until its /health answers, the stop.

test_front_door and test_first_minutes subclass `ShardctlServe` with their own options; test_serve and
test_openai_api use `Server`, which waits until healthy and hands out an `openai` client. Both are context
managers, so a fixture reads `with Server(...) as s: yield s`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from coordinator.launch import child_env
from tests.support.daemons import _die_with_parent, free_port


class ShardctlServe:
    """`shardctl serve --port <free port> ARGS`. Its output goes to `log` (stdout and stderr in one file), or else
    to pipes: stdout with stderr merged in, or apart with `stderr_apart`. `stop()` gives it `grace_s` after SIGTERM."""

    def __init__(self, *args: str, log: Path | None = None, env: dict | None = None, stderr_apart: bool = False,
                 grace_s: float = 20):
        self.args, self.env, self.stderr_apart = args, env, stderr_apart
        self.log = log
        self.grace_s = grace_s
        self.port_retries = 3  # a port found free can be taken (another test's daemon) before serve binds it
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args, env, stderr_apart, log = self.args, self.env, self.stderr_apart, self.log
        command = [sys.executable, "-m", "coordinator.cli", "serve", "--port", str(self.port), *args]
        if log is not None:
            with open(log, "wb") as out:
                self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                env=env, preexec_fn=_die_with_parent)
        else:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT, env=env,
                                            text=True, preexec_fn=_die_with_parent)

    def output(self) -> str:
        """The log so far; piped, the rest of stderr (stdout when merged): read it only once the process ended."""
        if self.log is not None:
            return self.log.read_text(errors="replace")
        return (self.process.stderr or self.process.stdout).read()

    def wait_healthy(self, timeout_s: float = 90) -> None:
        """Until GET /health answers 200; an AssertionError when the process exits first (with its output) or
        `timeout_s` passes (the process stopped; its output quoted when it has a log)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                output = self.output()
                if self.process.returncode == 4 and "Address already in use" in output and self.port_retries:
                    self.port_retries -= 1
                    self._start()
                    continue
                raise AssertionError(f"shardctl serve exited {self.process.returncode}: {output}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise AssertionError(f"shardctl serve did not become healthy in {timeout_s:g} s"
                             + (f": {self.output()}" if self.log is not None else ""))

    def stop(self) -> int:
        """SIGTERM, `grace_s` to exit, then SIGKILL; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Server(ShardctlServe):
    """`shardctl serve ARGS` up and healthy, with the real `openai` client pointed at it."""

    def __init__(self, *args: str):
        super().__init__("--log-level", "warning", *args, env=child_env())
        self.wait_healthy()

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
