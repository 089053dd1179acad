"""Constrained decoding through `shardctl serve` with the real `openai` client, over two daemons of the tiny synthetic
model: `response_format` json_schema (strict or not) and json_object on chat and completions, `text.format` on
responses, `client.chat.completions.parse` with a pydantic model, `tool_choice` "required" and named; speculative
(ngram) output equal to plain, several streams with different schemas equal to each alone; a schema that cannot be
compiled refused by name; and the head daemon refusing a token mask of the wrong shape, changing nothing."""

from __future__ import annotations

import json
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

pytest.importorskip("xgrammar")

from coordinator.relay.client import ShardClient, forward_record  # noqa: E402
from protocol import ErrorCode, WireTensor  # noqa: E402
from protocol import RemoteError  # noqa: E402  (ShardClient raises its ShardError)
from tests.support.daemons import start_pair, stop_all  # noqa: E402
from tests.support.serving import Server  # noqa: E402

NEW = 120


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                        "kind": {"enum": ["cat", "dog", "fish"]},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 30}},
       "required": ["name", "kind", "age"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    binds, daemons = start_pair(tmp_path_factory.mktemp("guided"))
    try:
        yield binds
    finally:
        stop_all(daemons)


@pytest.fixture(scope="module")
def plain(shards):
    with Server("--shards", ",".join(shards), "--drafter", "none") as server:
        yield server.client()


@pytest.fixture(scope="module")
def speculative(shards):
    with Server("--shards", ",".join(shards), "--drafter", "ngram", "--block-size", "4") as server:
        yield server.client()


def parsed(text: str):
    """JSON as the grammar writes it: a string may hold raw control characters (xgrammar's JSON strings, as vLLM's)."""
    return json.loads(text, strict=False)


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def chat(client, content: str, **fields):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": content}],
                                          max_tokens=NEW, temperature=0, **fields)


@pytest.mark.parametrize("strict", [True, False])
def test_a_json_schema_answer_keeps_to_it(plain, strict):
    answer = chat(plain, "a pet?", response_format=schema_format(PET, strict)).choices[0]
    assert answer.finish_reason == "stop"
    Pet.model_validate(parsed(answer.message.content))


def test_json_object_and_completions(plain):
    answer = chat(plain, "any object", response_format={"type": "json_object"}).choices[0]
    assert isinstance(parsed(answer.message.content), dict)
    completion = plain.completions.create(model=None, prompt="A point:", max_tokens=NEW, temperature=0,
                                          extra_body={"response_format": schema_format(POINT)})
    point = parsed(completion.choices[0].text)
    assert set(point) <= {"x", "y"} and all(-9 <= point[key] <= 9 for key in ("x", "y"))


class Reading(BaseModel):  # no free text: pydantic's JSON parser refuses the raw control characters a string may hold
    unit: Literal["celsius", "kelvin"]
    value: int = Field(ge=-50, le=50)
    ok: bool


def test_parse_with_a_pydantic_model(plain):
    parsed = plain.chat.completions.parse(model=None, messages=[{"role": "user", "content": "a reading"}],
                                          response_format=Reading, max_tokens=NEW, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Reading)


def test_responses_text_format(plain):
    response = plain.responses.create(model=None, input="a pet?", max_output_tokens=NEW, temperature=0,
                                      text={"format": {"type": "json_schema", "name": "pet", "schema": PET,
                                                       "strict": True}})
    Pet.model_validate(parsed(response.output_text))
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_makes_a_call(plain, choice):
    answer = chat(plain, "weather or time?", tools=[WEATHER, CLOCK], tool_choice=choice,
                  parallel_tool_calls=False).choices[0]
    assert answer.finish_reason == "tool_calls"
    (call,) = answer.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    else:
        assert call.function.name in ("get_weather", "get_time")
        assert set(json.loads(call.function.arguments)) in ({"city"}, {"zone"})


def test_speculation_and_batching_give_the_plain_constrained_answers(plain, speculative):
    asks = [("a pet?", PET), ("a point?", POINT), ("another pet", PET), ("where?", POINT)]
    alone = [chat(plain, content, response_format=schema_format(schema)).choices[0].message.content
             for content, schema in asks]
    assert chat(speculative, "a pet?", response_format=schema_format(PET)).choices[0].message.content == alone[0]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda ask: chat(speculative, ask[0], response_format=schema_format(ask[1]))
                                 .choices[0].message.content, asks))
    assert together == alone


def test_a_schema_that_cannot_compile_is_refused_by_name(plain):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as refused:
        chat(plain, "x", response_format=schema_format({"type": "frob"}))
    assert refused.value.body["param"] == "response_format" and "frob" in refused.value.body["message"]
    with pytest.raises(BadRequestError) as refused:
        chat(plain, "x", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nowhere"}})
    assert refused.value.body["param"] == "tool_choice"
    with pytest.raises(BadRequestError) as refused:
        chat(plain, "x", extra_body={"guided_json": PET})
    assert refused.value.body["param"] == "guided_json"


def test_the_head_refuses_a_mask_of_the_wrong_shape_changing_nothing(shards):
    first, head = ShardClient(shards[0]), ShardClient(shards[1])
    seq = secrets.randbelow(1 << 40)
    try:
        for client in (first, head):
            client.open(seq)
        hidden = first.forward(seq, 0, tokens=[1, 2, 3]).tensors["hidden"]
        words = -(-head.hello()["model"]["vocab_size"] // 32)
        for shape in ((1, words + 1), (1, words - 1)):
            mask = WireTensor.from_torch(torch.full(shape, -1, dtype=torch.int32))
            record = forward_record(seq, 0, hidden=hidden, sampling={"mask_rows": 1, "token_mask": mask})
            with pytest.raises(RemoteError) as refused:
                head.request(record)
            assert refused.value.code == ErrorCode.BAD_REQUEST and "token_mask" in str(refused.value)
        mask = WireTensor.from_torch(torch.full((1, words), -1, dtype=torch.int32))
        assert head.request(forward_record(seq, 0, hidden=hidden, sampling={"mask_rows": 1, "token_mask": mask})
                            ).result["length"] == 3  # nothing changed before: the step still runs at 0
    finally:
        for client in (first, head):
            client.close(seq)
            client.close()
