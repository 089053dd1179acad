"""The relay between the coordinator and its daemons (issue 15): where a request's time goes (phase clocks at
both ends, STATS `phases`), over real `shardd serve` daemons on real sockets."""

from __future__ import annotations

import pytest

from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafters import make_drafter
from coordinator.launch import ShardSet, launched_sets
from coordinator.pipeline import Pipeline
from protocol.layout import even_split
from protocol.timing import per_request_ms

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
