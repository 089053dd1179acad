"""Micro-batches in flight (PROTOCOL.md, "Micro-batches"): the scheduler keeps one group's step in each shard of a
chain that passes its rows on itself; every stream's tokens are those of the same request alone, whatever the
grouping, and a shard that dies mid-run is re-filled while the other groups go on. Over real `shardd serve`
daemons on loopback."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from coordinator.drafting.drafters import OracleDrafter
from coordinator.relay.pipeline import Pipeline
from coordinator.sampling import Sampling
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import Scheduler, decode_all
from tests.support.daemons import Daemon, free_tcp_endpoint, kill_and_replace, start_daemons, stop_all

BLOCK = 8
PROMPTS = [list(b"The quick brown fox jumps over the lazy dog")[i:i + 7 + 2 * i] for i in range(6)]
LAYERS = ["0:2", "2:4", "4:6"]


def _args(k: int, binds: list[str], mode: str) -> list[str]:
    return ["--layers", LAYERS[k], "--rollback-mode", mode, "--max-verify-tokens", str(BLOCK), "--rows-wait", "30",
            *(["--relay-to", binds[k + 1]] if k < len(binds) - 1 else [])]


def _chain(workdir, mode: str = "checkpoint"):
    binds = [f"ipc://{workdir}/first-{mode}.sock", free_tcp_endpoint(), f"ipc://{workdir}/head-{mode}.sock"]
    specs = {f"{mode}{k}": (bind, _args(k, binds, mode)) for k, bind in enumerate(binds)}
    return binds, start_daemons(specs, workdir)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Three daemons of the tiny model, each but the head sending its rows to the next (--relay-to)."""
    binds, daemons = _chain(tmp_path_factory.mktemp("groups"))
    try:
        yield binds
    finally:
        stop_all(daemons.values())


class CountingPipeline(Pipeline):
    """A Pipeline that remembers the most batches it had in flight at once."""

    in_flight = most_in_flight = 0

    def start_forward_batch(self, items):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return _Counted(self, super().start_forward_batch(items))


class _Counted:
    def __init__(self, pipeline: CountingPipeline, handle) -> None:
        self.pipeline, self.handle, self.read = pipeline, handle, False

    def result(self) -> list:
        if not self.read:
            self.read = True
            self.pipeline.in_flight -= 1
        return self.handle.result()


def _requests(references=None, sampling=None, lengths=(12, 9, 15, 6, 11, 13)):
    drafters = [None] * len(PROMPTS) if references is None else [
        OracleDrafter.with_mean_commit(ref, len(p), block_size=BLOCK, mean_commit=3.0, seed=i)
        for i, (ref, p) in enumerate(zip(references, PROMPTS))]
    return [Request(p, n, block_size=BLOCK, drafter=d, sampling=None if sampling is None else sampling(i))
            for i, (p, n, d) in enumerate(zip(PROMPTS, lengths, drafters))]


def _run(pipeline, groups, **options):
    requests = options.pop("requests")
    scheduler = Scheduler(pipeline, max_sequences=len(requests), pipeline_groups=groups, **options)
    return [request.outcome().tokens for request in scheduler.run_all(requests)]


def _alone(binds, make, **options):
    """Each request run alone through its own scheduler: the reference every grouping must give."""
    with Pipeline.connect(binds) as pipeline:
        return [_run(pipeline, 1, requests=[request], **options)[0] for request in make()]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_grouping_gives_each_stream_its_tokens_alone(chain, sampled):
    """Plain decoding and oracle speculation (checkpoint rollbacks), greedy and seeded sampling: one, two and three
    groups in flight give every stream the tokens of its request alone; with several groups the pipeline really
    had several batches in flight."""
    sampling = (lambda i: Sampling(temperature=0.8, top_p=0.9, seed=100 + i)) if sampled else None
    reference = _alone(chain, lambda: _requests(sampling=sampling))
    spec_reference = _alone(chain, lambda: _requests(reference, sampling), rollback="checkpoint")
    if not sampled:
        assert spec_reference == reference
    for groups in (1, 2, 3):
        with CountingPipeline.connect(chain) as pipeline:
            assert pipeline.direct_rows
            assert _run(pipeline, groups, requests=_requests(sampling=sampling)) == reference
            assert _run(pipeline, groups, requests=_requests(reference, sampling), rollback="checkpoint") == \
                spec_reference
            assert pipeline.most_in_flight == groups
            assert all(client.stats()["rows"]["waiting"] == 0 for client in pipeline.clients)


def test_groups_are_off_unless_asked_for(chain):
    with Pipeline.connect(chain) as pipeline:
        assert Scheduler(pipeline, max_sequences=4).pipeline_groups == 1
        with pytest.raises(ValueError, match="pipeline_groups"):
            Scheduler(pipeline, max_sequences=4, pipeline_groups=0)


@pytest.mark.parametrize("mode", ["replay-ssm", "replay"])
def test_other_rollback_modes_give_the_same_tokens_in_groups(tmp_path, mode):
    """replay-ssm (by the shards) and replay (by the coordinator) with groups: each stream's tokens alone."""
    binds, daemons = _chain(tmp_path, "replay-ssm")
    try:
        reference = _alone(binds, lambda: _requests())
        with Pipeline.connect(binds) as pipeline:
            assert _run(pipeline, 3, requests=_requests(reference), rollback=mode) == reference
    finally:
        stop_all(daemons.values())


def test_a_middle_shard_killed_mid_run_is_refilled_while_the_other_groups_go_on(tmp_path):
    """kill -9 of the middle shard (replaced on its endpoint) while three groups are in flight: every stream is
    re-filled or goes on, and gives its tokens alone."""
    binds, started = _chain(tmp_path)
    daemons = list(started.values())
    try:
        reference = _alone(binds, lambda: _requests())
        with Pipeline.connect(binds, timeout_s=30.0) as pipeline:
            requests = _requests(reference)
            commits, killed = [], []

            def kill_middle(ids):
                commits.append(ids)
                if len(commits) == 12 and not killed:
                    kill_and_replace(daemons, 1, "middle-restarted", _args(1, binds, "checkpoint"), tmp_path)
                    killed.append(True)

            for request in requests:
                request.on_commit = kill_middle
            tokens = _run(pipeline, 3, requests=requests, rollback="checkpoint")
        assert killed and tokens == reference
        assert sum(r.result.recoveries + r.result.rollbacks_fallback for r in requests) >= 1
    finally:
        stop_all(daemons)


def test_a_middle_shard_killed_with_rollbacks_unread_recovers_in_seconds(tmp_path):
    """Rows relayed shard to shard: the middle shard is stopped with a step's ROLLBACKs sent and unread, then
    killed and replaced while the next step's FORWARDs wait for it. The head's FORWARD waiting for rows that never
    come is not waited for: the sequence is re-filled within seconds, with greedy's tokens."""
    binds, started = _chain(tmp_path)
    daemons = list(started.values())
    finished = threading.Event()
    try:
        with Pipeline.connect(binds) as pipeline:
            reference = decode_all(pipeline, [Request(PROMPTS[5], 16)], pipeline_groups=1)[0].tokens
        with Pipeline.connect(binds, timeout_s=60.0) as pipeline:
            commits, stopped = [], []

            def replace_middle():
                time.sleep(1.0)  # the next step's requests are sent, the FORWARDs after the middle one waiting
                kill_and_replace(daemons, 1, "middle-restarted", _args(1, binds, "checkpoint"), tmp_path)
                finished.wait(60)  # the replacement dies with the thread that started it (PR_SET_PDEATHSIG)

            def stop_middle(ids):
                commits.append(ids)
                if len(commits) >= 2 and pipeline._rollbacks and not stopped:  # ROLLBACKs sent, not yet read
                    daemons[1].signal(signal.SIGSTOP)
                    stopped.append(threading.Thread(target=replace_middle))
                    stopped[0].start()

            drafter = OracleDrafter.with_mean_commit(reference, len(PROMPTS[5]), block_size=BLOCK, mean_commit=3.0)
            request = Request(PROMPTS[5], 16, block_size=BLOCK, drafter=drafter, on_commit=stop_middle)
            started_at = time.monotonic()
            result = decode_all(pipeline, [request], rollback="checkpoint")[0]
            elapsed = time.monotonic() - started_at
        assert stopped and result.tokens == reference
        assert result.recoveries + result.rollbacks_fallback >= 1
        assert elapsed < 20.0  # a wait for the lost rows would take the client's compute timeout (60 s)
    finally:
        stop_all(daemons)
        finished.set()


def test_generate_takes_pipeline_groups():
    """`shardctl generate --pipeline-groups 2` over launched shards (which relay rows themselves) gives the tokens of
    one group, with the ngram drafter and with DFlash."""
    import json

    from click.testing import CliRunner

    from coordinator.cli import cli

    args = ["generate", "--synthetic", "tiny", "--split", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", "10",
            "--concurrency", "4", "--drafter", "ngram", "--json"]
    runs = [CliRunner().invoke(cli, [*args, "--pipeline-groups", groups]) for groups in ("1", "2")]
    assert all(run.exit_code == 0 for run in runs), [run.output for run in runs]
    records = [json.loads(run.stdout.strip().splitlines()[-1]) for run in runs]
    assert records[0]["tokens"] == records[1]["tokens"] and records[1]["streams_identical"]
    dflash = [a if a != "ngram" else "dflash" for a in args]
    runs = [CliRunner().invoke(cli, [*dflash, "--pipeline-groups", groups]) for groups in ("1", "2")]
    assert all(run.exit_code == 0 for run in runs), [run.output for run in runs]
    records = [json.loads(run.stdout.strip().splitlines()[-1]) for run in runs]
    assert records[0]["tokens"] == records[1]["tokens"] and records[1]["streams_identical"]


@pytest.mark.parametrize("layers", [["0:2", "2:4", "4:6"], ["0:2", "2:3", "3:6"]], ids=["propose", "in-reply"])
def test_dflash_streams_in_groups_are_the_same_requests_alone(tmp_path, layers):
    """DFlash beside the head of a chain that relays its own rows, in 1, 2 and 3 groups: each stream's tokens and
    acceptance are those of the request alone. The drafter reads layers 1 and 3: with the head owning neither, its
    context comes by PROPOSE (on a connection of its own, not held behind the steps of the groups in flight); owning
    layer 3, it proposes in each verify's reply, layer 1's rows carried to it."""
    from coordinator.drafting.dflash import DFlashDrafterClient

    binds = [f"ipc://{tmp_path}/first.sock", free_tcp_endpoint(), f"ipc://{tmp_path}/head.sock"]
    specs = {f"dflash{k}": (bind, ["--layers", layers[k], "--max-verify-tokens", str(BLOCK), "--rows-wait", "30",
                                   *(["--relay-to", binds[k + 1]] if k < 2 else ["--draft", "synthetic"])])
             for k, bind in enumerate(binds)}
    daemons = start_daemons(specs, tmp_path)
    try:
        with Pipeline.connect(binds) as pipeline:
            drafter = DFlashDrafterClient(pipeline.clients[2], pipeline)
            assert drafter.proposes_in_reply == (layers[1] == "2:3")

            def run(groups, prompts):
                scheduler = Scheduler(pipeline, max_sequences=len(prompts), pipeline_groups=groups)
                done = scheduler.run_all([Request(p, 14, drafter=drafter.fresh(), block_size=BLOCK) for p in prompts])
                return [(r.outcome().tokens, r.result.accepted, r.result.drafted) for r in done]

            alone = [run(1, [prompt])[0] for prompt in PROMPTS]
            for groups in (1, 2, 3):
                assert run(groups, PROMPTS) == alone, groups
    finally:
        stop_all(daemons.values())
