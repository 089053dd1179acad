"""`shardctl serve` end to end: a checkpoint written by transformers with a BPE tokenizer.json and a chat
template (tests/support/served_model.py), two real `shardd serve` daemons on loopback, the real server on a free
port, the real `openai` client. Greedy text must equal transformers' greedy text."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from coordinator.cli import cli
from coordinator.decoding import speculative_decode
from coordinator.drafting.drafters import NgramDrafter
from coordinator.relay.pipeline import Pipeline
from coordinator.sampling import Sampling
from tests.support.served_model import MAX_CONTEXT, NEW, PROMPT, model, model_name, shards  # noqa: F401 (fixtures)
from tests.support.serving import Server


@pytest.fixture(scope="module")
def server(shards):
    with Server("--shards", ",".join(shards), "--drafter", "ngram", "--block-size", "6") as server:
        yield server


def test_models_health_and_metrics(server, model, shards):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [model_name(model)]
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and set(health["shards"]) == set(shards)
    client.completions.create(model=model_name(model), prompt=PROMPT, max_tokens=3, temperature=0)
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("shardctl_requests_total", "shardctl_generation_tokens_total", "shardctl_accepted_drafts_per_step",
                 "shardctl_step_seconds", "shardctl_recoveries_total"):
        assert name in metrics, name


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_transformers(server, model, stream):
    tokens, text, finish = model["completion"]
    client = server.client()
    kwargs = dict(model=model_name(model), prompt=PROMPT, max_tokens=NEW, temperature=0)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert reasons == [finish]
    else:
        response = client.completions.create(**kwargs)
        got, usage = response.choices[0].text, response.usage
        assert response.choices[0].finish_reason == finish
    assert finish == "stop"  # the model's EOS (generation_config.json) ended it, and is not in the text
    assert got == text
    assert usage.prompt_tokens == len(model["prompt_ids"]) and usage.completion_tokens == len(tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_transformers(server, model, stream):
    tokens, text, finish = model["chat_expected"]
    client = server.client()
    kwargs = dict(model=model_name(model), messages=model["chat"], max_tokens=NEW, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [finish]
    else:
        response = client.chat.completions.create(**kwargs)
        got = response.choices[0].message.content
        assert response.choices[0].finish_reason == finish
        assert response.usage.prompt_tokens == len(model["chat_ids"])
        assert response.usage.completion_tokens == len(tokens)
    assert got == text


def test_context_limit_ends_with_length_and_long_prompts_are_refused(server, model):
    from openai import BadRequestError

    client = server.client()
    room = MAX_CONTEXT - len(model["prompt_ids"])
    response = client.completions.create(model=model_name(model), prompt=PROMPT, max_tokens=room, temperature=1.0,
                                         seed=3, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == MAX_CONTEXT
    # A budget beyond the context is refused as vLLM refuses it, not cut silently.
    with pytest.raises(BadRequestError, match=rf"'max_tokens' or 'max_completion_tokens' is too large: {room + 1}\."):
        client.completions.create(model=model_name(model), prompt=PROMPT, max_tokens=room + 1)
    with pytest.raises(BadRequestError, match="maximum context length"):
        client.completions.create(model=model_name(model), prompt=list(range(MAX_CONTEXT)), max_tokens=1)


def test_stop_strings_and_seeds(server, model):
    client = server.client()
    name = model_name(model)
    sampled = [client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=s,
                                         extra_body={"ignore_eos": True}).choices[0].text for s in (7, 7, 8)]
    assert sampled[0] == sampled[1]
    full = sampled[0]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    if stop.strip():
        response = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7,
                                             stop=[stop], extra_body={"ignore_eos": True})
        assert response.choices[0].text == full[:full.find(stop)]
        assert response.choices[0].finish_reason == "stop"


def test_concurrent_streams_each_equal_their_output_alone(server, model):
    name = model_name(model)
    prompts = [f"{PROMPT} {i}" for i in range(8)]

    def run(i: int, results: dict) -> None:
        client = server.client()
        chunks = client.completions.create(model=name, prompt=prompts[i], max_tokens=12, temperature=0.8, seed=100 + i,
                                           stream=True)
        results[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    alone: dict = {}
    for i in range(8):
        run(i, alone)
    together: dict = {}
    threads = [threading.Thread(target=run, args=(i, together)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert together == alone


def test_a_seed_reproduces_across_rollback_modes_through_the_shards(shards, model):
    outputs = {}
    with Pipeline.connect(shards) as pipeline:
        for mode in ("checkpoint", "replay"):
            outputs[mode] = speculative_decode(pipeline, 77, model["prompt_ids"], NgramDrafter(), block_size=6,
                                               rollback=mode, max_new_tokens=16,
                                               sampling=Sampling(temperature=1.0, seed=99)).tokens
    assert outputs["checkpoint"] == outputs["replay"]


def test_generate_uses_the_tokenizer_the_shards_name(shards, model):
    """Without --tokenizer, `generate --shards` used to encode the prompt as bytes: wrong text, silently."""
    result = CliRunner().invoke(cli, ["generate", "--shards", ",".join(shards), "--prompt", PROMPT, "--drafter", "none",
                                      "--max-new-tokens", str(NEW), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    tokens, text, _ = model["completion"]
    assert record["tokens"] == tokens
    assert record["text"] == text  # and the EOS is not part of it


def test_generate_samples_with_a_seed(shards, model):
    args = ["generate", "--shards", ",".join(shards), "--prompt", PROMPT, "--max-new-tokens", "8", "--json",
            "--temperature", "1.0", "--seed", "5", "--ignore-eos", "--block-size", "6"]
    runs = [CliRunner().invoke(cli, args + extra) for extra in ([], ["--rollback", "replay"])]
    assert [run.exit_code for run in runs] == [0, 0], [run.output for run in runs]
    first, again = (json.loads(run.stdout) for run in runs)
    assert first["tokens"] == again["tokens"]  # (seed, position) decides each draw, whatever the rollback mode


def test_a_tokenizer_the_shards_name_but_this_host_lacks_is_refused():
    from coordinator.relay.shards import ShardInfo
    from coordinator.tokenizer import TokenizerUnavailable, load_tokenizer

    shard = ShardInfo("tcp://127.0.0.1:1", {"tokenizer": "/nonexistent/model"})
    with pytest.raises(TokenizerUnavailable, match="--tokenizer"):
        load_tokenizer(None, 300, [shard])


def test_quantized_checkpoints_are_refused(model, tmp_path):
    from common.model_config import ConfigError, load_config

    for method in ("gptq", "awq"):  # FP8 loads (tests/unit/test_quant.py)
        quantized = tmp_path / method
        quantized.mkdir()
        raw = json.loads((Path(model["dir"]) / "config.json").read_text())
        raw["quantization_config"] = {"quant_method": method, "weight_block_size": [128, 128]}
        (quantized / "config.json").write_text(json.dumps(raw))
        with pytest.raises(ConfigError, match=f"quant_method '{method}'"):
            load_config(quantized)


# ---- the text of the commits: decoded incrementally, the same as decoding the whole history -------------------


def _whole_history_text(*args):
    """The reference TextTracker: every commit decodes all the visible tokens again (what the incremental one
    must send, delta for delta); its stop strings and hold-back are the tracker's own."""
    from coordinator.serve.engine import TextTracker

    class WholeHistoryText(TextTracker):
        def _text(self):
            return self.tokenizer.decode(self._visible(), skip_special_tokens=self.skip_special_tokens)

    return WholeHistoryText(*args)


def _sentencepiece_style():
    """A Llama-style tokenizer (metaspace words, byte fallback, the first space stripped when decoding): a window
    decoded without the tokens before it would lose a word's space."""
    from tokenizers import Tokenizer, decoders, models

    from coordinator.tokenizer import HFTokenizer

    vocab = {"<unk>": 0, **{f"<0x{i:02X}>": 1 + i for i in range(256)}}
    for word in ["a", "b", "é", "ab", "ba", "€"]:
        vocab[word], vocab["\u2581" + word] = len(vocab), len(vocab) + 1
    tokenizer = HFTokenizer.__new__(HFTokenizer)
    tokenizer._tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer._tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.vocab_size = len(vocab)
    return tokenizer


def _tokenizers():
    from coordinator.tokenizer import ByteTokenizer, HFTokenizer

    return {"synthetic": HFTokenizer.synthetic_for(1024), "bytes": ByteTokenizer(300),
            "sentencepiece": _sentencepiece_style()}


_TEXT_TOKENIZERS = {}


@pytest.mark.parametrize("which", ["synthetic", "bytes", "sentencepiece"])
def test_the_text_of_commits_decoded_incrementally_is_the_whole_history_s(which):
    """TextTracker (incremental: the last window and what follows) sends, commit by commit, exactly the deltas
    and stops of decoding the whole history every time: multi-byte characters split over commits (byte ids
    0..255, including invalid sequences), special tokens skipped, an EOS at the end, stop strings."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from coordinator.serve.engine import TextTracker

    tokenizer = _TEXT_TOKENIZERS.setdefault(which, _tokenizers()[which])
    utf8 = list("é€😀".encode())
    ids = st.one_of(st.sampled_from(utf8), st.integers(0, 127), st.integers(128, 255),
                    st.integers(256, tokenizer.vocab_size - 1))

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.lists(st.lists(ids, min_size=1, max_size=5), min_size=1, max_size=14),
           st.lists(st.sampled_from(["a", "ba", "\u20ac", "ZZ"]), max_size=2), st.booleans(), st.booleans())
    def check(commits, stop, skip, eos_last):
        eos = (commits[-1][-1],) if eos_last else ()
        fast, reference = TextTracker(tokenizer, stop, eos, skip), _whole_history_text(tokenizer, stop, eos, skip)
        for committed in commits:
            assert fast.add(committed) == reference.add(committed)
        assert fast.finish() == reference.finish()

    check()


class ThreadNoting:
    """A tokenizer that notes the thread of every decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.threads = tokenizer, set()

    def decode(self, ids, **options):
        self.threads.add(threading.current_thread().name)
        return self.tokenizer.decode(ids, **options)


def test_text_and_stop_strings_are_made_off_the_engine_thread(shards, model):
    """Detokenizing and stop strings run on the event loop, not on the thread that drives the steps; a stop
    string still ends the request at the commit it appeared in (the usage counts no token the engine ran past it)."""
    import asyncio

    from coordinator.sampling import Sampling
    from coordinator.serve.engine import Engine, EngineConfig, GenerateParams

    tokenizer = ThreadNoting(model["tokenizer"])
    engine = Engine(shards, tokenizer, EngineConfig(model_name="m", drafter="none"))
    try:
        alone = asyncio.run(engine.complete(GenerateParams(model["prompt_ids"], 12, Sampling(), ignore_eos=True)))
        full, tokens = alone[0], alone[1].tokens
        stop = next(full[i:i + 2] for i in range(len(full) // 2, len(full) - 1) if full[i:i + 2].strip())
        text, result, _ = asyncio.run(engine.complete(
            GenerateParams(model["prompt_ids"], 12, Sampling(), stop=[stop], ignore_eos=True)))
    finally:
        engine.close()
    assert text == full[:full.find(stop)] and result.finish_reason == "stop"
    # Greedy commits one token a step: the request holds the shortest prefix whose text shows the stop string.
    shortest = next(n for n in range(1, len(tokens) + 1) if stop in model["tokenizer"].decode(tokens[:n]))
    assert result.tokens == tokens[:shortest] and result.steps == shortest - 1
    assert tokenizer.threads and "shardctl-engine" not in tokenizer.threads
