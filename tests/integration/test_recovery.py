"""A shard that dies and is restarted mid-generation: the coordinator keeps every committed token, re-fills
the restarted shard from that history, and the output is exactly plain greedy decoding (README, "Running it")."""

from __future__ import annotations


import pytest

from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafting.drafters import OracleDrafter
from coordinator.relay.pipeline import Pipeline
from shardd.weights.loading import ModelSource
from shardd.local import LocalTarget
from tests.support.daemons import Daemon, free_tcp_endpoint, kill_and_replace, stop_all

PROMPT = list(b"restart me, then carry on: ")
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def expected():
    return greedy_decode(LocalTarget(ModelSource(synthetic="tiny")), 1, PROMPT, NEW_TOKENS).tokens


def ready_daemons(names: list[str], args: list[list[str]], workdir) -> tuple[list[str], list[Daemon]]:
    """One daemon per name on a free loopback port, each ready: their endpoints and the daemons."""
    binds = [free_tcp_endpoint() for _ in names]
    daemons = [Daemon(name, bind, arguments, workdir) for name, bind, arguments in zip(names, binds, args)]
    try:
        for daemon in daemons:
            daemon.wait_ready()
    except BaseException:
        stop_all(daemons)
        raise
    return binds, daemons


def restart_after_third_commit(daemons: list[Daemon], name: str, args: list[str], workdir):
    """An on_commit callback that, mid-generation, kills daemons[1] and starts `name` with `args` in its place."""
    commits = []

    def on_commit(new_ids):
        commits.append(new_ids)
        if len(commits) == 3:
            kill_and_replace(daemons, 1, name, args, workdir)

    return on_commit


@pytest.mark.parametrize("mode", ["checkpoint"])  # every mode: tests/unit/test_decoding.py
def test_killed_and_restarted_shard_is_refilled(tmp_path, expected, mode):
    args = [["--layers", "0:3", "--max-verify-tokens", "16"], ["--layers", "3:6", "--max-verify-tokens", "16"]]
    binds, daemons = ready_daemons(["shard0", "shard1"], args, tmp_path)
    try:
        pipeline = Pipeline.connect(binds, timeout_s=30.0)
        # the head shard loses every sequence
        kill_and_restart_second_shard = restart_after_third_commit(daemons, "shard1-restarted", args[1], tmp_path)
        drafter = OracleDrafter.with_mean_commit(expected, len(PROMPT), block_size=8, mean_commit=3.0, seed=1)
        result = speculative_decode(pipeline, 7, PROMPT, drafter, block_size=8, rollback=mode,
                                    max_new_tokens=NEW_TOKENS, on_commit=kill_and_restart_second_shard)
        pipeline.disconnect()
        assert result.tokens == expected
        assert result.recoveries >= 1
    finally:
        stop_all(daemons)


def test_killed_and_restarted_drafter_daemon_is_refilled(tmp_path, expected):
    """A separate DFlash drafter daemon restarts: PROPOSE answers NO_SUCH_SEQUENCE, the loop re-fills
    target and drafter from the history, and the output is unchanged."""
    from coordinator.relay.client import ShardClient
    from coordinator.drafting.dflash import DFlashDrafterClient

    shard_args = ["--layers", "0:6", "--max-verify-tokens", "16"]
    drafter_args = ["--layers", "none", "--draft", "synthetic"]
    binds, daemons = ready_daemons(["shard", "drafter"], [shard_args, drafter_args], tmp_path)
    try:
        kill_and_restart_drafter = restart_after_third_commit(daemons, "drafter-restarted", drafter_args, tmp_path)
        with Pipeline.connect(binds[:1], timeout_s=30.0) as pipeline, ShardClient(binds[1], timeout_s=30.0) as client:
            drafter = DFlashDrafterClient(client, pipeline)
            result = speculative_decode(drafter.target, 9, PROMPT, drafter, block_size=8, rollback="checkpoint",
                                        max_new_tokens=NEW_TOKENS, on_commit=kill_and_restart_drafter)
        assert result.tokens == expected
        assert result.recoveries >= 1
    finally:
        stop_all(daemons)


def test_dflash_streams_in_the_scheduler_are_refilled_after_the_head_shard_restarts(tmp_path, expected):
    """The head shard, which hosts the drafter, is killed and restarted while two DFlash streams (proposals in the
    verify reply) and a greedy one share the scheduler's steps: each is re-filled (the DFlash ones through their
    drafter's target, so the features are captured again and the new drafter's context is built again) and every
    output is plain greedy decoding."""
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import decode_all

    args = [["--layers", "0:3", "--max-verify-tokens", "16"],
            ["--layers", "3:6", "--max-verify-tokens", "16", "--draft", "synthetic"]]
    binds, daemons = ready_daemons(["shard0", "shard1"], args, tmp_path)
    try:
        kill_and_restart_head_shard = restart_after_third_commit(daemons, "shard1-restarted", args[1], tmp_path)
        with Pipeline.connect(binds, timeout_s=30.0) as pipeline:
            first = DFlashDrafterClient(pipeline.clients[1], pipeline)
            assert first.proposes_in_reply
            requests = [Request(PROMPT, NEW_TOKENS, drafter=first, block_size=8, on_commit=kill_and_restart_head_shard),
                        Request(PROMPT, NEW_TOKENS, drafter=first.fresh(), block_size=8), Request(PROMPT, NEW_TOKENS)]
            results = decode_all(pipeline, requests)
            stats = pipeline.stats()
        assert [result.tokens for result in results] == [expected] * 3
        assert all(result.recoveries >= 1 for result in results)
        assert sum(request.drafter.proposals_in_reply for request in requests[:2]) > 0
        assert stats[1]["drafter"]["proposals_in_reply"] > 0  # the restarted shard's drafter answered in replies too
        assert all(shard["open_sequences"] == 0 for shard in stats)
    finally:
        stop_all(daemons)


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_dflash_streams_fall_back_to_plain_decoding_when_their_drafter_daemon_fails(tmp_path, expected, caplog, fault):
    """The drafter's own daemon is killed (and not restarted) or stopped (SIGSTOP: it hangs) while two DFlash streams
    and a greedy one share the scheduler's steps: the failure is logged in one line naming the drafter, both DFlash
    streams go on without drafts (after a hang only the first waits out the timeout), and every output is plain
    greedy decoding."""
    import logging
    import signal
    import time

    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.relay.client import ShardClient
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import decode_all

    args = [["--layers", "0:6", "--max-verify-tokens", "16"], ["--layers", "none", "--draft", "synthetic"]]
    binds, daemons = ready_daemons(["shard", "drafter"], args, tmp_path)
    timeout_s = 3.0
    commits = []

    def fail_the_drafter(ids):
        commits.append(ids)
        if len(commits) == 3:
            if fault == "killed":
                daemons[1].signal(signal.SIGKILL)
                daemons[1].wait(10)
            else:
                daemons[1].signal(signal.SIGSTOP)

    try:
        with Pipeline.connect(binds[:1], timeout_s=30.0) as pipeline, \
                ShardClient(binds[1], timeout_s=timeout_s) as client, caplog.at_level(logging.WARNING, "shardctl"):
            first = DFlashDrafterClient(client, pipeline)
            requests = [Request(PROMPT, NEW_TOKENS, drafter=first, block_size=8, on_commit=fail_the_drafter),
                        Request(PROMPT, NEW_TOKENS, drafter=first.fresh(), block_size=8), Request(PROMPT, NEW_TOKENS)]
            started = time.monotonic()
            results = decode_all(pipeline, requests)
            elapsed = time.monotonic() - started
            open_after = pipeline.stats()[0]["open_sequences"]
        assert [result.tokens for result in results] == [expected] * 3
        assert [result.drafter_failed for result in results] == [True, True, False]
        lines = [r.getMessage() for r in caplog.records if "drafter" in r.getMessage()]
        assert len(lines) == 1 and binds[1] in lines[0] and "without drafts" in lines[0], lines
        assert open_after == 0
        if fault == "hung":
            assert elapsed < 2.5 * timeout_s + 20, elapsed  # one timeout, not one per stream
    finally:
        if fault == "hung":
            daemons[1].signal(signal.SIGCONT)
        stop_all(daemons)
