"""The OpenAI API as vLLM serves it, with the real `openai` client against `shardctl serve` over real
daemons: logprobs equal to the head shard's log-softmax (plain and speculative), `n` choices equal to seeded
single requests, penalties (a reference written here; plain and speculative sampling alike by chi-square), tool
calls through a chat template that defines tools (a model built to answer with one), `--api-key`, the tokenizer
endpoints, and every field the server does not implement refused by name."""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner

from coordinator.cli import cli
from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.relay.client import ShardClient, forward_record
from coordinator.sampling import Sampling
from shardd.weights.loading import ModelSource
from shardd.local import LocalTarget
from shardd.engine.head.penalties import Penalties, penalise
from tests.support.served_model import PROMPT, hf_greedy, model, model_name, shards  # noqa: F401 (fixtures)
from tests.support.serving import Server
from tests.support.tool_model import ASK, CALL, WEATHER, tool_model, tool_server  # noqa: F401 (fixtures)
from tests.support.stats import chi2_critical, two_sample_chi2

KEY = "sk-test-" + "k" * 24


@pytest.fixture(scope="module")
def spec_server(shards):
    with Server("--shards", ",".join(shards), "--drafter", "ngram", "--block-size", "4") as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(shards):
    """One token per step, and keyed: the API-key tests use it too."""
    with Server("--shards", ",".join(shards), "--drafter", "none", "--api-key", KEY) as server:
        yield server


def client_of(server, key: str = KEY):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


# ---- logprobs ------------------------------------------------------------------------------------

class HeadShard:
    """The head shard's log-softmax after each token, by hand: FORWARD through both shards, logits returned."""

    def __init__(self, shards, prompt: list[int]):
        self.first, self.head = ShardClient(shards[0]), ShardClient(shards[1])
        self.seq, self.pos = secrets.randbelow(1 << 40), 0
        self.first.open(self.seq)
        self.head.open(self.seq)
        self.row = self.feed(prompt)

    def feed(self, tokens: list[int]) -> torch.Tensor:
        hidden = self.first.forward(self.seq, self.pos, tokens=tokens).tensors["hidden"]
        record = dataclasses.replace(forward_record(self.seq, self.pos, hidden=hidden), return_logits=True)
        logits = self.head.request(record).tensors["logits"].to_torch().float()
        self.pos += len(tokens)
        self.row = torch.log_softmax(logits[-1], dim=-1)
        return self.row

    def close(self) -> None:
        for client in (self.first, self.head):
            client.close(self.seq)
            client.close()


def matching_id(tokenizer, row: torch.Tensor, text: str, logprob: float) -> int:
    """The vocabulary id that decodes to `text` and has `logprob` in this row (a text alone may be ambiguous)."""
    found = [i for i in range(row.shape[0]) if tokenizer.decode([i]) == text and abs(float(row[i]) - logprob) < 1e-4]
    assert found, f"no token {text!r} with logprob {logprob} in the head shard's row (top: {row.topk(3)})"
    return found[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_logprobs_equal_the_head_shards_log_softmax(plain_server, spec_server, shards, model, temperature):
    tokenizer, top = model["tokenizer"], 3
    answers = {}
    for name, server in (("plain", plain_server), ("speculative", spec_server)):
        response = client_of(server).completions.create(
            model=model_name(model), prompt=PROMPT, max_tokens=8, temperature=temperature, seed=5, logprobs=top,
            extra_body={"ignore_eos": True})
        scores = response.choices[0].logprobs
        assert len(scores.tokens) == len(scores.token_logprobs) == len(scores.top_logprobs) == 8
        head = HeadShard(shards, model["prompt_ids"])
        try:
            for text, logprob, ranked in zip(scores.tokens, scores.token_logprobs, scores.top_logprobs):
                row = head.row
                token = matching_id(tokenizer, row, text, logprob)
                best = row.topk(top)
                expected = {tokenizer.decode([int(i)]): float(v) for i, v in zip(best.indices, best.values)}
                expected.setdefault(text, float(row[token]))
                assert ranked.keys() == expected.keys()
                assert all(abs(ranked[k] - expected[k]) < 1e-4 for k in expected)
                head.feed([token])
        finally:
            head.close()
        answers[name] = response.choices[0].text
    if temperature == 0:
        assert answers["plain"] == answers["speculative"]


def test_chat_logprobs_streamed_and_not(spec_server, model):
    client = client_of(spec_server)
    kwargs = dict(model=model_name(model), messages=model["chat"], max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=2)
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert 0 < len(content) == whole.usage.completion_tokens - (whole.choices[0].finish_reason == "stop")
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the best token
        assert bytes(entry.bytes) == entry.token.encode()
    streamed = [entry for chunk in client.chat.completions.create(**kwargs, stream=True)
                for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**{**kwargs, "logprobs": False})


# ---- n > 1 ---------------------------------------------------------------------------------------

def test_n_choices_each_equal_a_seeded_single_request(spec_server, model):
    client = client_of(spec_server)
    kwargs = dict(model=model_name(model), prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    response = client.completions.create(**kwargs, n=3, seed=21)
    alone = [client.completions.create(**kwargs, seed=21 + i).choices[0].text for i in range(3)]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == alone
    assert response.usage.completion_tokens == 18 and response.usage.prompt_tokens == len(model["prompt_ids"])
    streamed = ["", ""]
    for chunk in client.completions.create(**kwargs, n=2, seed=21, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == alone[:2]
    chat = client.chat.completions.create(model=model_name(model), messages=model["chat"], max_tokens=5,
                                          temperature=1.0, seed=4, n=2, extra_body={"best_of": 2})
    single = client.chat.completions.create(model=model_name(model), messages=model["chat"], max_tokens=5,
                                            temperature=1.0, seed=5)
    assert chat.choices[1].message.content == single.choices[0].message.content


# ---- penalties -----------------------------------------------------------------------------------

def reference_penalised(logits: list[float], prompt: list[int], output: list[int], presence: float, frequency: float,
                        repetition: float) -> list[float]:
    """vLLM's penalties, written out token by token: repetition over prompt and output, then frequency and
    presence over the output."""
    out = list(logits)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4)


def test_penalise_equals_the_reference():
    torch.manual_seed(3)
    logits = torch.randn(40)
    prompt, output = [1, 2, 2, 7], [7, 7, 3, 9, 3, 7]
    got = penalise(logits, Penalties(0.8, 0.6, 1.4), prompt, output)
    want = reference_penalised(logits.tolist(), prompt, output, 0.8, 0.6, 1.4)
    assert got.tolist() == pytest.approx(want, abs=1e-6)


def test_each_verify_row_sees_the_drafts_before_it():
    """Four equal rows: plain greedy decoding with a presence penalty picks a new token each time, so the drafts
    of that chain are all accepted only if row j counts drafts 0..j-1 as output."""
    from shardd.engine.head.answer import HeadRequest, answer_rows

    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(2)).repeat(4, 1)
    prompt, output = [1, 2], [3]
    chain = []
    for row in logits:
        scores = reference_penalised(row.tolist(), prompt, output + chain, 5.0, 0.0, 1.0)
        chain.append(max(range(12), key=scores.__getitem__))
    assert len(set(chain)) == 4
    head = HeadRequest(None, Penalties(presence=5.0), prompt, output, chain[:3])
    ids, accepted, _ = answer_rows(logits, [0, 0, 0, 0], 10, head)
    assert (ids, accepted) == (chain, 3)


@pytest.mark.parametrize("fields,message", [
    (dict(output_tokens=[3]), "only read by a penalty"),
    (dict(repetition_penalty=0.0), "must be > 0"),
    (dict(drafts=[2]), "needs temperature > 0, a penalty, logprobs, a token mask or propose"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
])
def test_the_head_fields_are_checked_on_the_wire(fields, message):
    from protocol import ProtocolError, decode_request, encode_request
    from protocol.messages import Forward

    good = Forward(id=1, seq=1, pos=0, tokens=[1, 2], presence_penalty=0.5, output_tokens=[3], prompt_tokens=[1],
                   drafts=[2], logprobs=2)
    assert decode_request(encode_request(good)) == good
    with pytest.raises(ProtocolError, match=message):
        decode_request(encode_request(Forward(id=1, seq=1, pos=0, tokens=[1, 2], **fields), validate=False))


def test_greedy_with_penalties_equals_the_reference_plain_and_speculative(plain_server, spec_server, model):
    hf, prompt = model["hf"], model["prompt_ids"]
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(10):
            logits = hf(torch.tensor([tokens])).logits[0, -1].tolist()
            row = reference_penalised(logits, prompt, tokens[len(prompt):], 0.8, 0.6, 1.4)
            tokens.append(max(range(len(row)), key=row.__getitem__))
    expected = model["tokenizer"].decode(tokens[len(prompt):], skip_special_tokens=True)
    assert tokens[len(prompt):] != hf_greedy(hf, prompt, 10, set())  # the penalties change the output
    for server in (plain_server, spec_server):
        response = client_of(server).completions.create(model=model_name(model), prompt=PROMPT, max_tokens=10,
                                                        temperature=0, extra_body={"ignore_eos": True, **PENALTIES})
        assert response.choices[0].text == expected


PENALTY_PROMPT = [105, 294, 150]
SAMPLES = 300


class Likely:
    """Drafts the continuation plain sampling gave most often (deterministic, as every drafter here)."""

    name = "likely"

    def __init__(self, likely: tuple[int, ...]):
        self.likely = list(likely)

    def propose(self, history, n):
        done = len(history) - len(PENALTY_PROMPT)
        drafts = self.likely[done:done + n]
        return drafts + [0] * (n - len(drafts))


def penalised_sequences(local, drafter) -> tuple[Counter, int]:
    counts, accepted = Counter(), 0
    for seed in range(SAMPLES):
        # Negative presence/frequency penalties make the output repeat itself: each row's output context matters.
        sampling = Sampling(temperature=1.0, top_k=3, seed=seed, presence_penalty=-2.0, frequency_penalty=-1.0,
                            repetition_penalty=1.1)
        if drafter is None:
            result = greedy_decode(local, 1, PENALTY_PROMPT, 3, sampling=sampling)
        else:
            result = speculative_decode(local, 1, PENALTY_PROMPT, drafter, block_size=4, max_new_tokens=3,
                                        sampling=sampling)
            accepted += result.accepted
        counts[tuple(result.tokens)] += 1
    return counts, accepted


def test_penalised_sampling_is_the_same_distribution_plain_and_speculative():
    torch.set_num_threads(1)
    local = LocalTarget(ModelSource(synthetic="tiny"), max_context=32)
    plain, _ = penalised_sequences(local, None)
    likely = plain.most_common(1)[0][0]
    speculated, accepted = penalised_sequences(local, Likely(likely))
    assert accepted > SAMPLES // 4 and len(plain) > 3  # drafts were accepted: later rows saw them as output
    stat, df = two_sample_chi2(plain, speculated)
    assert stat < chi2_critical(df), (stat, df, plain.most_common(6), speculated.most_common(6))


# ---- tools ---------------------------------------------------------------------------------------

def test_a_tool_call_round_trip(tool_server, tool_model):
    client = client_of(tool_server)
    name = Path(tool_model["dir"]).resolve().name
    response = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], max_tokens=10)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The tools reached the model through the template's `tools` variable.
    rendered = tool_model["render"](messages=ASK, tools=[WEATHER], add_generation_prompt=True)
    assert '"name": "get_weather"' in rendered
    assert response.usage.prompt_tokens == tool_model["count"](rendered)
    # The call and the tool's answer go back: the assistant's call rendered with its arguments as JSON.
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model=name, messages=history, tools=[WEATHER], max_tokens=3)
    expected = tool_model["render"](messages=[*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]], tools=[WEATHER],
        add_generation_prompt=True)
    assert f"<tool_call>{CALL}</tool_call>" in expected and "<tool_response>sunny</tool_response>" in expected
    assert second.usage.prompt_tokens == tool_model["count"](expected)
    tokenized = httpx.post(tool_server.url + "/tokenize", json={"messages": history, "tools": [WEATHER]}).json()
    assert tokenized["count"] == second.usage.prompt_tokens


def test_tool_calls_stream_and_special_tokens_never_show(tool_server, tool_model):
    client = client_of(tool_server)
    name = Path(tool_model["dir"]).resolve().name
    chunks = list(client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], max_tokens=10,
                                                 stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert content == ""
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # tool_choice "none": the same answer is text; the special token after it is not
    plain = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           max_tokens=10, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in plain if c.choices)
    assert text == f"<tool_call>{CALL}</tool_call>"
    kept = client.chat.completions.create(model=name, messages=ASK, max_tokens=10,
                                          extra_body={"skip_special_tokens": False})
    assert kept.choices[0].message.content == f"<tool_call>{CALL}</tool_call><|im_start|>"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_or_named_constrains_to_a_call(tool_server, tool_model, choice):
    """The model's own call keeps to the call grammar, which then ends the answer (no tokens after the call)."""
    answer = client_of(tool_server).chat.completions.create(
        model=Path(tool_model["dir"]).resolve().name, messages=ASK, tools=[WEATHER], tool_choice=choice,
        parallel_tool_calls=False, max_tokens=10).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


# ---- API key, tokenizer endpoints ----------------------------------------------------------------

def test_the_api_key_guards_v1_and_the_tokenizer_routes(plain_server, model):
    from openai import AuthenticationError

    for key in ("wrong", KEY[:-1]):
        with pytest.raises(AuthenticationError):
            client_of(plain_server, key).models.list()
        with pytest.raises(AuthenticationError):
            client_of(plain_server, key).completions.create(model=model_name(model), prompt=PROMPT, max_tokens=1)
    for path in ("/v1/models", "/version"):
        assert httpx.get(plain_server.url + path).status_code == 401
    assert httpx.post(plain_server.url + "/tokenize", json={"prompt": PROMPT}).status_code == 401
    assert httpx.get(plain_server.url + "/health").status_code == 200
    assert httpx.get(plain_server.url + "/metrics").status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    tokens = httpx.post(plain_server.url + "/tokenize", json={"prompt": PROMPT}, headers=auth).json()
    assert tokens["tokens"] == model["prompt_ids"] and tokens["count"] == len(model["prompt_ids"])
    text = httpx.post(plain_server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()
    assert text == {"prompt": PROMPT}
    assert httpx.post(plain_server.url + "/detokenize", json={"tokens": [10 ** 6]}, headers=auth).status_code == 400
    assert httpx.get(plain_server.url + "/version", headers=auth).json()["version"]
    assert [m.id for m in client_of(plain_server).models.list().data] == [model_name(model)]


def test_a_public_host_without_a_key_is_refused_at_start():
    result = CliRunner().invoke(cli, ["serve", "--shards", "tcp://127.0.0.1:1", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "--api-key" in result.output and "Traceback" not in result.output


# ---- refused fields ------------------------------------------------------------------------------

REFUSED = [
    ("completions", "logit_bias", {"logit_bias": {"5": 3}}),
    ("completions", "suffix", {"suffix": "end"}),
    ("completions", "best_of", {"best_of": 2}),
    ("completions", "min_tokens", {"min_tokens": 2}),
    ("completions", "stop_token_ids", {"stop_token_ids": [3]}),
    ("completions", "guided_json", {"guided_json": {"type": "object"}}),
    ("completions", "frobnicate", {"frobnicate": 1}),
    ("chat", "response_format", {"response_format": {"type": "regex", "regex": "a+"}}),
    ("chat", "guided_choice", {"guided_choice": ["a", "b"]}),
    ("chat", "logit_bias", {"logit_bias": {"5": 3}}),
    ("chat", "frobnicate", {"frobnicate": 1}),
    ("chat", "store", {"store": True}),
    ("chat", "modalities", {"modalities": ["text", "audio"]}),
    ("chat", "stream_options", {"stream_options": {"include_usage": True}}),  # without stream, as vLLM refuses it
    ("completions", "stream_options.continuous_usage_stats",
     {"stream": True, "stream_options": {"continuous_usage_stats": True}}),
    ("completions", "frobnicate", {"stream": True, "stream_options": {"frobnicate": True}}),
]


@pytest.mark.parametrize("route,field,extra", REFUSED, ids=[f"{r}-{f}" for r, f, _ in REFUSED])
def test_unimplemented_and_unknown_fields_are_refused_by_name(spec_server, model, route, field, extra):
    from openai import BadRequestError

    client = client_of(spec_server)
    with pytest.raises(BadRequestError, match=field):
        if route == "completions":
            client.completions.create(model=model_name(model), prompt=PROMPT, max_tokens=2, extra_body=extra)
        else:
            client.chat.completions.create(model=model_name(model), messages=model["chat"], max_tokens=2,
                                           extra_body=extra)


def test_defaults_of_unimplemented_fields_pass(spec_server, model):
    response = client_of(spec_server).chat.completions.create(
        model=model_name(model), messages=model["chat"], max_tokens=2, temperature=0,
        response_format={"type": "text"}, logit_bias={}, n=1, presence_penalty=0, frequency_penalty=0, user="u",
        store=False, modalities=["text"], extra_body={"stream_options": {}})  # empty: asks for nothing, as vLLM reads it
    assert response.choices[0].finish_reason in ("stop", "length")
    stream = client_of(spec_server).completions.create(
        model=model_name(model), prompt=PROMPT, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {"include_usage": True,
                                                                               "continuous_usage_stats": False}})
    assert [chunk.usage.completion_tokens for chunk in stream if chunk.usage] == [2]


def test_a_null_is_the_field_left_out(spec_server, model):
    """Clients that write every field send null for the unset ones: a null reads as the default, on fields we
    implement (`stream`, `n`, `echo`, `logprobs` are not Optional here) and on those we do not; a required field's
    null is refused by name."""
    url, name = spec_server.url, model_name(model)
    completion = {"model": name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    chat = {"model": name, "messages": model["chat"], "max_tokens": 4, "temperature": 0}
    for path, body, nulls in (
            ("/v1/completions", completion, ["stream", "n", "echo", "logprobs", "stop", "suffix", "frobnicate"]),
            ("/v1/chat/completions", chat, ["stream", "n", "logprobs", "tools", "service_tier", "audio", "functions"]),
            ("/v1/responses", {"model": name, "input": PROMPT, "max_output_tokens": 4, "temperature": 0},
             ["stream", "store", "service_tier", "prompt_cache_key"])):
        alone = httpx.post(url + path, json=body, timeout=60)
        with_nulls = httpx.post(url + path, json={**body, **dict.fromkeys(nulls)}, timeout=60)
        assert alone.status_code == with_nulls.status_code == 200, with_nulls.text
        text = (lambda answer: answer["choices"][0].get("text") or answer["choices"][0].get("message", {}).get("content")
                ) if path != "/v1/responses" else (lambda answer: answer["output"][0]["content"][0]["text"])
        assert text(alone.json()) == text(with_nulls.json())
    refused = httpx.post(url + "/v1/chat/completions", json={**chat, "messages": None}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_a_transcript_sent_back_as_openai_returns_it_parses(spec_server, model):
    """An assistant message as OpenAI-style servers return it (refusal, audio, function_call, annotations empty)
    is accepted; one of those fields set is refused by name (the server would ignore it)."""
    from openai import BadRequestError

    client = client_of(spec_server)
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "refusal": None, "audio": None,
                                                  "function_call": None, "annotations": [], "tool_calls": []},
               {"role": "user", "content": "c"}]
    response = client.chat.completions.create(model=model_name(model), messages=history, max_tokens=1, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")
    history[-2] = {**history[-2], "reasoning_content": "because"}
    with pytest.raises(BadRequestError, match="reasoning_content"):
        client.chat.completions.create(model=model_name(model), messages=history, max_tokens=1, temperature=0)
