"""The relay between the coordinator and its daemons (issue 15): where a request's time goes (phase clocks at
both ends, STATS `phases`), over real `shardd serve` daemons on real sockets."""

from __future__ import annotations

import pytest

from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafters import make_drafter
from coordinator.launch import ShardSet, launched_sets
from coordinator.pipeline import Pipeline
from coordinator.target import RollbackFailed
from protocol import RECORD_TYPES, ErrorCode, MessageType, encode_request, pure_chain
from protocol.layout import even_split
from protocol.timing import per_request_ms
from tests.daemons import Client, Daemon, free_tcp_endpoint, kill_and_replace, stop_all

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
