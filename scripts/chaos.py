"""A standing chaos run: two `shardd serve` daemons (tiny synthetic model) and `shardctl serve` on
loopback, knocked about on purpose, and one table of how they came back.

    python scripts/chaos.py --budget 900 --json bench/results/chaos.json | tee bench/results/chaos.txt
    python scripts/chaos.py --phases launched --launched-kills 3 --launched-freezes 2 --budget 300  # a quick check

Trials: kill -9 and restart of a shard mid-generation; SIGSTOP of 2-30 s then SIGCONT; a coordinator process
killed mid-step (its sequences must be reclaimed by the daemons' lease); HTTP clients that drop mid-request
(streaming or not: their sequences must close); a 50 MB body (Content-Length and chunked); junk bodies (the
campaign's malformed fields); 2,000 half-open connections; a daemon message of many 16 MiB frames. The
`launched` phase (not in the default) launches its own pair as `shardctl serve` does (coordinator.launch: rows
shard to shard under the set's relay key) under the supervisor, and kills a shard with SIGKILL, or freezes it
with SIGSTOP past the supervisor's hang timeout, mid-stream: the supervisor restarts it, the coordinator re-fills.
A decoding trial recovers when its output equals an undisturbed run's byte for byte. Everything is bounded by
--budget (seconds; a phase runs fewer trials when time runs short, and the table says how many ran). Loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import zmq  # noqa: E402

from coordinator.decoding import greedy_decode  # noqa: E402
from coordinator.relay.client import ShardClient  # noqa: E402
from coordinator.relay.pipeline import Pipeline  # noqa: E402
from protocol import encode_request  # noqa: E402
from protocol.messages import Hello  # noqa: E402

PROMPT = list(b"chaos, then exactly the same output: ")
NEW_TOKENS = 24
LAYERS = ["0:3", "3:6"]
LEASE_S = 5.0  # the daemons' --sequence-idle-timeout, so a killed coordinator's sequences go within seconds
FREEZES_S = [2, 3, 5, 8, 12, 20, 30]
LAUNCHED_KILL_S = 20  # a launched kill round's time: detection, backoff, the daemon's load, the re-fill
LAUNCHED_FREEZE_S = 40  # a freeze round's: the supervisor's hang timeout on top


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


class Shard:
    def __init__(self, index: int, bind: str, workdir: Path):
        self.index, self.bind, self.workdir, self.restarts = index, bind, workdir, 0
        self.process = None
        self.start()

    def start(self) -> None:
        log = open(self.workdir / f"shard{self.index}.{self.restarts}.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shardd", "serve", "--synthetic", "tiny", "--bind", self.bind, "--layers",
             LAYERS[self.index], "--threads", "1", "--sequence-idle-timeout", str(LEASE_S)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        self.restarts += 1

    def kill_and_restart(self) -> None:
        self.process.kill()
        self.process.wait()
        self.start()

    def wait_ready(self, timeout_s: float = 120) -> None:
        with ShardClient(self.bind, timeout_s=timeout_s) as client:
            client.hello(timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Table:
    def __init__(self):
        self.rows = []

    def add(self, name, trials, recovered=None, recover_s=(), errors=0, rss_before=None, rss_after=None, note=""):
        recover_s = list(recover_s)
        self.rows.append({
            "trial": name, "trials": trials, "recovered": recovered,
            "recover_median_s": round(statistics.median(recover_s), 2) if recover_s else None,
            "recover_max_s": round(max(recover_s), 2) if recover_s else None,
            "errors": errors,
            "rss_before_mb": None if rss_before is None else round(rss_before / 2**20),
            "rss_after_mb": None if rss_after is None else round(rss_after / 2**20),
            "note": note,
        })
        print(f"[chaos] {name}: {self.rows[-1]}", file=sys.stderr, flush=True)

    def progress(self, message: str) -> None:
        print(f"[chaos] {message}", file=sys.stderr, flush=True)

    def render(self) -> str:
        head = ["trial", "trials", "recovered", "recover median s", "recover max s", "errors", "RSS before MB",
                "RSS after MB", "note"]
        keys = ["trial", "trials", "recovered", "recover_median_s", "recover_max_s", "errors", "rss_before_mb",
                "rss_after_mb", "note"]
        lines = [[str(h) for h in head]] + [["-" if row[k] is None else str(row[k]) for k in keys] for row in self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = []
        for n, line in enumerate(lines):
            out.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip())
            if n == 0:
                out.append("  ".join("-" * w for w in widths))
        return "\n".join(out)


class Chaos:
    def __init__(self, args, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.deadline = time.monotonic() + args.budget
        self.random = random.Random(args.seed)
        self.table = Table()
        self.shards: list[Shard] = []
        self.endpoints: list[str] = []
        self.seq = 1000
        self.expected = None

    def start_shards(self) -> None:
        """The hand-started pair every phase but `launched` knocks about, and its undisturbed output."""
        self.shards = [Shard(i, f"tcp://127.0.0.1:{free_port()}", self.workdir) for i in range(2)]
        for shard in self.shards:
            shard.wait_ready()
        self.endpoints = [shard.bind for shard in self.shards]
        self.expected = self.decode().tokens

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def pipeline(self, endpoints=None) -> Pipeline:
        return Pipeline([ShardClient(endpoint, timeout_s=60) for endpoint in endpoints or self.endpoints])

    def decode(self, on_commit=None, endpoints=None):
        self.seq += 1
        with self.pipeline(endpoints) as pipeline:
            return greedy_decode(pipeline, self.seq, PROMPT, NEW_TOKENS, on_commit=on_commit, recovery_timeout_s=60)

    # ---- the shards ---------------------------------------------------------------------------------

    def disturbed_runs(self, name: str, trials: int, disturb, per_trial_s: float) -> None:
        recovered, times, errors, ran = 0, [], [], 0
        rss_before = sum(rss_bytes(s.process.pid) for s in self.shards)
        for trial in range(trials):
            if self.left() < per_trial_s:
                break
            ran += 1
            commits, marks = [], {}
            at = self.random.randint(2, NEW_TOKENS - 4)
            victim = self.shards[trial % 2]

            def on_commit(new_ids):
                commits.append(time.monotonic())
                if len(commits) == at:
                    marks["back"] = disturb(victim, trial)
                elif "back" in marks and "recovered" not in marks:
                    marks["recovered"] = time.monotonic()

            try:
                result = self.decode(on_commit)
                if result.tokens == self.expected:
                    recovered += 1
                    back = marks["back"]() if callable(marks["back"]) else marks["back"]
                    times.append(marks.get("recovered", time.monotonic()) - back)
                else:
                    errors.append(f"trial {trial}: output differs")
            except Exception as error:  # noqa: BLE001 - counted and reported
                errors.append(f"trial {trial}: {type(error).__name__}: {error}")
            self.table.progress(f"{name} trial {trial}: {'ok' if len(errors) == 0 or not errors[-1].startswith(f'trial {trial}:') else errors[-1]}")
            if victim.process.poll() is not None:
                errors.append(f"trial {trial}: shard {victim.index} exited {victim.process.returncode}")
                victim.start()
                victim.wait_ready()
        rss_after = sum(rss_bytes(s.process.pid) for s in self.shards)
        self.table.add(name, ran, recovered, times, len(errors), rss_before, rss_after, "; ".join(errors[:3]))

    def kill_trials(self) -> None:
        restarts = []  # (killed, answered): when the restarted daemon first answered HELLO

        def note_answer(victim, killed):
            with ShardClient(victim.bind, timeout_s=120) as client:
                client.hello(120)
            restarts.append((killed, time.monotonic()))

        def kill(victim, trial):
            killed = time.monotonic()
            victim.kill_and_restart()
            threading.Thread(target=note_answer, args=(victim, killed), daemon=True).start()
            return killed  # recovery time: from the kill to the next commit

        self.disturbed_runs("kill -9 + restart", self.args.kills, kill, 12)
        loads = [answered - killed for killed, answered in restarts]
        if loads:
            self.table.rows[-1]["note"] = (f"of which the restarted daemon loading (kill to its first HELLO answer): "
                                           f"median {statistics.median(loads):.2f} s, max {max(loads):.2f} s; "
                                           + self.table.rows[-1]["note"]).rstrip("; ")

    def freeze_trials(self) -> None:
        def freeze(victim, trial):
            seconds = FREEZES_S[trial % len(FREEZES_S)]
            os.kill(victim.process.pid, signal.SIGSTOP)
            resumed = {}

            def resume():
                os.kill(victim.process.pid, signal.SIGCONT)
                resumed["at"] = time.monotonic()

            threading.Timer(seconds, resume).start()
            return lambda: resumed.get("at", time.monotonic())  # recovery time: from SIGCONT to the next commit

        self.disturbed_runs("SIGSTOP 2-30 s + SIGCONT", self.args.freezes, freeze, 45)

    def open_sequences(self) -> int:
        total = 0
        for endpoint in self.endpoints:
            with ShardClient(endpoint, timeout_s=10) as client:
                total += client.stats()["open_sequences"]
        return total

    def wait_no_sequences(self, within_s: float) -> float | None:
        started = time.monotonic()
        while time.monotonic() - started < within_s:
            if self.open_sequences() == 0:
                return time.monotonic() - started
            time.sleep(0.1)
        return None

    def coordinator_kills(self) -> None:
        code = ("import sys, time; from coordinator.relay.pipeline import Pipeline; from coordinator.decoding import "
                "greedy_decode; p = Pipeline.connect(sys.argv[1].split(',')); "
                "greedy_decode(p, 7, list(b'killed mid-step'), 200, on_commit=lambda ids: time.sleep(0.05))")
        recovered, times, errors, ran = 0, [], [], 0
        for trial in range(self.args.coordinator_kills):
            if self.left() < LEASE_S + 20:
                break
            ran += 1
            child = subprocess.Popen([sys.executable, "-c", code, ",".join(self.endpoints)], env=child_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 30
            while self.open_sequences() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(self.random.uniform(0.1, 0.5))
            child.kill()
            child.wait()
            killed = time.monotonic()
            gone = self.wait_no_sequences(LEASE_S + 10)
            if gone is None:
                errors.append(f"trial {trial}: sequences not reclaimed within {LEASE_S + 10:g} s")
                continue
            if self.decode().tokens == self.expected:
                recovered += 1
                times.append(time.monotonic() - killed)
            else:
                errors.append(f"trial {trial}: output differs after")
        self.table.add("coordinator killed mid-step", ran, recovered, times, len(errors), note="; ".join(errors[:3])
                       or f"reclaimed by the {LEASE_S:g} s lease")

    def many_frames(self) -> None:
        errors = []
        pid = self.shards[0].process.pid
        before = rss_bytes(pid)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.shards[0].bind)
        frame = bytes(16 << 20)
        trials = 3
        for trial in range(trials):
            sock.send_multipart([*encode_request(Hello(id=trial + 1)), *[frame] * self.args.frames])
            if not sock.poll(60_000):
                errors.append("no reply")
                continue
            reply = sock.recv_multipart()
            if b"HELLO request has at most 1 frame" not in reply[0]:  # BAD_REQUEST, TOO_LARGE past 64 frames
                errors.append(f"reply {reply[0][:80]!r}")
        sock.close()
        after = rss_bytes(pid)
        self.table.add(f"{self.args.frames} frames of 16 MiB", trials, trials - len(errors), (), len(errors), before,
                       after, "refused frame by frame, each extra frame let go at once")

    # ---- launched shards under their supervisor ------------------------------------------------------

    def launched_trials(self) -> None:
        """A pair launched as `shardctl serve` launches its shards (coordinator.launch: endpoint files, rows shard to
        shard under the set's relay key) and supervised (coordinator.supervise); each round kills or freezes one
        shard mid-stream and the supervisor, not this script, brings it back."""
        from coordinator.launch import ShardSet, keep_logs, launched_sets
        from coordinator.supervise import BACKOFF_S, HANG_S, Supervisor

        rounds = self.args.launched_kills + self.args.launched_freezes
        if rounds == 0 or self.left() < 30:
            return
        lines: list[str] = []

        def said(line: str) -> None:
            lines.append(line)
            self.table.progress(line)

        shard_set = ShardSet(("--synthetic", "tiny"), ((0, 3), (3, 6)), "tcp", ("--threads", "1"))
        with launched_sets([shard_set], ready_timeout_s=120, progress=said, supervise=False) as (pair,):
            endpoints = [shard.endpoint for shard in pair]
            with self.pipeline(endpoints) as pipeline:
                relayed = "rows shard to shard" if pipeline.direct_rows else "rows through the coordinator"
            expected = self.decode(endpoints=endpoints).tokens
            if self.expected is not None and expected != self.expected:
                self.table.progress("launched: the undisturbed output differs from the hand-started pair's")
            # each round a first fault: the first backoff, and enough restarts for every round
            with Supervisor(pair, said, max_restarts=rounds + 1, backoff_s=BACKOFF_S[:1]):
                self.launched_rounds(f"launched: kill -9 ({relayed})", pair, endpoints, expected,
                                     self.args.launched_kills, signal.SIGKILL, LAUNCHED_KILL_S)
                self.launched_rounds(f"launched: SIGSTOP past {HANG_S:g} s hang ({relayed})", pair, endpoints,
                                     expected, self.args.launched_freezes, signal.SIGSTOP, LAUNCHED_FREEZE_S)
            if any(row["errors"] for row in self.table.rows[-2:]):  # the run directory goes with the launch
                said(f"shard logs kept in {keep_logs(pair[0].log_path.parent.parent)}")
        lost = [line for line in lines if "not restarting it" in line]
        if lost:
            self.table.rows[-1]["note"] = f"{lost[0]}; " + self.table.rows[-1]["note"]

    def launched_rounds(self, name: str, pair, endpoints, expected, trials: int, how: signal.Signals,
                        per_trial_s: float) -> None:
        """`trials` rounds of decoding while `how` hits one shard of `pair` mid-stream (alternating shards);
        recovery: from the hit to the next commit. The note adds the supervisor's part: from the hit to the new
        process."""
        recovered, times, restarts, errors, ran = 0, [], [], [], 0
        for trial in range(trials):
            if self.left() < per_trial_s:
                break
            ran += 1
            victim = pair[trial % 2]
            old_pid = victim.process.pid
            at = self.random.randint(2, NEW_TOKENS - 4)
            commits, marks = [], {}

            def note_restart(victim, old_pid: int, hit: float) -> None:
                while victim.process.pid == old_pid and time.monotonic() - hit < 120:
                    time.sleep(0.02)
                restarts.append(time.monotonic() - hit)

            def on_commit(new_ids):
                commits.append(time.monotonic())
                if len(commits) == at:
                    marks["hit"] = time.monotonic()
                    os.kill(old_pid, how)
                    threading.Thread(target=note_restart, args=(victim, old_pid, marks["hit"]), daemon=True).start()
                elif "hit" in marks and "recovered" not in marks:
                    marks["recovered"] = time.monotonic()

            try:
                result = self.decode(on_commit, endpoints)
                if result.tokens != expected:
                    errors.append(f"trial {trial}: output differs")
                elif victim.process.pid == old_pid:
                    errors.append(f"trial {trial}: {victim.label} was not restarted")
                else:
                    recovered += 1
                    times.append(marks.get("recovered", time.monotonic()) - marks["hit"])
            except Exception as error:  # noqa: BLE001 - counted and reported
                errors.append(f"trial {trial}: {type(error).__name__}: {error}")
            self.table.progress(f"{name} trial {trial} ({victim.label}): "
                                f"{errors[-1] if errors and errors[-1].startswith(f'trial {trial}:') else 'ok'}")
            if not self.wait_restarted(victim, old_pid):
                errors.append(f"trial {trial}: {victim.label} not serving again within 120 s")
                break
        note = (f"supervisor (hit to new process): median {statistics.median(restarts):.2f} s, max "
                f"{max(restarts):.2f} s; " if restarts else "") + "; ".join(errors[:3])
        self.table.add(name, ran, recovered, times, len(errors), note=note.rstrip("; "))

    def wait_restarted(self, victim, old_pid: int, timeout_s: float = 120) -> bool:
        """Until the supervisor has replaced `old_pid` and the new daemon answers HELLO (a round that failed may
        end before that); a daemon still stopped then is let go on."""
        deadline = time.monotonic() + timeout_s
        while victim.process.pid == old_pid and time.monotonic() < deadline:
            time.sleep(0.1)
        if victim.process.pid == old_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old_pid, signal.SIGCONT)
            return False
        try:
            with ShardClient(victim.endpoint, timeout_s=max(1.0, deadline - time.monotonic())) as client:
                client.hello(max(1.0, deadline - time.monotonic()))
            return True
        except Exception:  # noqa: BLE001 - reported by the caller
            return False

    # ---- the HTTP front door ---------------------------------------------------------------------------

    def start_server(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(self.workdir / "serve.log", "wb")
        self.server = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "serve", "--shards", ",".join(self.endpoints), "--port",
             str(self.port), "--drafter", "none", "--log-level", "warning"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("shardctl serve did not become healthy")

    def health_probe(self):
        """A separate process timing /health every 50 ms until stopped (apart from this one's own work);
        returns (stop, latencies, join): call stop(), then join() fills latencies."""
        # a fresh connection per probe, raw: an HTTP library's per-call setup (an SSL context) would be measured too
        code = ("import json, sys, time, os, socket\n"
                "port, stop_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]; latencies = []\n"
                "while not os.path.exists(stop_file):\n"
                "    started = time.monotonic(); answer = b''\n"
                "    try:\n"
                "        with socket.create_connection(('127.0.0.1', port), timeout=10) as s:\n"
                "            s.sendall(b'GET /health HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n')\n"
                "            while (data := s.recv(65536)): answer += data\n"
                "    except OSError: pass\n"
                "    ok = answer.startswith(b'HTTP/1.1 200')\n"
                "    latencies.append(time.monotonic() - started if ok else 1e9); time.sleep(0.05)\n"
                "open(out, 'w').write(json.dumps(latencies))\n")
        self.probes = getattr(self, "probes", 0) + 1
        stop_file, out = self.workdir / f"probe{self.probes}.stop", self.workdir / f"probe{self.probes}.json"
        child = subprocess.Popen([sys.executable, "-c", code, str(self.port), str(stop_file), str(out)],
                                 env=child_env())
        time.sleep(1.0)  # the probe's imports, before the attack starts
        latencies: list = []

        class Stop:
            def set(self):
                stop_file.write_text("")

        class Join:
            def join(self):
                child.wait(30)
                latencies.extend(json.loads(out.read_text()))

        return Stop(), latencies, Join()

    def health_baseline(self) -> None:
        """/health with nothing else going on: what the machine gives before any attack (for the rows below)."""
        stop, latencies, thread = self.health_probe()
        time.sleep(3)
        stop.set()
        thread.join()
        self.table.add("/health, undisturbed", len(latencies), len(latencies), latencies, 0,
                       rss_bytes(self.server.pid), rss_bytes(self.server.pid),
                       "recover = its latency, a fresh connection each (the probe used in the rows below)")

    def http_drops(self) -> None:
        errors, times, ran = [], [], 0
        for trial in range(self.args.drops):
            if self.left() < 15:
                break
            ran += 1
            stream = trial % 2 == 1
            body = json.dumps({"prompt": "go on", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
                               "stream": stream}).encode()
            with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                time.sleep(self.random.uniform(0.2, 1.0))
            closed = self.wait_no_sequences(10)
            if closed is None:
                errors.append(f"trial {trial}: sequence still open 10 s after the client left")
            else:
                times.append(closed)
        self.table.add("HTTP client drops mid-request", ran, ran - len(errors), times, len(errors),
                       note="recover = until its sequence closed")

    def big_body(self) -> None:
        body = b'{"prompt": [' + b"1, " * ((50 << 20) // 3) + b'1], "max_tokens": 1}'
        before = rss_bytes(self.server.pid)
        stop, latencies, thread = self.health_probe()
        answers, times, errors = [], [], []
        for chunked in (False, True):
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
                head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                head += b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Content-Length: %d\r\n\r\n" % len(body)
                try:
                    sock.sendall(head)
                    for i in range(0, len(body), 1 << 20):
                        piece = body[i:i + (1 << 20)]
                        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                    if chunked:
                        sock.sendall(b"0\r\n\r\n")
                except OSError:
                    pass
                try:
                    answer = sock.recv(200)
                except OSError as error:
                    answer = repr(error).encode()
            times.append(time.monotonic() - started)
            answers.append(answer[:12])
            if not answer.startswith(b"HTTP/1.1 4"):
                errors.append(f"{'chunked' if chunked else 'Content-Length'}: {answer[:40]!r}")
        time.sleep(0.5)
        stop.set()
        thread.join()
        after = rss_bytes(self.server.pid)
        self.table.add("50 MB body (length, chunked)", 2, 2 - len(errors), times, len(errors), before, after,
                       f"answers {[a.decode(errors='replace') for a in answers]}; /health max "
                       f"{max(latencies) * 1000:.0f} ms")

    def junk(self) -> None:
        bodies = [
            b'{"prompt": "a\\ud800b", "max_tokens": 1}',
            b'{"prompt": "ab", "max_tokens": 1, "temperature": 0.7, "top_k": 2147483648}',
            b'{"prompt": "ab", "max_tokens": 1, "temperature": 0.7, "top_k": 1e400}',
            b'{"prompt": "ab", "max_tokens": 1, "seed": 123456789012345678901234567890}',
            b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}',
            b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"bos_token": "x"}}',
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
            b'{"prompt": [1, 2, -1]}', b'{"prompt": [99999999999999999999]}', b'{"prompt": []}', b'{"prompt": ""}',
            b'{"prompt": "ab", "max_tokens": -1}', b'{"prompt": "ab", "max_tokens": 1e30}', b'{"prompt": null}',
            b'{"prompt": "ab", "stop": [null]}', b'{"prompt": "ab", "n": 1000000}', b'{"prompt": "ab", "logprobs": 5}',
            b'{"prompt": "ab", "stream_options": "x", "stream": true}', b"[" * 100000 + b"]" * 100000,
            b'{"prompt": "ab"', b"\xff\xfe\x00", b"", b"null", b"[]", b'"str"', b'{"prompt": NaN}',
            b'{"prompt": "ab", "temperature": Infinity}', b'{"prompt": {"a": 1}}', b'{"model": 5, "prompt": "x"}',
        ]
        statuses, five_hundreds = [], []
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in bodies:
                try:
                    status = httpx.post(self.url + path, content=body, headers={"content-type": "application/json"},
                                        timeout=60).status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                statuses.append(status)
                if status == 500 or not isinstance(status, int):
                    five_hundreds.append(f"{path} {body[:50]!r}: {status}")
        counts = {}
        for status in statuses:
            counts[status] = counts.get(status, 0) + 1
        self.table.add("junk bodies (campaign set)", len(statuses), len(statuses) - len(five_hundreds), (),
                       len(five_hundreds), note=f"statuses {dict(sorted(counts.items(), key=str))}; "
                                                + "; ".join(five_hundreds[:3]))

    def half_open(self) -> None:
        count = self.args.half_open
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = count + 512
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard != resource.RLIM_INFINITY else want,
                                                        hard))
        before = rss_bytes(self.server.pid)
        stop, latencies, thread = self.health_probe()
        sockets, opened = [], []
        errors = []
        for i in range(count):
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                opened.append(time.monotonic())
                if i % 2:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
                sockets.append(sock)
            except OSError as error:
                errors.append(f"connect {i}: {error}")
                break
        # how long until the server closed each one
        closed_at = [None] * len(sockets)
        deadline = time.monotonic() + 30
        for sock in sockets:
            sock.setblocking(False)
        while time.monotonic() < deadline and any(c is None for c in closed_at):
            for i, sock in enumerate(sockets):
                if closed_at[i] is None:
                    try:
                        sock.recv(4096)  # its 408, or the end: the server let it go
                        closed_at[i] = time.monotonic() - opened[i]
                    except BlockingIOError:
                        pass
                    except OSError:
                        closed_at[i] = time.monotonic() - opened[i]
            time.sleep(0.05)
        stop.set()
        thread.join()
        for sock in sockets:
            sock.close()
        after = rss_bytes(self.server.pid)
        still_open = sum(1 for c in closed_at if c is None)
        if still_open:
            errors.append(f"{still_open} connections still open after 30 s")
        slow = [t for t in latencies if t > 1.0]
        if slow:
            errors.append(f"/health over 1 s {len(slow)} times")
        done = [c for c in closed_at if c is not None]
        self.table.add(f"{count} half-open connections", len(sockets), len(done), done, len(errors), before, after,
                       f"closed by the server after (s) = recover; /health max {max(latencies) * 1000:.0f} ms over "
                       f"{len(latencies)} probes" + ("; " + "; ".join(errors[:2]) if errors else ""))

    def stop(self) -> None:
        if getattr(self, "server", None) is not None and self.server.poll() is None:
            self.server.terminate()
            self.server.wait(20)
        for shard in self.shards:
            shard.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=900, help="seconds for the whole run (default 900)")
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--freezes", type=int, default=20)
    parser.add_argument("--coordinator-kills", type=int, default=5)
    parser.add_argument("--drops", type=int, default=20)
    parser.add_argument("--half-open", type=int, default=2000)
    parser.add_argument("--frames", type=int, default=40, help="16 MiB frames in the many-frame message")
    parser.add_argument("--launched-kills", type=int, default=20, help="launched phase: SIGKILL rounds")
    parser.add_argument("--launched-freezes", type=int, default=20,
                        help="launched phase: SIGSTOP rounds, each past the supervisor's hang timeout")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--phases", default="http,shards",
                        help="comma-separated: http, shards (all below), frames, kills, freezes; launched (a "
                             "supervised launched pair of its own) (default: http,shards)")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args()
    groups = args.phases.split(",")
    known = {"http", "frames", "kills", "freezes", "shards", "launched"}
    if not set(groups) <= known:
        parser.error(f"--phases: unknown {sorted(set(groups) - known)}; choose from {sorted(known)}")
    hand_started = any(group != "launched" for group in groups)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardd-chaos-") as workdir:
        chaos = Chaos(args, Path(workdir))
        try:
            if hand_started:
                chaos.start_shards()
                chaos.start_server()
            phases = {"http": (chaos.health_baseline, chaos.big_body, chaos.junk, chaos.half_open, chaos.http_drops),
                      "frames": (chaos.many_frames,), "kills": (chaos.kill_trials,), "freezes": (chaos.freeze_trials,),
                      "shards": (chaos.many_frames, chaos.coordinator_kills, chaos.kill_trials, chaos.freeze_trials),
                      "launched": (chaos.launched_trials,)}
            for group in groups:
                for phase in phases[group]:
                    phase()
        finally:
            chaos.stop()
    table = chaos.table.render()
    what = ["two shards (tiny synthetic, tcp loopback) + shardctl serve"] if hand_started else []
    if "launched" in groups:
        what.append("a launched, supervised pair (tiny synthetic, tcp loopback)")
    print(f"chaos run: {time.monotonic() - started:.0f} s of a {args.budget:g} s budget, {' and '.join(what)}; "
          f"recovered = identical output (decoding) or the expected answer")
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps({"seconds": time.monotonic() - started, "budget": args.budget,
                                         "rows": chaos.table.rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
