"""The pipeline over real `shardd serve` daemons on real sockets, against one process.

Every shard count (1, 2, 3) runs over tcp and over ipc, half of the sets with the
daemons' `checkpoint` rollback and half with `replay-ssm`; each set decodes with both
drafters in its own mode and in `replay`. The tokens must equal plain greedy decoding
of the same model in one process (`LocalTarget`). All daemons start once, together.
"""

from __future__ import annotations

import threading

import pytest
import torch

from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafting.drafters import make_drafter
from coordinator.launch import ShardSet, launched_sets
from coordinator.relay.client import ShardClient, ShardError, ShardTimeout
from coordinator.relay.pipeline import CheckpointUnavailable, Pipeline, SequenceInconsistent
from coordinator.relay.shards import PipelineError, ShardInfo, order_shards
from coordinator.relay.target import RollbackFailed
from protocol import ErrorCode, RemoteError
from protocol.layout import even_split
from shardd.weights.loading import ModelSource
from shardd.local import LocalTarget
from shardd.engine.reference.rollback import RollbackStorage

TINY = ("--synthetic", "tiny")
NEW_TOKENS = 40
BLOCK = 8
PROMPTS = {
    "fox": list(b"The quick brown fox jumps over the lazy dog; the quick brown fox"),
    "numbers": list(b"1, 2, 3, 5, 8, 13, 21"),
}
# (name, shards, transport, daemon rollback mode): every count on both transports and in both daemon modes.
MATRIX = [
    ("1-tcp-checkpoint", 1, "tcp", "checkpoint"),
    ("2-ipc-checkpoint", 2, "ipc", "checkpoint"),
    ("3-tcp-checkpoint", 3, "tcp", "checkpoint"),
    ("1-ipc-replay-ssm", 1, "ipc", "replay-ssm"),
    ("2-tcp-replay-ssm", 2, "tcp", "replay-ssm"),
    ("3-ipc-replay-ssm", 3, "ipc", "replay-ssm"),
]
# One set takes at most BLOCK tokens per request: its prefill goes through the three shards in pipelined chunks.
SMALL_REQUESTS = {"3-ipc-replay-ssm": ("--max-tokens-per-request", str(BLOCK))}
SETS = {
    **{name: ShardSet(TINY, even_split(6, n), transport, ("--rollback-mode", mode, *SMALL_REQUESTS.get(name, ())))
       for name, n, transport, mode in MATRIX},
    "seed1-tail": ShardSet(("--synthetic", "tiny:1"), [(3, 6)]),  # other weights
    # No rollback storage, and small requests so that prefill is chunked.
    "bare-tail": ShardSet(TINY, [(3, 6)], "tcp", ("--max-verify-tokens", "0", "--max-tokens-per-request", "8")),
}


@pytest.fixture(scope="module")
def shard_sets():
    with launched_sets(list(SETS.values()), ready_timeout_s=120) as started:
        yield {name: [shard.endpoint for shard in shards] for name, shards in zip(SETS, started)}


@pytest.fixture(scope="module")
def local():
    return LocalTarget(ModelSource(synthetic="tiny"), storage=RollbackStorage(None, 0))


@pytest.fixture(scope="module")
def greedy(local):
    """Plain greedy decoding in one process, per prompt."""
    return {name: greedy_decode(local, 1, prompt, NEW_TOKENS).tokens for name, prompt in PROMPTS.items()}


def drafter_for(name, greedy_tokens, prompt):
    return make_drafter(name, prompt_len=len(prompt), reference=greedy_tokens, block_size=BLOCK, mean_commit=3.0, seed=1)


def test_reference_is_not_degenerate(greedy):
    # A constant output would let a broken rollback pass unnoticed.
    for tokens in greedy.values():
        assert len(tokens) == NEW_TOKENS and len(set(tokens)) > 10


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
@pytest.mark.parametrize("own_mode", [True, False], ids=["daemon-mode", "replay"])
@pytest.mark.parametrize("name,n_shards,transport,daemon_mode", MATRIX, ids=[m[0] for m in MATRIX])
def test_speculative_equals_single_process_greedy(shard_sets, greedy, name, n_shards, transport, daemon_mode, own_mode, drafter):
    mode = daemon_mode if own_mode else "replay"
    prompt = PROMPTS["fox"]
    with Pipeline.connect(shard_sets[name]) as pipeline:
        assert [s.layers for s in pipeline.shards] == [f"{b}:{e}" for b, e in even_split(6, n_shards)]
        assert pipeline.max_tokens_per_request == (BLOCK if name in SMALL_REQUESTS else 4096)
        pipeline.check_speculation(mode, BLOCK)
        before = pipeline.stats()
        result = speculative_decode(
            pipeline, 100, prompt, drafter_for(drafter, greedy["fox"], prompt),
            block_size=BLOCK, rollback=mode, max_new_tokens=NEW_TOKENS,
        )
        after = pipeline.stats()
    assert result.tokens == greedy["fox"]
    assert result.rollbacks_fallback == 0
    if drafter == "oracle":  # the oracle errs on purpose: partial accepts happened
        assert result.rollbacks_fast + result.replays > 0
    # The daemons did the rollbacks themselves, in their configured mode (replay: RESTORE instead).
    for first, last in zip(before, after):
        assert last["open_sequences"] == 0
        rolled = last["rollbacks"].get(daemon_mode, 0) - first["rollbacks"].get(daemon_mode, 0)
        restored = last["restores"] - first["restores"]
        assert (rolled, restored) == ((result.rollbacks_fast, 0) if own_mode else (0, result.replays))


def test_greedy_through_three_shards_equals_single_process(shard_sets, greedy):
    with Pipeline.connect(shard_sets["3-ipc-replay-ssm"]) as pipeline:
        assert greedy_decode(pipeline, 7, PROMPTS["numbers"], NEW_TOKENS).tokens == greedy["numbers"]


def test_two_sequences_at_once_match_each_alone(shard_sets, greedy):
    endpoints = shard_sets["3-tcp-checkpoint"]
    start = threading.Barrier(2)
    results, errors = {}, []

    def decode(name, seq, drafter):
        try:
            prompt = PROMPTS[name]
            with Pipeline.connect(endpoints) as pipeline:  # one Pipeline (sockets) per thread
                start.wait()
                results[name] = speculative_decode(
                    pipeline, seq, prompt, drafter_for(drafter, greedy[name], prompt),
                    block_size=BLOCK, rollback="checkpoint", max_new_tokens=NEW_TOKENS,
                ).tokens
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)

    threads = [
        threading.Thread(target=decode, args=("fox", 201, "oracle")),
        threading.Thread(target=decode, args=("numbers", 202, "ngram")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert results == greedy


# ---- refused shard sets --------------------------------------------------------------------

def test_gap_is_refused_naming_the_shards(shard_sets):
    head, tail = shard_sets["3-tcp-checkpoint"][0], shard_sets["2-ipc-checkpoint"][1]  # 0:2 and 3:6
    with pytest.raises(PipelineError, match="gap") as error:
        Pipeline.connect([head, tail])
    assert head in str(error.value) and tail in str(error.value) and "2:3" in str(error.value)


def test_missing_head_layers_are_refused(shard_sets):
    first = shard_sets["2-tcp-replay-ssm"][0]  # 0:3 alone
    with pytest.raises(PipelineError, match="gap: no shard serves layers 3:6") as error:
        Pipeline.connect([first])
    assert first in str(error.value)


def test_overlap_is_refused_naming_the_shards(shard_sets):
    first = shard_sets["2-tcp-replay-ssm"][0]  # 0:3
    middle, last = shard_sets["3-ipc-replay-ssm"][1:]  # 2:4, 4:6
    with pytest.raises(PipelineError, match="overlap") as error:
        Pipeline.connect([first, middle, last])
    assert first in str(error.value) and middle in str(error.value) and last not in str(error.value)


def test_different_weights_are_refused_naming_the_shards(shard_sets):
    first, other = shard_sets["2-tcp-replay-ssm"][0], shard_sets["seed1-tail"][0]
    with pytest.raises(PipelineError, match="fingerprint") as error:
        Pipeline.connect([first, other])
    assert "synthetic:tiny:0" in str(error.value) and other in str(error.value)


# ---- a shard without rollback storage --------------------------------------------------------

@pytest.fixture()
def mixed(shard_sets):
    """Layers 0:3 with checkpoint storage, 3:6 without (and at most 8 tokens per request)."""
    with Pipeline.connect([shard_sets["2-tcp-replay-ssm"][0], shard_sets["bare-tail"][0]]) as pipeline:
        yield pipeline


def test_checkpoint_modes_are_refused_without_storage(mixed, shard_sets):
    bare = shard_sets["bare-tail"][0]
    for mode in ("checkpoint", "replay-ssm"):
        with pytest.raises(PipelineError, match="--max-verify-tokens 0") as error:
            mixed.check_speculation(mode, BLOCK)
        assert bare in str(error.value) and "--rollback replay" in str(error.value)
    mixed.check_speculation("replay", BLOCK)


def test_checkpointed_forward_is_refused_before_any_shard_changes(mixed, local):
    prompt = PROMPTS["numbers"][:5]
    mixed.open(300)
    try:
        with pytest.raises(CheckpointUnavailable):
            mixed.forward(300, 0, prompt, checkpoint=True)
        # Nothing moved: the same tokens go in at position 0.
        local.open(300)
        assert mixed.forward(300, 0, prompt) == local.forward(300, 0, prompt)
        mixed.rollback(300, 1)  # sent, not waited for: the refusal comes with the next request about 300
        with pytest.raises(RollbackFailed, match="ROLLBACK_UNAVAILABLE|NO_PENDING_STEP"):
            mixed.forward(300, 5, [1])
    finally:
        mixed.close(300)
        local.close(300)


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_replay_works_without_storage(mixed, greedy, drafter):
    prompt = PROMPTS["fox"]  # longer than 8 tokens: prefill goes in chunks
    assert mixed.max_tokens_per_request == 8
    result = speculative_decode(
        mixed, 301, prompt, drafter_for(drafter, greedy["fox"], prompt),
        block_size=BLOCK, rollback="replay", max_new_tokens=NEW_TOKENS,
    )
    assert result.tokens == greedy["fox"]


def test_long_forward_goes_in_chunks_of_the_smallest_limit(mixed, local):
    tokens = PROMPTS["fox"][:20]
    forwards = lambda: [stats["forwards"] for stats in mixed.stats()]  # noqa: E731
    before = forwards()
    mixed.open(302)
    local.open(302)
    try:
        assert mixed.forward(302, 0, tokens) == local.forward(302, 0, tokens)
    finally:
        mixed.close(302)
        local.close(302)
    assert [b - a for a, b in zip(before, forwards())] == [3, 3]  # 8 + 8 + 4 on each shard


def test_prefill_past_the_context_is_refused_before_any_shard_works(mixed):
    assert mixed.max_context == 4096
    forwards = [stats["forwards"] for stats in mixed.stats()]
    mixed.open(303)
    try:
        with pytest.raises(PipelineError, match="exceed the context"):
            mixed.forward(303, 0, [1] * 4097)
    finally:
        mixed.close(303)
    assert [stats["forwards"] for stats in mixed.stats()] == forwards


# ---- failures part-way down the pipeline ----------------------------------------------------

def test_half_done_checkpointed_step_is_taken_back(shard_sets):
    endpoints = shard_sets["2-ipc-checkpoint"]
    prompt = PROMPTS["numbers"]
    with Pipeline.connect(endpoints) as pipeline:
        first, last = pipeline.clients  # a sequence belongs to the connection that opened it
        pipeline.open(400)
        try:
            pipeline.forward(400, 0, prompt)
            last.close(400)  # the head shard loses the sequence (as if restarted)
            last.open(400)
            with pytest.raises(ShardError) as error:
                pipeline.forward(400, len(prompt), [1, 2, 3], checkpoint=True)
            assert error.value.code is ErrorCode.POSITION_MISMATCH and error.value.endpoint == endpoints[1]
            # The first shard took the step back: nothing pending, its length is the prompt's again.
            with pytest.raises(ShardError, match="NO_PENDING_STEP"):
                first.rollback(400, 0)
            assert first.snapshot(400)["length"] == len(prompt)
            # Without a checkpoint the step cannot be taken back: the pipeline says so.
            with pytest.raises(SequenceInconsistent, match="sequence 400 is now inconsistent"):
                pipeline.forward(400, len(prompt), [1, 2, 3])
        finally:
            pipeline.close(400)


def test_close_works_in_any_state(shard_sets):
    endpoints = shard_sets["3-tcp-checkpoint"]
    with Pipeline.connect(endpoints) as pipeline:
        last = pipeline.clients[2]
        pipeline.close(500)  # never opened
        last.open(500)  # open on one shard only
        pipeline.close(500)
        assert [stats["open_sequences"] for stats in pipeline.stats()] == [0, 0, 0]


def test_open_of_an_open_sequence_fails_and_leaves_it_alone(shard_sets):
    with Pipeline.connect(shard_sets["1-tcp-checkpoint"]) as pipeline:
        pipeline.open(501)
        try:
            with pytest.raises(ShardError) as error:
                pipeline.open(501)
            assert error.value.code is ErrorCode.SEQUENCE_EXISTS
            assert pipeline.forward(501, 0, [5, 6]) and pipeline.stats()[0]["open_sequences"] == 1
        finally:
            pipeline.close(501)


# ---- capture and the client --------------------------------------------------------------------

def test_capture_returns_layer_outputs_from_every_shard(shard_sets, local):
    tokens = PROMPTS["numbers"][:6]
    with Pipeline.connect(shard_sets["3-ipc-replay-ssm"]) as pipeline:
        pipeline.open(600)
        local.open(600)
        try:
            ids, captured = pipeline.capture(600, 0, tokens, [1, 4, 5], checkpoint=True)
            want_ids, want = local.capture(600, 0, tokens, [1, 4, 5])
        finally:
            pipeline.close(600)
            local.close(600)
    assert ids == want_ids and sorted(captured) == [1, 4, 5]
    for layer, tensor in captured.items():
        assert tensor.shape == (6, 64) and tensor.dtype == "float32"
        assert torch.allclose(tensor.to_torch(), want[layer], atol=1e-5)


def test_client_errors_are_typed_and_stale_replies_dropped(shard_sets):
    endpoint = shard_sets["1-ipc-replay-ssm"][0]
    with ShardClient(endpoint, timeout_s=30) as client:
        with pytest.raises(ShardError) as error:
            client.rollback(999, 1)
        assert isinstance(error.value, RemoteError) and error.value.code is ErrorCode.NO_SUCH_SEQUENCE
        assert endpoint in str(error.value)
        with pytest.raises(ShardTimeout):
            client.hello(timeout_s=1e-9)  # its reply arrives late ...
        assert "open_sequences" in client.stats()  # ... and is not taken for this one's
        assert client.hello()["layers"] == [0, 6]


def test_client_times_out_without_a_daemon():
    with ShardClient("tcp://127.0.0.1:9", timeout_s=0.2) as client:
        with pytest.raises(ShardTimeout, match="tcp://127.0.0.1:9"):
            client.hello()


def test_mixed_protocol_versions_and_dtypes_are_refused(shard_sets):
    # A daemon of another protocol version would fail the reply codec itself; the HELLO
    # check names the shard. The HELLOs are real ones, one of them edited.
    with Pipeline.connect(shard_sets["2-tcp-replay-ssm"]) as pipeline:
        first, last = (shard.hello for shard in pipeline.shards)
    assert [s.layers for s in order_shards([ShardInfo("b", last), ShardInfo("a", first)])] == ["0:3", "3:6"]
    with pytest.raises(PipelineError, match="b speaks protocol version 2"):
        order_shards([ShardInfo("a", first), ShardInfo("b", {**last, "protocol_version": 2})])
    with pytest.raises(PipelineError, match="dtypes .*float32: a; bfloat16: b"):
        order_shards([ShardInfo("a", first), ShardInfo("b", {**last, "dtype": "bfloat16"})])
