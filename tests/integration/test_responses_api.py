"""`POST /v1/responses` with the real `openai` client (`client.responses.create`, streamed and not) against a real
`shardctl serve` on loopback: two daemons of the tiny synthetic model (its ChatML template and tokenizer) for text,
and a model that always answers one tool call for function calling. A response is the chat completion of the
same conversation, in the Responses shapes; what the server does not do is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.support.daemons import start_pair, stop_all
from tests.support.serving import Server
from tests.support.tool_model import CALL, tool_model, tool_server  # noqa: F401 (fixtures)

FLAT_WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    binds, daemons = start_pair(tmp_path_factory.mktemp("responses"))
    try:
        with Server("--shards", ",".join(binds), "--drafter", "ngram", "--block-size", "4") as server:
            yield server
    finally:
        stop_all(daemons)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def name(client):
    return client.models.list().data[0].id


def chat_answer(client, name, messages, max_tokens):
    return client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens, temperature=0)


def test_text_input_with_instructions_is_the_chat_completion(client, name):
    response = client.responses.create(model=name, input="hello shards", instructions="answer briefly",
                                       max_output_tokens=6, temperature=0)
    chat = chat_answer(client, name, [{"role": "system", "content": "answer briefly"},
                                      {"role": "user", "content": "hello shards"}], 6)
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == chat.choices[0].message.content and response.output_text
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert [part.type for part in item.content] == ["output_text"]
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    finished_by_length = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if finished_by_length else "completed")
    if finished_by_length:
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.store is False and response.instructions == "answer briefly"


def test_a_message_list_is_the_chat_of_those_messages(client, name):
    """Parts of input_text and output_text, the developer role (the system role to this template), an assistant
    turn: the same prompt, token for token, as the chat completion of the same messages."""
    items = [{"role": "developer", "content": "be terse"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"role": "user", "content": "second"}]
    response = client.responses.create(model=name, input=items, max_output_tokens=5, temperature=0)
    chat = chat_answer(client, name, [{"role": "system", "content": "be terse"}, {"role": "user", "content": "first"},
                                      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}], 5)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    developer = chat_answer(client, name, [{"role": "developer", "content": "be terse"},
                                           {"role": "user", "content": "first"}], 1)
    system = chat_answer(client, name, [{"role": "system", "content": "be terse"}, {"role": "user", "content": "first"}], 1)
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens


def test_the_stream_is_the_responses_events_of_the_same_answer(client, name, server):
    kwargs = dict(model=name, input="hello shards", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {final.output[0].id}
    # On the wire each event names itself on an `event:` line, as OpenAI's and vLLM's streams do.
    with httpx.stream("POST", server.url + "/v1/responses", json={**kwargs, "stream": True}, timeout=60) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[0] == "event: response.created" and json.loads(lines[1][len("data: "):])["type"] == "response.created"
    assert "data: [DONE]" not in lines


REFUSED = [
    ("store", {"store": True}),
    ("previous_response_id", {"previous_response_id": "resp_1"}),
    ("text.format", {"text": {"format": {"type": "grammar", "grammar": "root ::= \"a\""}}}),
    ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ("input[0].type", {"input": [{"type": "reasoning", "summary": []}]}),
    ("input[0].content[0].type", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
    ("include", {"include": ["message.output_text.logprobs"]}),
    ("truncation", {"truncation": "auto"}),
    ("frobnicate", {"frobnicate": 1}),
]


@pytest.mark.parametrize("param,extra", REFUSED, ids=[p for p, _ in REFUSED])
def test_what_the_server_does_not_do_is_refused_by_name(client, name, server, param, extra):
    from openai import BadRequestError

    body = {"model": name, "input": "hello", "max_output_tokens": 2, **extra}
    with pytest.raises(BadRequestError, match=param.replace("[", r"\[").replace("]", r"\]")):
        client.responses.create(**{k: v for k, v in body.items() if k not in ("frobnicate",)},
                                extra_body={"frobnicate": 1} if "frobnicate" in extra else None)
    answer = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_store_false_and_absent_are_served(client, name):
    for extra in ({"store": False}, {}):
        assert client.responses.create(model=name, input="hi", max_output_tokens=2, **extra).status


def test_an_unknown_model_is_a_404(client):
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        client.responses.create(model="no-such-model", input="hi", max_output_tokens=2)


# ---- function calling ----------------------------------------------------------------------------------------

def test_a_function_call_and_its_output_round_trip(tool_server, tool_model):
    client = tool_server.client()
    name = Path(tool_model["dir"]).resolve().name
    response = client.responses.create(model=name, input="weather in Paris?", tools=[FLAT_WEATHER],
                                       max_output_tokens=10)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert response.status == "completed"
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "weather in Paris?"}],
                                          tools=[{"type": "function", "function": {
                                              k: v for k, v in FLAT_WEATHER.items() if k != "type"}}], max_tokens=10)
    assert chat.usage.prompt_tokens == response.usage.input_tokens
    # The call and its output go back as items: the prompt the chat of the same turns renders.
    turns = [{"role": "user", "content": "weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(model=name, input=turns, tools=[FLAT_WEATHER], max_output_tokens=3)
    rendered = tool_model["render"](messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}], tools=[{"type": "function", "function": {
            k: v for k, v in FLAT_WEATHER.items() if k != "type"}}], add_generation_prompt=True)
    assert "<tool_response>sunny</tool_response>" in rendered and f"<tool_call>{CALL}</tool_call>" in rendered
    assert second.usage.input_tokens == tool_model["count"](rendered)
    # tool_choice "none": the same answer is text
    text = client.responses.create(model=name, input="weather in Paris?", tools=[FLAT_WEATHER], tool_choice="none",
                                   max_output_tokens=10)
    assert text.output_text == f"<tool_call>{CALL}</tool_call>"


def test_a_streamed_function_call(tool_server, tool_model):
    client = tool_server.client()
    name = Path(tool_model["dir"]).resolve().name
    events = list(client.responses.create(model=name, input="weather in Paris?", tools=[FLAT_WEATHER],
                                          max_output_tokens=10, stream=True))
    kinds = [event.type for event in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, done = events[2].item, events[5].item
    assert added.type == "function_call" and added.status == "in_progress" and added.arguments == ""
    assert json.loads(events[4].arguments) == {"city": "Paris"} == json.loads(done.arguments)
    assert done.call_id == added.call_id and done.status == "completed"
    assert [item.type for item in events[-1].response.output] == ["function_call"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_tool_choice_required_or_named_answers_a_call(tool_server, tool_model, choice):
    response = tool_server.client().responses.create(model=Path(tool_model["dir"]).resolve().name, input="hi",
                                                     tools=[FLAT_WEATHER], tool_choice=choice,
                                                     parallel_tool_calls=False, max_output_tokens=10)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
