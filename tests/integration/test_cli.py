"""`shardctl` end to end: real daemons, real sockets, the outputs a user reads."""

from __future__ import annotations

import json
import pkgutil
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import coordinator
from coordinator.benchstats import tokens_digest
from coordinator.cli import cli
from coordinator.cli.bench import benchmark_prompt
from coordinator.decoding import greedy_decode
from coordinator.launch import ShardSet, child_env, launched_sets
from coordinator.relay.client import CurveKeys, ShardClient, ShardTimeout
from coordinator.tokenizer import HFTokenizer
from protocol.layout import even_split
from shardd.weights.loading import ModelSource
from shardd.local import LocalTarget
from shardd.engine.reference.rollback import RollbackStorage

TINY = ("--synthetic", "tiny")
PROMPT = "Shards hand hidden states along; shards hand hidden states"


@pytest.fixture(scope="module")
def shards():
    sets = [
        ShardSet(TINY, even_split(6, 2), "tcp"),
        ShardSet(TINY, [(3, 6)], "ipc", ("--max-verify-tokens", "0")),
    ]
    with launched_sets(sets, ready_timeout_s=120) as (pair, bare):
        yield {"pair": [s.endpoint for s in pair], "bare": bare[0].endpoint}


@pytest.fixture(scope="module")
def local():
    return LocalTarget(ModelSource(synthetic="tiny"), storage=RollbackStorage(None, 0))


def greedy_ids(local, prompt_ids, n):
    return greedy_decode(local, 1, prompt_ids, n).tokens


def shardctl(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def test_generate_json_matches_plain_greedy(shards, local):
    result = shardctl("generate", "--shards", ",".join(shards["pair"]), "--prompt", PROMPT, "--max-new-tokens", 32,
                      "--drafter", "oracle", "--mean-commit", 3, "--block-size", 8, "--rollback", "checkpoint", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    expected = greedy_ids(local, list(PROMPT.encode()), 32)
    assert record["tokens"] == expected
    assert record["sha256"] == tokens_digest(expected)
    assert record["matches_greedy"] is True and record["reference"]["sha256"] == record["sha256"]
    assert record["prompt_tokens"] == len(PROMPT.encode()) and record["new_tokens"] == 32
    assert record["rollbacks"]["fast"] > 0 and record["rollbacks"]["fallback"] == 0
    assert record["steps"] < 31 and 0 < record["acceptance_rate"] < 1 and record["avg_commit"] > 1
    assert record["decode_tok_s"] > 0 and record["prefill_tok_s"] > 0
    assert "benchmark drafter" in record["drafter_note"]


def test_generate_streams_text_and_ids(shards, local):
    expected = greedy_ids(local, [7, 8, 9], 24)
    result = shardctl("generate", "--shards", ",".join(shards["pair"]), "--prompt-ids", "7,8,9", "--max-new-tokens", 24,
                      "--ids")
    assert result.exit_code == 0, result.output
    assert [int(x) for x in result.stdout.split()] == expected
    assert tokens_digest(expected)[:16] in result.stderr  # the summary line

    result = shardctl("generate", "--shards", ",".join(shards["pair"]), "--prompt-ids", "7,8,9", "--max-new-tokens", 24,
                      "--drafter", "none")
    assert result.exit_code == 0, result.output
    text = HFTokenizer.synthetic_for(320).decode(expected)  # the synthetic model's tokenizer: bytes, then words
    assert result.stdout == text + "\n"


# A child Python in which `import torch` fails: whatever it runs never imported torch.
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; "


def test_generate_against_running_shards_never_imports_torch(shards, local):
    # The oracle decodes greedily first, then speculates with checkpoint rollback: both loops run.
    completed = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH + "from coordinator.cli import main; main()", "generate",
         "--shards", ",".join(shards["pair"]), "--prompt", PROMPT, "--max-new-tokens", "12", "--drafter", "oracle",
         "--block-size", "8", "--mean-commit", "3", "--rollback", "checkpoint", "--json"],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    record = json.loads(completed.stdout)
    assert record["tokens"] == greedy_ids(local, list(PROMPT.encode()), 12) and record["matches_greedy"]


def test_the_coordinator_modules_import_without_torch():
    root = Path(coordinator.__file__).parent.parent
    modules = [module.name for package in ("coordinator", "protocol", "common")
               for module in pkgutil.walk_packages([str(root / package)], f"{package}.") if not module.name.endswith("__main__")]
    modules = ["coordinator", "protocol", "common"] + modules
    assert {"coordinator.cli.generate", "coordinator.tokenizer", "common.model_config", "protocol.codec"} <= set(modules)
    code = WITHOUT_TORCH + (f"import importlib; [importlib.import_module(name) for name in {modules!r}]; "
                            "shardd = sorted(m for m in sys.modules if m.split('.')[0] == 'shardd'); assert not shardd, shardd")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=60)
    assert completed.returncode == 0, completed.stderr


def test_generate_launches_its_own_shards(local):
    result = shardctl("generate", "--synthetic", "tiny", "--split", 3, "--transport", "ipc", "--prompt", PROMPT,
                      "--max-new-tokens", 24, "--drafter", "ngram", "--rollback", "replay-ssm", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["sha256"] == tokens_digest(greedy_ids(local, list(PROMPT.encode()), 24))
    assert [s["layers"] for s in record["shards"]] == [[0, 2], [2, 4], [4, 6]]
    assert all(s["endpoint"].startswith("ipc://") for s in record["shards"])


def test_generate_refuses_checkpoint_modes_on_a_shard_without_storage(shards, local):
    mixed = f"{shards['pair'][0]},{shards['bare']}"
    for mode in ("checkpoint", "replay-ssm"):
        result = shardctl("generate", "--shards", mixed, "--prompt", PROMPT, "--rollback", mode)
        assert result.exit_code == 2, result.output
        assert shards["bare"] in result.output and "--max-verify-tokens 0" in result.output
    result = shardctl("generate", "--shards", mixed, "--prompt", PROMPT, "--max-new-tokens", 16, "--rollback", "replay",
                      "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sha256"] == tokens_digest(greedy_ids(local, list(PROMPT.encode()), 16))


def test_generate_refuses_a_shard_set_with_a_gap(shards):
    result = shardctl("generate", "--shards", shards["pair"][0], "--prompt", PROMPT)
    assert result.exit_code == 2
    assert "gap" in result.output and shards["pair"][0] in result.output


def test_generate_usage_errors():
    assert shardctl("generate", "--prompt", "x").exit_code == 2  # no shards named
    assert shardctl("generate", "--synthetic", "tiny", "--prompt", "x").exit_code == 2  # no --split
    assert shardctl("generate", "--shards", "tcp://127.0.0.1:9", "--prompt-ids", "1,x").exit_code == 2


def test_generate_fails_with_exit_1_when_a_shard_is_down():
    result = shardctl("generate", "--shards", "tcp://127.0.0.1:9", "--timeout", 0.3, "--prompt", "x")
    assert result.exit_code == 1
    assert "tcp://127.0.0.1:9" in result.stderr and "Traceback" not in result.output


def test_status_json_and_table(shards):
    pair = shards["pair"]
    result = shardctl("status", "--shards", ",".join(pair), "--json")
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["pipeline"]["ok"]
    assert [entry["endpoint"] for entry in status["shards"]] == pair
    assert [entry["hello"]["layers"] for entry in status["shards"]] == [[0, 3], [3, 6]]
    for entry in status["shards"]:
        assert entry["ok"] and entry["stats"]["open_sequences"] == 0
        assert entry["hello"]["rollback"]["mode"] == "checkpoint"

    result = shardctl("status", "--shards", ",".join(pair))
    assert result.exit_code == 0 and all(endpoint in result.stdout for endpoint in pair)
    assert "checkpoint/16" in result.stdout and "pipeline: ok" in result.stdout

    result = shardctl("status", "--shards", f"{pair[0]},tcp://127.0.0.1:9", "--timeout", 0.3, "--json")
    assert result.exit_code == 1
    status = json.loads(result.stdout)
    assert [entry["ok"] for entry in status["shards"]] == [True, False] and not status["pipeline"]["ok"]


def test_demo_outputs_are_identical(tmp_path):
    result = shardctl("demo", "--max-new-tokens", 48, "--json", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["identical"]
    runs = {(run["drafter"], run["rollback"]): run for run in record["runs"]}
    assert set(runs) == {("none", None)} | {
        (d, m) for d in ("ngram", "oracle", "dflash") for m in ("checkpoint", "replay-ssm", "replay")}
    assert len({run["sha256"] for run in record["runs"]}) == 1
    assert runs[("oracle", "checkpoint")]["rollbacks"]["fast"] > 0 and runs[("oracle", "replay")]["rollbacks"]["replays"] > 0
    assert (tmp_path / "shardd" / "small-seed0" / "config.json").is_file()  # cached for the next demo


def test_bench_ab_a_on_tiny(tmp_path, local):
    out = tmp_path / "bench.json"
    result = shardctl("bench", "--synthetic", "tiny", "--split", 2, "--ab", "replay,replay-ssm", "--runs", 1,
                      "--max-new-tokens", 24, "--block-size", 8, "--json", out)
    assert result.exit_code == 0, result.output
    assert "A1/A2 drift" in result.stdout and "outputs identical: yes" in result.stdout
    record = json.loads(out.read_text())
    assert [(b["name"], b["mode"], len(b["runs"])) for b in record["blocks"]] == [
        ("A1", "replay", 1), ("B", "replay-ssm", 1), ("A2", "replay", 1)]
    assert record["identical"]
    assert record["sha256"] == [tokens_digest(greedy_ids(local, benchmark_prompt(), 24))]
    for block in record["blocks"]:
        assert block["summary"]["decode_tok_s"] > 0 and block["warmup"] is not None


def test_make_model_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "model"
    result = shardctl("make-model", "--preset", "tiny", "--out", out, "--seed", 3, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["path"] == str(out)
    assert ModelSource(model_dir=str(out)).config().num_layers == 6
    assert shardctl("make-model", "--preset", "tiny", "--out", out).exit_code == 2  # no silent overwrite


def test_make_model_into_an_unwritable_place_fails_in_one_line(tmp_path):
    # The writer runs as `shardd make-model` in a child process; its failure comes back as shardctl's one line.
    (tmp_path / "a-file").write_text("")
    completed = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH + "from coordinator.cli import main; main()", "make-model", "--preset",
         "tiny", "--out", str(tmp_path / "a-file" / "model")],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )
    assert completed.returncode == 1, completed.stderr
    assert "Traceback" not in completed.stderr and completed.stdout == ""
    assert completed.stderr.splitlines()[-1] == f"shardctl: error: [Errno 20] Not a directory: '{tmp_path / 'a-file' / 'model'}'"


def _small_files_only() -> None:
    """In the child: a file may not grow past 64 KiB (EFBIG, not SIGXFSZ), so a checkpoint's weights fail mid-write."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))


def test_make_model_that_fails_mid_write_leaves_nothing(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-c", "from coordinator.cli import main; main()", "make-model", "--preset", "tiny",
         "--out", str(tmp_path / "model")],
        capture_output=True, text=True, env=child_env(), timeout=120, preexec_fn=_small_files_only,
    )
    assert completed.returncode == 1, completed.stderr
    assert "Traceback" not in completed.stderr and "File too large" in completed.stderr.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []  # neither the model directory nor a partial one
    # a second run is not refused for a half-written model
    rerun = shardctl("make-model", "--preset", "tiny", "--out", tmp_path / "model", "--json")
    assert rerun.exit_code == 0, rerun.output


def test_launch_serves_until_sigterm():
    process = subprocess.Popen(
        [sys.executable, "-c", "from coordinator.cli import main; main()", "launch", "--synthetic", "tiny",
         "--layers", "0:1,1:6", "--draft", "synthetic", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )
    try:
        launched = json.loads(process.stdout.readline())
        endpoints = launched["endpoints"]
        assert len(endpoints) == 2 and len(launched["shards"]) == 2
        assert launched["draft_endpoint"] == endpoints[1]  # the default placement: beside the last shard
        result = shardctl("status", "--shards", ",".join(endpoints), "--json")
        assert result.exit_code == 0 and json.loads(result.stdout)["pipeline"]["ok"]
        assert json.loads(result.stdout)["shards"][1]["hello"]["drafter"]["name"] == "dflash"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    for endpoint in endpoints:  # every daemon went with it
        with ShardClient(endpoint, timeout_s=0.3) as client, pytest.raises(ShardTimeout):
            client.hello()


def test_curve_protected_shards(tmp_path, local):
    import zmq.auth

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    allowed.mkdir()
    shutil.copy(client_public, allowed)
    protected = ShardSet(TINY, [(0, 6)], "tcp", ("--curve-secret-key", server_secret, "--curve-allow", str(allowed)))
    with launched_sets([protected], curve=CurveKeys.load(server_public, client_secret)) as ((shard,),):
        result = shardctl("generate", "--shards", shard.endpoint, "--curve-server-key", server_public,
                          "--curve-client-key", client_secret, "--prompt", PROMPT, "--max-new-tokens", 8, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["sha256"] == tokens_digest(greedy_ids(local, list(PROMPT.encode()), 8))
        # Without the keys the handshake never completes: nothing is served.
        result = shardctl("status", "--shards", shard.endpoint, "--timeout", 0.5)
        assert result.exit_code == 1 and "DOWN" in result.stdout
        # Keys are for shards that already run; launched ones listen on loopback without them.
        result = shardctl("generate", "--synthetic", "tiny", "--split", 1, "--prompt", "x",
                          "--curve-server-key", server_public, "--curve-client-key", client_secret)
        assert result.exit_code == 2
