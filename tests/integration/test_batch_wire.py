"""Batched FORWARD / CAPTURE / ROLLBACK (PROTOCOL.md "Batches") over real daemons on real sockets.

A batch gives each item exactly what the item alone gives (ids, and hidden rows bit for bit); a bad item fails
alone with its own error and changes nothing; a malformed envelope is refused whole; the `Pipeline` relays one
batched request per shard and fails an item alone where it fails. Daemons: a two-shard pair on loopback tcp and
one whole-model daemon on ipc:// with small limits, started once for the module.
"""

from __future__ import annotations

import dataclasses
import signal

import msgpack
import pytest

from coordinator.relay.client import ShardError
from coordinator.relay.pipeline import BatchForward, Pipeline
from coordinator.relay.target import RollbackFailed, SequenceLost
from coordinator.sampling import Sampling
from protocol import (
    Capture,
    CaptureBatch,
    ErrorCode,
    Forward,
    ForwardBatch,
    MessageType,
    Rollback,
    RollbackBatch,
    encode_request,
    pure_chain,
    split_batch_reply,
    WireTensor,
)
from shardd.weights.loading import ModelSource
from shardd.local import LocalTarget
from shardd.engine.reference.errors import PositionMismatch
from tests.support.daemons import PAIR_ARGS, free_tcp_endpoint, start_daemons, stop_all

PROMPTS = [list(b"The quick brown fox"), list(b"1, 2, 3, 5"), list(b"hello")]
# The ipc daemon's small limits make the size errors cheap to reach.
SMALL = ["--layers", "0:6", "--max-context", "48", "--max-tokens-per-request", "32", "--max-verify-tokens", "4",
         "--max-sequences", "8"]


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("batch")
    specs = {
        "shard0": (free_tcp_endpoint(), PAIR_ARGS[0]),
        "shard1": (free_tcp_endpoint(), PAIR_ARGS[1]),
        "small": (f"ipc://{workdir}/small.sock", SMALL),
    }
    started = start_daemons(specs, workdir)
    yield started
    stop_all(started.values())


def forward(seq, pos, tokens=None, hidden=None, checkpoint=False, **fields):
    return Forward(id=0, seq=seq, pos=pos, tokens=tokens, hidden=hidden, checkpoint=checkpoint,
                   parents=pure_chain(len(tokens) if tokens is not None else hidden.shape[0]) if checkpoint else None,
                   **fields)


def send_batch(client, record_type, items):
    """A batched request through the plain DEALER client; its reply split per item."""
    sent = record_type(id=client.next_id(), items=tuple(items))
    reply = client.exchange(encode_request(sent, validate=False))
    assert reply.ok, (reply.error_code, reply.error_message)
    assert reply.id == sent.id
    return split_batch_reply(reply, sent)


def alone(client, record):
    """The same item as a one-sequence request."""
    record = dataclasses.replace(record, id=client.next_id())
    reply = client.exchange(encode_request(record))
    assert reply.ok and reply.id == record.id, (reply.error_code, reply.error_message)
    return reply


def opened(client, *seqs):
    for seq in seqs:
        client.call(MessageType.OPEN, seq=seq)


def closed(client, *seqs):
    """Close them: the daemon's max_sequences is shared by the tests."""
    for seq in seqs:
        client.call(MessageType.CLOSE, seq=seq)


def length_is(client, seq, length):
    """The sequence's committed length is `length`: a FORWARD there succeeds (a wrong pos would be refused)."""
    reply = client.request(MessageType.FORWARD, seq=seq, pos=length, tokens=[7], checkpoint=True, parents=[-1])
    assert reply.ok, f"seq {seq} is not at {length}: {reply.error_code} {reply.error_message}"
    client.call(MessageType.ROLLBACK, seq=seq, keep=0)


def test_a_batch_equals_each_item_alone_ids_and_hidden_bit_for_bit(daemons):
    shard0, shard1 = daemons["shard0"].client(), daemons["shard1"].client()
    batched, single = [1, 2, 3], [11, 12, 13]
    for client in (shard0, shard1):
        opened(client, *batched, *single)
    sampled = dict(temperature=0.8, top_p=0.9, seed=5, logprobs=2)
    lengths = [0, 0, 0]
    for step in range(2):  # a prefill of three lengths, then a verify, a decode and a sampled decode side by side
        if step == 0:
            inputs = [(p, False, {}) for p in PROMPTS]
        else:
            inputs = [([5, 6, 7], True, {}), ([9], False, {}), ([4], False, sampled)]
        items_0 = [forward(seq, lengths[i], tokens=t, checkpoint=c) for i, (seq, (t, c, _)) in enumerate(zip(batched, inputs))]
        parts_0 = send_batch(shard0, ForwardBatch, items_0)
        for i, (seq, (tokens, checkpoint, _)) in enumerate(zip(single, inputs)):
            reference = alone(shard0, forward(seq, lengths[i], tokens=tokens, checkpoint=checkpoint))
            assert parts_0[i].ok and parts_0[i].result == {"seq": batched[i], "length": lengths[i] + len(tokens)}
            assert bytes(parts_0[i].tensors["hidden"].data) == bytes(reference.tensors["hidden"].data)
        items_1 = [forward(seq, lengths[i], hidden=parts_0[i].tensors["hidden"], checkpoint=c, **extra)
                   for i, (seq, (_, c, extra)) in enumerate(zip(batched, inputs))]
        parts_1 = send_batch(shard1, ForwardBatch, items_1)
        for i, (seq, (tokens, checkpoint, extra)) in enumerate(zip(single, inputs)):
            reference = alone(shard1, forward(seq, lengths[i], hidden=parts_0[i].tensors["hidden"],
                                              checkpoint=checkpoint, **extra))
            assert parts_1[i].result == {**reference.result, "seq": batched[i]}
            assert len(parts_1[i].result["ids"]) == len(tokens)
            lengths[i] += len(tokens)
    assert "logprobs" in parts_1[2].result
    stats = shard1.call(MessageType.STATS).result
    assert stats["batches"] == {"requests": 2, "items": 6, "rows": sum(map(len, PROMPTS)) + 5}
    # sampling asked of the shard without the head: that item alone is refused
    parts = send_batch(shard0, ForwardBatch, [forward(1, lengths[0], tokens=[1], temperature=1.0),
                                              forward(2, lengths[1], tokens=[1])])
    assert parts[0].error_code is ErrorCode.BAD_REQUEST and "head" in parts[0].error_message and parts[1].ok
    for client in (shard0, shard1):
        closed(client, *batched, *single)


def test_every_bad_item_fails_alone_with_its_code_and_changes_nothing(daemons):
    small = daemons["small"]
    client, other = small.client(), small.client()
    opened(client, *range(1, 8))
    opened(other, 50)
    reference = alone(client, forward(7, 0, tokens=PROMPTS[2]))
    items = [
        forward(1, 0, tokens=PROMPTS[2]),                        # runs
        forward(99, 0, tokens=[1]),                              # never opened
        forward(2, 3, tokens=[1]),                               # wrong pos
        forward(50, 0, tokens=[1]),                              # another client's sequence
        forward(3, 0, tokens=[1], temperature=500.0),            # bad sampling field
        forward(4, 0, tokens=[1] * 5, checkpoint=True),          # more rows than the rollback storage holds
        Forward(id=0, seq=5, pos=0, tokens=[1, 2], checkpoint=True, parents=[-1, -1]),  # bad verify geometry
        forward(6, 0, tokens=[1], drafts=[1], temperature=1.0),  # as many drafts as rows
    ]
    parts = send_batch(client, ForwardBatch, items)
    assert parts[0].ok and parts[0].result["ids"] == reference.result["ids"]
    assert [part.error_code for part in parts[1:]] == [
        ErrorCode.NO_SUCH_SEQUENCE, ErrorCode.POSITION_MISMATCH, ErrorCode.NO_SUCH_SEQUENCE, ErrorCode.BAD_REQUEST,
        ErrorCode.ROLLBACK_UNAVAILABLE, ErrorCode.GEOMETRY_REJECTED, ErrorCode.BAD_REQUEST,
    ]
    assert "temperature" in parts[4].error_message and "500" in parts[4].error_message
    for seq in range(2, 7):
        length_is(client, seq, 0)
    length_is(other, 50, 0)

    # A row past the context fails alone (CAPACITY); capture layers are checked per item.
    alone(client, forward(1, len(PROMPTS[2]), tokens=[3] * 25))
    parts = send_batch(client, ForwardBatch, [forward(2, 0, tokens=[3] * 2), forward(1, len(PROMPTS[2]) + 25, tokens=[3] * 20)])
    assert parts[0].ok and parts[1].error_code is ErrorCode.CAPACITY
    parts = send_batch(client, CaptureBatch, [
        Capture(id=0, seq=3, pos=0, tokens=[1, 2], layers=[1, 4]),
        Capture(id=0, seq=4, pos=0, tokens=[1], layers=[6]),
        Capture(id=0, seq=5, pos=0, tokens=[1], layers=[1], propose=2, drafts=[]),
        Capture(id=0, seq=6, pos=0, tokens=[1, 2], layers=[4]),  # the same rows as seq 3's, one layer of them
    ])
    assert parts[0].ok and parts[0].result["captured_layers"] == [1, 4]
    assert {name: t.shape for name, t in parts[0].tensors.items()} == {"layer.1": (2, 64), "layer.4": (2, 64)}
    assert parts[3].result["captured_layers"] == [4] and set(parts[3].tensors) == {"layer.4"}
    assert bytes(parts[3].tensors["layer.4"].data) == bytes(parts[0].tensors["layer.4"].data)
    assert parts[1].error_code is ErrorCode.BAD_REQUEST and "capture layer 6" in parts[1].error_message
    # `propose` is checked as the one-sequence CAPTURE checks it: this daemon hosts no drafter
    single = client.exchange(encode_request(Capture(id=client.next_id(), seq=5, pos=0, tokens=[1], layers=[1],
                                                    propose=2, drafts=[])))
    assert (parts[2].error_code, parts[2].error_message) == (single.error_code, single.error_message)
    assert parts[2].error_code is ErrorCode.NO_DRAFTER
    length_is(client, 4, 0)
    length_is(client, 5, 0)
    closed(client, *range(1, 8))
    closed(other, 50)


def test_a_draft_outside_the_vocabulary_or_non_finite_rows_fail_their_item_alone(daemons):
    """A sampled verify whose drafts hold an id past the vocabulary, and rows holding a NaN or an infinity, are
    each BAD_REQUEST for their item alone, changing nothing; the head-answered items beside them run as alone."""
    shard0, shard1 = daemons["shard0"].client(), daemons["shard1"].client()
    seqs = [31, 32, 33, 34, 35]
    for client in (shard0, shard1):
        opened(client, *seqs)
    rows = send_batch(shard0, ForwardBatch, [forward(seq, 0, tokens=PROMPTS[2]) for seq in seqs])
    hidden = [part.tensors["hidden"] for part in rows]
    sampled = dict(temperature=0.8, seed=9)
    nan_rows = hidden[3].to_torch().clone()
    nan_rows[1, 5] = float("nan")
    inf_rows = hidden[4].to_torch().clone()
    inf_rows[0, 0] = float("-inf")
    items = [forward(31, 0, hidden=hidden[0], drafts=[7, 8], **sampled),
             forward(32, 0, hidden=hidden[1], drafts=[7, 320], **sampled),
             forward(33, 0, hidden=hidden[2], **sampled),
             forward(34, 0, hidden=WireTensor.from_torch(nan_rows), **sampled),
             forward(35, 0, hidden=WireTensor.from_torch(inf_rows))]
    parts = send_batch(shard1, ForwardBatch, items)
    assert parts[0].ok and parts[2].ok
    assert [(part.error_code, part.error_message.split(":")[0]) for part in parts[1:2] + parts[3:]] == [
        (ErrorCode.BAD_REQUEST, "draft token 320 is outside the vocabulary 0..319"),
        (ErrorCode.BAD_REQUEST, "tensor 'hidden' holds a non-finite value (NaN or infinity)"),
        (ErrorCode.BAD_REQUEST, "tensor 'hidden' holds a non-finite value (NaN or infinity)")]
    # nothing changed for the refused items: each runs now from position 0, as the ones that ran did
    again = send_batch(shard1, ForwardBatch, [forward(32, 0, hidden=hidden[1], drafts=[7, 8], **sampled),
                                              forward(34, 0, hidden=hidden[3], **sampled)])
    assert again[0].result == {**parts[0].result, "seq": 32}
    assert again[1].result == {**parts[2].result, "seq": 34}
    # the one-sequence FORWARD is refused the same way
    single = shard1.request(MessageType.FORWARD, seq=35, pos=0, hidden=WireTensor.from_torch(inf_rows),
                            drafts=[7, 320], **sampled)
    assert (single.error_code, single.error_message) == (parts[1].error_code, parts[1].error_message)
    single = shard1.request(MessageType.FORWARD, seq=35, pos=0, hidden=WireTensor.from_torch(inf_rows))
    assert single.error_code is ErrorCode.BAD_REQUEST and "'hidden'" in single.error_message
    assert shard1.call(MessageType.FORWARD, seq=35, pos=0, hidden=hidden[4]).result["length"] == len(PROMPTS[2])
    for client in (shard0, shard1):
        closed(client, *seqs)


def raw(client, header: dict, *frames) -> tuple:
    reply = client.exchange([msgpack.packb({"v": 1, "id": 77, **header}, use_bin_type=True), *frames])
    return reply.ok, reply.error_code, reply.error_message


def test_a_malformed_envelope_is_refused_whole_and_changes_nothing(daemons):
    client = daemons["small"].client()
    opened(client, 1, 2)
    good = {"seq": 1, "pos": 0, "tokens": [1, 2]}
    hidden = {"name": "hidden", "dtype": "float32", "shape": [2, 64]}
    cases = {
        "items not a list": ({"type": "FORWARD", "items": {"seq": 1}}, ErrorCode.BAD_REQUEST),
        "no items": ({"type": "FORWARD", "items": []}, ErrorCode.BAD_REQUEST),
        "an item not a map": ({"type": "FORWARD", "items": [good, 3]}, ErrorCode.BAD_REQUEST),
        "an item without seq": ({"type": "FORWARD", "items": [good, {"pos": 0, "tokens": [1]}]}, ErrorCode.BAD_REQUEST),
        "a seq twice": ({"type": "FORWARD", "items": [good, {**good, "pos": 2}]}, ErrorCode.BAD_REQUEST),
        "rows without hidden": ({"type": "FORWARD", "items": [good, {"seq": 2, "pos": 0, "rows": 1}]}, ErrorCode.BAD_REQUEST),
        "a per-sequence field outside the items": ({"type": "FORWARD", "items": [good], "pos": 0}, ErrorCode.BAD_REQUEST),
        "items on OPEN": ({"type": "OPEN", "seq": 3, "items": [good]}, ErrorCode.BAD_REQUEST),
        "more rows than a request takes": ({"type": "FORWARD", "items": [good, {"seq": 2, "pos": 0, "tokens": [1] * 31}]},
                                           ErrorCode.TOO_LARGE),
        "more items than max_sequences": ({"type": "ROLLBACK", "items": [{"seq": s, "keep": 0} for s in range(9)]},
                                          ErrorCode.TOO_LARGE),
    }
    for what, (header, code) in cases.items():
        ok, got, message = raw(client, header)
        assert (ok, got) == (False, code), f"{what}: {got} {message}"
    # hidden rows that the items' counts do not add up to
    ok, got, message = raw(client, {"type": "FORWARD", "tensors": [hidden],
                                    "items": [{"seq": 1, "pos": 0, "rows": 1}, {"seq": 2, "pos": 0, "rows": 2}]},
                           bytes(2 * 64 * 4))
    assert (ok, got) == (False, ErrorCode.BAD_REQUEST) and "add up" in message
    # a batch's third frame is its tensor 'carried' (the CAPTURE items' carried rows), read and checked; its fourth
    # `token_mask`; a fifth is one too many
    carried = {"name": "carried", "dtype": "float32", "shape": [1, 128]}
    verify = {"seq": 1, "pos": 0, "rows": 2, "layers": [5], "checkpoint": True, "parents": [-1, 0], "drafts": [3],
              "propose": 1, "carried_layers": [1, 3]}
    frames = (bytes(2 * 64 * 4), bytes(128 * 4))
    ok, got, message = raw(client, {"type": "FORWARD", "tensors": [hidden, carried], "items": [verify]}, *frames)
    assert (ok, got) == (False, ErrorCode.BAD_REQUEST) and "tensor 'carried' has 1" in message
    ok, got, message = raw(client, {"type": "FORWARD", "tensors": [hidden, carried], "items": [verify]}, *frames,
                           bytes(4), bytes(4))
    assert (ok, got) == (False, ErrorCode.BAD_REQUEST) and "FORWARD batch has at most 4 frame(s)" in message
    length_is(client, 1, 0)
    length_is(client, 2, 0)
    closed(client, 1, 2)


def test_a_batched_rollback_rolls_each_item_back_on_its_own(daemons):
    client, other = daemons["small"].client(), daemons["small"].client()
    opened(client, 1, 2, 3)
    opened(other, 60)
    other.call(MessageType.FORWARD, seq=60, pos=0, tokens=[1, 2], checkpoint=True, parents=[-1, 0])
    parts = send_batch(client, ForwardBatch, [forward(1, 0, tokens=[1, 2, 3], checkpoint=True),
                                              forward(2, 0, tokens=[1, 2, 3], checkpoint=True),
                                              forward(3, 0, tokens=[1, 2])])
    assert all(part.ok for part in parts)
    parts = send_batch(client, RollbackBatch, [Rollback(id=0, seq=1, keep=1), Rollback(id=0, seq=2, keep=9),
                                               Rollback(id=0, seq=3, keep=0), Rollback(id=0, seq=4, keep=0),
                                               Rollback(id=0, seq=60, keep=0)])
    assert parts[0].ok and parts[0].result == {"seq": 1, "length": 1}
    assert [part.error_code for part in parts[1:]] == [ErrorCode.BAD_REQUEST, ErrorCode.NO_PENDING_STEP,
                                                       ErrorCode.NO_SUCH_SEQUENCE, ErrorCode.NO_SUCH_SEQUENCE]
    assert other.call(MessageType.ROLLBACK, seq=60, keep=1).result == {"seq": 60, "length": 1}  # its own, untouched
    closed(other, 60)
    assert client.call(MessageType.ROLLBACK, seq=2, keep=2).result == {"seq": 2, "length": 2}  # still pending
    length_is(client, 1, 1)
    length_is(client, 3, 2)
    closed(client, 1, 2, 3)


def test_local_target_batch_equals_each_item_alone():
    local = LocalTarget(ModelSource(synthetic="tiny"), splits=[(0, 3), (3, 6)])
    for seq in (1, 2, 3, 11, 12):
        local.open(seq)
    sampling = Sampling(temperature=0.7, seed=3, logprobs=1)
    items = [BatchForward(1, 0, PROMPTS[0]), BatchForward(2, 0, PROMPTS[1], sampling=sampling),
             BatchForward(3, 4, [1])]
    results = local.forward_batch(items)
    assert results[0] == local.forward(11, 0, PROMPTS[0])
    assert results[1] == local.forward(12, 0, PROMPTS[1], sampling=sampling)
    assert results[1].logprobs is not None
    assert isinstance(results[2], PositionMismatch)
    local.forward_batch([BatchForward(1, len(PROMPTS[0]), [1, 2, 3], checkpoint=True)])
    local.rollback_batch([(1, 1), (2, 1)])  # seq 2 has nothing pending: refused on its next call
    after = local.forward_batch([BatchForward(1, len(PROMPTS[0]) + 1, [4]), BatchForward(2, len(PROMPTS[1]), [4])])
    assert len(after[0]) == 1 and isinstance(after[1], RollbackFailed)


def test_pipeline_batch_over_two_daemons_fails_one_item_alone_and_survives_a_killed_shard(daemons):
    endpoints = [daemons["shard0"].bind, daemons["shard1"].bind]
    with Pipeline.connect(endpoints, timeout_s=10, liveness_timeout_s=2) as pipeline:
        for seq in (1, 2, 3, 4, 11, 13):
            pipeline.open(seq)
        pipeline.clients[0].open(5)  # on the first shard only: the head refuses it
        items = [BatchForward(1, 0, PROMPTS[0]), BatchForward(2, 3, [1]), BatchForward(3, 0, PROMPTS[1], checkpoint=True),
                 BatchForward(5, 0, [1, 2], checkpoint=True), BatchForward(4, 0, [])]
        results = pipeline.forward_batch(items)
        assert results[0] == pipeline.forward(11, 0, PROMPTS[0])
        assert isinstance(results[1], ShardError) and results[1].code is ErrorCode.POSITION_MISMATCH
        assert results[2] == pipeline.forward(13, 0, PROMPTS[1], checkpoint=True)
        assert isinstance(results[3], SequenceLost)  # NO_SUCH_SEQUENCE at the head, undone on the first shard
        assert pipeline.clients[0].forward(5, 0, [1, 2]).result["length"] == 2
        assert isinstance(results[4], ValueError)

        # rollbacks in one batch, read behind the next batch; seq 1 had nothing pending
        pipeline.rollback_batch([(3, 2), (1, 0), (13, 2)])
        n0 = len(PROMPTS[0])
        after = pipeline.forward_batch([BatchForward(3, 2, [7], checkpoint=True), BatchForward(1, n0, [7]),
                                        BatchForward(13, 2, [7], checkpoint=True)])
        assert isinstance(after[1], RollbackFailed)
        assert after[0] == after[2] and len(after[0]) == 1

        # the head shard killed: every item of the next batch is lost (to be re-filled); the first shard serves on
        daemons["shard1"].signal(signal.SIGKILL)
        daemons["shard1"].wait(10)
        lost = pipeline.forward_batch([BatchForward(3, 3, [8, 9], checkpoint=True),
                                       BatchForward(13, 3, [8, 9], checkpoint=True)])
        assert all(isinstance(result, SequenceLost) for result in lost), lost
        assert pipeline.clients[0].forward(3, 5, [8]).result["length"] == 6


def test_pipeline_batch_item_the_codec_refuses_fails_alone(daemons):
    """A token id the protocol refuses (out of 0 <= id < 2^31, not a vocabulary check) fails its item alone, with
    the daemon's BAD_REQUEST naming the field, as any other bad item does: it does not take the batch with it."""
    with Pipeline.connect([daemons["small"].bind], timeout_s=10, liveness_timeout_s=2) as pipeline:
        for seq in (21, 22, 23):
            pipeline.open(seq)
        try:
            results = pipeline.forward_batch([BatchForward(21, 0, [1, 2]), BatchForward(22, 0, [1, -5]),
                                              BatchForward(23, 0, [3])])
            assert isinstance(results[1], ShardError) and results[1].code is ErrorCode.BAD_REQUEST, results[1]
            assert "tokens" in str(results[1])
            assert results[0] == pipeline.forward(22, 0, [1, 2])  # seq 22 is still at 0: the refusal changed nothing
            assert len(results[2]) == 1
        finally:
            for seq in (21, 22, 23):
                pipeline.close(seq)


def test_pipeline_batch_splits_by_rows_and_chunks_a_long_item_alone(daemons):
    small = daemons["small"]
    with Pipeline.connect([small.bind], timeout_s=10, liveness_timeout_s=2) as pipeline:
        assert pipeline.max_tokens_per_request == 32 and pipeline.max_batch_items == 8
        lengths = {1: 30, 2: 10, 3: 40, 4: 1}
        for seq in lengths:
            pipeline.open(seq)
            pipeline.open(seq + 10)
        prompt = list(b"a longer prompt than one request takes, by a few tokens")
        before = pipeline.stats()[0]["batches"]
        results = pipeline.forward_batch([BatchForward(seq, 0, prompt[:n]) for seq, n in lengths.items()])
        for (seq, n), ids in zip(lengths.items(), results):
            assert ids == pipeline.forward(seq + 10, 0, prompt[:n])
        after = pipeline.stats()[0]["batches"]
        # 30 rows alone (30 + 10 > 32), then seqs 2 and 4 in one batch, then the 40-token item in chunks alone
        assert after["requests"] - before["requests"] == 1 and after["items"] - before["items"] == 2
        for seq in lengths:
            pipeline.close(seq)
            pipeline.close(seq + 10)
