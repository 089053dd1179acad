"""The scheduler (continuous batching): who runs in which step, and that batching never changes a token.

The order tests drive an in-memory target (tests/support/fake_target.py, whose next token depends on the
whole state, so a misplaced row changes the output) and read the batches it was sent. The exactness tests run
real `shardd serve` daemons and the in-process `LocalTarget`: every request of a mixed batch (greedy and
seeded sampling, plain and speculative, checkpoint and replay-ssm) must produce the tokens it produces alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import pytest

from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafting.dflash import FeatureCapture
from coordinator.drafting.drafters import NgramDrafter
from coordinator.launch import ShardSet, launched_sets
from coordinator.relay.pipeline import Captured, Pipeline
from coordinator.relay.target import SequenceLost
from coordinator.sampling import Sampling
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import LoopBatches, Scheduler, decode_all
from protocol.layout import CHECKPOINT, REPLAY, REPLAY_SSM
from tests.support.fake_target import VOCAB, FakeTarget, TargetMisuse

PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21]]


class BatchTarget(FakeTarget):
    """FakeTarget with the batch calls; `steps` holds each batch as (seq, pos, rows) per item."""

    def __init__(self):
        super().__init__()
        self.steps: list[list[tuple[int, int, int]]] = []
        self.lose: set[int] = set()  # sequences to drop at their next forward (a shard restarted)

    def forward_batch(self, items):
        self.steps.append([(item.seq, item.pos, len(item.tokens)) for item in items])
        results = []
        for item in items:
            if item.seq in self.lose:
                self.lose.discard(item.seq)
                del self.states[item.seq]
                results.append(SequenceLost(f"sequence {item.seq}: shard restarted"))
                continue
            results.extend(LoopBatches(self).forward_batch([item]))
        return results

    def rollback_batch(self, items):
        for seq, keep in items:
            self.rollback(seq, keep)

    def close(self, seq):
        if seq in self.states:
            super().close(seq)


def alone(prompt, max_new_tokens, drafter=None, block_size=4):
    target = FakeTarget()
    if drafter is None:
        return greedy_decode(target, 1, prompt, max_new_tokens).tokens
    return speculative_decode(target, 1, prompt, drafter, block_size=block_size, max_new_tokens=max_new_tokens).tokens


def seqs(step):
    return {seq for seq, _, _ in step}


def test_requests_join_and_leave_at_step_boundaries():
    target = BatchTarget()
    scheduler = Scheduler(target, max_sequences=4, batch_rows=16)
    first = scheduler.submit(Request(PROMPTS[0], 6))
    scheduler.step(), scheduler.step()
    second = scheduler.submit(Request(PROMPTS[1], 12, drafter=NgramDrafter(), block_size=4))
    while not (first.done.is_set() and second.done.is_set()):
        scheduler.step()
    joined = next(i for i, step in enumerate(target.steps) if second.seq in seqs(step))
    left = max(i for i, step in enumerate(target.steps) if first.seq in seqs(step))
    assert joined == 2 and first.seq in seqs(target.steps[joined])  # joined a running stream's step
    assert left < len(target.steps) - 1  # the other went on without it
    assert first.seq not in target.states and second.seq not in target.states  # both closed
    assert first.outcome().tokens == alone(PROMPTS[0], 6)
    assert second.outcome().tokens == alone(PROMPTS[1], 12, NgramDrafter())


def test_a_long_prompt_is_prefilled_in_chunks_while_streams_keep_flowing():
    target = BatchTarget()
    scheduler = Scheduler(target, max_sequences=4, batch_rows=6, prefill_chunk=4)
    stream = scheduler.submit(Request(PROMPTS[0], 20))
    scheduler.step()
    long_prompt = [(3 * i) % VOCAB for i in range(1, 30)]  # 29 tokens: 8 chunks
    late = scheduler.submit(Request(long_prompt, 3))
    while not late.done.is_set():
        scheduler.step()
    prefill = [step for step in target.steps if late.seq in seqs(step)][:8]
    chunks = [(pos, rows) for step in prefill for seq, pos, rows in step if seq == late.seq]
    assert chunks == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4), (20, 4), (24, 4), (28, 1)]
    assert all(stream.seq in seqs(step) for step in prefill)  # the running stream had a row in every one
    assert all(sum(rows for _, _, rows in step) <= 6 for step in target.steps)  # the row budget held
    assert late.outcome().tokens == alone(long_prompt, 3)
    while not stream.done.is_set():
        scheduler.step()
    assert stream.outcome().tokens == alone(PROMPTS[0], 20)


def test_prompt_chunks_are_whole_prefill_pieces_of_the_shards():
    """Shards that graph their prefill in pieces of P rows (HELLO `prefill_rows`) get prompt chunks of a multiple
    of P (at least one piece), so no chunk but a prompt's last runs a piece eagerly; without P, half a step."""
    from coordinator.scheduler.scheduler import default_prefill_chunk

    assert default_prefill_chunk(1024, None) == 512 and default_prefill_chunk(1024, 0) == 512
    assert default_prefill_chunk(1024, 512) == 512 and default_prefill_chunk(1024, 192) == 384
    assert default_prefill_chunk(1024, 1024) == 1024  # one piece, though it leaves no room beside it
    assert default_prefill_chunk(1024, 2048) == 512  # a piece larger than a step never runs whole: half a step
    target = BatchTarget()
    target.prefill_rows = 3
    scheduler = Scheduler(target, max_sequences=2, batch_rows=16)
    assert scheduler.prefill_chunk == 6
    long_prompt = [(5 * i) % VOCAB for i in range(1, 15)]  # 14 tokens: 6 + 6 + 2
    request = scheduler.submit(Request(long_prompt, 2))
    while not request.done.is_set():
        scheduler.step()
    chunks = [(pos, rows) for step in target.steps for seq, pos, rows in step if seq == request.seq]
    assert chunks[:3] == [(0, 6), (6, 6), (12, 2)]
    assert request.outcome().tokens == alone(long_prompt, 2)


def test_a_prompt_that_finds_no_room_goes_first_next_step():
    target = BatchTarget()
    scheduler = Scheduler(target, max_sequences=4, batch_rows=8, prefill_chunk=8)
    streams = [scheduler.submit(Request(p, 6, drafter=NgramDrafter(), block_size=4)) for p in PROMPTS[:2]]
    scheduler.step()  # both prompts: 5 + 3 rows
    late = scheduler.submit(Request(PROMPTS[2], 2))
    scheduler.step()  # two verify blocks fill the step: the prompt waits
    scheduler.step()  # the prompt first, then what fits
    assert late.seq not in seqs(target.steps[1]) and target.steps[2][0][0] == late.seq
    while not all(r.done.is_set() for r in [*streams, late]):
        scheduler.step()
    assert [r.outcome().tokens for r in streams] == [alone(p, 6, NgramDrafter()) for p in PROMPTS[:2]]


def test_at_capacity_requests_wait_and_start_in_arrival_order():
    target = BatchTarget()
    scheduler = Scheduler(target, max_sequences=2, batch_rows=16)
    requests = [scheduler.submit(Request(PROMPTS[i % 4], 3 + i)) for i in range(5)]
    opened = []
    while not all(r.done.is_set() for r in requests):
        scheduler.step()
        assert len(target.states) <= 2
        opened.extend(r for r in requests if r.seq is not None and r not in opened)
    assert opened == requests
    assert [r.outcome().tokens for r in requests] == [alone(PROMPTS[i % 4], 3 + i) for i in range(5)]
    admitted = [r.arrived + r.queued_seconds for r in requests]  # time in queue ends at admission, in arrival order
    assert admitted == sorted(admitted)


def test_cancelling_closes_the_sequence_and_frees_its_slot():
    target = BatchTarget()
    scheduler = Scheduler(target, max_sequences=1, batch_rows=16)
    running = scheduler.submit(Request(PROMPTS[0], 50))
    waiting = scheduler.submit(Request(PROMPTS[1], 4))
    queued = scheduler.submit(Request(PROMPTS[2], 4))
    for _ in range(3):
        scheduler.step()
    assert waiting.seq is None
    running.cancel()
    queued.cancel()  # cancelled before it ever ran: never opened
    scheduler.step()
    assert running.done.is_set() and running.seq not in target.states and waiting.seq is not None
    assert running.result.tokens == alone(PROMPTS[0], 50)[:len(running.result.tokens)]
    while not waiting.done.is_set():
        scheduler.step()
    assert queued.done.is_set() and queued.seq is None and queued.result.tokens == []
    assert waiting.outcome().tokens == alone(PROMPTS[1], 4)


def test_one_failing_request_leaves_the_others_unchanged():
    target = BatchTarget()
    scheduler = Scheduler(target, max_sequences=4, batch_rows=32)
    good = [scheduler.submit(Request(p, 10)) for p in PROMPTS[:2]]
    bad = scheduler.submit(Request([1, VOCAB + 5, 2], 10))  # a token the target refuses
    spec = scheduler.submit(Request(PROMPTS[2], 10, drafter=NgramDrafter(), block_size=4))
    lost = scheduler.submit(Request(PROMPTS[3], 10, drafter=NgramDrafter(), block_size=4))
    for _ in range(3):
        scheduler.step()
    target.lose.add(lost.seq)  # its shard restarts: re-filled from its history, the others untouched
    while not all(r.done.is_set() for r in [*good, bad, spec, lost]):
        scheduler.step()
    with pytest.raises(TargetMisuse, match="bad tokens"):
        bad.outcome()
    assert [r.outcome().tokens for r in good] == [alone(p, 10) for p in PROMPTS[:2]]
    assert spec.outcome().tokens == alone(PROMPTS[2], 10, NgramDrafter())
    assert lost.outcome().tokens == alone(PROMPTS[3], 10, NgramDrafter()) and lost.result.recoveries == 1
    assert not target.states


def test_eos_max_tokens_and_the_context_limit_end_each_request_on_its_own():
    target = BatchTarget()
    target.max_context = 12  # the shards' context: prompt and output together
    reference = alone(PROMPTS[0], 6)
    eos = reference[3]
    stopped = Request(PROMPTS[0], 6, eos_ids=[eos])
    limited = Request(PROMPTS[1], 50, drafter=NgramDrafter(), block_size=4)
    budget = Request(PROMPTS[3], 5, drafter=NgramDrafter(), block_size=4)
    nothing = Request(PROMPTS[2], 0)
    Scheduler(target, max_sequences=4, batch_rows=16).run_all([stopped, limited, budget, nothing])
    assert stopped.result.tokens == reference[:reference.index(eos) + 1] and stopped.result.finish_reason == "stop"
    assert limited.result.tokens == alone(PROMPTS[1], 12 - len(PROMPTS[1]))  # its blocks shrank near the limit
    assert limited.result.finish_reason == "length"
    assert budget.result.tokens == alone(PROMPTS[3], 5) and budget.result.finish_reason == "length"
    assert nothing.result.tokens == [] and nothing.seq is None
    assert not target.states


# ---- a drafter that reads the target's features (DFlash's shape) -------------------------------------------


class CapturingTarget(BatchTarget):
    """BatchTarget whose items with `capture` answer a `Captured`: the "features" of layer 0 are the tokens
    forwarded; `rollback_calls` holds each rollback batch's sequences."""

    def __init__(self):
        super().__init__()
        self.rollback_calls: list[list[int]] = []
        self.captures: list[tuple[int, Optional[int]]] = []  # (seq, propose) of each capture item

    def forward_batch(self, items):
        results = super().forward_batch(items)
        for index, item in enumerate(items):
            if item.capture is not None:
                self.captures.append((item.seq, item.propose))
                if not isinstance(results[index], Exception):
                    results[index] = Captured(results[index], {0: list(item.tokens)})
        return results

    def rollback_batch(self, items):
        self.rollback_calls.append([seq for seq, _ in items])
        super().rollback_batch(items)


class FeatureDrafter:
    """A drafter fed as DFlashDrafterClient is: each forward of its sequence captures (`prepare`), the rows come
    from the batch's answers (`collect`), OPEN, CLOSE and re-fills go through its `target`. It drafts as the n-gram
    drafter does, once it has checked that it holds the feature of every committed token."""

    name = "features"
    shares_pipeline_daemon = False  # it drafts here, not on a daemon of the target

    def __init__(self, target):
        self.target = FeatureCapture(target, self)
        self.rows: dict[int, int] = {}
        self.opens = 0

    def opened(self, seq, length=0):
        self.rows, self.opens = {}, self.opens + 1

    def closed(self, seq):
        self.rows = {}

    def prepare(self, forward):
        return dataclasses.replace(forward, capture=[0], propose=2 if forward.checkpoint else None)

    def collect(self, forward, answer):
        for offset, feature in enumerate(answer.outputs[0]):
            self.rows[forward.pos + offset] = feature
        return answer.ids

    def propose(self, history, n):
        committed = len(history) - 1
        assert [self.rows.get(position) for position in range(committed)] == history[:committed]
        return NgramDrafter().propose(history, n)


@pytest.mark.parametrize("rollback", [CHECKPOINT, REPLAY])
def test_a_feature_drafters_rows_are_items_of_the_steps_one_batch(rollback):
    """A DFlash-shaped stream is a batch stream: its forwards are capture items of each step's one forward_batch,
    its rollbacks go in the step's one rollback_batch, its drafter gets the rows of every committed token from
    the answers; after a lost sequence its re-fill captures again (through the drafter's target), and every
    stream equals its request alone. The replay baseline sends no `propose` (the shards hold no pending step)."""
    target = CapturingTarget()
    features = FeatureDrafter(target)
    requests = [Request(PROMPTS[0], 12, drafter=features, block_size=4), Request(PROMPTS[1], 12),
                Request(PROMPTS[2], 12, drafter=NgramDrafter(), block_size=4)]
    scheduler = Scheduler(target, max_sequences=3, batch_rows=16, rollback=rollback)
    for request in requests:
        scheduler.submit(request)
    for _ in range(4):
        scheduler.step()
    if rollback == CHECKPOINT:  # one forward_batch a step (the replay baseline adds its replays' batches)
        assert len(target.steps) == scheduler.steps
    target.lose.add(requests[0].seq)  # a restarted shard: re-filled through the drafter's target
    while not all(request.done.is_set() for request in requests):
        scheduler.step()
    assert requests[0].outcome().tokens == alone(PROMPTS[0], 12, NgramDrafter())
    assert requests[1].outcome().tokens == alone(PROMPTS[1], 12)
    assert requests[2].outcome().tokens == alone(PROMPTS[2], 12, NgramDrafter())
    assert requests[0].result.recoveries == 1 and features.opens == 2
    feature_seq = requests[0].seq
    shared = [step for step in target.steps if feature_seq in seqs(step) and len(step) > 1]
    assert len(shared) >= 4  # its rows went in the steps' batches beside the others'
    assert all(seq == feature_seq for seq, _ in target.captures)  # only its forwards captured
    assert any(feature_seq in call and len(call) > 1 for call in target.rollback_calls) or rollback == REPLAY
    proposing = [propose for _, propose in target.captures if propose is not None]
    assert bool(proposing) == (rollback != REPLAY)
    assert not target.states


# ---- exactness over a real model --------------------------------------------------------------------------

NEW = 10
TEXTS = [list(b"The quick brown fox jumps over the lazy dog; the quick brown fox"), list(b"1, 2, 3, 5, 8, 13"),
         list(b"abcabcabcabc"), list(b"hello hello")]
SEEDED = Sampling(temperature=0.9, top_p=0.95, seed=7)
# (prompt, sampling, speculative): greedy and seeded sampling, plain and ngram-speculative, in one batch.
MIX = [(TEXTS[0], None, True), (TEXTS[1], SEEDED, False), (TEXTS[2], SEEDED, True), (TEXTS[3], None, False)]
BLOCK = 4


def each_alone(target, rollback):
    out = []
    for seq, (prompt, sampling, speculative) in enumerate(MIX, start=100):
        if speculative:
            out.append(speculative_decode(target, seq, prompt, NgramDrafter(), block_size=BLOCK, rollback=rollback,
                                          max_new_tokens=NEW, sampling=sampling).tokens)
        else:
            out.append(greedy_decode(target, seq, prompt, NEW, sampling=sampling).tokens)
    return out


def batched(target, rollback, batch_rows=16, prefill_chunk=8):
    requests = [Request(prompt, NEW, sampling=sampling, drafter=NgramDrafter() if speculative else None,
                        block_size=BLOCK) for prompt, sampling, speculative in MIX]
    results = decode_all(target, requests, batch_rows=batch_rows, prefill_chunk=prefill_chunk, rollback=rollback)
    return [result.tokens for result in results]


@pytest.fixture(scope="module")
def daemons():
    sets = [ShardSet(("--synthetic", "tiny"), [(0, 3), (3, 6)], "ipc", ("--rollback-mode", mode, "--max-verify-tokens",
                                                                          str(BLOCK)))
            for mode in (CHECKPOINT, REPLAY_SSM)]
    with launched_sets(sets, ready_timeout_s=120) as started:
        yield {mode: [shard.endpoint for shard in shards] for mode, shards in zip((CHECKPOINT, REPLAY_SSM), started)}


@pytest.mark.parametrize("mode", [CHECKPOINT, REPLAY_SSM])
def test_every_stream_equals_its_request_alone_through_daemons(daemons, mode):
    with Pipeline.connect(daemons[mode]) as pipeline:
        expected = each_alone(pipeline, mode)
        assert batched(pipeline, mode) == expected
        assert batched(pipeline, REPLAY, batch_rows=8, prefill_chunk=3) == expected  # the coordinator's replay


def test_every_stream_equals_its_request_alone_in_one_process():
    from shardd.weights.loading import ModelSource
    from shardd.engine.reference.rollback import RollbackStorage
    from shardd.local import LocalTarget

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: spinning thread pools on a shared machine cost far more than they gain
    try:
        target = LocalTarget(ModelSource(synthetic="tiny"), storage=RollbackStorage(CHECKPOINT, BLOCK))
        assert batched(target, CHECKPOINT, batch_rows=8, prefill_chunk=5) == each_alone(target, CHECKPOINT)
    finally:
        torch.set_num_threads(threads)


def test_generate_runs_copies_of_a_request_together(daemons):
    import json
    import subprocess
    import sys

    prompt = ",".join(map(str, TEXTS[2]))
    command = [sys.executable, "-m", "coordinator.cli", "generate", "--shards", ",".join(daemons[CHECKPOINT]),
               "--prompt-ids", prompt, "--max-new-tokens", str(NEW), "--drafter", "ngram", "--block-size", str(BLOCK),
               "--ignore-eos", "--concurrency", "3", "--json"]
    record = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, timeout=120).stdout)
    with Pipeline.connect(daemons[CHECKPOINT]) as pipeline:
        alone = greedy_decode(pipeline, 1, TEXTS[2], NEW).tokens
    assert record["concurrency"] == 3 and record["streams_identical"] and record["tokens"] == alone
    assert record["aggregate_tok_s"] > 0


def test_the_serve_engine_batches_requests_counts_them_and_cancels_a_dropped_one(daemons):
    """One engine thread for every request: outputs as alone, the scheduler's metrics, a dropped stream closed."""
    import asyncio

    from coordinator.relay.client import ShardClient
    from coordinator.serve.engine import Engine, EngineConfig, GenerateParams
    from coordinator.tokenizer import ByteTokenizer

    engine = Engine(daemons[REPLAY_SSM], ByteTokenizer(),
                    EngineConfig(model_name="m", drafter="ngram", rollback=REPLAY_SSM, block_size=BLOCK))
    params = [GenerateParams(prompt, NEW, sampling or Sampling(), ignore_eos=True) for prompt, sampling, _ in MIX]

    async def run():
        async def dropped():  # a client that reads one delta and goes away
            stream = engine.generate(GenerateParams(TEXTS[0], 4000, Sampling(), ignore_eos=True))
            await stream.__anext__()
            await stream.aclose()

        return await asyncio.gather(*(engine.complete(p) for p in params), dropped())

    try:
        results = asyncio.run(run())[:-1]
        with Pipeline.connect(daemons[REPLAY_SSM]) as pipeline:
            expected = [speculative_decode(pipeline, seq, p.prompt_ids, NgramDrafter(), block_size=BLOCK,
                                           rollback=REPLAY_SSM, max_new_tokens=NEW,
                                           sampling=p.sampling).tokens for seq, p in enumerate(params)]
        assert [result.tokens for _, result, _ in results] == expected
        metrics = engine.metrics.registry
        deadline = time.monotonic() + 5
        while metrics.get_sample_value("shardctl_time_in_queue_seconds_count") < len(params) + 1:
            assert time.monotonic() < deadline, "the dropped stream was never ended"
            time.sleep(0.05)
        with ShardClient(daemons[REPLAY_SSM][0], timeout_s=10) as client:
            assert client.stats()["open_sequences"] == 0  # its sequence closed at the next step boundary
        assert metrics.get_sample_value("shardctl_batch_size_count") >= NEW // BLOCK
        assert metrics.get_sample_value("shardctl_prefill_rows_total") >= sum(len(p.prompt_ids) for p in params)
        assert metrics.get_sample_value("shardctl_requests_queued") == 0
    finally:
        engine.close()
