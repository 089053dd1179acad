"""DFlash drafting over real daemons: features captured across shards, PROPOSE on a drafter daemon.

Daemons (all start once, together): a 2-way tcp set with checkpoint rollback, a drafter-only tcp
daemon (synthetic drafter built in memory), a 3-way ipc set of a checkpoint written by
`shardctl make-model --with-drafter` with replay-ssm rollback, 8-token requests (so prefill and
the first PROPOSE go in chunks) and the drafter from `draft/` hosted by its last shard, a
tail shard without rollback storage, and two 2-way sets whose last shard hosts the synthetic
drafter and captures one of its layers, so the verify's reply proposes the next block: with
layer 1 carried from the first shard (checkpoint), and with both layers on the head shard, the
rows going from shard to shard (replay-ssm). The synthetic drafter is untrained (acceptance near
zero): what counts is that its output is exactly greedy and that its context follows the commits.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from coordinator.cli import cli
from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafting.dflash import CapturedRows, DFlashDrafterClient
from coordinator.drafting.drafters import Drafter, NgramDrafter
from coordinator.launch import ShardSet, drafter_set, launched_sets
from coordinator.relay.client import ShardClient, ShardError
from coordinator.relay.pipeline import BatchForward, Captured, Pipeline
from coordinator.relay.shards import PipelineError, ShardInfo, order_shards
from coordinator.relay.target import RollbackFailed
from coordinator.sampling import Sampling
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import Scheduler, decode_all
from protocol import ErrorCode, WireTensor
from shardd.draft.model import DFlashDrafter
from common.draft_config import synthetic_draft_config
from shardd.draft.synthetic import synthetic_draft_weights
from shardd.weights.loading import ModelSource, build_drafter, build_shard
from shardd.local import LocalTarget
from shardd.engine.reference.rollback import RollbackStorage
from shardd.weights.reader import embedding_and_head_shapes, load_tensors
from tests.support.reference import hf_logits_and_hidden, hf_model

TINY = ("--synthetic", "tiny")
PROMPT = list(b"The quick brown fox jumps over the lazy dog; the quick brown fox")
NEW_TOKENS = 32
BLOCK = 8
LAYER_IDS = [1, 3]  # synthetic:2 on the 6-layer tiny model (build_target_layer_ids)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash") / "tiny"
    result = CliRunner().invoke(cli, ["make-model", "--preset", "tiny", "--out", str(out), "--with-drafter", "--json"])
    assert result.exit_code == 0, result.output
    assert (out / "draft" / "config.json").is_file() and (out / "draft" / "model.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def daemons(model_dir):
    model = ("--model", str(model_dir))
    sets = {
        "pair": ShardSet(TINY, [(0, 3), (3, 6)], "tcp", ("--rollback-mode", "checkpoint", "--max-verify-tokens", str(BLOCK))),
        "drafter": drafter_set(TINY, "synthetic", "tcp"),
        "triple": ShardSet(
            model, [(0, 2), (2, 4), (4, 6)], "ipc",
            ("--rollback-mode", "replay-ssm", "--max-verify-tokens", str(BLOCK), "--max-tokens-per-request", "8"),
            shard_args=((), (), ("--draft", str(model_dir / "draft"))),
        ),
        "bare": ShardSet(TINY, [(3, 6)], "tcp", ("--max-verify-tokens", "0")),
        "beside": ShardSet(TINY, [(0, 3), (3, 6)], "ipc", ("--rollback-mode", "checkpoint", "--max-verify-tokens",
                                                            str(BLOCK)), shard_args=((), ("--draft", "synthetic"))),
        "head": ShardSet(TINY, [(0, 1), (1, 6)], "tcp", ("--rollback-mode", "replay-ssm", "--max-verify-tokens",
                                                          str(BLOCK)), shard_args=((), ("--draft", "synthetic"))),
    }
    with launched_sets(list(sets.values()), ready_timeout_s=120) as started:
        yield {name: [shard.endpoint for shard in shards] for name, shards in zip(sets, started)}


def pipeline_endpoints(daemons, name):
    """Shards of a pipeline and the daemon of its drafter."""
    if name == "pair":
        return daemons["pair"], daemons["drafter"][0]
    if name in ("triple", "beside", "head"):
        return daemons[name], daemons[name][-1]  # the last shard hosts the drafter too
    if name == "head-own":
        return daemons["head"], daemons["drafter"][0]  # the drafter on its own daemon
    return [daemons["pair"][0], daemons["bare"][0]], daemons["drafter"][0]  # layer 3 on a shard without storage


@pytest.fixture(scope="module")
def local():
    return LocalTarget(ModelSource(synthetic="tiny"), storage=RollbackStorage(None, 0))


@pytest.fixture(scope="module")
def greedy(local):
    return greedy_decode(local, 1, PROMPT, NEW_TOKENS).tokens


# ---- features --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pair", "triple"])
def test_features_captured_across_shards_equal_one_process_and_transformers(daemons, local, model_dir, name):
    layers = list(range(6))
    with Pipeline.connect(pipeline_endpoints(daemons, name)[0]) as pipeline:
        pipeline.open(10)
        try:
            ids, captured = pipeline.capture(10, 0, PROMPT, layers)  # triple: in 8-token chunks
        finally:
            pipeline.close(10)
    local.open(10)
    try:
        want_ids, want = local.capture(10, 0, PROMPT, layers)
    finally:
        local.close(10)
    _, hidden_states = hf_logits_and_hidden(hf_model(model_dir), PROMPT)
    assert ids == want_ids and sorted(captured) == layers
    for layer in layers:
        got = captured[layer].to_torch()
        assert got.shape == (len(PROMPT), 64)
        assert torch.allclose(got, want[layer], atol=1e-5, rtol=0)
        if layer < 5:  # transformers' last entry is after the final norm, not a layer output
            assert (got - hidden_states[layer + 1]).abs().max().item() <= 1e-4


def test_capture_goes_only_to_shards_owning_a_layer(daemons):
    endpoints, _ = pipeline_endpoints(daemons, "triple")
    with Pipeline.connect(endpoints) as pipeline:
        before = pipeline.stats()
        pipeline.open(11)
        try:
            pipeline.capture(11, 0, PROMPT[:6], LAYER_IDS)
        finally:
            pipeline.close(11)
        after = pipeline.stats()
    captures = [a["captures"] - b["captures"] for a, b in zip(after, before)]
    forwards = [a["forwards"] - b["forwards"] for a, b in zip(after, before)]
    assert captures == [1, 1, 0] and forwards == [1, 1, 1]  # layers 1 and 3 live on 0:2 and 2:4


def test_feature_rows_interleave_layers_in_target_order():
    rows = CapturedRows([3, 1])
    layer = {i: WireTensor.from_torch(torch.arange(8, dtype=torch.float32).view(4, 2) + 100 * i) for i in (1, 3)}
    rows.record(10, layer)  # positions 10..13
    rows.record(12, {i: WireTensor.from_torch(t.to_torch()[:1] + 1000) for i, t in layer.items()})  # 12, 13 rolled back
    features = rows.take(10, 13).to_torch()
    assert features.shape == (3, 4)
    assert features.tolist() == [[300, 301, 100, 101], [302, 303, 102, 103], [1300, 1301, 1100, 1101]]
    with pytest.raises(ValueError, match="never captured"):
        rows.take(12, 14)


# ---- speculative decoding ---------------------------------------------------------------------


# (shard set, rollback mode): tcp and ipc, drafter alone and beside layers, a shard without storage in replay.
MATRIX = [("pair", "checkpoint"), ("pair", "replay"), ("triple", "replay-ssm"), ("triple", "replay"), ("bare", "replay")]


class Recording:
    """A drafter as it is, noting the committed length (len(history) - 1) of each proposal it makes."""

    def __init__(self, drafter):
        self.drafter, self.name, self.committed = drafter, drafter.name, []

    def propose(self, history, n):
        if n:
            self.committed.append(len(history) - 1)
        return self.drafter.propose(history, n)


@pytest.mark.parametrize("name,mode", MATRIX, ids=[f"{n}-{m}" for n, m in MATRIX])
def test_dflash_equals_greedy(daemons, greedy, name, mode):
    endpoints, draft_endpoint = pipeline_endpoints(daemons, name)
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as draft_client:
        pipeline.check_speculation(mode, BLOCK)
        drafter = DFlashDrafterClient(draft_client, pipeline)
        assert drafter.shares_pipeline_daemon == (name == "triple")
        recording = Recording(drafter)
        before = draft_client.stats()["drafter"]
        result = speculative_decode(drafter.target, 20, PROMPT, recording, block_size=BLOCK, rollback=mode,
                                    max_new_tokens=NEW_TOKENS)
        after = draft_client.stats()["drafter"]
        stats = pipeline.stats()
    assert result.tokens == greedy
    assert result.drafted > 0 and result.rollbacks_fallback == 0
    assert after["proposals"] - before["proposals"] >= len(recording.committed) == result.steps - 1
    # Only committed rows reach the drafter, each once: by the last proposal, the committed length.
    assert after["context_rows_added"] - before["context_rows_added"] == recording.committed[-1]
    assert after["crops"] == before["crops"] and "20" not in after["context_rows"]
    assert all(shard["open_sequences"] == 0 for shard in stats)


def test_captures_work_on_a_shard_without_rollback_storage(daemons, greedy):
    endpoints, draft_endpoint = pipeline_endpoints(daemons, "bare")
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as draft_client:
        assert pipeline.shards[1].max_verify_tokens == 0
        with pytest.raises(PipelineError, match="--max-verify-tokens 0"):
            pipeline.check_speculation("checkpoint", BLOCK)
        before = pipeline.stats()[1]
        drafter = DFlashDrafterClient(draft_client, pipeline)
        result = speculative_decode(drafter.target, 21, PROMPT, drafter, block_size=BLOCK, rollback="replay",
                                    max_new_tokens=NEW_TOKENS)
        after = pipeline.stats()[1]
    assert result.tokens == greedy and result.replays > 0
    # CAPTURE and ROLLBACK are separate: the storage-less shard captured every forward and wrote no checkpoint.
    assert after["captures"] - before["captures"] == after["forwards"] - before["forwards"] > result.steps
    assert after["checkpoint_writes"] == 0 and after["recurrence_log_tokens"] == 0 and after["checkpointed_steps"] == 0
    assert after["rollbacks"] == {} and after["restores"] - before["restores"] == result.replays


class OracleMix:
    """The dflash drafter (so its daemon sees every step) with a seeded number of its drafts
    replaced by the greedy truth, so steps accept 0 .. n drafts; checks after every proposal that
    the drafter daemon's context holds exactly the committed length."""

    name = "dflash+oracle"

    def __init__(self, drafter: DFlashDrafterClient, stats: ShardClient, truth: list[int], seq: int):
        self.drafter, self.stats, self.truth, self.seq = drafter, stats, truth, seq
        self.rng = random.Random(5)
        self.checked = 0

    def propose(self, history: list[int], n: int) -> list[int]:
        drafts = self.drafter.propose(history, n)
        if n:
            context = self.stats.stats()["drafter"]["context_rows"][str(self.seq)]
            assert context == len(history) - 1, f"drafter context {context}, committed length {len(history) - 1}"
            self.checked += 1
        generated = len(history) - len(PROMPT)
        right = self.rng.randint(0, n)
        return self.truth[generated:generated + right] + drafts[right:]


@pytest.mark.parametrize("name,mode", [("pair", "checkpoint"), ("triple", "replay")])
def test_drafter_context_follows_partial_accepts(daemons, local, name, mode):
    truth = greedy_decode(local, 2, PROMPT, 3 * NEW_TOKENS).tokens
    endpoints, draft_endpoint = pipeline_endpoints(daemons, name)
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as draft_client:
        dflash = DFlashDrafterClient(draft_client, pipeline)
        # STATS lists only the asking client's sequence ids: ask over the connection that drafts
        mix = OracleMix(dflash, dflash.client, truth + [0] * BLOCK, seq=30)
        assert isinstance(mix, Drafter)
        result = speculative_decode(dflash.target, 30, PROMPT, mix, block_size=BLOCK, rollback=mode,
                                    max_new_tokens=3 * NEW_TOKENS)
    assert result.tokens == truth
    kept = [commit for commit in result.commits if 1 < commit < BLOCK]
    assert len(kept) > 5 and mix.checked >= result.steps - 1  # many partial accepts, each checked


class FailingRollback:
    """Every third fast rollback fails, so the loop re-fills the sequence: CLOSE, OPEN, forward the history."""

    def __init__(self, target):
        self.target, self.rollbacks = target, 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def rollback(self, seq, keep):
        self.rollbacks += 1
        if self.rollbacks % 3 == 0:
            raise RollbackFailed("injected")
        self.target.rollback(seq, keep)


def test_refill_rebuilds_the_drafter_context(daemons, greedy):
    endpoints, draft_endpoint = pipeline_endpoints(daemons, "triple")
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as draft_client:
        drafter = DFlashDrafterClient(draft_client, pipeline)
        before = draft_client.stats()["drafter"]
        result = speculative_decode(FailingRollback(drafter.target), 40, PROMPT, drafter, block_size=BLOCK,
                                    rollback="replay-ssm", max_new_tokens=NEW_TOKENS)
        after = draft_client.stats()["drafter"]
    assert result.tokens == greedy and result.rollbacks_fallback > 2
    # After each re-fill the drafter starts over: the whole committed history again (in 8-row PROPOSEs).
    assert after["context_rows_added"] - before["context_rows_added"] > len(PROMPT) * (1 + result.rollbacks_fallback)


def test_drafts_equal_the_in_process_drafter_on_single_process_features(daemons, local):
    endpoints, draft_endpoint = pipeline_endpoints(daemons, "pair")
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as draft_client:
        drafter = DFlashDrafterClient(draft_client, pipeline)
        drafter.target.open(50)
        try:
            first = drafter.target.forward(50, 0, PROMPT)[-1]
            drafts = drafter.propose(PROMPT + [first], BLOCK - 1)
        finally:
            drafter.target.close(50)
    local.open(50)
    try:
        _, captured = local.capture(50, 0, PROMPT, LAYER_IDS)
    finally:
        local.close(50)
    shard = local.shards[0]
    config = synthetic_draft_config(local.config, num_layers=2)
    model = DFlashDrafter(config, synthetic_draft_weights(config, 0), target_embed=shard.embed_tokens,
                          target_lm_head=shard.lm_head)
    state = model.new_state(256)
    model.add_context(state, torch.cat([captured[i] for i in config.target_layer_ids], dim=1))
    want, _ = model.propose(state, first, BLOCK)
    assert list(config.target_layer_ids) == LAYER_IDS and drafts == want.tolist()


# ---- the daemon --------------------------------------------------------------------------------


def test_hello_describes_the_drafter(daemons, model_dir):
    with ShardClient(daemons["drafter"][0]) as alone, ShardClient(daemons["triple"][2]) as beside:
        only, both = alone.hello(), beside.hello()
    assert only["layers"] is None and not only["owns_embedding"] and not only["owns_head"]
    assert only["rollback"]["mode"] is None and only["model"]["fingerprint"] == "synthetic:tiny:0:cpu"
    drafter = only["drafter"]
    assert drafter["name"] == "dflash" and drafter["target_layer_ids"] == LAYER_IDS
    assert (drafter["block_size"], drafter["max_draft_tokens"], drafter["mask_token_id"]) == (16, 15, 319)
    assert drafter["feature_size"] == 2 * 64 and drafter["fingerprint"].startswith("synthetic-dflash:")
    assert both["layers"] == [4, 6] and both["owns_head"] and both["rollback"]["mode"] == "replay-ssm"
    assert both["drafter"]["fingerprint"].startswith("sha256:") and both["drafter"]["target_layer_ids"] == LAYER_IDS


def test_a_drafter_daemon_is_no_pipeline_shard(daemons):
    pair, drafter = daemons["pair"], daemons["drafter"][0]
    with pytest.raises(PipelineError, match="not a pipeline shard"):
        Pipeline.connect([*pair, drafter])
    with ShardClient(drafter) as client:
        infos = [ShardInfo(drafter, client.hello())]
    with Pipeline.connect(pair) as pipeline:
        infos += pipeline.shards
    assert [str(s) for s in order_shards(infos)] == [str(s) for s in infos[1:]]  # counted for no layers
    with pytest.raises(PipelineError, match="no shard owns target layers"):
        order_shards(infos[:1])
    result = CliRunner().invoke(cli, ["status", "--shards", ",".join([*pair, drafter]), "--json"])
    assert result.exit_code == 0, result.output
    assert '"ok": true' in result.output and "1 drafter-only daemon" in result.output


def propose(client, seq, pos, n, *, width=128, dtype=torch.float32, last_token=7, block_size=4, seed=0):
    features = None
    if n is not None:
        rows = torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(dtype)
        features = WireTensor.from_torch(rows)
    return client.propose(seq, pos, last_token, block_size, features)


def error_code(call):
    with pytest.raises(ShardError) as error:
        call()
    return error.value.code


def test_propose_rejections_change_nothing(daemons):
    with ShardClient(daemons["bare"][0]) as bare:
        bare.open(60)
        try:
            assert error_code(lambda: propose(bare, 60, 0, None)) is ErrorCode.NO_DRAFTER
        finally:
            bare.close(60)
    with ShardClient(daemons["drafter"][0]) as client:
        assert error_code(lambda: propose(client, 61, 0, None)) is ErrorCode.NO_SUCH_SEQUENCE
        client.open(61)
        try:
            assert propose(client, 61, 3, 3)["context_length"] == 3
            cases = {
                "wrong width": (lambda: propose(client, 61, 5, 2, width=64), ErrorCode.BAD_REQUEST),
                "wrong dtype": (lambda: propose(client, 61, 5, 2, dtype=torch.float16), ErrorCode.BAD_REQUEST),
                "block too large": (lambda: propose(client, 61, 5, 2, block_size=16), ErrorCode.BAD_REQUEST),
                "token outside vocabulary": (lambda: propose(client, 61, 5, 2, last_token=320), ErrorCode.BAD_REQUEST),
                "rows before position 0": (lambda: propose(client, 61, 1, 2), ErrorCode.BAD_REQUEST),
                "rows missing": (lambda: propose(client, 61, 6, 2), ErrorCode.POSITION_MISMATCH),
                "non-finite features": (lambda: client.propose(61, 5, 7, 4, WireTensor.from_torch(
                    torch.tensor([[0.5] * 127 + [float("nan")]] * 2))), ErrorCode.BAD_REQUEST),
            }
            for what, (call, code) in cases.items():
                assert error_code(call) is code, what
                assert client.stats()["drafter"]["context_rows"]["61"] == 3, what
            with ShardClient(daemons["drafter"][0]) as other:
                assert error_code(lambda: other.forward(61, 3, tokens=[1])) is ErrorCode.BAD_REQUEST  # no layers here
            assert propose(client, 61, 5, 2, seed=1)["context_length"] == 5
        finally:
            client.close(61)


def test_propose_crops_rows_of_rolled_back_tokens(daemons):
    with ShardClient(daemons["drafter"][0]) as client:
        before = client.stats()["drafter"]
        client.open(62)
        client.open(63)
        try:
            propose(client, 62, 6, 6, seed=2)  # six rows, of which the last three get rolled back
            cropped = propose(client, 62, 4, 1, seed=3, block_size=8)  # crops to 3, adds one row
            propose(client, 63, 3, 3, seed=2)  # the same rows 0..2 straight away
            fresh = propose(client, 63, 4, 1, seed=3, block_size=8)
            without_rows = propose(client, 62, 2, None)  # no rows: a crop to the committed length alone
        finally:
            client.close(62)
            client.close(63)
        after = client.stats()["drafter"]
    assert cropped["context_length"] == 4 and cropped["tokens"] == fresh["tokens"] and len(fresh["tokens"]) == 8
    assert without_rows["context_length"] == 2
    assert (after["crops"] - before["crops"], after["rows_cropped"] - before["rows_cropped"]) == (2, 5)


def test_loader_reads_only_the_embedding_and_head_for_a_drafter(model_dir):
    config = ModelSource(model_dir=str(model_dir)).config()
    loaded = load_tensors(model_dir, embedding_and_head_shapes(config))
    assert sorted(loaded.keys_read) == ["lm_head.weight", "model.language_model.embed_tokens.weight"]
    source = ModelSource(model_dir=str(model_dir))
    alone = build_drafter(source, str(model_dir / "draft"))
    beside = build_drafter(source, str(model_dir / "draft"), shard=build_shard(source, 0, 6))
    assert alone.borrowed_bytes == 2 * 320 * 64 * 4 and beside.borrowed_bytes == 0  # the shard's own tensors, shared
    # The checkpoint make-model wrote is the drafter `--draft synthetic` builds in memory.
    synthetic = build_drafter(ModelSource(synthetic="tiny"), "synthetic")
    assert synthetic.config == alone.config
    assert torch.equal(synthetic.model.fc, alone.model.fc)


# ---- shardctl ----------------------------------------------------------------------------------


def shardctl(*args):
    return CliRunner().invoke(cli, [str(arg) for arg in args])


def test_shardctl_generate_dflash(daemons, model_dir, greedy):
    shards, draft_shard = pipeline_endpoints(daemons, "pair")
    ids = ",".join(map(str, PROMPT))
    common = ("--prompt-ids", ids, "--max-new-tokens", NEW_TOKENS, "--block-size", BLOCK, "--json")
    result = shardctl("generate", "--shards", ",".join(shards), "--drafter", "dflash", "--draft-shard", draft_shard, *common)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["drafter"] == "dflash" and record["tokens"] == greedy and record["steps"] > 1
    # Launched shards come with a drafter daemon: here the one make-model wrote into MODEL/draft.
    result = shardctl("generate", "--model", model_dir, "--split", 2, "--drafter", "dflash", "--rollback", "replay", *common)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == greedy
    usage = [
        ("--shards", ",".join(shards), "--drafter", "dflash"),  # no --draft-shard
        ("--shards", ",".join(shards), "--drafter", "ngram", "--draft-shard", draft_shard),
        ("--shards", ",".join(shards), "--drafter", "dflash", "--draft", "synthetic"),
        ("--shards", ",".join(shards), "--drafter", "dflash", "--draft-shard", shards[0]),  # hosts no drafter
    ]
    for args in usage:
        assert shardctl("generate", *args, *common).exit_code == 2, args
    too_wide = shardctl("generate", "--shards", ",".join(shards), "--drafter", "dflash", "--draft-shard", draft_shard,
                        "--prompt-ids", ids, "--block-size", 17, "--rollback", "replay")
    assert too_wide.exit_code == 2 and "at most 16" in too_wide.output


# ---- sampling -------------------------------------------------------------------------------

def continuation_probs(shard, prompt: list[int], new: int, params) -> dict[tuple[int, ...], float]:
    """The exact distribution plain sampling draws `new` tokens after `prompt` from: each continuation's
    probability is the product of the head shard's per-step distribution (`target_probs`) along its prefixes."""
    from shardd.engine.head.sampling import target_probs

    probs = {(): 1.0}
    for _ in range(new):
        grown = {}
        for prefix, p in probs.items():
            state = shard.new_state(64)
            try:
                logits = shard.forward(state, 0, tokens=prompt + list(prefix)).logits[-1]
            finally:
                shard.release_state(state)
            step = target_probs(logits, params)
            for token in step.nonzero().flatten().tolist():
                grown[prefix + (token,)] = p * float(step[token])
        probs = grown
    return probs


def test_sampling_with_dflash_drafts_keeps_the_distribution(daemons, local):
    """Speculative rejection sampling with the dflash drafter's drafts: the sampled continuations follow the
    distribution of plain sampling (computed exactly from the one-process model's logits and the head shard's
    `target_probs`), by chi-square. 400 samples against the exact distribution test at least the power of the
    two-sample test this replaced (1200 plain samples against 500 speculative ones: 353 effective)."""
    from collections import Counter

    from coordinator.sampling import Sampling
    from shardd.engine.head.sampling import SamplingParams
    from tests.support.stats import chi2_against, chi2_critical

    prompt, new, samples = PROMPT[:12], 3, 400
    exact = continuation_probs(local.shards[0], prompt, new, SamplingParams(1.0, top_k=2))
    outcomes = list(exact)
    assert len(outcomes) == 2**new and abs(sum(exact.values()) - 1) < 1e-5
    endpoints, draft_endpoint = pipeline_endpoints(daemons, "pair")
    drafted = Counter()
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as client:
        drafter = DFlashDrafterClient(client, pipeline)
        for s in range(samples):
            result = speculative_decode(drafter.target, 40, prompt, drafter, block_size=4, rollback="checkpoint",
                                        max_new_tokens=new, sampling=Sampling(1.0, top_k=2, seed=10_000 + s))
            tokens = tuple(result.tokens)
            drafted[outcomes.index(tokens) if tokens in exact else len(outcomes)] += 1  # outside: chi2_against fails
        assert result.drafted > 0
    stat, df = chi2_against(drafted, torch.tensor([exact[o] for o in outcomes]), samples)
    assert df >= 2 and stat < chi2_critical(df), (stat, df, exact, drafted)


@pytest.mark.parametrize("name,mode", [("pair", "checkpoint"), ("pair", "replay"), ("triple", "replay-ssm")])
def test_dflash_requests_share_the_schedulers_steps(daemons, greedy, name, mode):
    """The scheduler runs DFlash requests in its steps beside greedy and n-gram ones: each drafter instance
    (`fresh`) holds its own sequence's features, every stream equals its request alone, and the streams
    shared steps (fewer steps than their forwards)."""
    from coordinator.drafting.drafters import NgramDrafter
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import Scheduler

    endpoints, draft_endpoint = pipeline_endpoints(daemons, name)
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as draft_client:
        first = DFlashDrafterClient(draft_client, pipeline)
        drafters = [first, first.fresh(), first.fresh(), NgramDrafter(), None]
        requests = [Request(PROMPT, NEW_TOKENS, drafter=drafter, block_size=BLOCK) for drafter in drafters]
        scheduler = Scheduler(pipeline, max_sequences=len(requests), rollback=mode)
        results = [request.outcome() for request in scheduler.run_all(requests)]
        stats = pipeline.stats()
    assert [result.tokens for result in results] == [greedy] * len(requests)
    assert all(result.drafted > 0 for result in results[:4])
    assert scheduler.steps < sum(result.steps + 1 for result in results[:3])
    assert len({id(drafter.target) for drafter in drafters[:3]}) == 3
    assert all(shard["open_sequences"] == 0 for shard in stats)


def test_shardctl_generate_dflash_streams_together(daemons, greedy):
    shards, draft_shard = pipeline_endpoints(daemons, "pair")
    result = shardctl("generate", "--shards", ",".join(shards), "--drafter", "dflash", "--draft-shard", draft_shard,
                      "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", NEW_TOKENS,
                      "--block-size", BLOCK, "--concurrency", 3, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == greedy


def test_the_serve_engine_runs_dflash_requests_in_its_scheduler(daemons, greedy):
    """`shardctl serve --drafter dflash` serves through the one scheduler, as every drafter: two requests at once,
    each streamed as deltas, each the greedy continuation, in shared steps."""
    import asyncio

    from coordinator.sampling import Sampling
    from coordinator.serve.engine import Engine, EngineConfig, GenerateParams
    from coordinator.tokenizer import ByteTokenizer

    endpoints, draft_endpoint = pipeline_endpoints(daemons, "pair")
    engine = Engine(endpoints, ByteTokenizer(), EngineConfig(model_name="m", drafter="dflash",
                                                              draft_endpoint=draft_endpoint, block_size=BLOCK))
    params = GenerateParams(PROMPT, NEW_TOKENS, Sampling(), ignore_eos=True)

    async def stream():
        deltas = [delta async for delta in engine.generate(params)]
        return deltas[-1].result, sum(delta.result is None for delta in deltas)

    async def run():
        return await asyncio.gather(stream(), stream())

    try:
        outcomes = asyncio.run(run())
        for result, text_deltas in outcomes:
            assert result.tokens == greedy and text_deltas >= 1 and result.drafted > 0
        assert engine.scheduler.steps < sum(result.steps + 1 for result, _ in outcomes)
    finally:
        engine.close()


# ---- DFlash streams in the scheduler's batches ------------------------------------------------------------------

TEXTS = [PROMPT, list(b"1, 2, 3, 5, 8, 13, 21, 34"), list(b"abcabcabcabcabc"), list(b"hello hello hello")]
SEEDED = Sampling(temperature=0.9, top_p=0.95, seed=7)
# The streams of a run at concurrency N are the first N: (drafter, sampling), stream i prompting TEXTS[i % 4].
STREAMS = [("dflash", None), ("greedy", None), ("dflash", SEEDED), ("ngram", None), ("dflash", None),
           ("greedy", SEEDED), ("dflash", None), ("ngram", SEEDED)]
# (shards, rollback mode): the drafter on a daemon of its own (PROPOSE) or beside the last shard (the next block in
# the verify reply, with the first shard's layer carried along, or every layer on the head shard and the rows going
# from shard to shard), in each rollback mode.
PLACEMENTS = [("pair", "checkpoint"), ("beside", "checkpoint"), ("head-own", "replay-ssm"), ("head", "replay-ssm"),
              ("pair", "replay"), ("beside", "replay")]


@pytest.fixture(scope="module")
def greedy_texts(local):
    return [greedy_decode(local, 1, text, NEW_TOKENS).tokens for text in TEXTS]


def stream_drafter(kind: str, dflash: DFlashDrafterClient):
    return {"dflash": dflash.fresh, "ngram": NgramDrafter, "greedy": lambda: None}[kind]()


def each_alone(pipeline, dflash, mode, greedy_texts) -> list[list[int]]:
    """Each stream's tokens decoded alone: greedy ones are greedy decoding; sampled ones go through the reference
    loops with the same drafter."""
    out = []
    for index, (kind, sampling) in enumerate(STREAMS):
        text = TEXTS[index % len(TEXTS)]
        if sampling is None:
            out.append(greedy_texts[index % len(TEXTS)])
        elif kind == "greedy":
            out.append(greedy_decode(pipeline, 300 + index, text, NEW_TOKENS, sampling=sampling).tokens)
        else:
            drafter = stream_drafter(kind, dflash)
            target = drafter.target if kind == "dflash" else pipeline
            out.append(speculative_decode(target, 300 + index, text, drafter, block_size=BLOCK, rollback=mode,
                                          max_new_tokens=NEW_TOKENS, sampling=sampling).tokens)
    return out


def recording_batches(pipeline) -> list:
    """Every `forward_batch` call of `pipeline` from now on, as its list of items."""
    calls, forward_batch = [], pipeline.forward_batch

    def record(items):
        calls.append(list(items))
        return forward_batch(items)

    pipeline.forward_batch = record
    return calls


@pytest.mark.parametrize("name,mode", PLACEMENTS, ids=[f"{n}-{m}" for n, m in PLACEMENTS])
def test_every_dflash_stream_equals_its_request_alone_at_concurrency_1_3_8(daemons, greedy_texts, name, mode):
    """DFlash streams beside greedy and n-gram ones, greedy and seeded: each stream's tokens equal its request
    alone (greedy ones: greedy decoding); each DFlash forward is a capture item of the step's one batch, beside the
    others'; with the drafter beside the last shard the verify replies bring the next blocks (not in replay, whose
    plain forwards leave nothing pending to propose after)."""
    endpoints, draft_endpoint = pipeline_endpoints(daemons, name)
    in_reply = name in ("beside", "head") and mode != "replay"
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as draft_client:
        pipeline.check_speculation(mode, BLOCK)
        dflash = DFlashDrafterClient(draft_client, pipeline)
        assert dflash.proposes_in_reply == (name in ("beside", "head"))
        expected = each_alone(pipeline, dflash, mode, greedy_texts)
        calls = recording_batches(pipeline)
        sent_before, steps = pipeline.clients[0].stats()["rows"]["sent"], 0
        for concurrency in (1, 3, 8):
            calls.clear()
            streams = STREAMS[:concurrency]
            requests = [Request(TEXTS[index % len(TEXTS)], NEW_TOKENS, sampling=sampling, block_size=BLOCK,
                                drafter=stream_drafter(kind, dflash)) for index, (kind, sampling) in enumerate(streams)]
            scheduler = Scheduler(pipeline, max_sequences=concurrency, rollback=mode, batch_rows=32, prefill_chunk=8)
            results = [request.outcome() for request in scheduler.run_all(requests)]
            assert [result.tokens for result in results] == expected[:concurrency], concurrency
            greedy_dflash = [request for request, (kind, sampling) in zip(requests, streams)
                             if kind == "dflash" and sampling is None]
            assert all(request.result.drafted > 0 for request in greedy_dflash)
            assert (sum(request.drafter.proposals_in_reply for request in greedy_dflash) > 0) == in_reply
            if mode != "replay":  # one forward_batch a step (replay adds the batches of its replays)
                assert len(calls) == scheduler.steps, concurrency
            captures = [sum(item.capture is not None for item in call) for call in calls]
            assert sum(captures) > 0 and all(item.capture is not None for call in calls for item in call
                                              if item.propose is not None)
            if concurrency == 8:  # DFlash forwards went in batches together and beside the plain ones
                assert any(n >= 2 and len(call) > n for n, call in zip(captures, calls))
            steps += len(calls)
        if name == "head":  # nothing to carry: every step's rows went from shard to shard, proposing verifies too
            assert pipeline.clients[0].stats()["rows"]["sent"] - sent_before == steps
        stats = pipeline.stats() + [draft_client.stats()]
    assert all(shard["open_sequences"] == 0 for shard in stats)


def test_a_batch_item_with_a_bad_propose_is_refused_alone_and_changes_nothing(daemons):
    """Verify steps of four DFlash sequences in one batch through the shards whose last hosts the drafter: two whose
    `propose` the head shard cannot honour (more drafts than the drafter makes; a drafter context short of the
    verify) are refused alone, and their sequences and drafter contexts are as before (the same verify then gives
    exactly a twin sequence's answer); the other two get exactly what a twin sequence's verify alone gets."""
    endpoints, _ = pipeline_endpoints(daemons, "beside")
    pos = len(PROMPT)
    with Pipeline.connect(endpoints) as pipeline:
        first = DFlashDrafterClient(pipeline.clients[1], pipeline)
        drafters = {seq: first.fresh() for seq in (70, 71, 72, 73, 80, 81)}
        blocks = {}
        for seq, drafter in drafters.items():
            drafter.target.open(seq)
            if seq == 73:  # 73's drafter context stays empty: its prompt goes without `propose`
                prompt = replace(drafter.prepare(BatchForward(seq, 0, PROMPT)), propose=None)
                (answer,) = pipeline.forward_batch([prompt])
                assert isinstance(answer, Captured) and answer.proposal is None
                drafter.collect(prompt, answer)  # its rows wait here for the PROPOSE that brings them
                continue
            last = drafter.target.forward(seq, 0, PROMPT)[-1]
            blocks[seq] = [last] + drafter.propose(PROMPT + [last], BLOCK - 1)
        blocks[73] = blocks[70]

        def verify(seq, **fields):
            return replace(drafters[seq].prepare(BatchForward(seq, pos, blocks[seq], checkpoint=True)), **fields)

        def contexts():
            return {seq: first.client.stats()["drafter"]["context_rows"][str(seq)] for seq in drafters}

        try:
            before = contexts()
            assert before == {**{seq: pos for seq in drafters}, 73: 0}
            items = [verify(70), verify(71, propose=99), verify(72), verify(73, propose=BLOCK - 1)]
            results = pipeline.forward_batch(items)
            twins = [pipeline.forward_batch([verify(80)])[0], pipeline.forward_batch([verify(81)])[0]]
            for got, twin in zip([results[0], results[2]], twins):
                assert isinstance(got, Captured) and got.proposal is not None
                assert (got.ids, got.proposal) == (twin.ids, twin.proposal)
                assert {layer: bytes(rows.data) for layer, rows in got.outputs.items()} == {
                    layer: bytes(rows.data) for layer, rows in twin.outputs.items()}
            assert isinstance(results[1], ShardError) and results[1].code is ErrorCode.BAD_REQUEST
            assert "propose 99 exceeds" in str(results[1])
            assert isinstance(results[3], ShardError) and results[3].code is ErrorCode.POSITION_MISMATCH
            assert contexts() == {**before, 70: pos + 1, 72: pos + 1, 80: pos + 1, 81: pos + 1}
            # the refused ones are where they were: the same verify now answers as the twins' did
            retried = pipeline.forward_batch([verify(71)])[0]
            assert (retried.ids, retried.proposal) == (twins[0].ids, twins[0].proposal)
            blocks[73] = [blocks[70][0]] + drafters[73].propose(PROMPT + [blocks[70][0]], BLOCK - 1)
            retried = pipeline.forward_batch([verify(73)])[0]
            assert (retried.ids, retried.proposal) == (twins[0].ids, twins[0].proposal)
        finally:
            for seq, drafter in drafters.items():
                drafter.target.close(seq)


class FailingRollbacks:
    """The pipeline, whose batched rollbacks report every third rollback of `seqs` failed (the shards did roll
    back): the scheduler re-fills that sequence."""

    def __init__(self, pipeline, seqs):
        self.pipeline, self.seqs, self.rollbacks, self.failed = pipeline, seqs, 0, 0

    def __getattr__(self, name):
        return getattr(self.pipeline, name)

    def rollback_batch(self, items):
        self.pipeline.rollback_batch(items)
        failures = {}
        for seq, _ in items:
            if seq in self.seqs():
                self.rollbacks += 1
                if self.rollbacks % 3 == 0:
                    failures[seq] = RollbackFailed("injected")
        self.failed += len(failures)
        return failures


@pytest.mark.parametrize("name", ["pair", "beside"])
def test_a_refill_in_the_scheduler_rebuilds_the_drafter_context(daemons, greedy, name):
    """DFlash streams whose rollbacks fail are re-filled inside the scheduler's step through their drafter's target:
    the re-fill captures again, the drafter's context is built again from the whole history, the output stays
    greedy."""
    endpoints, draft_endpoint = pipeline_endpoints(daemons, name)
    with Pipeline.connect(endpoints) as pipeline, ShardClient(draft_endpoint) as draft_client:
        first = DFlashDrafterClient(draft_client, pipeline)
        requests = [Request(PROMPT, NEW_TOKENS, drafter=first, block_size=BLOCK),
                    Request(PROMPT, NEW_TOKENS, drafter=first.fresh(), block_size=BLOCK), Request(PROMPT, NEW_TOKENS)]
        target = FailingRollbacks(pipeline, lambda: {request.seq for request in requests[:2]})
        before = first.client.stats()["drafter"]
        results = decode_all(target, requests, prefill_chunk=8)
        after = first.client.stats()["drafter"]
        stats = pipeline.stats()
    assert [result.tokens for result in results] == [greedy] * 3
    assert sum(result.rollbacks_fallback for result in results[:2]) == target.failed >= 2
    refills = sum(result.rollbacks_fallback for result in results[:2])
    # after each re-fill the drafter's context is built again from the whole committed history
    assert after["context_rows_added"] - before["context_rows_added"] > len(PROMPT) * (2 + refills)
    assert all(shard["open_sequences"] == 0 for shard in stats)


def test_a_moe_target_s_drafter_loads_beside_its_last_shard_and_equals_greedy(tmp_path):
    """A MoE target (`make-model --preset tiny-moe --with-drafter`: the drafter's config in the published
    layout, its target layers read from a sparse model) over two daemons, the drafter loaded from its checkpoint
    beside the last shard: DFlash through the scheduler equals the same model's greedy in every rollback mode."""
    out = tmp_path / "tiny-moe"
    made = CliRunner().invoke(cli, ["make-model", "--preset", "tiny-moe", "--out", str(out), "--with-drafter", "--json"])
    assert made.exit_code == 0, made.output
    greedy = greedy_decode(LocalTarget(ModelSource(model_dir=str(out)), storage=RollbackStorage(None, 0)), 1,
                           PROMPT, 16).tokens
    sets = [ShardSet(("--model", str(out)), [(0, 3), (3, 6)], "tcp", ("--max-verify-tokens", str(BLOCK)),
                     shard_args=((), ("--draft", str(out / "draft"))))]
    with launched_sets(sets, ready_timeout_s=120) as (shards,), \
            Pipeline.connect([shard.endpoint for shard in shards]) as pipeline:
        drafter = DFlashDrafterClient(pipeline.clients[1], pipeline)
        for mode in ("checkpoint", "replay-ssm", "replay"):
            scheduler = Scheduler(pipeline, max_sequences=2, rollback=mode)
            (done,) = scheduler.run_all([Request(PROMPT, 16, drafter=drafter.fresh(), block_size=BLOCK)])
            assert done.outcome().tokens == greedy and done.result.drafted > 0, mode


def test_sampled_dflash_streams_take_their_blocks_from_the_verify_reply(daemons):
    """Seeded sampled DFlash streams with the drafter beside the head: each block after the first comes in the
    verify's reply, and the tokens equal those of the same requests drafted by a PROPOSE every step (the drafts
    are the same, so the sampled tokens are)."""
    endpoints, _ = pipeline_endpoints(daemons, "beside")

    def run(in_reply: bool):
        with Pipeline.connect(endpoints) as pipeline:
            drafter = DFlashDrafterClient(pipeline.clients[-1], pipeline)
            drafter.proposes_in_reply = in_reply
            drafters = [drafter.fresh() for _ in range(3)]
            requests = [Request(PROMPT[:20 + i], 24, sampling=Sampling(0.9, top_k=5, seed=70 + i), drafter=d,
                                block_size=BLOCK) for i, d in enumerate(drafters)]
            done = Scheduler(pipeline, max_sequences=3).run_all(requests)
            return [r.outcome().tokens for r in done], sum(d.proposals_in_reply for d in drafters)

    (in_reply, taken), (each_step, none) = run(True), run(False)
    assert in_reply == each_step and taken > 0 and none == 0


def test_a_prompt_of_one_request_brings_the_first_block_in_its_reply(daemons, greedy):
    """With the drafter beside the head, a prompt chunk that fits one request joins the drafter's context in its own
    CAPTURE (its features never come back to be sent in PROPOSE): DFlash streams send no PROPOSE at all, equal
    greedy, and draft what the same streams fed by PROPOSE draft."""
    endpoints, _ = pipeline_endpoints(daemons, "beside")

    def run(in_reply: bool, chunk: int):
        with Pipeline.connect(endpoints) as pipeline:
            drafter = DFlashDrafterClient(pipeline.clients[-1], pipeline)
            drafter.proposes_in_reply = in_reply
            before = pipeline.clients[-1].stats()["requests"].get("PROPOSE", 0)
            requests = [Request(PROMPT[:40 + i], NEW_TOKENS, drafter=drafter.fresh(), block_size=BLOCK)
                        for i in range(2)]
            done = Scheduler(pipeline, max_sequences=2, prefill_chunk=chunk).run_all(requests)
            proposes = pipeline.clients[-1].stats()["requests"].get("PROPOSE", 0) - before
            return [request.outcome() for request in done], proposes

    fed, proposes = run(False, 64)
    assert proposes > 0
    for chunk in (64, 16):  # the prompt in one chunk, and in several (each joins, the last one proposes)
        joined, none = run(True, chunk)
        assert none == 0, chunk
        assert [r.tokens for r in joined] == [r.tokens for r in fed]
        assert [(r.drafted, r.accepted) for r in joined] == [(r.drafted, r.accepted) for r in fed], chunk


# Injected into a daemon's interpreter at startup (a `sitecustomize` on its PYTHONPATH): every third batch of
# proposals the hosted drafter drafts raises, as a drafter that fails mid-step would.
FAILING_DRAFTER = '''
from shardd.draft import model

_propose_batch, _calls = model.DFlashDrafter.propose_batch, [0]


def propose_batch(self, items):
    _calls[0] += 1
    if _calls[0] % 3 == 0:
        raise RuntimeError("injected drafter fault")
    return _propose_batch(self, items)


model.DFlashDrafter.propose_batch = propose_batch
'''


@pytest.mark.parametrize("direct", [True, False], ids=["shard-to-shard", "through-coordinator"])
def test_features_stay_on_the_shards_unless_the_proposal_fails(tmp_path, monkeypatch, greedy, direct):
    """With the drafter beside the head (layer 1 on the first shard, layer 3 on the head), a verify whose reply
    brings its proposal answers no `layer.<id>` frames: its rows joined the drafter context on the head, and the
    first shard's went on with the rows (shard to shard) or to the client for the head's `carried`. A head whose
    drafter fails every third batch answers `proposal.error` with every drafter layer's frames, the client brings
    those rows in PROPOSE, and the streams still equal greedy."""
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(FAILING_DRAFTER)
    shards = ShardSet(TINY, [(0, 3), (3, 6)], "ipc", ("--rollback-mode", "checkpoint", "--max-verify-tokens",
                                                      str(BLOCK)), direct_rows=direct)
    monkeypatch.setenv("PYTHONPATH", str(fault), prepend=":")  # the daemons' interpreters only: undone below
    with launched_sets([replace(shards, shard_args=((), ("--draft", "synthetic")))], ready_timeout_s=120) as started:
        monkeypatch.undo()
        endpoints = [shard.endpoint for shard in started[0]]
        with Pipeline.connect(endpoints) as pipeline:
            dflash = DFlashDrafterClient(pipeline.clients[-1], pipeline)
            assert dflash.proposes_in_reply
            replies, forward_batch = [], pipeline.forward_batch

            def recording(items):
                answers = forward_batch(items)
                replies.extend(answer for item, answer in zip(items, answers) if item.propose is not None)
                return answers

            pipeline.forward_batch = recording
            requests = [Request(PROMPT, NEW_TOKENS, drafter=dflash.fresh(), block_size=BLOCK) for _ in range(3)]
            done = Scheduler(pipeline, max_sequences=3, prefill_chunk=64).run_all(requests)
            assert [request.outcome().tokens for request in done] == [greedy] * 3
            drafter = pipeline.clients[-1].stats()["drafter"]
            proposes = pipeline.clients[-1].stats()["requests"].get("PROPOSE", 0)
    drafted = [answer for answer in replies if "error" not in answer.proposal]
    failed = [answer for answer in replies if "error" in answer.proposal]
    assert drafted and failed and drafter["proposal_failures"] >= 1 and proposes >= 1
    assert all(answer.outputs == {} for answer in drafted) if direct else \
        all(sorted(answer.outputs) == [1] for answer in drafted)  # the first shard's, for the head's `carried`
    assert all(sorted(answer.outputs) == LAYER_IDS for answer in failed)


@pytest.mark.gpu
def test_features_ride_the_device_ring_with_the_rows():
    """Two fast bf16 daemons on the GPU, the drafter beside the head: the first shard's captured layer goes on with
    its rows through the head's device ring (ROWS `slot_carried`, STATS `rows.carried_on_device`), and three DFlash
    streams give greedy's tokens, and those of the same daemons whose head lends no ring (its rows and carried rows
    through the host)."""
    fast = ("--engine", "fast", "--device", "cuda:0", "--dtype", "bfloat16", "--rollback-mode", "checkpoint",
            "--max-verify-tokens", str(BLOCK))
    sets = {name: ShardSet(TINY, [(0, 3), (3, 6)], "ipc", fast, shard_args=(
        (), ("--draft", "synthetic", *(["--max-gpu-memory", "0.25"] if name == "host" else []))))
        for name in ("ring", "host")}
    prompts = [PROMPT[:40 + k] for k in range(3)]
    tokens, stats = {}, {}
    with launched_sets(list(sets.values()), ready_timeout_s=180) as started:
        for name, shards in zip(sets, started):
            with Pipeline.connect([shard.endpoint for shard in shards]) as pipeline:
                greedy = [greedy_decode(pipeline, 1 + k, prompt, NEW_TOKENS).tokens for k, prompt in enumerate(prompts)]
                dflash = DFlashDrafterClient(pipeline.clients[-1], pipeline)
                requests = [Request(prompt, NEW_TOKENS, drafter=dflash.fresh(), block_size=BLOCK) for prompt in prompts]
                done = Scheduler(pipeline, max_sequences=3, prefill_chunk=64).run_all(requests)
                tokens[name] = [request.outcome().tokens for request in done]
                assert tokens[name] == greedy, name
                stats[name] = pipeline.clients[-1].stats()["rows"]
    assert tokens["ring"] == tokens["host"]
    assert stats["ring"]["carried_on_device"] > 0 and stats["ring"]["on_device"] == stats["ring"]["received"]
    assert stats["host"]["carried_on_device"] == 0 and stats["host"]["on_device"] == 0
