"""What one HTTP request may cost `shardctl serve`, against the real server on loopback (two daemons of the tiny
synthetic model): `stop` strings bounded in count and length, `seed` to 64 bits, `n` and `n x max_tokens` bounded
before anything is admitted, every choice of a request cancelled when its client leaves, tool-call arguments nested
too deep for a parser answered 400, and the streaming tool-call parser linear in what it is fed."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from coordinator.relay.client import ShardClient
from coordinator.serve.limits import MAX_CHOICE_TOKENS, MAX_CHOICES, MAX_STOP_CHARS, MAX_STOP_STRINGS
from coordinator.serve.tools import ToolCallStream
from tests.support.daemons import start_pair, stop_all
from tests.support.serving import ShardctlServe


class Server(ShardctlServe):
    def __init__(self, shards: list[str], log: Path):
        super().__init__("--shards", ",".join(shards), "--drafter", "none", log=log)
        self.wait_healthy()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    binds, daemons = start_pair(tmp_path_factory.mktemp("bounds"))
    try:
        yield binds
    finally:
        stop_all(daemons)


@pytest.fixture(scope="module")
def server(shards, tmp_path_factory):
    with Server(shards, tmp_path_factory.mktemp("serve") / "serve.log") as server:
        yield server


def refused_param(server, path: str, body: dict) -> str:
    answer = httpx.post(server.url + path, json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]["param"]


def test_stop_strings_are_bounded(server):
    body = {"prompt": "hi", "max_tokens": 2}
    assert refused_param(server, "/v1/completions", {**body, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}) == "stop"
    assert refused_param(server, "/v1/completions", {**body, "stop": "y" * (MAX_STOP_CHARS + 1)}) == "stop"
    assert refused_param(server, "/v1/responses", {"input": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}) == "stop"
    answer = httpx.post(server.url + "/v1/completions", json={**body, "stop": ["y" * MAX_STOP_CHARS] * MAX_STOP_STRINGS},
                        timeout=60)
    assert answer.status_code == 200, answer.text


def test_a_seed_is_a_64_bit_integer(server):
    """As vLLM bounds it: one past either end is a 400 naming `seed` (it would otherwise wrap onto a seed in range and
    repeat that seed's samples); both ends themselves are served."""
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 1}
    for path, request in (("/v1/completions", body), ("/v1/responses", {"input": "hi", "max_output_tokens": 2})):
        for seed in (1 << 63, -(1 << 63) - 1, 1 << 70):
            assert refused_param(server, path, {**request, "seed": seed}) == "seed"
        for seed in ((1 << 63) - 1, -(1 << 63)):
            answer = httpx.post(server.url + path, json={**request, "seed": seed}, timeout=60)
            assert answer.status_code == 200, answer.text


def test_n_and_its_tokens_are_bounded_before_admission(server):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert refused_param(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": MAX_CHOICES + 1}) == "n"
    n = MAX_CHOICES - 1
    max_tokens = MAX_CHOICE_TOKENS // n + 1  # within the context: only the product is over
    assert refused_param(server, "/v1/chat/completions", {**chat, "max_tokens": max_tokens, "n": n}) == "n"
    assert refused_param(server, "/v1/completions", {"prompt": "hi", "n": 1000000, "max_tokens": 1}) == "n"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def open_sequences(shards) -> int:
    with ShardClient(shards[0], timeout_s=10) as client:
        return client.stats()["open_sequences"]


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_is_cancelled_when_the_client_leaves(server, shards, stream):
    body = json.dumps({"prompt": "go on", "max_tokens": 4000, "temperature": 1.0, "ignore_eos": True, "n": 4,
                       "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 20
        while open_sequences(shards) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert open_sequences(shards) == 4
    deadline = time.monotonic() + 10
    while open_sequences(shards) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_sequences(shards) == 0, "choices decoded on after their client left"


def test_tool_call_arguments_nested_too_deep_are_a_400(server):
    deep = "[" * 100_000 + "]" * 100_000
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "b"}]
    for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
                       ("/tokenize", {"messages": messages})):
        answer = httpx.post(server.url + path, json=body, timeout=30)
        assert answer.status_code == 400 and "deeper" in answer.json()["error"]["message"], answer.text
    items = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": deep},
             {"type": "function_call_output", "call_id": "c", "output": "b"}]
    answer = httpx.post(server.url + "/v1/responses", json={"input": items, "max_output_tokens": 1}, timeout=30)
    assert answer.status_code == 400, answer.text


def test_the_streaming_tool_call_parser_is_linear_and_shallow():
    arguments = {"text": "x" * 400_000}
    call = "<tool_call>" + json.dumps({"name": "f", "arguments": arguments}) + "</tool_call>"
    parser = ToolCallStream()
    started = time.perf_counter()
    events = [event for at in range(0, len(call), 4) for event in parser.feed(call[at:at + 4])]
    elapsed = time.perf_counter() - started
    assert [json.loads(e.function.arguments) for e in events] == [arguments]
    assert elapsed < 3.0, f"{elapsed:.1f} s to parse a 400 KB call fed 4 characters at a time"
    deep = "<tool_call>" + '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    parser = ToolCallStream()
    text = [event for at in range(0, len(deep), 4096) for event in parser.feed(deep[at:at + 4096])] + parser.finish()
    assert "".join(text) == deep  # too deep to be a call: it stays text, and nothing recursed past the limit
