"""Issue 18: real text in the first five minutes, and every mistake one clear line.

A synthetic model written by `shardctl make-model` ships a real tokenizer and a ChatML chat template, so
`generate`, the HTTP server, the README's `curl` and `openai` chat examples show text; a Hugging Face id
resolves through huggingface_hub's cache; each row of the issue's table is an error line (or a working option),
never a traceback or silence. Real daemons, real sockets, a real server and clients, all on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from coordinator.cli import cli
from coordinator.launch import ShardSet, child_env, launched_sets
from coordinator.relay.shards import ShardInfo
from coordinator.tokenizer import load_tokenizer
from tests.support.serving import ShardctlServe, free_port

ROOT = Path(__file__).resolve().parents[2]
MAX_CONTEXT = 96


def shardctl(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def run(command: list[str], timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env={**child_env(), **env})


def one_line_error(result, code: int) -> str:
    """A usage or runtime error: the exit code, no traceback; its text."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.output


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("made") / "tiny-chat"
    result = shardctl("make-model", "--preset", "tiny", "--out", out, "--json")
    assert result.exit_code == 0, result.output
    return out


class Serve(ShardctlServe):
    """`shardctl serve ARGS` on a free port with its own temp dir; `--json` tells the shards it serves."""

    def __init__(self, tmpdir: Path, *args: str):
        tmpdir.mkdir(parents=True, exist_ok=True)
        self.tmpdir = tmpdir
        super().__init__("--log-level", "warning", "--json", *args, env={**child_env(), "TMPDIR": str(tmpdir)},
                         stderr_apart=True, grace_s=30)
        line = self.process.stdout.readline()  # printed once the shards are ready
        if not line:
            raise AssertionError(f"shardctl serve exited {self.process.wait()}: {self.process.stderr.read()}")
        self.record = json.loads(line)
        self.wait_healthy(30)


@pytest.fixture(scope="module")
def server(made, tmp_path_factory):
    with Serve(tmp_path_factory.mktemp("serve-tmp"), "--model", str(made), "--split", "2",
               "--max-context", str(MAX_CONTEXT), "--max-sequences", "2", "--rollback-mode", "checkpoint",
               "--recovery-timeout", "5", "--drafter", "ngram", "--block-size", "4") as serve:
        yield serve


# --- real text ------------------------------------------------------------------------------------------------


def test_make_model_ships_a_tokenizer_and_a_qwen_chat_template(made):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_file(str(made / "tokenizer.json"))
    from common.model_config import load_config

    assert tokenizer.get_vocab_size() == load_config(str(made)).vocab_size == 320
    text = "Shards hand hidden states along, ünïcode too"
    assert tokenizer.encode(text, add_special_tokens=False).ids == list(text.encode())  # the ids synthetic models took
    specials = {t["content"]: t for t in json.loads((made / "tokenizer.json").read_text())["added_tokens"]}
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"):
        # Qwen's: the ChatML tokens special, the tool-call markers added but kept as text (skip_special_tokens)
        assert specials[name]["special"] == name.startswith("<|"), name
        assert len(tokenizer.encode(name, add_special_tokens=False).ids) == 1
    assert tokenizer.decode(list(range(263, 270))).split() == ["ba", "be", "bi", "bo", "bu", "da", "de"]  # words

    hf = PreTrainedTokenizerFast.from_pretrained(str(made))  # what transformers (and vLLM) read from the directory
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    rendered = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(tools[0], ensure_ascii=False) +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = hf.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_every_preset_gets_a_tokenizer_of_its_vocabulary_and_in_memory_synthetic_shards_use_it():
    from tokenizers import Tokenizer

    from common.presets import PRESETS
    from common.synthetic_tokenizer import build_tokenizer_json

    for preset in PRESETS.values():
        assert Tokenizer.from_str(build_tokenizer_json(preset["vocab_size"])).get_vocab_size() == preset["vocab_size"]
    shard = ShardInfo("tcp://127.0.0.1:1", {"model": {"fingerprint": "synthetic:tiny:0:cpu"}, "tokenizer": None})
    tokenizer = load_tokenizer(None, 320, [shard])
    assert tokenizer.encode("hello") == list(b"hello") and tokenizer.decode([263, 264]) == " ba be"


def test_generate_and_the_server_speak_text_and_serve_the_model_by_name(server, made):
    from openai import OpenAI

    from coordinator.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(made)
    shards = ",".join(server.record["shards"])
    result = shardctl("generate", "--shards", shards, "--prompt", "hello", "--max-new-tokens", 12, "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["text"] == tokenizer.decode(record["tokens"])  # the model's tokenizer, named by the shards' HELLO

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny-chat"] == [server.record["model"]]
    reply = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    assert server.record["max_context"] == MAX_CONTEXT and server.record["max_sequences"] == 2  # launched that way


def test_the_model_id_over_running_shards_is_the_model_directory_name(server, tmp_path):
    with Serve(tmp_path, "--shards", ",".join(server.record["shards"]), "--drafter", "none") as other:
        assert [m["id"] for m in httpx.get(other.url + "/v1/models").json()["data"]] == ["tiny-chat"]


def readme_block(after: str, fence: str = "```") -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index(fence, readme.index(after)) + len(fence)
    start = readme.index("\n", start) + 1
    return readme[start:readme.index(fence, start)]


def test_the_readme_quickstart_and_its_openai_chat_snippet_run_as_written(tmp_path):
    """Literally, apart from the scratch directory (/tmp -> a test dir) and the port (8000 -> a free one)."""
    port = str(free_port())
    block = readme_block("## Quickstart: text")
    snippet = (ROOT / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    assert "OpenAI(base_url=\"http://127.0.0.1:8000/v1\"" in snippet and "kill %1" in block
    script = block.replace("/tmp/", f"{tmp_path}/").replace("8000", port)
    script = script.replace("kill %1", "python - <<'PY'\n" + snippet.replace("8000", port) + "\nprint()\nPY\nkill %1\nwait")
    result = subprocess.run(["bash", "-c", "set -e\n" + script], capture_output=True, text=True, timeout=240, cwd=ROOT,
                            stdin=subprocess.DEVNULL, env={**child_env(), "USER": "readme"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()  # curl's reply has no newline: the server's next log line follows it
    completion = json.JSONDecoder().raw_decode(next(line for line in lines if line.startswith("{")))[0]
    assert completion["model"] == "readme-chat" and completion["choices"][0]["message"]["content"]
    assert completion["usage"]["completion_tokens"] == 16
    assert lines[-1].strip()  # the streamed chat text the snippet printed


# --- Hugging Face hub ids -------------------------------------------------------------------------------------


def hub_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """`repo_id` laid out as huggingface_hub lays out its cache: blobs, a snapshot of links, refs/main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        if file.is_file():
            blob = repo / "blobs" / f"blob-{file.name}"
            shutil.copyfile(file, blob)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_id_resolves_from_the_local_cache_offline_and_says_when_it_is_not_there(made, tmp_path):
    from common.hub import model_name

    snapshot = hub_cache(tmp_path / "hub", "shardd-test/tiny-chat", made)
    assert model_name(snapshot) == "shardd-test/tiny-chat"  # served as vLLM serves a hub id
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf-home")}
    result = run([sys.executable, "-m", "coordinator.cli", "generate", "--model", "shardd-test/tiny-chat", "--split", "1",
                  "--prompt", "hello", "--max-new-tokens", "4", "--drafter", "none", "--json"], **env)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["new_tokens"] == 4 and record["text"]
    assert str(snapshot) in result.stderr  # the tokenizer read from the snapshot

    missing = run([sys.executable, "-m", "coordinator.cli", "generate", "--model", "shardd-test/not-there", "--split", "1",
                   "--prompt", "hello"], **env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "shardd-test/not-there is not in the Hugging Face cache" in missing.stderr and "HF_HUB_OFFLINE=1" in missing.stderr
    not_an_id = shardctl("generate", "--model", str(tmp_path / "no-such-dir"), "--split", 1, "--prompt", "x")
    assert "no such directory, and not a Hugging Face model id" in one_line_error(not_an_id, 2)


# --- errors, not tracebacks or silence -------------------------------------------------------------------------


def test_base_dependencies_include_tokenizers_and_the_hub_client():
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d)[0] for d in dependencies}
    assert {"tokenizers", "huggingface_hub"} <= names


def test_serve_without_its_extra_names_the_pip_command():
    code = ("import sys; sys.modules['uvicorn'] = None; sys.argv = ['shardctl', 'serve', '--synthetic', 'tiny', "
            "'--split', '1']; from coordinator.cli import main; main()")
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 4 and "Traceback" not in result.stderr  # a start-up failure
    assert "pip install 'shardd[serve]'" in result.stderr and "launching" not in result.stderr


def test_prompt_over_the_context_and_tokenizer_mistakes_are_one_line(server, made, tmp_path):
    shards = ",".join(server.record["shards"])
    long = one_line_error(shardctl("generate", "--shards", shards, "--prompt", "x" * (MAX_CONTEXT + 10)), 2)
    assert f"the prompt holds {MAX_CONTEXT + 10} tokens; the shards hold {MAX_CONTEXT} per sequence" in long

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text('{"model": ')
    for command in ("generate", "serve"):
        output = one_line_error(shardctl(command, "--shards", shards, "--tokenizer", corrupt, "--prompt", "hi")
                                if command == "generate" else
                                shardctl(command, "--shards", shards, "--tokenizer", corrupt, "--port", free_port()), 2)
        assert f"cannot read the tokenizer {corrupt}/tokenizer.json" in output, command
    empty = tmp_path / "empty"
    empty.mkdir()
    output = one_line_error(shardctl("generate", "--shards", shards, "--tokenizer", empty, "--prompt", "hi"), 2)
    assert f"--tokenizer {empty} holds no tokenizer.json" in output


def test_bind_and_endpoint_mistakes_are_named():
    for bind, message in (("tcp://127.0.0.1:99999", "port '99999' is not a port number"),
                          ("127.0.0.1:24710", "has no transport: write tcp://HOST:PORT or ipc:///PATH (did you mean "
                                              "tcp://127.0.0.1:24710?)")):
        result = run([sys.executable, "-m", "shardd", "serve", "--synthetic", "tiny", "--bind", bind], timeout=60)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
        for command in (("generate", "--shards", bind, "--prompt", "x"), ("status", "--shards", f"ipc:///x,{bind}"),
                        ("generate", "--shards", "ipc:///x", "--drafter", "dflash", "--draft-shard", bind,
                         "--prompt", "x")):
            output = one_line_error(shardctl(*command), 2)
            assert message in output, command


def test_a_layer_gap_is_refused_before_any_daemon_starts():
    for command in (("generate", "--prompt", "x"), ("launch",)):
        result = shardctl(command[0], "--synthetic", "tiny", "--layers", "0:2,3:6", *command[1:])
        output = one_line_error(result, 2)
        assert "gap: no shard serves layers 2:3" in output and "launching" not in output


def test_a_failed_launch_leaves_nothing_in_the_temp_dir(made, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(made, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    temp, cache = tmp_path / "temp", tmp_path / "cache"
    temp.mkdir()
    result = run([sys.executable, "-m", "coordinator.cli", "generate", "--model", str(broken), "--split", "1",
                  "--prompt", "x"], TMPDIR=str(temp), XDG_CACHE_HOME=str(cache))
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr
    assert list(temp.iterdir()) == []
    kept = re.search(r"shard logs kept in (\S+)", result.stderr).group(1)
    assert Path(kept).is_relative_to(cache / "shardd" / "logs") and list(Path(kept).rglob("*.log"))


def test_a_curve_shard_tells_a_client_without_keys_and_logs_the_refusal(tmp_path):
    import zmq
    import zmq.auth

    from coordinator.relay.client import CurveKeys

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    shutil.copy(client_public, allowed)
    protected = ShardSet(("--synthetic", "tiny"), [(0, 6)], "tcp",
                         ("--curve-secret-key", server_secret, "--curve-allow", str(allowed), "--threads", "1"))
    with launched_sets([protected], curve=CurveKeys.load(server_public, client_secret)) as ((shard,),):
        started = time.monotonic()
        output = one_line_error(shardctl("generate", "--shards", shard.endpoint, "--prompt", "x", "--timeout", 10), 1)
        assert "the shard wants CurveZMQ keys: give --curve-server-key" in output
        assert time.monotonic() - started < 5
        keyless = zmq.Context.instance().socket(zmq.DEALER)  # a client without keys, retrying as libzmq does
        keyless.connect(shard.endpoint)
        try:
            deadline = time.monotonic() + 10
            while "the client sent no CurveZMQ keys" not in shard.log_tail() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            keyless.close(linger=0)
        assert "the client sent no CurveZMQ keys" in shard.log_tail()


# --- one vocabulary --------------------------------------------------------------------------------------------


def test_every_command_spells_rollback_mode_and_serve_takes_the_launch_options():
    for command in ("generate", "serve", "launch"):
        help_text = shardctl(command, "--help").output
        assert "--rollback-mode" in help_text, command
    serve_help, launch_help = shardctl("serve", "--help").output, shardctl("launch", "--help").output
    for option in ("--max-context", "--max-sequences", "--max-tokens-per-request", "--recovery-timeout",
                   "--liveness-timeout"):
        assert option in serve_help, option
    for option in re.findall(r"^\s+(--[a-z-]+)", launch_help, re.M):
        if option not in ("--split", "--layers", "--ready-timeout", "--max-verify-tokens", "--json", "--help",
                          "--dry-run"):
            assert option in serve_help, option
    assert "--recovery-timeout" in shardctl("generate", "--help").output
    assert "--liveness-timeout" in shardctl("generate", "--help").output


def test_readme_and_example_env_agree_and_the_systemd_recipe_installs_torch_first():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "scripts" / "systemd" / "example.env").read_text()
    example_socket = re.search(r"ipc://(\S+)", example).group(1)
    assert f"ipc://{example_socket}" in readme
    recipe = readme[readme.index("sudo useradd --system shardd"):]
    assert recipe.index("pip install torch") < recipe.index("pip install .")


def test_health_answers_within_a_second_with_a_shard_down_and_a_stopped_serve_leaves_no_temp_dir(server):
    down = server.record["shards"][1]
    pid = json.loads(shardctl("status", "--shards", down, "--json").stdout)["shards"][0]["hello"]["pid"]
    os.kill(pid, signal.SIGSTOP)  # a daemon this test's server launched: stopped, its socket still accepts
    try:
        started = time.monotonic()
        response = httpx.get(server.url + "/health", timeout=10)
        assert response.status_code == 503 and time.monotonic() - started < 1.5
        assert down in response.json()["shards"] and "error" in response.json()["shards"][down]

        started = time.monotonic()  # the liveness window is an option: 1 s here, not the default 5 s
        result = shardctl("generate", "--shards", ",".join(server.record["shards"]), "--prompt", "x",
                          "--liveness-timeout", 1, "--recovery-timeout", 1)
        assert down in one_line_error(result, 1) and time.monotonic() - started < 4.5
    finally:
        os.kill(pid, signal.SIGKILL)
    assert server.stop() in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
    assert list(server.tmpdir.iterdir()) == []
