"""Issue 19: reconnects that always land, and memory bounded per message.

Real daemons on loopback; the liveness window is 1 s, so a freeze "longer than the liveness timeout" takes
seconds here. One test (or more) per finding; each failed before the fix.
"""

from __future__ import annotations

import secrets
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

from coordinator.decoding import greedy_decode
from coordinator.relay.client import ShardClient, ShardTimeout
from coordinator.relay.pipeline import Pipeline
from protocol import ErrorCode, MessageType, decode_reply, encode_request
from protocol.messages import Hello
from shardd.weights.loading import ModelSource
from shardd.local import LocalTarget
from tests.support.daemons import Daemon, free_tcp_endpoint, start_pair, stop_all

PROMPT = list(b"freeze, then resume exactly: ")
NEW_TOKENS = 16
LIVENESS_S = 1.0


@pytest.fixture(scope="module")
def expected():
    return greedy_decode(LocalTarget(ModelSource(synthetic="tiny")), 1, PROMPT, NEW_TOKENS).tokens


def test_a_client_reconnecting_under_its_routing_id_is_served(tmp_path):
    """Was: the daemon's ROUTER ignored a second connection under an id it already held (no handover), so a
    coordinator that reconnected after a freeze while its old connection lingered was never answered."""
    bind = free_tcp_endpoint()
    daemon = Daemon("shard", bind, ["--layers", "0:6"], tmp_path)
    routing_id = b"shardctl-" + secrets.token_hex(16).encode()
    sockets = []
    try:
        daemon.wait_ready()
        for _ in range(2):  # the old connection stays up, as one the daemon has not yet seen die
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
            sock.connect(bind)
            sockets.append(sock)
            sock.send_multipart(encode_request(Hello(id=len(sockets))))
            assert sock.poll(10_000), f"connection {len(sockets)} under the same routing id was not answered"
            assert decode_reply(sock.recv_multipart()).ok
    finally:
        for sock in sockets:
            sock.close(linger=0)
        daemon.stop()


def test_a_frozen_shard_resumes_with_identical_output(tmp_path, expected):
    """Was: 3 of 6 runs never resumed after SIGSTOP > liveness, SIGCONT; output must be byte-identical."""
    binds, daemons = start_pair(tmp_path)
    pipeline = Pipeline([ShardClient(bind, timeout_s=60, liveness_timeout_s=LIVENESS_S) for bind in binds])
    frozen = []

    def freeze_the_head_shard(new_ids):
        if len(frozen) == 0:
            daemons[1].signal(signal.SIGSTOP)
            frozen.append(time.monotonic())
            threading.Timer(3 * LIVENESS_S, daemons[1].signal, (signal.SIGCONT,)).start()

    try:
        result = greedy_decode(pipeline, 5, PROMPT, NEW_TOKENS, on_commit=freeze_the_head_shard,
                               recovery_timeout_s=30.0)
        assert result.tokens == expected
        assert time.monotonic() - frozen[0] < 3 * LIVENESS_S + 10
    finally:
        daemons[1].signal(signal.SIGCONT)
        pipeline.disconnect()
        stop_all(daemons)


def test_a_daemon_that_is_there_but_silent_is_described_so():
    """Was: a request whose daemon kept answering heartbeats timed out with "is the daemon running?"."""
    bind = free_tcp_endpoint()
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # a peer that takes requests and never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(bind)
    try:
        with ShardClient(bind, timeout_s=1.0, liveness_timeout_s=LIVENESS_S) as client:
            with pytest.raises(ShardTimeout) as failure:
                client.hello()
        message = str(failure.value)
        assert "HELLO" in message and "answers heartbeats" in message and "is the daemon running" not in message
    finally:
        silent.close(linger=0)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_message_with_more_frames_than_its_type_allows_is_refused_and_its_memory_returned(tmp_path):
    """Was: 100 frames of 16 MiB (each under the frame limit) added 1.6 GB, and 1.3 GB stayed after refusal."""
    bind = free_tcp_endpoint()
    daemon = Daemon("shard", bind, ["--layers", "0:6"], tmp_path)
    try:
        daemon.wait_ready()
        client = daemon.client()
        client.call(MessageType.STATS)
        before = rss_bytes(daemon.process.pid)
        frame = bytes(4 << 20)
        for attempt in range(3):
            reply = client.exchange([*encode_request(Hello(id=100 + attempt)), *[frame] * 80])
            assert not reply.ok and reply.error_code == ErrorCode.TOO_LARGE  # past Limits.max_frames (64)
            assert "HELLO request has at most 1 frame" in reply.error_message and "81 frames" in reply.error_message
        after = rss_bytes(daemon.process.pid)
        assert after - before < 64 << 20, f"the daemon kept {(after - before) >> 20} MiB after refusing"
        assert client.call(MessageType.HELLO).ok  # and it serves on
    finally:
        daemon.stop()
