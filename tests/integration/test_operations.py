"""What an operator relies on: systemd's watchdog and status, failing before the weights load, the endpoint a
`:*` bind got, Prometheus metrics, JSON logs, and the flags both commands share. Real `shardd serve` processes."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from coordinator.cli import cli
from protocol import pure_chain
from tests.support.daemons import Client, Daemon, free_tcp_endpoint, receive_until, serve_command

TINY_WEIGHT_BYTES = 1066752  # the tiny preset in float32


@pytest.fixture(scope="module")
def workdir():
    # Short: ipc:// and datagram socket paths must fit in sun_path (108 bytes).
    path = Path(tempfile.mkdtemp(prefix="shardd-ops-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_serve(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "shardd", "serve", *args], capture_output=True, text=True,
                            timeout=timeout)
    return result, time.monotonic() - started


# ---- systemd ---------------------------------------------------------------------------------------------


def test_watchdog_pings_at_half_the_interval_and_status_counts_sequences(workdir):
    notify_path = workdir / "notify-watchdog"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        daemon = Daemon("watchdog", f"ipc://{workdir}/watchdog.sock", [], workdir,
                        env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000"})
        try:
            loading = receive_until(notify, "READY=1", timeout=60)
            assert f"STATUS=loading weights {TINY_WEIGHT_BYTES}/{TINY_WEIGHT_BYTES} bytes (100%, ETA 0:00)" in loading
            assert "STATUS=serving layers 0:6 on" in loading[-1] and "0 sequences open" in loading[-1]
            # No request at all: the serving loop alone pings, every 0.2 s (half of WATCHDOG_USEC).
            pings = []
            while len(pings) < 6:
                receive_until(notify, "WATCHDOG=1", timeout=2)
                pings.append(time.monotonic())
            gaps = [b - a for a, b in zip(pings, pings[1:])]
            assert all(0.1 < gap < 0.4 for gap in gaps), gaps

            client = daemon.client()
            client.call("OPEN", seq=1)
            # The loop's next turn says so (the one after it at the latest, should a ping come first).
            messages = receive_until(notify, "WATCHDOG=1", timeout=2) + receive_until(notify, "WATCHDOG=1", timeout=2)
            assert any(m.startswith("STATUS=serving layers 0:6") and m.endswith(": 1 sequences open")
                       for m in messages), messages
            daemon.signal(15)
            receive_until(notify, "STOPPING=1", timeout=5)
            assert daemon.wait(10) == 0
        finally:
            daemon.stop()


def test_no_watchdog_pings_for_another_pid(workdir):
    notify_path = workdir / "notify-otherpid"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        daemon = Daemon("otherpid", f"ipc://{workdir}/otherpid.sock", [], workdir,
                        env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
        try:
            receive_until(notify, "READY=1", timeout=60)
            with pytest.raises(AssertionError, match="no 'WATCHDOG=1'"):
                receive_until(notify, "WATCHDOG=1", timeout=1.0)
        finally:
            daemon.stop()


def test_the_unit_sets_a_watchdog():
    unit = (Path(__file__).resolve().parents[2] / "scripts/systemd/shardd@.service").read_text()
    assert re.search(r"^WatchdogSec=\d+", unit, re.M) and re.search(r"^Type=notify$", unit, re.M)


# ---- fail before the long work ---------------------------------------------------------------------------


def test_a_port_in_use_fails_in_one_line_before_any_weight_loads():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # The small preset takes seconds to build: it must never get there.
        result, seconds = run_serve("--synthetic", "small", "--bind", f"tcp://127.0.0.1:{port}")
    assert result.returncode == 1, result.stderr
    assert f"cannot bind tcp://127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr and "loading weights" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert seconds < 30


def test_an_ipc_path_of_a_live_daemon_is_refused_and_a_stale_one_replaced(workdir):
    path = workdir / "taken.sock"
    first = Daemon("taken", f"ipc://{path}", [], workdir)
    try:
        first.wait_ready()
        result, _ = run_serve("--synthetic", "tiny", "--bind", f"ipc://{path}")
        assert result.returncode == 1
        assert f"cannot bind ipc://{path}: another process is serving on {path}" in result.stderr
        assert first.client().call("HELLO").result["pid"] == first.process.pid  # still the first one's
    finally:
        assert first.stop() == 0
    # A socket file left by a process that died: replaced.
    stale = workdir / "stale.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(stale))
    leftover.close()
    assert stale.exists()
    second = Daemon("stale", f"ipc://{stale}", [], workdir)
    try:
        assert second.wait_ready()["layers"] == [0, 6]
    finally:
        assert second.stop() == 0


def test_sigterm_right_after_binding_leaves_no_socket_file(workdir):
    path, endpoint_file = workdir / "loading.sock", workdir / "loading.endpoint"
    log = workdir / "loading.log"
    with open(log, "wb") as out:
        # The small preset takes a moment to build: the signal most likely lands while it loads.
        process = subprocess.Popen(serve_command(f"ipc://{path}", "--endpoint-file", str(endpoint_file), synthetic="small"),
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not endpoint_file.exists():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        process.terminate()
        assert process.wait(30) == 0, log.read_text()
        assert re.search(r"signal SIGTERM( while loading)?: stopping", log.read_text()) and not path.exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_wildcard_port_is_reported(workdir):
    endpoint_file = workdir / "wildcard.endpoint"
    log = workdir / "wildcard.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(serve_command("tcp://127.0.0.1:*", "--endpoint-file", str(endpoint_file)),
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not endpoint_file.exists():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        endpoint = endpoint_file.read_text().strip()
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", endpoint) and not endpoint.endswith(":0")
        client = Client(endpoint)
        assert client.wait_ready(process, log=log)["pid"] == process.pid
        client.close()
        assert f"bound {endpoint}" in log.read_text() and f"serving on {endpoint}" in log.read_text()
    finally:
        process.terminate()
        assert process.wait(10) == 0


@pytest.mark.parametrize("args, code, message", [
    (["--layers", "4:2"], 2, "layer range 4:2 is reversed"),
    (["--layers", "0:9"], 2, "layer range 0:9 is not inside 0:6"),
    (["--log-level", "CHATTY"], 2, "Invalid value for '--log-level'"),
    (["--device", "tpu"], 2, "--device must be cpu or cuda:N"),
    (["--busy-poll-ms", "soon"], 2, "--busy-poll-ms must be a number of milliseconds or auto, got 'soon'"),
    (["--busy-poll-ms", "2000"], 2, "--busy-poll-ms must be within [0, 1000]"),
    (["--relay-to", "tcp://192.0.2.7:7701"], 2, "only ipc:// or a loopback tcp:// endpoint (a daemon of this host)"),
    (["--relay-to", "127.0.0.1:7701"], 2, "has no transport"),
    (["--relay-to", "tcp://127.0.0.1:*"], 2, "name the next shard's port"),
    (["--relay-to", "ipc:///tmp/next.sock", "--relay-to-file", "/tmp/next.endpoint"], 2,
     "--relay-to-file names the next shard as --relay-to does: give one of them"),
], ids=["reversed", "outside", "log-level", "device", "busy-poll-word", "busy-poll-range", "relay-remote",
        "relay-no-scheme", "relay-any-port", "relay-twice"])
def test_usage_errors_are_one_clear_line(args, code, message):
    result, _ = run_serve("--synthetic", "tiny", "--bind", free_tcp_endpoint(), *args)
    assert result.returncode == code and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU has CUDA devices")
def test_cuda_without_a_gpu_says_so():
    result, _ = run_serve("--synthetic", "tiny", "--bind", free_tcp_endpoint(), "--device", "cuda")
    assert result.returncode == 2 and "--device cuda: no CUDA device was found" in result.stderr, result.stderr


# ---- metrics, HELLO, logs ------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_hello_health_and_json_logs(workdir):
    daemon = Daemon("metrics", f"ipc://{workdir}/metrics.sock",
                    ["--max-verify-tokens", "4", "--metrics-port", "0", "--log-format", "json"], workdir)
    try:
        hello = daemon.wait_ready()
        assert hello["version"] == "0.1.0" and hello["pid"] == daemon.process.pid and hello["uptime_seconds"] >= 0
        memory = hello["device_memory"]
        assert 0 < memory["process_bytes"] and 0 < memory["used_bytes"] <= memory["total_bytes"]

        records = [json.loads(line) for line in daemon.output().splitlines() if line.startswith("{")]
        assert records and all({"time", "level", "pid", "message"} <= set(r) for r in records)
        url = next(re.search(r"metrics on (\S+)", r["message"]).group(1) for r in records if "metrics on" in r["message"])

        client = daemon.client()
        client.call("OPEN", seq=5)
        client.call("FORWARD", seq=5, pos=0, tokens=[1, 2, 3])
        client.call("FORWARD", seq=5, pos=3, tokens=[4, 5, 6], checkpoint=True, parents=pure_chain(3))
        client.call("ROLLBACK", seq=5, keep=1)
        client.call("CAPTURE", seq=5, pos=4, tokens=[7], layers=[2])
        assert client.request("FORWARD", seq=5, pos=99, tokens=[1]).error_code == "POSITION_MISMATCH"
        assert client.request("OPEN", seq=5).error_code == "SEQUENCE_EXISTS"

        samples = scrape(url)
        assert samples['shardd_requests_total{type="FORWARD"}'] == 3
        assert samples['shardd_requests_total{type="ROLLBACK"}'] == 1
        assert samples['shardd_errors_total{code="POSITION_MISMATCH",type="FORWARD"}'] == 1
        assert samples['shardd_errors_total{code="SEQUENCE_EXISTS",type="OPEN"}'] == 1
        assert samples['shardd_rollbacks_total{keep="1",mode="checkpoint"}'] == 1
        assert samples["shardd_captures_total"] == 1
        assert samples["shardd_open_sequences"] == 1
        assert samples["shardd_checkpoint_bytes"] > 0
        assert samples['shardd_request_seconds_count{type="FORWARD"}'] == 3
        assert samples['shardd_device_memory_total_bytes{device="cpu"}'] > 0
        # a whole model sends no rows on and waits for none (test_relay.py counts them where it does)
        assert [samples[f'shardd_rows_total{{event="{event}"}}'] for event in ("sent", "received", "waited",
                                                                             "missing")] == [0, 0, 0, 0]
        assert samples["shardd_rows_waiting"] == 0
        client.call("CLOSE", seq=5)
        assert scrape(url)["shardd_open_sequences"] == 0
    finally:
        assert daemon.stop() == 0


# ---- the command lines ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["-m", "shardd"], ["-c", "from coordinator.cli import main; main()"]],
                         ids=["shardd", "shardctl"])
def test_help_and_version_on_both_commands(command):
    for flag in ("-h", "--help"):
        result = subprocess.run([sys.executable, *command, flag], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "Example" in result.stdout, result.stdout
    result = subprocess.run([sys.executable, *command, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "0.1.0" in result.stdout


def test_every_shardctl_command_has_an_example_and_json():
    for name in cli.commands:
        result = CliRunner().invoke(cli, [name, "-h"])
        assert result.exit_code == 0, result.output
        assert "Example" in result.output and "--json" in result.output, name


def test_busy_polling_auto_is_on_only_for_a_gpu_with_cores_to_spare(monkeypatch):
    """--busy-poll-ms auto: AUTO_BUSY_POLL_MS on a CUDA device with enough usable CPUs, else 0 (on
    a small host polling takes the cores the daemons' threads need); a number is taken as given."""
    from shardd import config

    monkeypatch.setattr(config, "usable_cpus", lambda: 16)
    assert config.busy_poll_seconds("auto", "cuda:0") == config.AUTO_BUSY_POLL_MS / 1000
    assert config.busy_poll_seconds("auto", "cpu") == 0
    assert config.busy_poll_seconds("0", "cuda:0") == 0 and config.busy_poll_seconds("2.5", "cpu") == 0.0025
    monkeypatch.setattr(config, "usable_cpus", lambda: config.AUTO_BUSY_POLL_CPUS - 1)
    assert config.busy_poll_seconds("AUTO", "cuda:1") == 0


def test_a_coordinator_s_auto_follows_its_daemons_on_a_host_with_the_cores(monkeypatch):
    """shardctl --busy-poll-ms auto (Pipeline.connect busy_poll_s=None): a client polls as long as its daemon
    reports polling in HELLO, where this host has AUTO_BUSY_POLL_CPUS too; never for a daemon that sleeps."""
    from common.busy_poll import AUTO_BUSY_POLL_CPUS, follow_busy_poll

    assert follow_busy_poll(20.0, cpus=16) == 0.02
    assert follow_busy_poll(20.0, cpus=AUTO_BUSY_POLL_CPUS - 1) == 0
    assert follow_busy_poll(0, cpus=16) == 0 and follow_busy_poll(None, cpus=16) == 0
    assert follow_busy_poll("20", cpus=16) == 0 and follow_busy_poll(5000, cpus=16) == 0


def test_a_busy_polling_daemon_and_client_answer_as_sleeping_ones_and_stop_at_once(workdir):
    """--busy-poll-ms (the daemon) and busy_poll_s (the client) change how each waits, not what is answered: the
    same ids as without, requests apart by more than the window are still served, and SIGTERM ends the daemon
    within its poll, not after the window. HELLO reports the daemon's polling, which a client's auto follows."""
    from common.busy_poll import follow_busy_poll
    from coordinator.relay.client import ShardClient

    bind = f"ipc://{workdir}/busy.sock"
    daemon = Daemon("busy", bind, ["--layers", "0:6", "--busy-poll-ms", "300"], workdir)
    try:
        daemon.wait_ready()
        with ShardClient(bind, timeout_s=30, busy_poll_s=0.3) as busy, ShardClient(bind, timeout_s=30) as plain, \
                ShardClient(bind, timeout_s=30, busy_poll_s=None) as follower:
            assert busy.hello()["busy_poll_ms"] == 300
            follower.hello()  # follows the daemon where the host has the cores for it (not this test machine's 2)
            assert follower.busy_poll_s == follow_busy_poll(300)
            busy.open(1)
            plain.open(2)
            ids = busy.forward(1, 0, [1, 2, 3]).result["ids"]
            time.sleep(0.5)  # past both windows: the daemon and the client are back to sleeping polls
            assert plain.forward(2, 0, [1, 2, 3]).result["ids"] == ids
            assert busy.forward(1, 3, [4]).result["length"] == 4
        started = time.monotonic()
        daemon.signal(signal.SIGTERM)  # inside the 300 ms window after the last reply
        assert daemon.wait(10) == 0 and time.monotonic() - started < 5, daemon.output()
    finally:
        daemon.stop()


def test_shardctl_busy_poll_gives_the_same_tokens_on_both_ends():
    """shardctl --busy-poll-ms: the coordinator polls for each reply and the shards it launches for their next
    request (shardd serve --busy-poll-ms); the tokens are those of a run where neither polls."""
    args = ["generate", "--synthetic", "tiny", "--split", 2, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", 6,
            "--drafter", "oracle", "--ignore-eos", "--json"]
    plain, busy = shardctl(*args, "--busy-poll-ms", 0), shardctl(*args, "--busy-poll-ms", 5)
    assert plain.exit_code == 0 and busy.exit_code == 0, (plain.output, busy.output)
    assert json.loads(busy.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
    bad = shardctl(*args, "--busy-poll-ms", "soon")  # auto (the default) or milliseconds, refused before launching
    assert bad.exit_code == 2 and "a number of milliseconds in [0, 1000] or auto, got 'soon'" in bad.output


def test_one_vocabulary_of_flags():
    def options(*path):
        from shardd.cli import main as shardd_main

        group = shardd_main if path[0] == "shardd" else cli
        command = group.commands[path[1]]
        return {name for param in command.params for name in param.opts}

    serve, launch, generate = options("shardd", "serve"), options("shardctl", "launch"), options("shardctl", "generate")
    for spelling in ("--device", "--rollback-mode", "--rollback", "--max-context", "--max-sequences", "--dtype"):
        assert spelling in serve and spelling in launch and spelling in generate, spelling
    assert "--devices" in launch and "--devices" in generate  # the old spelling still works
    timeouts = {cli.commands[name].params[[p.name for p in cli.commands[name].params].index("timeout")].default
                for name in ("generate", "bench", "status")}
    assert len(timeouts) == 1


# ---- the coordinator waiting for shards, and status ------------------------------------------------------


def shardctl(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_a_shard_that_does_not_answer_is_named_at_once_and_one_with_nothing_listening_fails_at_once(workdir):
    import zmq

    # A bound socket that never answers: what a shard still loading its weights looks like from outside.
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        result = shardctl("generate", "--shards", endpoint, "--prompt", "x", "--timeout", 3)
        seconds = time.monotonic() - started
        assert result.exit_code == 1, result.output
        assert f"waiting for the shard at {endpoint}: no answer to HELLO yet" in result.stderr, result.output
        assert f"{endpoint}: no reply to HELLO" in result.stderr and 2.5 < seconds < 30, (seconds, result.output)
    finally:
        silent.close(linger=0)
    # A port probed free (the one above may still be closing: libzmq closes listeners asynchronously).
    for gone in (free_tcp_endpoint(), f"ipc://{workdir}/nobody.sock"):
        started = time.monotonic()
        result = shardctl("status", "--shards", gone)  # the default timeout: no waiting for what cannot answer
        assert result.exit_code == 1 and "nothing is listening" in result.stdout, result.output
        assert time.monotonic() - started < 10, result.output


def test_status_exits_1_when_the_shards_do_not_form_the_model(workdir):
    daemon = Daemon("half", f"ipc://{workdir}/half.sock", ["--layers", "0:3"], workdir)
    try:
        hello = daemon.wait_ready()
        result = shardctl("status", "--shards", daemon.bind, "--json")
        assert result.exit_code == 1, result.output
        record = json.loads(result.stdout)
        entry = record["shards"][0]
        assert entry["ok"] and not record["pipeline"]["ok"] and "3" in record["pipeline"]["message"]
        assert entry["hello"]["pid"] == daemon.process.pid and entry["stats"]["open_sequences"] == 0
        table = shardctl("status", "--shards", daemon.bind)
        assert table.exit_code == 1 and "NOT USABLE" in table.stdout
        assert str(hello["pid"]) in table.stdout and "0.1.0" in table.stdout and "GiB" in table.stdout
    finally:
        assert daemon.stop() == 0


def test_generate_passes_capacity_options_to_the_shards_it_starts():
    result = shardctl("generate", "--synthetic", "tiny", "--split", 1, "--max-context", 12, "--max-sequences", 1,
                      "--prompt-ids", "1,2,3,4,5,6,7,8", "--max-new-tokens", 4, "--drafter", "none", "--ignore-eos")
    # the shards hold 12 tokens: the 8-token prompt leaves room for 4; more is a usage error, not a silent cap
    assert result.exit_code == 0, result.output
    assert "4 tokens" in result.stderr
    result = shardctl("generate", "--shards", "tcp://127.0.0.1:9", "--max-context", 12, "--prompt", "x")
    assert result.exit_code == 2 and "--max-context" in result.output
