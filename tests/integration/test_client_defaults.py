"""What a client trips on, against a real `shardctl serve` on loopback (two daemons of the tiny synthetic model; a
tool-calling model whose tokenizer marks the call markers special): every error is OpenAI's error object (an
unknown route, a wrong method, a body that is not JSON or not UTF-8, a field of the wrong type), `GET
/v1/models/{id}`, one log line per refusal saying why, the `developer` role, and tool calls whatever the
tokenizer says of `<tool_call>`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from common.synthetic_tokenizer import build_tokenizer_json
from tests.support.daemons import start_pair, stop_all
from tests.support.serving import ShardctlServe
from tests.support.tool_model import ASK, CALL, WEATHER, build_tool_model, serve_tool_model


class Server(ShardctlServe):
    def __init__(self, shards: list[str], log: Path):
        super().__init__("--shards", ",".join(shards), "--drafter", "none", log=log)
        self.wait_healthy()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("client-defaults")
    binds, daemons = start_pair(workdir)
    try:
        with Server(binds, workdir / "serve.log") as server:
            yield server
    finally:
        stop_all(daemons)


def error_of(answer: httpx.Response, status: int) -> dict:
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status
    return body["error"]


def test_every_error_is_an_openai_error_object(server):
    url = server.url
    assert "/nowhere" in error_of(httpx.get(url + "/nowhere"), 404)["message"]
    wrong_method = httpx.delete(url + "/v1/models")
    assert "DELETE" in error_of(wrong_method, 405)["message"] and wrong_method.headers["allow"] == "GET"
    assert error_of(httpx.get(url + "/v1/chat/completions"), 405)["type"] == "MethodNotAllowedError"
    post = lambda body, **headers: httpx.post(url + "/v1/completions", content=body,  # noqa: E731
                                              headers={"content-type": "application/json", **headers})
    assert "not valid JSON" in error_of(post(b'{"prompt": '), 400)["message"]
    not_utf8 = error_of(post(b'{"prompt": "\xff\xfe"}'), 400)
    assert "not UTF-8" in not_utf8["message"] and not_utf8["param"] == "body"
    wrong_type = error_of(post(json.dumps({"prompt": "hi", "max_tokens": "many"}).encode()), 400)
    assert wrong_type["param"] == "max_tokens" and "max_tokens" in wrong_type["message"]
    assert error_of(post(b"[1, 2]"), 400)["param"] == "body"


def test_a_model_by_id(server):
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model"
    with pytest.raises(NotFoundError, match="no-such"):
        client.models.retrieve("no-such")
    assert error_of(httpx.get(server.url + "/v1/models/org/no-such"), 404)["param"] == "model"


def test_each_refusal_is_logged_saying_why(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "frobnicate": 1})
    httpx.post(server.url + "/v1/responses", json={"input": "hi", "store": True})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        log = server.log.read_text()
        if "frobnicate" in log and "'store': true" in log:
            break
        time.sleep(0.2)
    lines = log.splitlines()
    assert any(line.startswith("refused POST /v1/completions with 400: unsupported field: frobnicate")
               for line in lines), log
    assert any("refused POST /v1/responses with 400: 'store': true is not supported" in line for line in lines), log


def test_a_burst_of_refusals_is_logged_within_a_bound(server):
    before = server.log.read_text().count("refused ")
    with httpx.Client() as client:
        for index in range(120):
            client.post(server.url + "/v1/completions", json={"prompt": "hi", f"field{index}": 1})
    time.sleep(0.5)
    logged = server.log.read_text().count("refused ") - before
    assert 0 < logged < 120  # the log keeps up with at most its rate, whatever arrives


def test_developer_is_the_system_role_to_a_template_without_it(server):
    def prompt_of(role):
        answer = httpx.post(server.url + "/tokenize", json={"messages": [{"role": role, "content": "be terse"},
                                                                         {"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
        return answer.json()["tokens"]

    assert prompt_of("developer") == prompt_of("system")


def test_the_synthetic_tokenizer_keeps_the_tool_call_markers_as_text():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(build_tokenizer_json(320))
    ids = tokenizer.encode("<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"
    assert ids[0] == 259 and ids[-2] == 260  # the ids synthetic models always gave them


@pytest.fixture(scope="module")
def special_markers_server(tmp_path_factory):
    model = build_tool_model(tmp_path_factory.mktemp("special-markers"), markers_special=True)
    with serve_tool_model(model) as server:
        yield server, Path(model["dir"]).resolve().name


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_parse_where_the_tokenizer_marks_the_markers_special(special_markers_server, stream):
    server, name = special_markers_server
    client = server.client()
    kwargs = dict(model=name, messages=ASK, tools=[WEATHER], max_tokens=10)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, content, finish = choice.message.tool_calls, choice.message.content or "", [choice.finish_reason]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert content == "" and finish == ["tool_calls"]
    # Without tools the special markers are skipped as special tokens are.
    plain = client.chat.completions.create(model=name, messages=ASK, max_tokens=10)
    assert plain.choices[0].message.content == CALL
