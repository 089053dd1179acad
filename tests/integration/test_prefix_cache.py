"""Prefix caching (PROTOCOL.md, "Prefix caching"; README): prompts that share a prefix resume from the shards' prefix
entries, and every output is the cold run's, token for token, in every rollback mode, greedy and seeded, speculating
or not; a budget too small for the entries evicts and the outputs stay; a restarted shard's entries are gone and the
prompt goes cold; the wire refuses what cannot be resumed. Over real `shardd serve` daemons on loopback."""

from __future__ import annotations

import httpx
import pytest

from coordinator.drafting.drafters import NgramDrafter
from coordinator.relay.pipeline import Pipeline
from coordinator.sampling import Sampling
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import Scheduler
from protocol import MessageType
from tests.support.daemons import Client, kill_and_replace, start_pair, stop_all
from tests.support.serving import Server

CHUNK = 16
SYSTEM = list(b"You are a careful assistant. Answer in one short line, and never guess. ")
PROMPTS = [SYSTEM + list(question) for question in
           (b"What is two plus two?", b"Name a colour of the sky.", b"What is two plus three?", b"Spell cat.")]
TURN = PROMPTS[0] + list(b" Four. And what is four plus four?")  # a second turn: the first one's prompt extended


def _run(pipeline, prompts, *, caching, rollback="checkpoint", sampled=False, drafter=False, together=False,
         scheduler=None):
    """Each prompt's tokens and cached_tokens, one request after another (so later ones can hit), or `together`."""
    scheduler = scheduler or Scheduler(pipeline, max_sequences=4, prefill_chunk=CHUNK, prefix_caching=caching,
                                       rollback=rollback)

    def request(i, prompt):
        sampling = Sampling(temperature=0.8, seed=7 + i) if sampled else None
        return Request(prompt, 12, sampling=sampling, drafter=NgramDrafter() if drafter else None, block_size=4)

    if together:
        done = scheduler.run_all([request(i, p) for i, p in enumerate(prompts)])
    else:
        done = [scheduler.run_all([request(i, p)])[0] for i, p in enumerate(prompts)]
    return [(r.outcome().tokens, r.result.cached_tokens) for r in done], scheduler


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    binds, daemons = start_pair(tmp_path_factory.mktemp("prefix"))
    try:
        yield binds, daemons, tmp_path_factory.mktemp("prefix-restart")
    finally:
        stop_all(daemons)


@pytest.fixture(scope="module")
def pipeline(pair):
    pipeline = Pipeline.connect(pair[0])
    yield pipeline
    pipeline.disconnect()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "ngram"])
def test_a_hit_gives_the_cold_run_s_tokens(pipeline, sampled, drafter):
    cold, _ = _run(pipeline, PROMPTS + [TURN], caching=False, sampled=sampled, drafter=drafter)
    warm, scheduler = _run(pipeline, PROMPTS + [TURN], caching=True, sampled=sampled, drafter=drafter)
    assert [tokens for tokens, _ in warm] == [tokens for tokens, _ in cold]
    assert all(cached == 0 for _, cached in cold)
    # the later prompts resume after the shared system prompt's whole chunks, the second turn after its first's
    shared = len(SYSTEM) // CHUNK * CHUNK
    assert all(cached >= shared for _, cached in warm[1:4]), warm
    assert warm[4][1] >= (len(PROMPTS[0]) - 1) // CHUNK * CHUNK
    assert all(cached % CHUNK == 0 for _, cached in warm)
    assert scheduler.prefixes.hits >= 4


def test_prompts_arriving_together_resume_from_what_the_first_left(pipeline):
    cold, _ = _run(pipeline, PROMPTS, caching=False, together=True)
    _, scheduler = _run(pipeline, PROMPTS[:1], caching=True)  # the system prompt's entries are there
    warm, _ = _run(pipeline, PROMPTS, caching=True, together=True, scheduler=scheduler)
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert all(cached > 0 for _, cached in warm)


def test_the_wire_refuses_what_cannot_be_resumed(pair):
    first = Client(pair[0][0])
    other = Client(pair[0][0])
    try:
        refused = first.request(MessageType.OPEN, seq=901, prefix=12345)
        assert refused.error_code == "PREFIX_MISSING" and "open the sequence cold" in refused.error_message
        assert first.call(MessageType.OPEN, seq=902).result["length"] == 0
        saved = first.call(MessageType.FORWARD, seq=902, pos=0, tokens=list(range(1, 9)), save_prefix=77)
        assert saved.result["prefix_saved"] is True and saved.result["length"] == 8
        again = first.request(MessageType.FORWARD, seq=902, pos=8, tokens=[5], save_prefix=77)
        assert again.error_code == "BAD_REQUEST" and "exists already" in again.error_message
        pending = first.request(MessageType.FORWARD, seq=902, pos=8, tokens=[5, 6], checkpoint=True,
                                parents=[-1, 0], save_prefix=78, validate=False)
        assert pending.error_code == "BAD_REQUEST" and "save_prefix" in pending.error_message
        assert first.call(MessageType.FORWARD, seq=902, pos=8, tokens=[5]).result["length"] == 9  # nothing changed
        # another client does not see the entry; its owner resumes from it at its length
        assert other.request(MessageType.OPEN, seq=903, prefix=77).error_code == "PREFIX_MISSING"
        assert first.call(MessageType.OPEN, seq=903, prefix=77).result["length"] == 8
        stats = first.call(MessageType.STATS).result["prefix_cache"]
        assert stats["hits"] >= 1 and stats["misses"] >= 2 and stats["bytes"] <= stats["budget_bytes"]
        for seq in (902, 903):
            first.call(MessageType.CLOSE, seq=seq)
    finally:
        first.close()
        other.close()


def test_a_restarted_shard_s_entries_are_gone_and_the_prompt_goes_cold(pair, pipeline):
    binds, daemons, workdir = pair
    cold, _ = _run(pipeline, PROMPTS[:2], caching=False)
    scheduler = Scheduler(pipeline, max_sequences=4, prefill_chunk=CHUNK)
    [first] = scheduler.run_all([Request(PROMPTS[0], 12)])
    kill_and_replace(daemons, 1, "restarted", ["--layers", "3:6"], workdir)
    [second] = scheduler.run_all([Request(PROMPTS[1], 12)])
    assert [first.outcome().tokens, second.outcome().tokens] == [t for t, _ in cold]
    assert second.result.cached_tokens == 0 and scheduler.prefixes.lost == 1
    [third] = scheduler.run_all([Request(PROMPTS[1], 12)])  # the entries saved cold just now serve it
    assert third.outcome().tokens == cold[1][0] and third.result.cached_tokens > 0


def test_the_automatic_budget_fits_what_the_plan_leaves():
    """--prefix-cache-gib auto: 4 GiB on a GPU, 1 GiB on the CPU, never more than a cap leaves (or, uncapped on a
    GPU, half of what its memory holds beyond the plan); the plan counts it."""
    from common.memory import GiB, plan_memory
    from common.presets import preset_config

    config = preset_config("tiny")
    plan = lambda **kw: plan_memory(config, 0, 6, weight_bytes={"weights": GiB}, dtype_bytes=4, engine="reference",  # noqa: E731
                                    max_sequences=2, max_context=64, max_tokens_per_request=64,
                                    checkpoint_bytes_per_sequence=0, step_rows=16, prefix_cache=None, **kw)
    assert plan(on_gpu=False).items["prefix_cache"] == GiB
    assert plan(on_gpu=True).items["prefix_cache"] == 4 * GiB
    rest = plan(on_gpu=False)
    others = rest.total - rest.items["prefix_cache"]
    assert plan(on_gpu=True, cap=others + GiB).items["prefix_cache"] == GiB
    assert plan(on_gpu=True, cap=others).items["prefix_cache"] == 0
    assert plan(on_gpu=True, device_bytes=others + 2 * GiB).items["prefix_cache"] == GiB
    assert plan(on_gpu=True, device_bytes=others + 20 * GiB).items["prefix_cache"] == 4 * GiB


@pytest.fixture(scope="module")
def small_budget(tmp_path_factory):
    """Two replay-ssm daemons whose prefix cache holds about three entries of the tiny model at CHUNK tokens."""
    binds, daemons = start_pair(tmp_path_factory.mktemp("prefix-small"),
                                extra=["--rollback-mode", "replay-ssm", "--prefix-cache-gib", "0.00003"])
    pipeline = Pipeline.connect(binds)
    try:
        yield pipeline
    finally:
        pipeline.disconnect()
        stop_all(daemons)


@pytest.mark.parametrize("rollback", ["replay-ssm", "replay"])
def test_a_budget_that_evicts_keeps_every_output(small_budget, rollback):
    distinct = [list(bytes([65 + i])) * 40 + list(b" and then?") for i in range(5)]
    prompts = distinct + PROMPTS + distinct[:2]
    cold, _ = _run(small_budget, prompts, caching=False, rollback=rollback, drafter=True)
    warm, _ = _run(small_budget, prompts, caching=True, rollback=rollback, drafter=True)
    assert [t for t, _ in warm] == [t for t, _ in cold]
    for stats in small_budget.stats():
        cache = stats["prefix_cache"]
        assert cache["bytes"] <= cache["budget_bytes"] and cache["evictions"] > 0, cache


@pytest.fixture(scope="module")
def server(pair):
    with Server("--shards", ",".join(pair[0]), "--drafter", "none") as server:
        yield server


def test_the_api_reports_cached_tokens_and_salts_keep_tenants_apart(server):
    client = server.client()
    name = client.models.list().data[0].id
    system = "You are a careful assistant who answers in one short line and never guesses. " * 5

    def ask(question, **extra):
        return client.chat.completions.create(model=name, max_tokens=4, temperature=0, extra_body=extra,
                                              messages=[{"role": "system", "content": system},
                                                        {"role": "user", "content": question}])

    first, second = ask("What is two plus two?"), ask("Name a colour.")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 256
    salted = ask("Name a colour.", cache_salt="tenant-b")
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].message.content == second.choices[0].message.content
    assert ask("Spell cat.", cache_salt="tenant-b").usage.prompt_tokens_details.cached_tokens >= 256
    metrics = httpx.get(server.url + "/metrics").text
    assert 'shardctl_prefix_cache_requests_total{outcome="hit"}' in metrics
    refused = httpx.post(server.url + "/v1/chat/completions",
                         json={"model": name, "messages": [{"role": "user", "content": "hi"}], "cache_salt": ""})
    assert refused.status_code == 400 and "cache_salt" in refused.text


@pytest.fixture(scope="module")
def beside(tmp_path_factory):
    """Two daemons, the second hosting a synthetic DFlash drafter beside its layers."""
    from tests.support.daemons import free_tcp_endpoint, start_daemons

    binds = [free_tcp_endpoint(), free_tcp_endpoint()]
    specs = {"first": (binds[0], ["--layers", "0:3"]), "head": (binds[1], ["--layers", "3:6", "--draft", "synthetic"])}
    daemons = start_daemons(specs, tmp_path_factory.mktemp("prefix-dflash"))
    pipeline = Pipeline.connect(binds)
    try:
        yield pipeline
    finally:
        pipeline.disconnect()
        stop_all(daemons.values())


def test_dflash_resumes_its_drafter_context_too(beside):
    from coordinator.drafting.dflash import DFlashDrafterClient

    drafter = DFlashDrafterClient(beside.clients[1], beside)
    assert drafter.target.prefix_cache

    def run(caching):
        scheduler = Scheduler(beside, max_sequences=2, prefill_chunk=CHUNK, prefix_caching=caching)
        done = [scheduler.run_all([Request(p, 12, drafter=drafter.fresh(), block_size=4)])[0] for p in PROMPTS]
        return [(r.outcome().tokens, r.result.drafted, r.result.accepted, r.result.cached_tokens) for r in done]

    cold, warm = run(False), run(True)
    assert [c[:3] for c in warm] == [c[:3] for c in cold]  # the tokens, and the drafter's acceptance
    assert all(c[3] == 0 for c in cold) and all(w[3] >= len(SYSTEM) // CHUNK * CHUNK for w in warm[1:])
    head = beside.stats()[1]["prefix_cache"]
    assert head["hits"] >= 3 and head["misses"] == 0


def test_streams_without_dflash_resume_beside_the_drafter(beside):
    """On a pipeline whose head hosts the drafter, streams that do not draft with it open without a drafter context
    (`draft_context: false`) and resume from entries that hold none; a DFlash stream never resumes from those (its
    drafter would lack the prefix's rows): it prefills cold, with the same tokens."""
    from coordinator.drafting.dflash import DFlashDrafterClient

    before = beside.stats()[1]["prefix_cache"]
    cold, _ = _run(beside, PROMPTS + [TURN], caching=False, drafter=True)
    scheduler = Scheduler(beside, max_sequences=4, prefill_chunk=CHUNK)
    warm, _ = _run(beside, PROMPTS + [TURN], caching=True, drafter=True, scheduler=scheduler)
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert all(cached >= len(SYSTEM) // CHUNK * CHUNK for _, cached in warm[1:])
    drafter = DFlashDrafterClient(beside.clients[1], beside)
    alone = Scheduler(beside, max_sequences=2, prefill_chunk=CHUNK, prefix_caching=False)
    expected = alone.run_all([Request(PROMPTS[1], 12, drafter=drafter.fresh(), block_size=4)])[0].outcome().tokens
    # the same scheduler, so the same index: its entries were saved without the drafter's context
    (done,) = scheduler.run_all([Request(PROMPTS[1], 12, drafter=drafter.fresh(), block_size=4)])
    assert done.outcome().tokens == expected and done.result.cached_tokens == 0
    after = beside.stats()[1]["prefix_cache"]
    assert after["hits"] - before["hits"] >= 4 and after["misses"] > before["misses"]


def test_a_sequence_opened_without_a_drafter_context_cannot_propose(beside):
    head = Client(beside.endpoints[1])
    try:
        assert head.call(MessageType.OPEN, seq=950, draft_context=False).result["length"] == 0
        refused = head.request(MessageType.PROPOSE, seq=950, pos=0, last_token=3, block_size=2)
        assert refused.error_code == "BAD_REQUEST" and "draft_context" in refused.error_message
        assert str(950) not in head.call(MessageType.STATS).result["drafter"]["context_rows"]
        head.call(MessageType.CLOSE, seq=950)
    finally:
        head.close()


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """Two daemons of layers and a drafter-only daemon (its entries hold the drafter's context alone), and a second
    drafter-only daemon whose budget holds no entry."""
    from tests.support.daemons import free_tcp_endpoint, start_daemons

    binds = {name: free_tcp_endpoint() for name in ("first", "head", "drafter", "tiny")}
    specs = {"first": (binds["first"], ["--layers", "0:3"]), "head": (binds["head"], ["--layers", "3:6"]),
             "drafter": (binds["drafter"], ["--layers", "none", "--draft", "synthetic"]),
             "tiny": (binds["tiny"], ["--layers", "none", "--draft", "synthetic", "--prefix-cache-gib", "0.000001"])}
    daemons = start_daemons(specs, tmp_path_factory.mktemp("prefix-own"))
    pipeline = Pipeline.connect([binds["first"], binds["head"]])
    try:
        yield pipeline, binds
    finally:
        pipeline.disconnect()
        stop_all(daemons.values())


def _dflash_runs(pipeline, drafter, caching, scheduler=None):
    scheduler = scheduler or Scheduler(pipeline, max_sequences=2, prefill_chunk=CHUNK, prefix_caching=caching)
    done = [scheduler.run_all([Request(p, 12, drafter=drafter.fresh(), block_size=4)])[0] for p in PROMPTS + [TURN]]
    return [(r.outcome().tokens, r.result.drafted, r.result.accepted, r.result.cached_tokens) for r in done]


def test_a_drafter_daemon_of_its_own_resumes_its_context_too(own):
    """The entries the shards save are saved on the drafter-only daemon by the PROPOSE that brings their rows; a
    DFlash stream resumes from both, with the cold run's tokens and acceptance."""
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.relay.client import ShardClient

    pipeline, binds = own
    drafter = DFlashDrafterClient(ShardClient(binds["drafter"]), pipeline)
    assert not drafter.shares_pipeline_daemon and drafter.target.prefix_cache
    cold, warm = _dflash_runs(pipeline, drafter, False), _dflash_runs(pipeline, drafter, True)
    assert [c[:3] for c in warm] == [c[:3] for c in cold]
    assert all(c[3] == 0 for c in cold) and all(w[3] >= len(SYSTEM) // CHUNK * CHUNK for w in warm[1:])
    assert warm[-1][3] >= len(PROMPTS[0]) // CHUNK * CHUNK  # the second turn resumes past the first one's prompt
    stats = drafter.client.stats()["prefix_cache"]
    assert stats["saves"] > 0 and stats["hits"] >= 4 and stats["misses"] == 0


def test_a_drafter_daemon_without_the_entry_sends_the_prompt_cold(own):
    """The shards hold the entries, the drafter-only daemon could keep none (its budget): OPEN from them is refused
    there, the shards close the sequence again, and the prompt prefills cold with the same tokens. The entries stay
    in the index: a stream without the drafter still resumes from them."""
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.relay.client import ShardClient

    pipeline, binds = own
    drafter = DFlashDrafterClient(ShardClient(binds["tiny"]), pipeline)
    assert drafter.target.prefix_cache
    scheduler = Scheduler(pipeline, max_sequences=2, prefill_chunk=CHUNK)
    cold, warm = _dflash_runs(pipeline, drafter, False), _dflash_runs(pipeline, drafter, True, scheduler)
    assert [c[:3] for c in warm] == [c[:3] for c in cold] and all(w[3] == 0 for w in warm)
    (plain,) = scheduler.run_all([Request(PROMPTS[1], 12)])
    assert plain.result.cached_tokens >= len(SYSTEM) // CHUNK * CHUNK
    stats = drafter.client.stats()["prefix_cache"]
    assert stats["entries"] == 0 and stats["declined"] > 0 and stats["misses"] > 0
    assert all(s["open_sequences"] == 0 for s in pipeline.stats())


def test_the_wire_refuses_saves_that_cannot_be_kept(own, beside):
    """PROPOSE's saves: both fields or neither, lengths ascending within pos, new ids, only on a drafter-only
    daemon; each refusal changes nothing."""
    _, binds = own
    drafter = Client(binds["drafter"])
    try:
        drafter.call(MessageType.OPEN, seq=962)
        held = drafter.call(MessageType.STATS).result["prefix_cache"]["entries"]
        for fields, words in (({"save_prefix": [5]}, "save_lengths"),
                              ({"save_prefix": [5, 6], "save_lengths": [2, 1]}, "ascend"),
                              ({"save_prefix": [5], "save_lengths": [3]}, "pos"),
                              ({"save_prefix": [5, 5], "save_lengths": [1, 2]}, "repeats")):
            refused = drafter.request(MessageType.PROPOSE, validate=False, seq=962, pos=2, last_token=3, block_size=2,
                                      **fields)
            assert refused.error_code == "BAD_REQUEST" and words in refused.error_message, refused
        assert drafter.request(MessageType.OPEN, seq=963, prefix=123456).error_code == "PREFIX_MISSING"
        stats = drafter.call(MessageType.STATS).result
        assert stats["prefix_cache"]["entries"] == held and stats["drafter"]["context_rows"]["962"] == 0
        drafter.call(MessageType.CLOSE, seq=962)
    finally:
        drafter.close()
    head = Client(beside.endpoints[1])  # layers and the drafter: its entries come with FORWARD's save_prefix
    try:
        head.call(MessageType.OPEN, seq=964)
        refused = head.request(MessageType.PROPOSE, seq=964, pos=1, last_token=3, block_size=2, save_prefix=[7],
                               save_lengths=[1], validate=False)
        assert refused.error_code == "BAD_REQUEST" and "drafter-only" in refused.error_message
        head.call(MessageType.CLOSE, seq=964)
    finally:
        head.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["checkpoint", "replay-ssm"])
def test_the_fast_engine_resumes_bit_for_bit(tmp_path, mode):
    """Two fast bf16 daemons on the GPU (rows through the device ring, DFlash beside the head): every prompt's
    tokens with its prefix resumed from the state pools' entries equal the cold run's, greedy, seeded and DFlash."""
    from coordinator.drafting.dflash import DFlashDrafterClient
    from tests.support.daemons import start_daemons

    binds = [f"ipc://{tmp_path}/s{k}.sock" for k in range(2)]
    common = ["--engine", "fast", "--device", "cuda:0", "--dtype", "bfloat16", "--rollback-mode", mode,
              "--max-verify-tokens", "8"]
    specs = {"first": (binds[0], ["--layers", "0:3", *common, "--relay-to", binds[1]]),
             "head": (binds[1], ["--layers", "3:6", *common, "--draft", "synthetic"])}
    daemons = start_daemons(specs, tmp_path)
    try:
        with Pipeline.connect(binds) as pipeline:
            for sampled in (False, True):
                cold, _ = _run(pipeline, PROMPTS + [TURN], caching=False, sampled=sampled, drafter=True)
                warm, _ = _run(pipeline, PROMPTS + [TURN], caching=True, sampled=sampled, drafter=True)
                assert [t for t, _ in warm] == [t for t, _ in cold]
                assert all(cached > 0 for _, cached in warm[1:])
            drafter = DFlashDrafterClient(pipeline.clients[1], pipeline)

            def dflash(caching):
                scheduler = Scheduler(pipeline, max_sequences=2, prefill_chunk=CHUNK, prefix_caching=caching)
                done = [scheduler.run_all([Request(p, 12, drafter=drafter.fresh(), block_size=4)])[0]
                        for p in PROMPTS]
                return [(r.outcome().tokens, r.result.accepted, r.result.cached_tokens) for r in done]

            cold, warm = dflash(False), dflash(True)
            assert [c[:2] for c in warm] == [c[:2] for c in cold] and all(w[2] > 0 for w in warm[1:])
    finally:
        stop_all(daemons.values())
