"""Prompt logprobs, scored on the head shard during the prefill, and a list of prompts per completions request, over
real daemons: the scores equal transformers' float32 log-softmax of the same checkpoint in any prefill chunking and
over two splits of the layers; the daemon refuses bad `prompt_logprobs` / `next_tokens` changing nothing; the HTTP
API answers `echo` with `logprobs` (the prompt's entries first, the first null), vLLM's `prompt_logprobs`,
`max_tokens` 0 with `echo`, and a list of prompts (prompt-major choices, streamed or not) exactly as each prompt
alone, within the bound on choices; lm-eval's `local-completions` scores a local loglikelihood task as transformers
does."""

from __future__ import annotations

import json
import math
import secrets

import httpx
import pytest
import torch

from coordinator.launch import ShardSet, launched_sets
from coordinator.relay.pipeline import Pipeline
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import Scheduler
from coordinator.serve.limits import MAX_CHOICES
from protocol import ErrorCode, MessageType
from shardd.local import LocalTarget
from shardd.weights.loading import ModelSource
from tests.support.daemons import Client
from tests.support.served_model import MAX_CONTEXT, PROMPT, hf_greedy, model, shards  # noqa: F401 (fixtures)
from tests.support.serving import Server

TOL = 1e-4  # float32 log-softmax of the same logits, computed shard by shard against one full forward


@pytest.fixture(scope="module")
def three_shards(model):
    """The same checkpoint split another way, over three daemons that take at most 4 tokens a request (a longer
    prompt chunk is relayed in pieces)."""
    sets = [ShardSet(("--model", str(model["dir"])), [(0, 1), (1, 3), (3, 4)], "tcp",
                     ("--max-context", str(MAX_CONTEXT), "--threads", "1", "--max-tokens-per-request", "4"))]
    with launched_sets(sets, ready_timeout_s=120) as (three,):
        yield [s.endpoint for s in three]


@pytest.fixture(scope="module")
def server(shards):
    with Server("--shards", ",".join(shards), "--drafter", "ngram", "--block-size", "4") as served:
        yield served


def reference(model, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax after each prompt position [len(prompt), V]."""
    with torch.inference_mode():
        logits = model["hf"](torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_scores_match(scored: list, prompt: list[int], expected: torch.Tensor, top: int) -> None:
    """Each entry [logprob, [[id, logprob], ...top], rank] against the reference row before its token."""
    assert len(scored) == len(prompt) - 1
    for position, (logprob, ranked, rank) in enumerate(scored):
        row, token = expected[position], prompt[position + 1]
        assert abs(logprob - float(row[token])) < TOL
        best = row.topk(top)
        assert [i for i, _ in ranked] == best.indices.tolist()
        assert all(abs(v - float(e)) < TOL for (_, v), e in zip(ranked, best.values))
        assert rank == int((row >= row[token]).sum())


def scheduled(target, prompts: list[list[int]], max_new_tokens: int, top: int, prefill_chunk: int) -> list:
    """The results of `prompts` run together by the scheduler over `target` (daemons' endpoints, or a target)."""
    if isinstance(target, list):
        with Pipeline.connect(target) as pipeline:
            return scheduled(pipeline, prompts, max_new_tokens, top, prefill_chunk)
    scheduler = Scheduler(target, max_sequences=len(prompts), prefill_chunk=prefill_chunk)
    requests = scheduler.run_all([Request(prompt, max_new_tokens, prompt_logprobs=top) for prompt in prompts])
    return [request.outcome() for request in requests]


# ---- the head shard's scores -----------------------------------------------------------------------

def test_prompt_logprobs_equal_the_reference_in_any_chunking_and_split(model, shards, three_shards):
    prompt = model["prompt_ids"]
    expected = reference(model, prompt)
    answers = {}
    for name, endpoints, chunk in (("two shards, chunks of 3", shards, 3), ("two shards, one chunk", shards, 64),
                                   ("three shards, chunks of 3", three_shards, 3),
                                   ("three shards, one chunk relayed in pieces of 4", three_shards, 64)):
        (result,) = scheduled(endpoints, [prompt], 0, 5, chunk)
        assert result.tokens == [] and result.finish_reason == "length"
        assert_scores_match(result.prompt_logprobs, prompt, expected, 5)
        answers[name] = result.prompt_logprobs
    # a split changes nothing a row computes: the same bits
    assert answers["two shards, chunks of 3"] == answers["three shards, chunks of 3"]
    # in process too (its torch threads may sum in another order than the daemons' one thread)
    local = LocalTarget(ModelSource(model_dir=str(model["dir"])), [(0, 3), (3, 4)], max_context=MAX_CONTEXT)
    (result,) = scheduled(local, [prompt], 0, 5, 3)
    assert_scores_match(result.prompt_logprobs, prompt, expected, 5)


def test_a_batch_of_prompts_scores_each_as_alone_and_still_generates(model, shards):
    prompts = [model["prompt_ids"], model["chat_ids"], model["prompt_ids"][:5]]
    together = scheduled(shards, prompts, 3, 2, 4)
    for prompt, result in zip(prompts, together):
        (alone,) = scheduled(shards, [prompt], 3, 2, 4)
        assert result.prompt_logprobs == alone.prompt_logprobs
        assert result.tokens == alone.tokens == hf_greedy(model["hf"], prompt, 3, set())
        assert_scores_match(result.prompt_logprobs, prompt, reference(model, prompt), 2)


def test_the_daemon_refuses_bad_prompt_scoring_and_changes_nothing(shards):
    first, head = Client(shards[0]), Client(shards[1])
    seq = secrets.randbelow(1 << 40)
    try:
        for client in (first, head):
            client.call(MessageType.OPEN, seq=seq)
        hidden = first.call(MessageType.FORWARD, seq=seq, pos=0, tokens=[5, 6, 7]).tensors["hidden"]
        vocab = head.call(MessageType.HELLO).result["model"]["vocab_size"]
        bad = [({"prompt_logprobs": 2}, "'prompt_logprobs' and 'next_tokens'"),
               ({"next_tokens": [6, 7]}, "'prompt_logprobs' and 'next_tokens'"),
               ({"prompt_logprobs": 2, "next_tokens": [6, 7, 8, 9]}, "'next_tokens' holds 4 tokens for 3 rows"),
               ({"prompt_logprobs": 21, "next_tokens": [6]}, "prompt_logprobs"),
               ({"prompt_logprobs": 2, "next_tokens": [6, vocab]}, f"next token {vocab} is outside the vocabulary")]
        for fields, message in bad:
            reply = head.request(MessageType.FORWARD, validate=False, seq=seq, pos=0, hidden=hidden, **fields)
            assert reply.error_code is ErrorCode.BAD_REQUEST and message in reply.error_message, reply.error_message
        refused = first.request(MessageType.FORWARD, seq=seq, pos=3, tokens=[8], prompt_logprobs=1, next_tokens=[9])
        assert refused.error_code is ErrorCode.BAD_REQUEST and "without the head" in refused.error_message
        assert first.call(MessageType.FORWARD, seq=seq, pos=3, tokens=[8]).result["length"] == 4  # nothing changed
        # the head took none of the refused steps: the good one runs at 0 and scores its rows
        good = head.call(MessageType.FORWARD, seq=seq, pos=0, hidden=hidden, prompt_logprobs=1, next_tokens=[6, 7])
        assert good.result["length"] == 3 and len(good.result["prompt_logprobs"]) == 2
        assert all(len(ranked) == 1 for _, ranked, _ in good.result["prompt_logprobs"])
    finally:
        first.close()
        head.close()


# ---- the HTTP API ------------------------------------------------------------------------------------

def completion(server, **body) -> dict:
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_echo_with_logprobs_and_no_new_tokens_scores_the_prompt(server, model):
    tokenizer, prompt = model["tokenizer"], model["prompt_ids"]
    expected = reference(model, prompt)
    answer = completion(server, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    (choice,) = answer["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    scores = choice["logprobs"]
    assert scores["tokens"] == [tokenizer.decode([t]) for t in prompt]
    assert scores["token_logprobs"][0] is None and scores["top_logprobs"][0] is None
    assert scores["text_offset"] == [len(tokenizer.decode(prompt[:i])) for i in range(len(prompt))]
    for position, (logprob, ranked) in enumerate(zip(scores["token_logprobs"][1:], scores["top_logprobs"][1:])):
        row, token = expected[position], prompt[position + 1]
        assert abs(logprob - float(row[token])) < TOL
        best = {tokenizer.decode([int(i)]): float(v) for i, v in zip(*reversed(row.topk(3)))}
        best.setdefault(tokenizer.decode([token]), float(row[token]))
        assert ranked.keys() == best.keys() and all(abs(ranked[k] - best[k]) < TOL for k in best)
    assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt),
                               "prompt_tokens_details": {"cached_tokens": 0}}
    # without logprobs the echo alone needs no step at all
    assert completion(server, prompt=PROMPT, echo=True, max_tokens=0)["choices"][0]["text"] == PROMPT


def test_echo_logprobs_run_on_into_the_generated_tokens(server, model):
    greedy = completion(server, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    echoed = completion(server, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, ignore_eos=True, echo=True)
    (plain,), (choice,) = greedy["choices"], echoed["choices"]
    assert choice["text"] == PROMPT + plain["text"]
    prompt_only = completion(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)["choices"][0]["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert choice["logprobs"][key] == prompt_only[key] + plain["logprobs"][key]
    assert choice["logprobs"]["text_offset"] == prompt_only["text_offset"] + [
        len(PROMPT) + offset for offset in plain["logprobs"]["text_offset"]]


def test_vllm_prompt_logprobs_shape(server, model):
    tokenizer, prompt = model["tokenizer"], model["prompt_ids"]
    expected = reference(model, prompt)
    (choice,) = completion(server, prompt=prompt, max_tokens=1, prompt_logprobs=2, temperature=0)["choices"]
    scores = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and len(scores) == len(prompt) and scores[0] is None
    for position, entry in enumerate(scores[1:]):
        row, token = expected[position], prompt[position + 1]
        best = row.topk(2).indices.tolist()
        assert set(entry) == {str(t) for t in [token, *best]}
        assert entry[str(token)]["rank"] == int((row >= row[token]).sum())
        for rank, other in enumerate(best, start=1):
            assert entry[str(other)]["rank"] == rank or other == token
        for key, value in entry.items():
            assert abs(value["logprob"] - float(row[int(key)])) < TOL
            assert value["decoded_token"] == tokenizer.decode([int(key)])


def test_chat_prompt_logprobs_are_the_rendered_prompts(server, model):
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": model["chat"], "max_tokens": 1, "prompt_logprobs": 1}).json()
    (choice,) = completion(server, prompt=model["chat_ids"], max_tokens=1, prompt_logprobs=1)["choices"]
    assert chat["prompt_logprobs"] == choice["prompt_logprobs"] and len(chat["prompt_logprobs"]) == len(model["chat_ids"])
    refused = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": model["chat"], "max_tokens": 1, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


PROMPTS = [PROMPT, "hello world, the shards say hello", "tokens"]


def test_a_list_of_prompts_answers_each_as_alone_prompt_major(server, model):
    body = dict(max_tokens=3, temperature=0.8, seed=11, n=2, logprobs=1, echo=True, ignore_eos=True)
    together = completion(server, prompt=PROMPTS, **body)
    choices = together["choices"]
    assert [c["index"] for c in choices] == list(range(len(PROMPTS) * 2))
    prompt_tokens = 0
    for p, prompt in enumerate(PROMPTS):
        alone = completion(server, prompt=prompt, **body)
        assert [{**c, "index": c["index"] - 2 * p} for c in choices[2 * p:2 * p + 2]] == alone["choices"]
        prompt_tokens += alone["usage"]["prompt_tokens"]
    assert together["usage"]["prompt_tokens"] == prompt_tokens
    assert together["usage"]["completion_tokens"] == 3 * 2 * len(PROMPTS)
    # token-id prompts the same
    ids = [model["tokenizer"].encode(p) for p in PROMPTS]
    by_ids = completion(server, prompt=ids, **{**body, "echo": False})
    assert [c["text"] for c in by_ids["choices"]] == [c["text"][len(PROMPTS[c["index"] // 2]):] for c in choices]


def test_a_list_of_prompts_streams_each_choice_by_index(server, model):
    body = dict(prompt=PROMPTS, max_tokens=3, temperature=0, logprobs=1, echo=True, ignore_eos=True)
    whole = completion(server, **body)
    texts, scores, usage = {}, {}, None
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=streamed, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                part = scores.setdefault(choice["index"], {})
                for key, values in (choice["logprobs"] or {}).items():
                    part[key] = part.get(key, []) + values
    assert [texts[i] for i in range(len(PROMPTS))] == [c["text"] for c in whole["choices"]]
    assert [scores[i] for i in range(len(PROMPTS))] == [c["logprobs"] for c in whole["choices"]]
    assert usage == whole["usage"]


def test_a_prompt_in_none_of_the_four_forms_is_one_line_naming_them(server):
    for prompt in (["a", [1, 2]], [[1], ["a"]], [1.0, 2], [True], {"a": 1}):
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text
        assert "a string, a list of strings, a list of token ids or a list of token-id lists" in reply.text
        assert ";" not in reply.json()["error"]["message"]  # one problem, not the union's every branch


def test_choices_beyond_the_bound_are_refused_naming_the_prompt(server):
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": ["a"] * (MAX_CHOICES // 2 + 1), "n": 2, "max_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert str(MAX_CHOICES) in reply.json()["error"]["message"]


def test_lm_eval_loglikelihood_requests_read_as_it_reads_them(server, model):
    """lm-eval's `local-completions` loglikelihood: a batch of token-id prompts (context + continuation), echo,
    logprobs 1, max_tokens 1, temperature 0; it sums token_logprobs[ctxlen:-1] and calls the continuation greedy
    when each of those is the most likely of its top_logprobs."""
    context = model["prompt_ids"][:6]
    expected = reference(model, model["prompt_ids"])
    likely = int(expected[5].argmax())
    unlikely = int(expected[5].argmin())
    prompts = [context + model["prompt_ids"][6:9], context + [likely], context + [unlikely]]
    answer = completion(server, model=None, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234,
                        echo=True)
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    assert len(choices) == len(prompts)
    for prompt, choice in zip(prompts, choices):
        scores = choice["logprobs"]
        assert len(scores["token_logprobs"]) == len(prompt) + 1  # the prompt, then the one new token
        logprob = sum(scores["token_logprobs"][len(context):-1])
        rows = reference(model, prompt)
        assert abs(logprob - sum(float(rows[i - 1][prompt[i]]) for i in range(len(context), len(prompt)))) < TOL
        greedy = all(token == max(top.values()) for token, top in
                     zip(scores["token_logprobs"][len(context):-1], scores["top_logprobs"][len(context):-1]))
        assert greedy == all(int(rows[i - 1].argmax()) == prompt[i] for i in range(len(context), len(prompt)))
    assert [choice["logprobs"]["token_logprobs"][-2] for choice in choices[1:]] == [
        pytest.approx(float(expected[5][likely]), abs=TOL), pytest.approx(float(expected[5][unlikely]), abs=TOL)]


def test_the_fast_engine_scores_prompts_as_the_reference_engine(tmp_path):
    """Daemons on the fast engine (the GPU's step; on the CPU under Triton's interpreter) score a batch of prompts,
    chunked and in batched steps, as the reference engine does."""
    from common.presets import preset_config
    from tests.support.daemons import free_tcp_endpoint, start_daemons, stop_all

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    common = ["--engine", "fast", "--device", device, "--dtype", "float32", "--max-verify-tokens", "4",
              "--step-rows", "4", "--max-context", "64", "--max-sequences", "2"]
    specs = {"first": (free_tcp_endpoint(), ["--layers", "0:3", *common]),
             "second": (free_tcp_endpoint(), ["--layers", "3:6", *common])}
    vocab = preset_config("tiny").vocab_size
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (9, 6)]
    daemons = start_daemons(specs, tmp_path)
    try:
        fast = scheduled([bind for bind, _ in specs.values()], prompts, 1, 3, 4)
    finally:
        stop_all(daemons.values())
    # the reference engine on the same device: a synthetic model's weights are drawn by that device's generator
    reference_engine = scheduled(LocalTarget(ModelSource(synthetic="tiny"), device=device), prompts, 1, 3, 4)
    for ours, theirs in zip(fast, reference_engine):
        assert len(ours.prompt_logprobs) == len(theirs.prompt_logprobs) > 0
        for (logprob, ranked, rank), (expected, expected_ranked, expected_rank) in zip(ours.prompt_logprobs,
                                                                                          theirs.prompt_logprobs):
            assert abs(logprob - expected) < TOL and rank == expected_rank
            assert [i for i, _ in ranked] == [i for i, _ in expected_ranked]


LM_EVAL_DOCS = [{"context": "Shards hand hidden", "continuation": " states"},
                {"context": "hello world, the shards", "continuation": " say hello"},
                {"context": "speculative decoding drafts", "continuation": " tokens and verifies"},
                {"context": "pipeline of hidden", "continuation": " states and tokens"}]


def test_lm_eval_local_completions_scores_a_loglikelihood_task_from_local_data(server, model, tmp_path):
    """lm-eval itself (`local-completions`, token-id requests, the served checkpoint's tokenizer) on a
    loglikelihood task whose documents are a local JSON file: each document's loglikelihood and greediness equal
    transformers' on the token ids lm-eval sent, and so do the task's perplexity and accuracy."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in LM_EVAL_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "shardd_loglikelihood.yaml").write_text(
        "task: shardd_loglikelihood\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        "metric_list:\n"
        "  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    served = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={served},base_url={server.url}/v1/completions,tokenizer={model['dir']},"
                   "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
        tasks=["shardd_loglikelihood"], task_manager=TaskManager(include_path=str(tasks)), batch_size=2,
        log_samples=True)
    tokenizer = model["tokenizer"]
    samples = sorted(results["samples"]["shardd_loglikelihood"], key=lambda sample: sample["doc_id"])
    assert len(samples) == len(LM_EVAL_DOCS)
    lls, greedy = [], []
    for doc, sample in zip(LM_EVAL_DOCS, samples):
        # lm-eval's own split: the whole text's ids, the context's ids first
        whole = tokenizer.encode(doc["context"] + doc["continuation"], add_special_tokens=False)
        n_context = len(tokenizer.encode(doc["context"], add_special_tokens=False))
        rows = reference(model, whole)
        ll = sum(float(rows[i - 1][whole[i]]) for i in range(n_context, len(whole)))
        is_greedy = all(int(rows[i - 1].argmax()) == whole[i] for i in range(n_context, len(whole)))
        (served_ll, served_greedy), = sample["filtered_resps"]
        assert abs(served_ll - ll) < TOL and served_greedy == is_greedy
        lls.append(ll)
        greedy.append(is_greedy)
    scores = results["results"]["shardd_loglikelihood"]
    assert scores["acc,none"] == pytest.approx(sum(greedy) / len(greedy))
    assert scores["perplexity,none"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)
