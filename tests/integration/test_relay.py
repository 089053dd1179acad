"""The relay between the coordinator and its daemons: where a request's time goes (phase clocks at
both ends, STATS `phases`), over real `shardd serve` daemons on real sockets."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import pytest
import torch

from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafting.drafters import make_drafter
from coordinator.launch import ShardSet, launched_sets, write_relay_key
from coordinator.relay.client import ShardError
from coordinator.relay.pipeline import Pipeline
from coordinator.relay.target import RollbackFailed
from protocol import (RECORD_TYPES, ErrorCode, Forward, ForwardBatch, MessageType, Rows, WireTensor, encode_request,
                      pure_chain)
from protocol.layout import even_split
from protocol.timing import per_request_ms
from tests.support.daemons import Client, Daemon, free_tcp_endpoint, kill_and_replace, start_daemons, stop_all

TINY = ("--synthetic", "tiny")
BLOCK = 8
PROMPT = list(b"The quick brown fox jumps over the lazy dog")
DAEMON_PHASES = {"receive", "decode", "lookup", "compute", "encode", "send"}
CLIENT_PHASES = {"encode", "send", "wait", "receive", "decode"}


@pytest.fixture(scope="module")
def endpoints():
    shard_set = ShardSet(TINY, even_split(6, 2), "ipc", ("--rollback-mode", "checkpoint"))
    with launched_sets([shard_set], ready_timeout_s=120) as started:
        yield [shard.endpoint for shard in started[0]]


def test_every_request_is_timed_by_phase_at_both_ends(endpoints):
    with Pipeline.connect(endpoints) as pipeline:
        assert pipeline.direct_rows  # launched shards send their rows on to the next (--relay-to-file)
        before = [client.stats()["phases"] for client in pipeline.clients]
        reference = greedy_decode(pipeline, 1, PROMPT, 12).tokens
        drafter = make_drafter("oracle", prompt_len=len(PROMPT), reference=reference, block_size=BLOCK, mean_commit=3.0, seed=1)
        result = speculative_decode(pipeline, 2, PROMPT, drafter, block_size=BLOCK, max_new_tokens=12)
        assert result.tokens == reference and result.rollbacks_fast > 0
        for client, old in zip(pipeline.clients, before):
            daemon = per_request_ms(old, client.stats()["phases"])
            # each of the two decodes: a prefill plus one FORWARD per step; a ROLLBACK for each partial commit
            assert daemon["FORWARD"]["requests"] == 2 + len(reference) - 1 + result.steps
            assert daemon["ROLLBACK"]["requests"] == result.rollbacks_fast
            assert DAEMON_PHASES <= set(daemon["FORWARD"]) and DAEMON_PHASES <= set(daemon["ROLLBACK"])
            assert all(ms >= 0 for row in daemon.values() for ms in row.values())
            coordinator = client.phases.totals()
            assert coordinator["FORWARD"]["requests"] == daemon["FORWARD"]["requests"]
            assert CLIENT_PHASES == set(coordinator["FORWARD"]["seconds"])
        assert result.draft_seconds > 0


# ---- requests back to back (PROTOCOL.md, "Ordering") ---------------------------------------------------------


def _send(client: Client, mtype: str, **fields) -> int:
    request_id = client.next_id()
    client.send_frames(encode_request(RECORD_TYPES[MessageType(mtype)](id=request_id, **fields)))
    return request_id


def test_requests_back_to_back_are_served_in_order_and_a_refused_one_changes_nothing(endpoints):
    """One DEALER sends a whole verify step and what follows without reading a reply: each is served as if the
    previous had been answered. A refused ROLLBACK leaves the length where it was, so the FORWARD sent right
    behind it (at the position the ROLLBACK would have left) is refused by its pos and changes nothing."""
    client = Client(endpoints[0])
    try:
        seq, block = 41, [5, 6, 7, 8]
        sent = [
            _send(client, "OPEN", seq=seq),
            _send(client, "FORWARD", seq=seq, pos=0, tokens=[1, 2, 3]),
            _send(client, "FORWARD", seq=seq, pos=3, tokens=block, checkpoint=True, parents=pure_chain(4)),
            _send(client, "ROLLBACK", seq=seq, keep=1),
            _send(client, "FORWARD", seq=seq, pos=4, tokens=[9]),
            _send(client, "ROLLBACK", seq=seq, keep=0),  # refused: no pending step
            _send(client, "FORWARD", seq=seq, pos=4, tokens=[9]),  # pos 4, length 5: refused, nothing changes
            _send(client, "FORWARD", seq=seq, pos=5, tokens=[10]),
            _send(client, "CLOSE", seq=seq),
        ]
        replies = [client.receive() for _ in sent]
        assert [reply.id for reply in replies] == sent
        assert [reply.ok for reply in replies] == [True, True, True, True, True, False, False, True, True]
        assert replies[5].error_code is ErrorCode.NO_PENDING_STEP
        assert replies[6].error_code is ErrorCode.POSITION_MISMATCH
        assert [reply.result["length"] for reply in replies[1:5]] == [3, 7, 4, 5]
        assert replies[7].result["length"] == replies[8].result["length"] == 6
    finally:
        client.close()


def test_a_rollback_the_pipeline_does_not_wait_for_is_settled_before_its_sequence_moves(endpoints):
    """Pipeline.rollback sends and returns; the next forward goes out right behind it and reads its reply first.
    A refused one surfaces there as RollbackFailed, and the decoding loop re-fills: the output is unchanged."""
    with Pipeline.connect(endpoints) as pipeline:
        pipeline.open(42)
        try:
            pipeline.forward(42, 0, PROMPT[:6])
            ids = pipeline.forward(42, 6, PROMPT[6:10], checkpoint=True)
            pipeline.rollback(42, 2)
            assert len(pipeline.forward(42, 8, [ids[1]])) == 1  # at 6 + 2: the rollback was served first
            pipeline.rollback(42, 0)  # no pending step: refused by both shards, read by the next call
            with pytest.raises(RollbackFailed, match="NO_PENDING_STEP"):
                pipeline.forward(42, 9, [1])
        finally:
            pipeline.close(42)


def test_a_daemon_killed_with_requests_in_flight_is_refilled(tmp_path):
    """The first shard is killed while a step's ROLLBACKs are on their way (sent, not yet read) and replaced:
    the next FORWARD reaches the new daemon, the lost ROLLBACK fails the step, and the loop re-fills from the
    committed tokens; the output is exactly greedy decoding's."""
    binds = [free_tcp_endpoint(), free_tcp_endpoint()]
    args = [["--layers", "0:3", "--max-verify-tokens", "8"], ["--layers", "3:6", "--max-verify-tokens", "8"]]
    daemons = [Daemon(f"shard{i}", binds[i], args[i], tmp_path) for i in range(2)]
    try:
        for daemon in daemons:
            daemon.wait_ready()
        with Pipeline.connect(binds, timeout_s=30.0) as pipeline:
            expected = greedy_decode(pipeline, 1, PROMPT, 16).tokens
            commits, killed = [], []

            def kill_first_shard(new_ids):
                commits.append(new_ids)
                if len(commits) >= 3 and pipeline._rollbacks and not killed:  # ROLLBACKs sent, still unread
                    kill_and_replace(daemons, 0, "shard0-restarted", args[0], tmp_path)
                    killed.append(len(commits))

            drafter = make_drafter("oracle", prompt_len=len(PROMPT), reference=expected, block_size=BLOCK,
                                   mean_commit=3.0, seed=1)
            result = speculative_decode(pipeline, 2, PROMPT, drafter, block_size=BLOCK, max_new_tokens=16,
                                        on_commit=kill_first_shard)
        assert killed and result.tokens == expected
        assert result.rollbacks_fallback + result.recoveries >= 1
    finally:
        stop_all(daemons)


# ---- rows from shard to shard (PROTOCOL.md, "Rows from shard to shard") --------------------------------------


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    """Three daemons of the tiny model on one host, each but the head sending its rows straight to the next
    (--relay-to); tcp and ipc between them."""
    workdir = tmp_path_factory.mktemp("direct")
    binds = [f"ipc://{workdir}/first.sock", free_tcp_endpoint(), f"ipc://{workdir}/head.sock"]
    layers = ["0:2", "2:4", "4:6"]
    specs = {f"shard{k}": (bind, ["--layers", layers[k], "--rollback-mode", "checkpoint", "--max-verify-tokens",
                                  str(BLOCK), "--rows-wait", "5", *(["--relay-to", binds[k + 1]] if k < 2 else [])])
             for k, bind in enumerate(binds)}
    daemons = start_daemons(specs, workdir)
    try:
        yield binds, list(daemons.values()), workdir
    finally:
        stop_all(daemons.values())


def test_rows_from_shard_to_shard_give_the_coordinator_relay_s_tokens(direct):
    """Greedy and speculative decoding (checkpoint rollbacks) through daemons that send their rows on themselves
    give the tokens of the coordinator relaying them (the same daemons, the coordinator told not to use it);
    each step's rows went daemon to daemon (STATS `rows`), none went missing, and HELLO names each daemon's next
    shard."""
    binds, _, _ = direct
    with Pipeline.connect(binds) as relayed:
        relayed.direct_rows = False
        reference = greedy_decode(relayed, 1, PROMPT, 12).tokens
    with Pipeline.connect(binds) as pipeline:
        assert pipeline.direct_rows
        assert [shard.hello["relay_to"] for shard in pipeline.shards] == [binds[1], binds[2], None]
        before = [client.stats()["rows"] for client in pipeline.clients]
        assert greedy_decode(pipeline, 1, PROMPT, 12).tokens == reference
        drafter = make_drafter("oracle", prompt_len=len(PROMPT), reference=reference, block_size=BLOCK,
                               mean_commit=3.0, seed=1)
        result = speculative_decode(pipeline, 2, PROMPT, drafter, block_size=BLOCK, max_new_tokens=12)
        assert result.tokens == reference and result.rollbacks_fast > 0 and result.recoveries == 0
        after = [client.stats()["rows"] for client in pipeline.clients]
    steps = 2 + len(reference) - 1 + result.steps  # two prefills, the greedy steps, the verify steps
    assert [a["sent"] - b["sent"] for a, b in zip(after, before)] == [steps, steps, 0]
    assert [a["received"] - b["received"] for a, b in zip(after, before)] == [0, steps, steps]
    assert all(a["missing"] == b["missing"] and a["waiting"] == 0 for a, b in zip(after, before))


def _clients(binds):
    return [Client(bind) for bind in binds]


def test_a_shard_that_refuses_has_the_next_one_s_wait_refused_and_nothing_changes(direct):
    """The first shard refuses a FORWARD with send_rows (its pos is wrong): it tells the second with a refused
    ROWS, whose waiting FORWARD is refused ROWS_MISSING at once and changes nothing, and the head after it too. A
    step whose rows came before their FORWARD runs at once, from the kept rows. A middle shard that refuses (its
    sequence is not open) tells the head the same way. A wait ends, refused, when its connection sends anything
    else: the refusal first, then that request's own reply."""
    binds, _, _ = direct
    first, middle, head = clients = _clients(binds)
    try:
        seq = 71
        for client in clients:
            assert client.request("OPEN", seq=seq).ok
        waits = [_send(middle, "FORWARD", seq=seq, pos=0, rows_ticket=11, ticket_rows=3, send_rows=12),
                 _send(head, "FORWARD", seq=seq, pos=0, rows_ticket=12, ticket_rows=3)]
        refused = first.request("FORWARD", seq=seq, pos=5, tokens=[1, 2, 3], send_rows=11)
        assert refused.error_code is ErrorCode.POSITION_MISMATCH
        for client, request_id in zip((middle, head), waits):
            reply = client.receive(10)
            assert reply.id == request_id and reply.error_code is ErrorCode.ROWS_MISSING, reply
            assert "nothing changed" in reply.error_message
        # the rows come first, the FORWARD later: it runs at once on the kept rows
        assert first.request("FORWARD", seq=seq, pos=0, tokens=[1, 2, 3], send_rows=13).result["rows_sent"]
        _send(head, "FORWARD", seq=seq, pos=0, rows_ticket=14, ticket_rows=3)
        assert middle.request("FORWARD", seq=seq, pos=0, rows_ticket=13, ticket_rows=3, send_rows=14).ok
        assert head.receive(10).result["length"] == 3
        # a middle shard without the sequence refuses at once, and so does the head after it
        assert middle.request("CLOSE", seq=seq).ok
        _send(head, "FORWARD", seq=seq, pos=3, rows_ticket=16, ticket_rows=1)
        assert middle.request("FORWARD", seq=seq, pos=3, rows_ticket=15, ticket_rows=1,
                              send_rows=16).error_code is ErrorCode.NO_SUCH_SEQUENCE
        assert head.receive(10).error_code is ErrorCode.ROWS_MISSING
        # rows that never come: the connection's next request ends the wait (refused first, then answered)
        waiting = _send(head, "FORWARD", seq=seq, pos=3, rows_ticket=17, ticket_rows=1)
        assert head.receive(0.3) is None
        hello = _send(head, "HELLO")
        cancelled, answered = head.receive(10), head.receive(10)
        assert (cancelled.id, cancelled.error_code) == (waiting, ErrorCode.ROWS_MISSING)
        assert "a later request of its connection came first" in cancelled.error_message
        assert answered.id == hello and answered.ok
        # none of the refused or ended waits moved the head: a wait at the wrong pos is refused before it waits
        mismatch = head.request("FORWARD", seq=seq, pos=4, rows_ticket=18, ticket_rows=1)
        assert mismatch.error_code is ErrorCode.POSITION_MISMATCH and "committed length is 3" in mismatch.error_message
        # asked of a daemon without --relay-to, or in a batch: refused by name
        nowhere = head.request("FORWARD", seq=seq, pos=3, rows_ticket=19, ticket_rows=1, send_rows=20)
        assert nowhere.error_code is ErrorCode.BAD_REQUEST and "without --relay-to" in nowhere.error_message
        items = (Forward(0, seq=seq, pos=3, tokens=[1], send_rows=21), Forward(0, seq=seq + 1, pos=0, tokens=[1]))
        batch = first.exchange(encode_request(ForwardBatch(id=first.next_id(), items=items), validate=False))
        assert "field 'send_rows' of FORWARD is not available in a batch" in batch.result["items"][0]["error"]["message"]
    finally:
        for client in clients:
            client.close()


def test_rows_nobody_asked_for_are_bounded_per_sender_and_evict_no_one_elses(direct):
    """Was: ROWS from any connection were kept in one shared inbox, so a peer sending ROWS for tickets nobody
    asked for pushed out the rows a real step was about to take (ROWS_MISSING after --rows-wait), and held any
    size. Each sender's parked rows are bounded on their own; rows no FORWARD here could take are refused."""
    binds, _, _ = direct
    first, middle = _clients(binds[:2])
    foreign = Client(binds[1])
    try:
        seq = 73
        assert first.request("OPEN", seq=seq).ok and middle.request("OPEN", seq=seq).ok
        assert first.request("FORWARD", seq=seq, pos=0, tokens=[4, 5], send_rows=31).ok  # kept at the middle shard
        row = WireTensor.from_torch(torch.zeros(1, 64))
        for ticket in range(1000, 1100):  # more than one sender may park (2 x max_sequences + 8)
            _send(foreign, "ROWS", seq=999, pos=0, ticket=ticket, hidden=row)
        assert all(foreign.receive(10).ok for _ in range(1000, 1100))
        wide = foreign.request("ROWS", seq=999, pos=0, ticket=2000, hidden=WireTensor.from_torch(torch.zeros(4, 4096)))
        assert wide.error_code is ErrorCode.BAD_REQUEST and "[n, 64]" in wide.error_message
        assert middle.request("FORWARD", seq=seq, pos=0, rows_ticket=31, ticket_rows=2).result["length"] == 2
        assert middle.call("STATS").result["rows"]["parked"] <= 2 * 8 + 8
    finally:
        for client in (first, middle, foreign):
            client.close()


def test_a_wait_whose_rows_never_come_ends_at_its_deadline(direct):
    """--rows-wait 5: a FORWARD waiting for rows that never come is refused ROWS_MISSING after 5 s, and changes
    nothing: the sequence then takes its step from the first shard's rows."""
    binds, _, _ = direct
    first, middle = _clients(binds[:2])
    try:
        seq = 72
        assert first.request("OPEN", seq=seq).ok and middle.request("OPEN", seq=seq).ok
        started = time.monotonic()
        waiting = _send(middle, "FORWARD", seq=seq, pos=0, rows_ticket=21, ticket_rows=2)
        reply = middle.receive(20)
        assert reply.id == waiting and reply.error_code is ErrorCode.ROWS_MISSING
        assert 4.5 < time.monotonic() - started < 15 and "within 5 s" in reply.error_message
        assert first.request("FORWARD", seq=seq, pos=0, tokens=[4, 5], send_rows=22).ok
        assert middle.request("FORWARD", seq=seq, pos=0, rows_ticket=22, ticket_rows=2).result["length"] == 2
    finally:
        first.close()
        middle.close()


def test_rows_on_the_device_are_refused_by_a_cpu_shard_and_a_slot_rows_refuses_its_waiting_forward(direct):
    """The device ring (PROTOCOL.md, "Rows on the device") is a GPU shard's: a CPU shard answers RING with
    BAD_REQUEST (so its previous shard's rows go through the host, as they did above), and a ROWS naming a slot
    it has no ring for is refused, its ticket refused with it: the FORWARD waiting for those rows is refused
    ROWS_MISSING at once (not at --rows-wait) and changes nothing. The sender side on a CPU never asks."""
    from shardd.server.rows import RowsLink

    binds, _, _ = direct
    first, middle = clients = _clients(binds[:2])
    try:
        ring = middle.request("RING", rows=64, pid=1)
        assert ring.error_code is ErrorCode.BAD_REQUEST and "not a GPU" in ring.error_message
        seq = 74
        assert first.request("OPEN", seq=seq).ok and middle.request("OPEN", seq=seq).ok
        started = time.monotonic()
        waiting = _send(middle, "FORWARD", seq=seq, pos=0, rows_ticket=31, ticket_rows=2)
        link = RowsLink(binds[1], device_rows=64)
        try:
            link.send(Rows(id=0, seq=seq, pos=0, ticket=31, slot=0, slot_rows=2))
            reply = middle.receive(10)
            assert reply.id == waiting and reply.error_code is ErrorCode.ROWS_MISSING
            assert time.monotonic() - started < 4  # at once, not at --rows-wait 5
            link._open_ring()  # what a GPU sender does first: refused, so its rows go through the host
            assert link.ring is None and "not a GPU" in link.ring_problem
            assert not link.send_on_device([torch.zeros(2, 8)], lambda slot, gen: None)  # CPU rows: the host, no RING
        finally:
            link.close()
        assert middle.request("STATS").result["rows"]["ring_bytes"] == 0
        assert first.request("FORWARD", seq=seq, pos=0, tokens=[4, 5], send_rows=32).ok  # nothing changed
        assert middle.request("FORWARD", seq=seq, pos=0, rows_ticket=32, ticket_rows=2).result["length"] == 2
    finally:
        for client in clients:
            client.close()


class _StubRing:
    """A sender's ring stand-in (the CPU has none): every rows fit, slots taken in turn."""

    slots, rows, next = 2, 64, 0

    def __init__(self):
        self.generations = [0] * self.slots

    def fits(self, parts):
        return True

    def put(self, parts, timeout_s=1.0, own=None):
        slot, self.next = self.next, (self.next + 1) % self.slots
        self.generations[slot] += 1
        return slot


def test_a_sender_whose_slot_rows_are_refused_drops_its_ring_and_the_rows_count_as_refused(direct):
    """A ROWS naming a slot of a ring the receiver does not have (it restarted, say) is refused; the sender frees
    the slot on that answer and drops its ring (the next rows ask again, or go by host), and the receiver keeps
    the ticket as refused: a FORWARD that comes later for those rows is refused ROWS_MISSING at once, changing
    nothing."""
    from shardd.server.rows import RowsLink

    binds, _, _ = direct
    middle = Client(binds[1])
    link = RowsLink(binds[1], device_rows=64)
    try:
        seq = 75
        assert middle.request("OPEN", seq=seq).ok
        link.ring = _StubRing()
        assert link.send_on_device([torch.zeros(2, 8)], lambda slot, gen: Rows(id=0, seq=seq, pos=0, ticket=41,
                                                                               slot=slot, slot_rows=2, slot_gen=gen))
        assert link._acknowledged(0)  # the refusal answers the slot's ROWS
        assert link.ring is None and link.refused == 1 and link.on_device == 1
        assert not link.send_on_device([torch.zeros(2, 8)], lambda slot, gen: None)  # CPU rows now: by host
        started = time.monotonic()
        late = middle.request("FORWARD", seq=seq, pos=0, rows_ticket=41, ticket_rows=2)
        assert late.error_code is ErrorCode.ROWS_MISSING and time.monotonic() - started < 4
        assert middle.request("STATS").result["rows"]["on_device"] == 0
    finally:
        link.close()
        middle.close()


@pytest.mark.parametrize("batched", [False, True], ids=["one-sequence", "batch"])
def test_a_first_shard_that_stops_mid_step_leaves_the_sequence_inconsistent_and_the_next_shard_serving(tmp_path,
                                                                                                       batched):
    """The first shard stops (SIGSTOP, then SIGKILL) with a step's FORWARD (one sequence's, or a batch's) in its
    queue while the head waits for that step's rows: the coordinator gives up on the first shard after its
    liveness timeout and calls the sequence (every item of the batch) inconsistent (a later shard's fate is
    unknown after a failure that is not a refusal: the caller re-fills it); the head changed nothing and answers
    the coordinator's next request at once, its wait ended."""
    import signal

    from coordinator.relay.pipeline import BatchForward, SequenceInconsistent

    binds = [f"ipc://{tmp_path}/first.sock", f"ipc://{tmp_path}/head.sock"]
    daemons = start_daemons({
        "first": (binds[0], ["--layers", "0:3", "--relay-to", binds[1]]),
        "head": (binds[1], ["--layers", "3:6", "--rows-wait", "60"]),
    }, tmp_path)
    try:
        with Pipeline.connect(binds, timeout_s=30, liveness_timeout_s=2) as pipeline:
            assert pipeline.direct_rows
            for seq in (1, 2):
                pipeline.open(seq)
                pipeline.forward(seq, 0, PROMPT[:5])
            daemons["first"].signal(signal.SIGSTOP)
            started = time.monotonic()
            if batched:
                results = pipeline.forward_batch([BatchForward(1, 5, [3]), BatchForward(2, 5, [4])])
                assert all(isinstance(result, SequenceInconsistent) for result in results), results
            else:
                with pytest.raises(SequenceInconsistent):
                    pipeline.forward(1, 5, [3])
            assert time.monotonic() - started < 20
            daemons["first"].signal(signal.SIGKILL)
            head = pipeline.clients[1]
            started = time.monotonic()
            rows = head.stats()["rows"]  # the head's wait ends with this request, refused, its reply dropped
            assert time.monotonic() - started < 5 and rows["waiting"] == 0 and rows["missing"] >= 1
            with pytest.raises(ShardError) as refused:  # the head is still at 5: it took nothing of the step
                head.forward(1, 6, hidden=WireTensor.from_torch(torch.zeros(1, pipeline.hidden_size)))
            assert refused.value.code is ErrorCode.POSITION_MISMATCH and "committed length is 5" in str(refused.value)
    finally:
        stop_all(daemons.values())


# ---- a batch's rows from shard to shard ---------------------------------------------------------------------


def test_batches_of_rows_from_shard_to_shard_give_the_coordinator_relay_s_tokens(direct):
    """Several streams through the scheduler (batched FORWARDs, greedy and oracle speculative with checkpoint
    rollbacks) over daemons that send each batch's rows on as one ROWS: the tokens of the coordinator relaying
    them, and no rows went missing."""
    from coordinator.drafting.drafters import OracleDrafter
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import decode_all

    binds, _, _ = direct
    prompts = [PROMPT[i:i + 9 + i] for i in range(5)]

    def run(pipeline, references=None):
        drafters = [None] * len(prompts) if references is None else [
            OracleDrafter.with_mean_commit(ref, len(p), block_size=BLOCK, mean_commit=3.0)
            for ref, p in zip(references, prompts)]
        requests = [Request(p, 10, block_size=BLOCK, drafter=d) for p, d in zip(prompts, drafters)]
        return [r.tokens for r in decode_all(pipeline, requests, max_sequences=len(prompts), rollback="checkpoint")]

    with Pipeline.connect(binds) as relayed:
        relayed.direct_rows = False
        reference = run(relayed)
    with Pipeline.connect(binds) as pipeline:
        assert pipeline.direct_rows
        before = [client.stats()["rows"] for client in pipeline.clients]
        assert run(pipeline) == reference
        assert run(pipeline, reference) == reference
        after = [client.stats()["rows"] for client in pipeline.clients]
    sent = [a["sent"] - b["sent"] for a, b in zip(after, before)]
    assert sent[0] == sent[1] > 0 and sent[2] == 0
    assert [a["received"] - b["received"] for a, b in zip(after, before)] == [0, sent[0], sent[1]]
    assert all(a["missing"] == b["missing"] and a["waiting"] == 0 for a, b in zip(after, before))


def test_one_sequence_is_a_batch_of_one_on_the_one_sequence_wire_both_ways(direct):
    """`forward`, and `forward_batch` of one item, send each shard a plain FORWARD (no batch on the wire: STATS
    `batches` unchanged), two items one batched FORWARD a shard; shard to shard and through the coordinator alike,
    with the same ids for each sequence whichever way it went."""
    from coordinator.relay.pipeline import BatchForward

    binds, _, _ = direct
    ids = {}
    for direct_rows in (True, False):
        with Pipeline.connect(binds) as pipeline:
            assert pipeline.direct_rows
            pipeline.direct_rows = direct_rows
            seqs = [61, 62, 63]
            for seq in seqs:
                pipeline.open(seq)
            try:
                before = [client.stats()["batches"]["requests"] for client in pipeline.clients]
                alone = pipeline.forward(61, 0, PROMPT[:7])
                [one] = pipeline.forward_batch([BatchForward(62, 0, PROMPT[:5])])
                middle = [client.stats()["batches"]["requests"] for client in pipeline.clients]
                two = pipeline.forward_batch([BatchForward(61, 7, [PROMPT[7]]), BatchForward(63, 0, PROMPT[:3])])
                after = [client.stats()["batches"]["requests"] for client in pipeline.clients]
            finally:
                _close_everywhere(pipeline, seqs)
        assert middle == before and [a - m for a, m in zip(after, middle)] == [1, 1, 1]
        ids[direct_rows] = (list(alone), list(one), [list(x) for x in two])
    assert ids[True] == ids[False]
    assert len(ids[True][0]) == 7 and len(ids[True][1]) == 5 and [len(x) for x in ids[True][2]] == [1, 3]


def _close_everywhere(pipeline, seqs) -> None:
    """Each sequence closed on every shard that still has it (the module's daemons hold 8 at most)."""
    for client in pipeline.clients:
        for seq in seqs:
            try:
                client.close(seq)
            except ShardError:  # not open there (closed on that shard by the test)
                pass


def test_a_batch_item_a_shard_refuses_is_refused_after_it_alone(direct):
    """Pipeline.forward_batch through shard-to-shard rows: an item the first shard refuses (wrong pos) and one
    the middle shard refuses (its sequence is not open there) fail alone with their own errors; the first is
    unchanged everywhere, the second rolled back on the first shard (a checkpointed step); the others ran, with
    the ids each gives alone."""
    from coordinator.relay.pipeline import BatchForward

    binds, _, _ = direct
    with Pipeline.connect(binds) as pipeline:
        seqs = [81, 82, 83, 84]
        for seq in seqs:
            pipeline.open(seq)
        for seq in seqs:
            pipeline.forward(seq, 0, PROMPT[:4])
        pipeline.clients[1].close(83)  # the middle shard no longer has sequence 83
        block = PROMPT[4:8]
        results = pipeline.forward_batch([
            BatchForward(81, 4, block, checkpoint=True), BatchForward(82, 7, block, checkpoint=True),
            BatchForward(83, 4, block, checkpoint=True), BatchForward(84, 4, block[:1])])
        assert isinstance(results[1], ShardError) and results[1].code is ErrorCode.POSITION_MISMATCH
        assert isinstance(results[2], Exception) and "NO_SUCH_SEQUENCE" in str(results[2])
        assert len(results[3]) == 1
        # the refused items changed nothing: 82 steps from 4 through every shard, 83 from 4 on the first shard
        assert len(pipeline.forward(82, 4, block)) == len(block)
        assert pipeline.clients[0].forward(83, 4, tokens=[1]).result["length"] == 5
        pipeline.rollback(81, 0)  # the same step alone gives the batch's ids
        assert list(pipeline.forward(81, 4, block, checkpoint=True)) == list(results[0])
        _close_everywhere(pipeline, seqs)


def test_a_batched_forward_waits_for_its_batch_s_rows_and_an_item_without_rows_is_refused_alone(direct):
    """On the wire: a batched FORWARD with rows_ticket (each item's `rows`) waits for one ROWS of that ticket; the
    first shard's batch with send_rows sends the rows of the items that ran, so an item it refused is refused
    ROWS_MISSING after it, alone and changing nothing; a batch none of whose items ran sends a refused ROWS, and
    every item after it is refused. Refused whole, by name: rows_ticket with tensor hidden, send_rows on a
    CAPTURE batch, a batched ROWS whose items name different tickets."""
    import msgpack

    from protocol import Rows, RowsBatch
    from protocol.tensors import row_slice

    binds, _, _ = direct
    first, middle = clients = _clients(binds[:2])
    seqs = (91, 92)
    try:
        for client in clients:
            for seq in seqs:
                assert client.request("OPEN", seq=seq).ok

        def waiting_batch(ticket, pos=0):
            items = tuple(Forward(0, seq=seq, pos=pos, rows_ticket=ticket, ticket_rows=2) for seq in seqs)
            request_id = middle.next_id()
            middle.send_frames(encode_request(ForwardBatch(id=request_id, items=items, rows_ticket=ticket)))
            return request_id

        waits = waiting_batch(31)
        bad_pos = (Forward(0, seq=91, pos=0, tokens=[1, 2]), Forward(0, seq=92, pos=5, tokens=[1, 2]))
        sent = first.exchange(encode_request(ForwardBatch(id=first.next_id(), items=bad_pos, send_rows=31)))
        assert sent.result["items"][0]["rows_sent"] and "hidden" not in sent.tensors
        assert sent.result["items"][1]["error"]["code"] == "POSITION_MISMATCH"
        reply = middle.receive(10)
        assert reply.id == waits and reply.result["items"][0]["length"] == 2
        assert reply.result["items"][1]["error"]["code"] == "ROWS_MISSING"
        assert "nothing changed" in reply.result["items"][1]["error"]["message"]
        # nothing ran: a refused ROWS, every item refused after it
        waits = waiting_batch(32, pos=2)
        both_bad = tuple(Forward(0, seq=seq, pos=9, tokens=[1, 2]) for seq in seqs)
        first.exchange(encode_request(ForwardBatch(id=first.next_id(), items=both_bad, send_rows=32)))
        reply = middle.receive(10)
        assert reply.id == waits and [item["error"]["code"] for item in reply.result["items"]] == ["ROWS_MISSING"] * 2
        # 92 still steps from 0 on both shards: the refusals changed nothing
        assert first.request("FORWARD", seq=92, pos=0, tokens=[1, 2], send_rows=33).result["rows_sent"]
        assert middle.request("FORWARD", seq=92, pos=0, rows_ticket=33, ticket_rows=2).result["length"] == 2
        # refused whole
        hidden = WireTensor.from_torch(torch.zeros(2, 64))
        header = {"v": 1, "type": "FORWARD", "id": 1, "rows_ticket": 5, "items": [{"seq": 91, "pos": 2, "rows": 2}],
                  "tensors": [hidden.descriptor("hidden")]}
        refused = middle.exchange([msgpack.packb(header), hidden.data])
        assert refused.error_code is ErrorCode.BAD_REQUEST and "not from tensor 'hidden'" in refused.error_message
        header = {"v": 1, "type": "CAPTURE", "id": 2, "send_rows": 5,
                  "items": [{"seq": 91, "pos": 2, "tokens": [1], "layers": [0]}]}
        refused = first.exchange([msgpack.packb(header)])
        assert refused.error_code is ErrorCode.BAD_REQUEST and "'send_rows'" in refused.error_message
        rows = WireTensor.from_torch(torch.zeros(2, 64))
        mixed = RowsBatch(id=3, items=(Rows(0, seq=91, pos=2, ticket=7, hidden=row_slice(rows, 0, 1)),
                                       Rows(0, seq=92, pos=2, ticket=8, hidden=row_slice(rows, 1, 1))))
        refused = middle.exchange(encode_request(mixed))
        assert refused.error_code is ErrorCode.BAD_REQUEST and "share one ticket" in refused.error_message
    finally:
        for client in clients:
            for seq in seqs:
                client.request("CLOSE", seq=seq)
            client.close()



def test_batches_with_refused_items_end_alike_relayed_and_shard_to_shard(direct):
    """Seeded batches of items, some refused by the first shard (a wrong pos), some by the middle one (their
    sequence closed there), through the coordinator's relay and through shard-to-shard rows: every item ends
    the same way (the same ids, or an error of the same kind), and afterwards every sequence still consistent
    steps on from where its outcome left it, identically in both."""
    import random

    from coordinator.relay.pipeline import BatchForward

    binds, _, _ = direct

    def scenario(pipeline, base, rng):
        seqs = [base + i for i in range(5)]
        for seq in seqs:
            pipeline.open(seq)
            pipeline.forward(seq, 0, PROMPT[:3])
        closed_middle = {seq for seq in seqs if rng.random() < 0.2}
        for seq in closed_middle:
            pipeline.clients[1].close(seq)
        items = [BatchForward(seq, 3 if rng.random() < 0.7 else 9, PROMPT[3:3 + rng.randint(1, 4)],
                              checkpoint=rng.random() < 0.5) for seq in seqs]
        outcomes = [list(result) if not isinstance(result, Exception) else type(result).__name__
                    for result in pipeline.forward_batch(items)]
        after = []  # the sequences the batch left consistent step on, from their length
        for item, outcome in zip(items, outcomes):
            if item.seq in closed_middle or outcome == "SequenceInconsistent":
                continue
            length = item.pos + len(item.tokens) if isinstance(outcome, list) else 3
            after.append(list(pipeline.forward(item.seq, length, [7])))
        _close_everywhere(pipeline, seqs)
        return outcomes, after

    kinds = set()
    for round_ in range(6):
        with Pipeline.connect(binds) as relayed:
            relayed.direct_rows = False
            expected = scenario(relayed, 1000 + 10 * round_, random.Random(round_))
        with Pipeline.connect(binds) as pipeline:
            assert pipeline.direct_rows
            assert scenario(pipeline, 2000 + 10 * round_, random.Random(round_)) == expected, round_
        kinds |= {outcome if isinstance(outcome, str) else "ids" for outcome in expected[0]}
    assert kinds == {"ids", "ShardError", "SequenceInconsistent"}  # the rounds met every ending


# ---- rows on the device (PROTOCOL.md, "Rows on the device"): GPU only ----------------------------------------


@pytest.mark.gpu
def test_rows_through_the_device_ring_give_the_host_rows_tokens(tmp_path):
    """Three fast bf16 daemons on the GPU, each sending its rows on through the next one's device ring: greedy,
    speculative (checkpoint rollbacks) and a batch of streams give the tokens of the same daemons with the rows
    through the host (a second set whose later shards lend no ring, being under --max-gpu-memory: the first one
    asks, is refused, and goes by host), every step's rows in a slot (STATS `rows`). The ring set shares a relay
    key: its RING and slot ROWS come on the connection that presented it."""
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import decode_all

    sets = {}
    for name in ("ring", "host"):
        workdir = tmp_path / name
        workdir.mkdir()
        binds = [f"ipc://{workdir}/s{k}.sock" for k in range(3)]
        layers = ["0:2", "2:4", "4:6"]
        keyed = ["--relay-key", str(write_relay_key(workdir / "relay.key"))] if name == "ring" else []
        specs = {f"{name}{k}": (bind, [*keyed, "--layers", layers[k], "--engine", "fast", "--device", "cuda:0",
                                       "--dtype", "bfloat16", "--rollback-mode", "checkpoint", "--max-verify-tokens",
                                       str(BLOCK),
                                       # the host set's first shard asks for a ring and is refused
                                       *(["--max-gpu-memory", "0.25"] if name == "host" and k else []),
                                       *(["--relay-to", binds[k + 1]] if k < 2 else [])])
                 for k, bind in enumerate(binds)}
        sets[name] = (binds, start_daemons(specs, workdir))
    try:
        tokens = {}
        for name, (binds, _) in sets.items():
            with Pipeline.connect(binds) as pipeline:
                greedy = greedy_decode(pipeline, 1, PROMPT, 12).tokens
                drafter = make_drafter("oracle", prompt_len=len(PROMPT), reference=greedy, block_size=BLOCK,
                                       mean_commit=3.0, seed=1)
                spec = speculative_decode(pipeline, 2, PROMPT, drafter, block_size=BLOCK, max_new_tokens=12)
                prompts = [PROMPT[:10 + k] for k in range(4)]
                batch = [r.tokens for r in decode_all(pipeline, [Request(p, 8) for p in prompts])]
                tokens[name] = (greedy, spec.tokens, batch)
                stats = [client.stats()["rows"] for client in pipeline.clients]
            if name == "ring":
                assert [s["ring_to_next"] for s in stats[:2]] == ["on", "on"]
                assert stats[0]["sent_on_device"] == stats[0]["sent"] > 0
                assert stats[1]["on_device"] == stats[1]["received"] and stats[2]["on_device"] == stats[2]["received"]
                # the GPU's front end waits where the driver can (no SM taken), else the host
                from shardd.server.ring import front_end_waits

                waits = "device" if front_end_waits() else "host"
                assert stats[1]["ring_wait"] == stats[2]["ring_wait"] == waits
                assert all(s["missing"] == 0 and s["forbidden"] == 0 for s in stats)
            else:
                assert stats[0]["sent_on_device"] == 0 and "--max-gpu-memory" in stats[0]["ring_to_next"]
        assert tokens["ring"] == tokens["host"]
        assert tokens["ring"][1] == tokens["ring"][0]
    finally:
        for _, daemons in sets.values():
            stop_all(daemons.values())


# ---- rows only from the previous shard (--relay-key; PROTOCOL.md, "Who may do what") -------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Two daemons of the tiny model sharing a relay key, the first sending its rows to the second."""
    workdir = tmp_path_factory.mktemp("keyed")
    key = write_relay_key(workdir / "relay.key")
    binds = [free_tcp_endpoint(), free_tcp_endpoint()]
    common = ["--rollback-mode", "checkpoint", "--max-verify-tokens", str(BLOCK), "--rows-wait", "5",
              "--relay-key", str(key)]
    args = [["--layers", "0:3", "--relay-to", binds[1], *common], ["--layers", "3:6", *common]]
    daemons = start_daemons({f"shard{k}": (binds[k], args[k]) for k in range(2)}, workdir)
    daemons = list(daemons.values())
    try:
        yield binds, daemons, args, workdir
    finally:
        stop_all(daemons)


def _relayed_and_direct(binds) -> tuple[list, list, int]:
    """Greedy tokens with the coordinator carrying the rows, then with the daemons passing them on, and how many
    ROWS the second shard took meanwhile."""
    with Pipeline.connect(binds) as relayed:
        relayed.direct_rows = False
        reference = greedy_decode(relayed, 1, PROMPT, 12).tokens
    with Pipeline.connect(binds) as pipeline:
        assert pipeline.direct_rows
        before = pipeline.clients[1].stats()["rows"]["received"]
        tokens = greedy_decode(pipeline, 1, PROMPT, 12).tokens
        return reference, tokens, pipeline.clients[1].stats()["rows"]["received"] - before


def test_rows_are_taken_only_from_the_shard_that_presented_the_relay_key(keyed):
    """Was: a daemon took ROWS from any connection. With --relay-key, ROWS and RING from a connection that did not
    present the key (nor a wrong key in HELLO) are refused FORBIDDEN and counted, and change nothing: the FORWARD
    waiting for that ticket still waits and takes the real previous shard's rows; decoding over the keyed shards
    gives the tokens of the coordinator carrying the rows."""
    binds, _, _, _ = keyed
    reference, tokens, received = _relayed_and_direct(binds)
    assert tokens == reference and received == len(reference)  # the prefill and every step after it, shard to shard
    first, head, foreign = Client(binds[0]), Client(binds[1]), Client(binds[1])
    try:
        assert all(client.call("HELLO").result["rows_from_key"] for client in (first, head))
        seq = 81
        assert first.request("OPEN", seq=seq).ok and head.request("OPEN", seq=seq).ok
        before = foreign.call("STATS").result["rows"]
        waiting = _send(head, "FORWARD", seq=seq, pos=0, rows_ticket=41, ticket_rows=2)
        forged = foreign.request("ROWS", seq=seq, pos=0, ticket=41, hidden=WireTensor.from_torch(torch.ones(2, 64)))
        assert forged.error_code is ErrorCode.FORBIDDEN and "nothing changed" in forged.error_message
        refused = foreign.request("ROWS", seq=seq, pos=0, ticket=41, refused=True)
        assert refused.error_code is ErrorCode.FORBIDDEN
        assert foreign.request("RING", rows=16, pid=1).error_code is ErrorCode.FORBIDDEN
        wrong = foreign.request("HELLO", relay_key="0" * 64)
        assert wrong.error_code is ErrorCode.FORBIDDEN and "relay_key" in wrong.error_message
        assert foreign.request("ROWS", seq=seq, pos=0, ticket=41, refused=True).error_code is ErrorCode.FORBIDDEN
        assert head.receive(0.3) is None  # still waiting: the forged rows did not end its wait
        after = foreign.call("STATS").result["rows"]
        assert after["forbidden"] - before["forbidden"] == 5 and after["parked"] == before["parked"]
        assert first.request("FORWARD", seq=seq, pos=0, tokens=[4, 5], send_rows=41).result["rows_sent"]
        reply = head.receive(10)
        assert reply.id == waiting and reply.ok and reply.result["length"] == 2
    finally:
        for client in (first, head, foreign):
            client.close()


def test_a_restarted_shard_presents_its_key_again_and_the_rows_still_pass(keyed):
    """The receiving shard killed and started again on its endpoint (as the supervisor does): the sender's link
    presents the key on its new connection; the sending shard restarted: its new link presents it. Each time the
    rows go shard to shard again and the tokens are unchanged."""
    binds, daemons, args, workdir = keyed
    for index in (1, 0):
        kill_and_replace(daemons, index, f"shard{index}-again", args[index], workdir)
        reference, tokens, received = _relayed_and_direct(binds)
        assert tokens == reference and received == len(reference), daemons[index].output()
        assert "FORBIDDEN" not in daemons[1].output()


def test_a_launched_set_passes_its_rows_under_a_key_of_its_own():
    """`launched_sets` writes one key per set (0600, in its run directory) and gives it to every shard: the head
    takes ROWS only from the shard before it, and decoding gives the coordinator relay's tokens."""
    with launched_sets([ShardSet(TINY, even_split(6, 2), "tcp")], ready_timeout_s=120, supervise=False) as (pair,):
        keys = {shard.command[shard.command.index("--relay-key") + 1] for shard in pair}
        assert len(keys) == 1 and os.stat(keys.pop()).st_mode & 0o777 == 0o600
        binds = [shard.endpoint for shard in pair]
        reference, tokens, received = _relayed_and_direct(binds)
        assert tokens == reference and received == len(reference)
        foreign = Client(binds[1])
        try:
            assert foreign.call("HELLO").result["rows_from_key"]
            forged = foreign.request("ROWS", seq=1, pos=0, ticket=1, hidden=WireTensor.from_torch(torch.ones(1, 64)))
            assert forged.error_code is ErrorCode.FORBIDDEN
        finally:
            foreign.close()


def _key_file(path: Path, mode: int = 0o600, key: str | None = None) -> Path:
    path.write_text((key or secrets.token_hex(32)) + "\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("case, message", [
    ("missing", "cannot read it: No such file or directory"),
    ("directory", "not a regular file"),
    ("world-readable", "mode 0644 lets other users read or write the key; make it 0600"),
    ("group-readable", "mode 0640 lets other users read or write the key"),
    ("unreadable", "cannot read it: Permission denied"),
    ("short", "the key must be 32 to 128 printable characters"),
    ("with-curve", "does not go with --curve-secret-key"),
])
def test_a_relay_key_file_that_cannot_serve_refuses_the_start_in_one_line(tmp_path, case, message):
    if case == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads a file of any mode")
    from click.testing import CliRunner

    from shardd.cli import main

    path = {"missing": lambda: tmp_path / "nothing.key", "directory": lambda: tmp_path,
            "world-readable": lambda: _key_file(tmp_path / "k", 0o644),
            "group-readable": lambda: _key_file(tmp_path / "k", 0o640),
            "unreadable": lambda: _key_file(tmp_path / "k", 0o000),
            "short": lambda: _key_file(tmp_path / "k", key="0123"),
            "with-curve": lambda: _key_file(tmp_path / "k")}[case]()
    curve = ["--curve-secret-key", str(_key_file(tmp_path / "server.key_secret"))] if case == "with-curve" else []
    result = CliRunner().invoke(main, ["serve", *TINY, "--bind", free_tcp_endpoint(), *curve, "--relay-key", str(path)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--relay-key" in errors[0] and message in errors[0], result.stderr
    assert case == "with-curve" or str(path) in errors[0]


# ---- flags that were removed ---------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value, now", [
    ("--ring-wait", "host", "always wait for ring rows on the device"),
    ("--device-rows", "0", "always go through the next shard's device ring"),
])
def test_a_removed_relay_flag_is_refused_in_one_line_naming_what_happens_now(flag, value, now):
    """A script that still passes a removed flag is told, in one line, what the daemon does now, and nothing
    starts (a usage error's exit code); the flag is not in --help."""
    from click.testing import CliRunner

    from shardd.cli import main

    result = CliRunner().invoke(main, ["serve", *TINY, flag, value])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {flag} was removed: ") and now in lines[0]
    assert lines[0].endswith("; drop the flag")
    assert flag not in CliRunner().invoke(main, ["serve", "--help"]).output


def test_a_capture_s_layers_ride_with_its_rows_to_the_next_shard(direct):
    """`carry`: the first shard's CAPTURE of layer 1 sends its rows and layer 1's outputs on (tensor `carried` of
    its ROWS); the middle shard's CAPTURE of layer 3 passes them on with its own (a head hosting the drafter takes
    them as its `carried`: tests/integration/test_groups.py's DFlash in-reply test, tokens equal to the relay through
    the coordinator). Refused, changing nothing: `carry` without send_rows, a FORWARD with nothing to carry, a ROWS
    whose `carried` is not the shard's width, `carries` without `carried`, and carried rows for a FORWARD."""
    binds, _, _ = direct
    first, middle, head = _clients(binds)
    try:
        seq = 74
        for client in (first, middle, head):
            assert client.request("OPEN", seq=seq).ok
        refused = first.request("CAPTURE", seq=seq, pos=0, tokens=[4, 5], layers=[1], carry=True)
        assert refused.error_code is ErrorCode.BAD_REQUEST and "send_rows" in refused.error_message
        empty = first.request("FORWARD", seq=seq, pos=0, tokens=[4, 5], carry=True, send_rows=40)
        assert empty.error_code is ErrorCode.BAD_REQUEST and "neither took in nor captures" in empty.error_message
        one = first.request("CAPTURE", seq=seq, pos=0, tokens=[4, 5], layers=[1], carry=True, send_rows=41)
        assert one.ok and one.result["rows_sent"] and one.result["length"] == 2
        two = middle.request("CAPTURE", seq=seq, pos=0, rows_ticket=41, ticket_rows=2, layers=[3], carry=True,
                             send_rows=42)
        assert two.ok and two.result["length"] == 2
        # what reached the head: ROWS with the rows and carried [2, 2 x 64] (layer 1's, then layer 3's)
        stats = head.call("STATS").result["rows"]
        assert stats["parked"] >= 1
        wide = head.request("ROWS", seq=999, pos=0, ticket=43, hidden=WireTensor.from_torch(torch.zeros(1, 64)),
                            carried=WireTensor.from_torch(torch.zeros(1, 65)), carries=True)
        assert wide.error_code is ErrorCode.BAD_REQUEST and "k * 64" in wide.error_message
        bare = head.request("ROWS", seq=999, pos=0, ticket=44, hidden=WireTensor.from_torch(torch.zeros(1, 64)),
                            carries=True, validate=False)
        assert bare.error_code is ErrorCode.BAD_REQUEST and "carries" in bare.error_message
        got = head.request("FORWARD", seq=seq, pos=0, rows_ticket=42, ticket_rows=2)
        assert got.error_code is ErrorCode.BAD_REQUEST and "only a CAPTURE takes them" in got.error_message
        assert head.call("STATS").result["open_sequences"] >= 1
    finally:
        for client in (first, middle, head):
            client.request("CLOSE", seq=74)
            client.close()
