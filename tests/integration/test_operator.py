"""What an operator meets first: a launched shard set that heals itself, causes named at once with one exit code
each, no silent substitutes, a vLLM user's flags, and a second Ctrl-C. Real daemons and servers on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from coordinator.cli import cli
from coordinator.cli.options import VLLM_FLAGS
from coordinator.launch import ShardSet, child_env, launched_sets
from coordinator.supervise import Supervisor
from protocol.layout import even_split
from tests.support.serving import ShardctlServe

TINY = ("--synthetic", "tiny")


def shardctl(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def run(args: list, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, timeout=timeout,
                          env={**child_env(), **env})


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    assert run(["make-model", "--preset", "tiny", "--out", str(out)]).returncode == 0
    return out


def test_a_daemon_that_cannot_load_is_named_with_its_own_error_and_a_log_that_exists(made, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(made, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:200])
    started = time.monotonic()
    result = run(["generate", "--model", str(broken), "--split", "2", "--prompt", "x"], XDG_CACHE_HOME=str(tmp_path))
    stderr = result.stderr.decode()
    assert result.returncode == 4 and "Traceback" not in stderr and "HELLO" not in stderr, stderr
    error = stderr.strip().splitlines()[-1]
    assert "exited with code 1 before it was ready: failed to load layers" in error and "header too large" in error
    log = Path(error.rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.is_file() and log.is_relative_to(tmp_path) and "header too large" in log.read_text()
    assert time.monotonic() - started < 30


def test_serve_on_a_taken_port_fails_before_any_shard_starts():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = run(["serve", *TINY, "--split", "1", "--port", str(port)])
    stderr = result.stderr.decode()
    assert result.returncode == 4 and f"cannot listen on 127.0.0.1:{port}" in stderr and "launching" not in stderr
    assert time.monotonic() - started < 10


def test_exit_codes_are_the_same_in_the_readme_and_help():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    help_text = shardctl("--help").output
    for code, cause in ((1, "a shard lost"), (2, "a usage error"), (3, "outputs differ"), (4, "a start-up failure")):
        assert f"{code}  {cause}" in help_text
        assert f"{code} {cause}" in readme, cause


@pytest.fixture(scope="module")
def short(made, tmp_path_factory) -> Path:
    """The tiny model with a config trained on 4,096 positions (the synthetic presets take the family's 262,144)."""
    out = tmp_path_factory.mktemp("short") / "tiny"
    shutil.copytree(made, out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 4096
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_no_silent_substitutes(made, short, tmp_path):
    long = shardctl("generate", "--model", short, "--split", 1, "--max-context", 100000, "--prompt", "x")
    assert long.exit_code == 2 and "max_position_embeddings (4096)" in long.output and "launching" not in long.output
    assert "--allow-long-context" in long.output

    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "generate", *TINY, "--split", "1",
                             "--prompt", b"h\xff\xfei"], capture_output=True, timeout=60, env=child_env())
    assert result.returncode == 2 and b"Traceback" not in result.stderr and b"not UTF-8" in result.stderr

    over = shardctl("generate", *TINY, "--split", 1, "--prompt-ids", "1,2", "--max-new-tokens", 100000)
    assert over.exit_code == 2 and "at most 4094" in over.output and "Traceback" not in over.output

    bare = tmp_path / "bare"
    shutil.copytree(made, bare)
    (bare / "tokenizer.json").unlink()
    text = shardctl("generate", "--model", bare, "--split", 1, "--prompt", "hi", "--max-new-tokens", 2)
    assert text.exit_code == 2 and "ships no tokenizer.json" in text.output and "--tokenizer bytes" in text.output
    ids = shardctl("generate", "--model", bare, "--split", 1, "--prompt-ids", "104,105", "--max-new-tokens", 3,
                   "--drafter", "none")
    as_bytes = shardctl("generate", "--model", bare, "--split", 1, "--prompt", "hi", "--max-new-tokens", 3,
                        "--drafter", "none", "--tokenizer", "bytes", "--json")
    assert ids.exit_code == 0 and as_bytes.exit_code == 0, ids.output + as_bytes.output
    assert [int(i) for i in ids.stdout.split()] == json.loads(as_bytes.stdout)["tokens"]


def test_a_vllm_user_s_flags(made, short):
    for flag in VLLM_FLAGS:
        value = [] if flag == "--trust-remote-code" else ["1"]
        for command in ("serve", "generate", "launch"):
            result = shardctl(command, *TINY, "--split", 1, flag, *value)
            assert result.exit_code == 2 and f"{flag} is vLLM's flag" in result.output, (command, result.output)
    for command in ("make-model", "launch", "generate", "serve", "status", "bench", "demo"):
        assert shardctl(command, "--version").output.startswith("shardctl, version"), command
    # aliases reach the same option: the context check names the model's limit, the sequences the daemons
    assert "max_position_embeddings" in shardctl("generate", "--model", short, "--split", 1, "--max-model-len", 5000,
                                                 "--prompt", "x").output
    result = shardctl("generate", "--model", made, "--split", 1, "--max-num-seqs", 1, "--dtype", "bf16",
                      "--prompt-ids", "1,2", "--max-new-tokens", 2, "--drafter", "none", "--json")
    assert result.exit_code == 0, result.output
    status = shardctl("generate", "--model", made, "--split", 1, "--dtype", "auto", "--prompt-ids", "1,2",
                      "--max-new-tokens", 2, "--drafter", "none", "--json")
    assert status.exit_code == 0, status.output


def test_a_launched_shard_that_dies_or_stops_is_restarted_and_the_output_is_unchanged():
    lines: list[str] = []
    sets = [ShardSet(TINY, even_split(6, 2), "tcp")]
    with launched_sets(sets, ready_timeout_s=120, progress=lines.append) as (pair,):
        endpoints = ",".join(shard.endpoint for shard in pair)
        args = ("generate", "--shards", endpoints, "--prompt-ids", "5,6,7", "--max-new-tokens", 24, "--json")
        expected = json.loads(shardctl(*args).stdout)["tokens"]
        for how in (signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP):  # bounded: three faults
            old = pair[1].process.pid
            os.kill(old, how)
            started = time.monotonic()
            while pair[1].process.pid == old and time.monotonic() - started < 30:  # the supervisor restarts it
                time.sleep(0.1)
            restarted_s = time.monotonic() - started
            result = shardctl(*args)
            assert result.exit_code == 0, result.output
            assert json.loads(result.stdout)["tokens"] == expected and pair[1].process.pid != old
            assert restarted_s < (2 if how == signal.SIGKILL else 15), restarted_s
        restarts = [line for line in lines if "restarting it" in line]
        assert len(restarts) == 3 and "killed by SIGKILL" in restarts[0] and "no heartbeat" in restarts[2], lines


def test_the_chaos_run_s_launched_phase_recovers_every_round(tmp_path):
    """scripts/chaos.py --phases launched, two rounds of each: a supervised launched pair whose shards are killed
    and frozen mid-stream gives the undisturbed output every round, and the table says so."""
    out = tmp_path / "chaos.json"
    result = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "scripts" / "chaos.py"), "--phases",
                             "launched", "--launched-kills", "2", "--launched-freezes", "2", "--budget", "150",
                             "--json", str(out)], capture_output=True, timeout=240, env=child_env())
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["trial"].split(" (")[0] for row in rows] == ["launched: kill -9", "launched: SIGSTOP past 10 s hang"]
    assert all(row["trials"] == row["recovered"] == 2 and row["errors"] == 0 for row in rows), rows
    assert all("rows shard to shard" in row["trial"] and row["recover_max_s"] < 60 for row in rows), rows


def test_a_shard_that_cannot_come_back_is_reported_once():
    lines, lost = [], []
    sets = [ShardSet(TINY, even_split(6, 1), "tcp")]
    with launched_sets(sets, ready_timeout_s=120, progress=lines.append, supervise=False) as ((shard,),):
        # a daemon whose restart fails at once: its model is gone
        shard.command = tuple(arg if arg != "tiny" else "no-such-preset" for arg in shard.command)
        with Supervisor([shard], lines.append, on_lost=lost.append, max_restarts=2, backoff_s=(0.1,)):
            shard.process.kill()
            deadline = time.monotonic() + 60
            while not lost and time.monotonic() < deadline:
                time.sleep(0.2)
    assert len(lost) == 1 and "not restarting it: 2 restarts" in lost[0] and "(log: " in lost[0], lines
    assert sum("restarting it in" in line for line in lines) == 2


def test_a_second_ctrl_c_on_serve_stops_without_tracebacks(tmp_path):
    with ShardctlServe(*TINY, "--split", "2", log=tmp_path / "serve.log") as server:
        server.wait_healthy()
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", server.url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 3000, "stream": True, "ignore_eos": True}) as stream:
            next(stream.iter_bytes())
            server.process.send_signal(signal.SIGINT)
            time.sleep(0.5)
            server.process.send_signal(signal.SIGINT)
            code = server.process.wait(30)
    output = (tmp_path / "serve.log").read_text()
    assert code in (0, 1, 130, -signal.SIGINT) and "Traceback" not in output and "CancelledError" not in output, output


@pytest.mark.parametrize("exit_on_loss", [False, True], ids=["503", "exit"])
def test_serve_after_a_shard_is_lost_answers_503_or_exits(made, tmp_path, exit_on_loss):
    """A launched shard is killed and cannot come back (its model directory is gone): the server answers 503 with
    OpenAI's error body on /v1/* and /health says why, no traceback; with --exit-on-shard-loss it exits 1."""
    from coordinator.relay.client import ShardClient

    model = tmp_path / "model"
    shutil.copytree(made, model)
    extra = ["--exit-on-shard-loss"] if exit_on_loss else []
    with ShardctlServe("--model", str(model), "--split", "2", *extra, log=tmp_path / "serve.log") as server:
        server.wait_healthy()
        with httpx.Client(timeout=30) as client:
            shards = client.get(server.url + "/health").json()["shards"]
            endpoint = sorted(shards)[-1]
            with ShardClient(endpoint, timeout_s=10) as shard:
                pid = shard.hello()["pid"]
            shutil.rmtree(model)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 90  # the supervisor's 5 restarts back off 0.5 .. 8 s
            if exit_on_loss:
                code = server.process.wait(deadline - time.monotonic())
                assert code == 1
            else:
                while time.monotonic() < deadline:  # meanwhile: 200, or 503 while the shard restarts
                    answer = client.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                    assert answer.status_code in (200, 503), answer.text
                    if answer.status_code == 503 and "not restarting it" in answer.text:
                        break
                    time.sleep(1)
                assert answer.status_code == 503, answer.text
                error = answer.json()["error"]
                assert error["type"] == "ServiceUnavailableError" and "not restarting it" in error["message"]
                health = client.get(server.url + "/health")
                assert health.status_code == 503 and "not restarting it" in health.json()["problems"][0]
    output = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in output, output
    assert sum(line.startswith("[shardctl]") and "not restarting it" in line for line in output.splitlines()) == 1, output
