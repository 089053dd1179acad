"""The client libraries people point at an OpenAI-compatible server, each called as its users call it by default,
against a real `shardctl serve` on loopback: instructor (TOOLS, JSON, JSON_SCHEMA), langchain-openai
(`with_structured_output` by function calling, JSON mode and JSON schema; `bind_tools` with `tool_choice="any"`;
the Responses API), openai-agents (an `Agent` with an `output_type` on the default Responses model) and litellm
(`response_format` a pydantic model). The model answers every chat prompt with a call of `Weather` and, when a
grammar forbids the call, with the same arguments as plain JSON: each library must get a parsed `Weather` of those
values, whatever it sends (tools and a named or required `tool_choice`, `response_format` json_schema or
json_object, `text.format`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar")

from tests.support.tool_model import build_tool_model, serve_tool_model  # noqa: E402

ANSWER = {"city": "Paris", "celsius": 21}
ASK = [{"role": "user", "content": "the weather in Paris?"}]
NEW = 64


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]
    celsius: int = Field(ge=-40, le=50)


@pytest.fixture(scope="module")
def answer_model(tmp_path_factory):
    # The call's arguments are not the answer's token: xgrammar's mask (0.2.9) forbids a token holding a whole call
    # when the vocabulary also has a token that starts its arguments object but cannot start the call.
    answer = json.dumps(ANSWER)
    return build_tool_model(tmp_path_factory.mktemp("clients"), answer=answer,
                            call=('{"name": "Weather", "arguments": ', answer + "}"))


@pytest.fixture(scope="module")
def server(answer_model):
    with serve_tool_model(answer_model) as server:
        yield server


@pytest.fixture(scope="module")
def name(answer_model):
    return Path(answer_model["dir"]).resolve().name


def expected(weather) -> None:
    assert isinstance(weather, Weather) and weather.model_dump() == ANSWER, weather


def test_the_model_calls_when_it_may_and_answers_json_when_a_grammar_says_so(server, name):
    """What the libraries below rely on, through the plain `openai` client."""
    client = server.client()
    free = client.chat.completions.create(model=name, messages=ASK, max_tokens=NEW, temperature=0,
                                          tools=[{"type": "function", "function": {
                                              "name": "Weather", "parameters": Weather.model_json_schema()}}])
    (call,) = free.choices[0].message.tool_calls
    assert call.function.name == "Weather" and json.loads(call.function.arguments) == ANSWER
    constrained = client.chat.completions.create(model=name, messages=ASK, max_tokens=NEW, temperature=0,
                                                 response_format={"type": "json_object"})
    assert json.loads(constrained.choices[0].message.content) == ANSWER
    assert constrained.choices[0].finish_reason == "stop"


# ---- instructor ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON", "JSON_SCHEMA"])
def test_instructor(server, name, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(server.client(), mode=getattr(instructor.Mode, mode))
    expected(client.chat.completions.create(model=name, messages=ASK, response_model=Weather, max_tokens=NEW,
                                            max_retries=0))


# ---- langchain-openai ------------------------------------------------------------------------------------------

def chat_model(server, name, **options):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model=name, base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                       max_tokens=NEW, temperature=0, **options)


@pytest.mark.parametrize("method", ["function_calling", "json_mode", "json_schema"])
def test_langchain_structured_output(server, name, method):
    expected(chat_model(server, name).with_structured_output(Weather, method=method).invoke(ASK))


@pytest.mark.parametrize("responses", [False, True])
def test_langchain_bind_tools_any_gives_a_tool_call(server, name, responses):
    message = chat_model(server, name, use_responses_api=responses).bind_tools([Weather], tool_choice="any").invoke(ASK)
    (call,) = message.tool_calls
    assert call["name"] == "Weather" and call["args"] == ANSWER


def test_langchain_responses_api_structured_output(server, name):
    expected(chat_model(server, name, use_responses_api=True).with_structured_output(Weather).invoke(ASK))


# ---- openai-agents ---------------------------------------------------------------------------------------------

def test_openai_agents_output_type(server, name):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model=name, openai_client=AsyncOpenAI(base_url=server.url + "/v1",
                                                                              api_key="unused", max_retries=0))
    agent = agents.Agent(name="forecaster", instructions="Answer with the weather.", model=model,
                         output_type=Weather, model_settings=agents.ModelSettings(max_tokens=NEW, temperature=0))
    expected(agents.Runner.run_sync(agent, "the weather in Paris?").final_output)


# ---- litellm ---------------------------------------------------------------------------------------------------

def test_litellm_response_format_model(server, name, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read when litellm is imported: never the network
    litellm = pytest.importorskip("litellm")
    reply = litellm.completion(model=f"openai/{name}", api_base=server.url + "/v1", api_key="unused", messages=ASK,
                               response_format=Weather, max_tokens=NEW, temperature=0)
    expected(Weather.model_validate_json(reply.choices[0].message.content))
