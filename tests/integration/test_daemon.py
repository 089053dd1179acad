"""The shard daemon over real sockets: real `shardd serve` processes, plain DEALER clients, the wire codec.

A handful of daemons (module-scoped, started in parallel) serve the whole file:

    full     layers 0:6, checkpoint rollback (8 tokens)        tcp://127.0.0.1
    first    layers 0:3, checkpoint rollback                   ipc://
    last     layers 3:6, checkpoint rollback                   tcp://127.0.0.1
    plain    layers 0:6, no rollback storage (--max-verify-tokens 0)   ipc://
    limited  layers 0:6, replay-ssm (4 tokens), 2 sequences, context 24, 8 tokens per request   ipc://

A few tests start their own short-lived daemon (readiness and signals, SHUTDOWN, CurveZMQ, a compute error).
The tiny synthetic model: 6 layers (GDN, GDN, attention) x 2, hidden 64, vocab 320.
"""

from __future__ import annotations

import itertools
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
import zmq.auth

from protocol import (
    DTYPE_SIZES,
    REQUEST_FIELDS,
    Capture,
    Close,
    ErrorCode,
    Forward,
    MessageType,
    Open,
    Propose,
    Reply,
    Restore,
    Rollback,
    Snapshot,
    WireTensor,
    encode_request,
    pure_chain,
)
from tests.support.daemons import Client, Daemon, free_tcp_endpoint, receive_until, start_daemons, stop_all

NUM_LAYERS, HIDDEN, VOCAB = 6, 64, 320
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention"] * 2
GDN_LAYERS = 4  # layers 0, 1, 3, 4
FINGERPRINT = "synthetic:tiny:0:cpu"
# Per GDN layer: recurrent state 4 heads x 16 x 8 floats = 2048 B; conv window 3 x (2*2*16 + 4*8) floats = 1152 B.
GDN_STATE_BYTES = 2048 + 1152
# checkpoint mode, 8 tokens: 9 slots (before the step + after each token) of both, for each GDN layer.
CHECKPOINT_BYTES_8 = GDN_LAYERS * 9 * GDN_STATE_BYTES
# replay-ssm, 4 tokens: state and conv before the step, 4 conv inputs (96 floats), key 4x4x16, value 4x4x8, g and beta 4x4.
REPLAY_SSM_BYTES_4 = GDN_LAYERS * (GDN_STATE_BYTES + 4 * (4 * 96 + 4 * 4 * 16 + 4 * 4 * 8 + 4 * 4 + 4 * 4))
# KV caches of the 2 attention layers (2 kv heads x head_dim 16, float32) plus the GDN states.
def state_bytes(context: int) -> int:
    return 2 * 2 * (2 * context * 16 * 4) + GDN_LAYERS * GDN_STATE_BYTES


PREFIX = [11, 22, 33]  # committed before every script
DRAFT = [44, 55, 66, 77]  # a verify block
KEEP = 2
NEXT = [88, 99]
PREFIX_AND_DRAFT = len(PREFIX) + len(DRAFT)

_seq_ids = itertools.count(1)
# Rows a "previous shard" would have produced, for shards that take hidden input: one fixed row per token id.
_HIDDEN_ROWS = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1234))


def propose_fields(seq: int, pos: int, **fields) -> dict:
    """PROPOSE's fields; `pos` (the committed length) only where this protocol version's schema has it."""
    if any(spec.name == "pos" for spec in REQUEST_FIELDS[MessageType.PROPOSE]):
        fields["pos"] = pos
    return {"seq": seq, **fields}


def new_seq() -> int:
    return next(_seq_ids)


def hidden_for(tokens: list[int], dtype=torch.float32) -> WireTensor:
    return WireTensor.from_torch(_HIDDEN_ROWS[tokens].to(dtype).contiguous())


def frames(header: dict, *data) -> list:
    return [msgpack.packb(header, use_bin_type=True), *data]


def tensor_bytes(reply: Reply) -> dict:
    return {name: (t.dtype, t.shape, bytes(t.data)) for name, t in reply.tensors.items()}


def outcome(reply: Reply) -> tuple:
    """What a client observes of a reply but the seq it names, comparable with == across sequences."""
    result = {key: value for key, value in reply.result.items() if key != "seq"}
    return reply.ok, reply.error_code, result, tensor_bytes(reply)


def as_torch(tensor: WireTensor) -> torch.Tensor:
    return tensor.to_torch().clone()


# ---- daemons and clients ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir():
    # Short, because an ipc:// path and a unix datagram path must fit in sun_path (108 bytes).
    path = Path(tempfile.mkdtemp(prefix="shardd-test-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(workdir):
    specs = {
        "full": (free_tcp_endpoint(), ["--max-verify-tokens", "8"]),
        "first": (f"ipc://{workdir}/first.sock", ["--layers", "0:3", "--max-verify-tokens", "8"]),
        "last": (free_tcp_endpoint(), ["--layers", "3:6", "--max-verify-tokens", "8"]),
        "plain": (f"ipc://{workdir}/plain.sock", ["--max-verify-tokens", "0"]),
        "limited": (f"ipc://{workdir}/limited.sock", [
            "--rollback-mode", "replay-ssm", "--max-verify-tokens", "4", "--max-sequences", "2",
            "--max-context", "24", "--max-tokens-per-request", "8",
        ]),
    }
    daemons = start_daemons(specs, workdir)
    yield daemons
    stop_all(daemons.values())


@dataclass
class Shard:
    """A client to one of the fleet's daemons, which knows what kind of input that shard takes."""

    daemon: Daemon
    client: Client

    @property
    def hello(self) -> dict:
        return self.daemon.hello

    @property
    def takes_hidden(self) -> bool:
        return not self.hello["owns_embedding"]

    @property
    def owns_head(self) -> bool:
        return self.hello["owns_head"]

    def request(self, mtype, **fields) -> Reply:
        return self.client.request(mtype, **fields)

    def call(self, mtype, **fields) -> Reply:
        return self.client.call(mtype, **fields)

    def inputs(self, tokens: list[int]) -> dict:
        """`tokens` as this shard takes them: ids on the first shard, the matching hidden rows on a later one."""
        return {"hidden": hidden_for(tokens)} if self.takes_hidden else {"tokens": list(tokens)}

    def forward(self, seq: int, pos: int, tokens: list[int], *, checkpoint: bool = False, layers=None, **fields) -> Reply:
        """FORWARD (or CAPTURE when `layers` is given); logits wherever the shard has the head."""
        if checkpoint:
            fields.update(checkpoint=True, parents=pure_chain(len(tokens)))
        if self.owns_head:
            fields.setdefault("return_logits", True)
        if layers is not None:
            return self.request("CAPTURE", seq=seq, pos=pos, layers=layers, **self.inputs(tokens), **fields)
        return self.request("FORWARD", seq=seq, pos=pos, **self.inputs(tokens), **fields)

    def stats(self) -> dict:
        return self.call("STATS").result

    @contextmanager
    def sequence(self, seq: int | None = None):
        seq = new_seq() if seq is None else seq
        self.call("OPEN", seq=seq)
        try:
            yield seq
        finally:
            self.request("CLOSE", seq=seq)


def shard_fixture(name: str):
    @pytest.fixture(scope="module")
    def fixture(fleet):
        daemon = fleet[name]
        return Shard(daemon, daemon.client())

    return fixture


full = shard_fixture("full")
first = shard_fixture("first")
last = shard_fixture("last")
plain = shard_fixture("plain")
limited = shard_fixture("limited")


def counter(stats: dict, key: str, sub: str | None = None) -> float:
    value = stats[key]
    return value.get(sub, 0) if sub is not None else value


def moved(before: dict, after: dict, key: str, sub: str | None = None) -> float:
    return counter(after, key, sub) - counter(before, key, sub)


# ---- HELLO --------------------------------------------------------------------------------------------


def test_hello_describes_the_full_model_shard(full):
    hello = full.call("HELLO").result
    assert hello["protocol_version"] == 1
    assert hello["model"] == {
        "fingerprint": FINGERPRINT, "num_layers": NUM_LAYERS, "hidden_size": HIDDEN, "vocab_size": VOCAB,
        "layer_types": LAYER_TYPES, "eos_token_ids": [], "moe": None,
    }
    assert hello["layers"] == [0, NUM_LAYERS]
    assert hello["owns_embedding"] is True and hello["owns_head"] is True
    assert hello["dtype"] == "float32" and hello["device"] == "cpu"
    assert hello["rollback"] == {"mode": "checkpoint", "max_verify_tokens": 8, "checkpoint_bytes_per_sequence": CHECKPOINT_BYTES_8}
    assert hello["limits"] == {"max_sequences": 8, "max_context": 4096, "max_tokens_per_request": 4096}
    assert hello["state_bytes_per_sequence"] == state_bytes(4096)
    assert hello["drafter"] is None


def test_hello_of_split_shards_and_configured_limits(first, last, plain, limited):
    hellos = {name: shard.call("HELLO").result for name, shard in
              {"first": first, "last": last, "plain": plain, "limited": limited}.items()}
    assert {h["model"]["fingerprint"] for h in hellos.values()} == {FINGERPRINT}
    assert (hellos["first"]["layers"], hellos["first"]["owns_embedding"], hellos["first"]["owns_head"]) == ([0, 3], True, False)
    assert (hellos["last"]["layers"], hellos["last"]["owns_embedding"], hellos["last"]["owns_head"]) == ([3, 6], False, True)
    # Each half holds 2 of the 4 GDN layers, so half the checkpoint storage.
    assert hellos["first"]["rollback"]["checkpoint_bytes_per_sequence"] == CHECKPOINT_BYTES_8 // 2
    assert hellos["last"]["rollback"]["checkpoint_bytes_per_sequence"] == CHECKPOINT_BYTES_8 // 2
    assert hellos["plain"]["rollback"] == {"mode": None, "max_verify_tokens": 0, "checkpoint_bytes_per_sequence": 0}
    assert hellos["limited"]["rollback"] == {
        "mode": "replay-ssm", "max_verify_tokens": 4, "checkpoint_bytes_per_sequence": REPLAY_SSM_BYTES_4,
    }
    assert hellos["limited"]["limits"] == {"max_sequences": 2, "max_context": 24, "max_tokens_per_request": 8}
    assert hellos["limited"]["state_bytes_per_sequence"] == state_bytes(24)


# ---- OPEN / CLOSE -------------------------------------------------------------------------------------


def test_open_and_close(full):
    seq = new_seq()
    assert full.call("OPEN", seq=seq).result == {"seq": seq, "length": 0}
    again = full.request("OPEN", seq=seq)
    assert again.error_code is ErrorCode.SEQUENCE_EXISTS and str(seq) in again.error_message
    full.call("FORWARD", seq=seq, pos=0, tokens=PREFIX)
    assert full.call("CLOSE", seq=seq).result == {"seq": seq, "length": len(PREFIX)}
    gone = full.request("CLOSE", seq=seq)
    assert gone.error_code is ErrorCode.NO_SUCH_SEQUENCE and str(seq) in gone.error_message
    # The seq may be opened again, from scratch.
    assert full.call("OPEN", seq=seq).result == {"seq": seq, "length": 0}
    assert full.call("FORWARD", seq=seq, pos=0, tokens=PREFIX).result["length"] == len(PREFIX)
    full.call("CLOSE", seq=seq)


def test_open_beyond_max_sequences_is_capacity(limited):
    with limited.sequence() as a, limited.sequence() as b:
        extra = new_seq()
        refused = limited.request("OPEN", seq=extra)
        assert refused.error_code is ErrorCode.CAPACITY and "limit 2" in refused.error_message
        assert limited.request("FORWARD", seq=extra, pos=0, tokens=PREFIX).error_code is ErrorCode.NO_SUCH_SEQUENCE
        limited.call("CLOSE", seq=b)
        limited.call("OPEN", seq=extra)  # a freed slot can be used
        limited.call("CLOSE", seq=extra)
        limited.call("OPEN", seq=b)
        assert limited.stats()["open_sequences"] == 2
        assert a != b


def test_context_limit_is_capacity_and_changes_nothing(limited):
    # --max-context 24: 20 tokens in, 5 more would pass the limit, 4 fill it exactly.
    fill = [[(7 * i + j) % VOCAB for j in range(5)] for i in range(4)]
    with limited.sequence() as seq, limited.sequence() as reference:
        for target in (seq, reference):
            for i, chunk in enumerate(fill):
                limited.call("FORWARD", seq=target, pos=5 * i, tokens=chunk)
        over = limited.request("FORWARD", seq=seq, pos=20, tokens=[1, 2, 3, 4, 5])
        assert over.error_code is ErrorCode.CAPACITY and "24" in over.error_message
        last_four = [limited.forward(target, 20, [1, 2, 3, 4]) for target in (seq, reference)]
        assert last_four[0].result["length"] == 24
        assert outcome(last_four[0]) == outcome(last_four[1])
        assert limited.request("FORWARD", seq=seq, pos=24, tokens=[5]).error_code is ErrorCode.CAPACITY


# ---- FORWARD -----------------------------------------------------------------------------------------


def test_forward_tokens_on_the_head_shard_returns_ids_and_optional_logits(full):
    with full.sequence() as seq, full.sequence() as twin:
        reply = full.call("FORWARD", seq=seq, pos=0, tokens=PREFIX)
        assert reply.result == {"seq": seq, "length": 3, "ids": reply.result["ids"]}
        assert reply.tensors == {}
        ids = reply.result["ids"]
        assert len(ids) == 3 and all(type(i) is int and 0 <= i < VOCAB for i in ids)

        with_logits = full.call("FORWARD", seq=twin, pos=0, tokens=PREFIX, return_logits=True)
        logits = with_logits.tensors["logits"]
        assert (logits.dtype, logits.shape) == ("float32", (3, VOCAB))
        assert with_logits.result["ids"] == ids == as_torch(logits).argmax(-1).tolist()

        step = full.call("FORWARD", seq=seq, pos=3, tokens=[ids[-1]])
        assert step.result["length"] == 4 and len(step.result["ids"]) == 1


def test_forward_on_a_first_shard_returns_hidden(first):
    with first.sequence() as seq:
        reply = first.call("FORWARD", seq=seq, pos=0, tokens=PREFIX)
        assert reply.result == {"seq": seq, "length": 3}
        assert list(reply.tensors) == ["hidden"]
        hidden = reply.tensors["hidden"]
        assert (hidden.dtype, hidden.shape) == ("float32", (3, HIDDEN))
        assert torch.isfinite(as_torch(hidden)).all()


def test_forward_hidden_on_a_later_shard_returns_ids(last):
    with last.sequence() as seq:
        reply = last.call("FORWARD", seq=seq, pos=0, hidden=hidden_for(PREFIX), return_logits=True)
        assert reply.result["length"] == 3
        assert reply.result["ids"] == as_torch(reply.tensors["logits"]).argmax(-1).tolist()
        assert reply.tensors["logits"].shape == (3, VOCAB)


def test_wrong_input_kind_for_the_shard(full, last):
    with full.sequence() as seq:
        reply = full.request("FORWARD", seq=seq, pos=0, hidden=hidden_for(PREFIX))
        assert reply.error_code is ErrorCode.BAD_REQUEST and "send tokens" in reply.error_message
    with last.sequence() as seq:
        reply = last.request("FORWARD", seq=seq, pos=0, tokens=PREFIX)
        assert reply.error_code is ErrorCode.BAD_REQUEST and "send hidden" in reply.error_message


# ---- CAPTURE -----------------------------------------------------------------------------------------


def test_capture_returns_only_the_owned_requested_layers(full, first, last):
    layers = [4, 1, 2]
    with full.sequence() as a, first.sequence() as b, last.sequence() as c:
        whole = full.call("CAPTURE", seq=a, pos=0, tokens=PREFIX, layers=layers)
        assert whole.result["captured_layers"] == [1, 2, 4]
        assert sorted(whole.tensors) == ["layer.1", "layer.2", "layer.4"]
        assert whole.result["length"] == 3 and len(whole.result["ids"]) == 3
        for tensor in whole.tensors.values():
            assert (tensor.dtype, tensor.shape) == ("float32", (3, HIDDEN))

        front = first.call("CAPTURE", seq=b, pos=0, tokens=PREFIX, layers=layers)
        assert front.result["captured_layers"] == [1, 2]
        assert sorted(front.tensors) == ["hidden", "layer.1", "layer.2"]
        back = last.call("CAPTURE", seq=c, pos=0, hidden=front.tensors["hidden"], layers=layers)
        assert back.result["captured_layers"] == [4]
        assert sorted(back.tensors) == ["layer.4"]

        # The same layer outputs wherever they are computed; a shard's hidden output is its last layer's output.
        whole_bytes, front_bytes, back_bytes = tensor_bytes(whole), tensor_bytes(front), tensor_bytes(back)
        assert front_bytes["layer.1"] == whole_bytes["layer.1"]
        assert front_bytes["layer.2"] == front_bytes["hidden"] == whole_bytes["layer.2"]
        assert back_bytes["layer.4"] == whole_bytes["layer.4"]
        assert back.result["ids"] == whole.result["ids"]

        # Asking only for layers another shard owns captures nothing but still forwards.
        none = last.call("CAPTURE", seq=c, pos=3, hidden=hidden_for([5]), layers=[0, 2])
        assert none.result["captured_layers"] == [] and sorted(none.tensors) == []
        assert none.result["length"] == 4


# ---- ROLLBACK ----------------------------------------------------------------------------------------


def test_rollback(full):
    with full.sequence() as seq, full.sequence() as reference:
        nothing = full.request("ROLLBACK", seq=seq, keep=0)
        assert nothing.error_code is ErrorCode.NO_PENDING_STEP

        full.call("FORWARD", seq=seq, pos=0, tokens=PREFIX)
        step = full.forward(seq, 3, DRAFT, checkpoint=True)
        assert step.result["length"] == 7
        out_of_range = full.request("ROLLBACK", seq=seq, keep=len(DRAFT) + 1)
        assert out_of_range.error_code is ErrorCode.BAD_REQUEST and "keep=5" in out_of_range.error_message
        assert full.call("ROLLBACK", seq=seq, keep=KEEP).result == {"seq": seq, "length": 3 + KEEP}
        assert full.request("ROLLBACK", seq=seq, keep=KEEP).error_code is ErrorCode.NO_PENDING_STEP
        after = full.forward(seq, 3 + KEEP, NEXT)

        # Same tokens without a rollback: PREFIX, the kept draft tokens, NEXT.
        full.call("FORWARD", seq=reference, pos=0, tokens=PREFIX)
        full.call("FORWARD", seq=reference, pos=3, tokens=DRAFT[:KEEP])
        expected = full.forward(reference, 3 + KEEP, NEXT)
        assert after.result["ids"] == expected.result["ids"]
        torch.testing.assert_close(as_torch(after.tensors["logits"]), as_torch(expected.tensors["logits"]), rtol=1e-4, atol=1e-4)

        # keep == n keeps everything; a forward ends the pending window.
        full.forward(seq, 3 + KEEP + 2, DRAFT, checkpoint=True)
        assert full.call("ROLLBACK", seq=seq, keep=len(DRAFT)).result["length"] == 3 + KEEP + 2 + len(DRAFT)
        full.forward(seq, 11, DRAFT, checkpoint=True)
        full.call("FORWARD", seq=seq, pos=15, tokens=[1])
        assert full.request("ROLLBACK", seq=seq, keep=0).error_code is ErrorCode.NO_PENDING_STEP
        # CLOSE ends a pending window too.
        full.forward(seq, 16, DRAFT, checkpoint=True)
    assert full.request("ROLLBACK", seq=seq, keep=0).error_code is ErrorCode.NO_SUCH_SEQUENCE


def test_rollback_unavailable_without_rollback_storage(plain):
    with plain.sequence() as seq:
        plain.call("FORWARD", seq=seq, pos=0, tokens=PREFIX)
        reply = plain.request("ROLLBACK", seq=seq, keep=0)
        assert reply.error_code is ErrorCode.ROLLBACK_UNAVAILABLE and "--max-verify-tokens 0" in reply.error_message
        reply = plain.request("FORWARD", seq=seq, pos=3, tokens=DRAFT, checkpoint=True, parents=pure_chain(4))
        assert reply.error_code is ErrorCode.ROLLBACK_UNAVAILABLE
        assert plain.call("FORWARD", seq=seq, pos=3, tokens=DRAFT).result["length"] == 7


# ---- SNAPSHOT / RESTORE --------------------------------------------------------------------------------


def test_snapshot_and_restore_replay_a_step(full):
    with full.sequence() as seq:
        assert full.request("RESTORE", seq=seq).error_code is ErrorCode.NO_SNAPSHOT
        full.call("FORWARD", seq=seq, pos=0, tokens=PREFIX)
        assert full.call("SNAPSHOT", seq=seq).result == {"seq": seq, "length": 3}
        first_time = full.forward(seq, 3, DRAFT)
        assert full.call("RESTORE", seq=seq).result == {"seq": seq, "length": 3}
        assert outcome(full.forward(seq, 3, DRAFT)) == outcome(first_time)
        # The replay baseline: restore, then forward only the kept tokens.
        assert full.call("RESTORE", seq=seq).result["length"] == 3
        replayed = full.forward(seq, 3, DRAFT[:KEEP])
        assert replayed.result["ids"] == first_time.result["ids"][:KEEP]
        # The snapshot stays until the next SNAPSHOT.
        assert full.call("RESTORE", seq=seq).result["length"] == 3
        # SNAPSHOT and RESTORE end a pending step.
        full.forward(seq, 3, DRAFT, checkpoint=True)
        assert full.call("SNAPSHOT", seq=seq).result["length"] == 7
        assert full.request("ROLLBACK", seq=seq, keep=0).error_code is ErrorCode.NO_PENDING_STEP
        full.forward(seq, 7, NEXT, checkpoint=True)
        assert full.call("RESTORE", seq=seq).result["length"] == 7
        assert full.request("ROLLBACK", seq=seq, keep=0).error_code is ErrorCode.NO_PENDING_STEP


# ---- PROPOSE, SHUTDOWN -----------------------------------------------------------------------------


def test_propose_without_a_drafter(full):
    with full.sequence() as seq:
        full.call("FORWARD", seq=seq, pos=0, tokens=PREFIX)
        reply = full.request("PROPOSE", **propose_fields(seq, len(PREFIX), last_token=5, block_size=4))
        assert reply.error_code is ErrorCode.NO_DRAFTER


def test_shutdown_stops_the_daemon_cleanly(workdir):
    endpoint = f"ipc://{workdir}/shutdown.sock"
    daemon = Daemon("shutdown", endpoint, [], workdir)
    try:
        daemon.wait_ready()
        client = daemon.client()
        client.call("OPEN", seq=1)
        assert daemon.ipc_path.exists()
        reply = client.call("SHUTDOWN")
        assert reply.result == {"stopping": True}
        assert daemon.wait(10) == 0
        assert not daemon.ipc_path.exists()
        assert "stopped: 1 sequences were open" in daemon.output()
    finally:
        daemon.stop()


# ---- the regression: CAPTURE never needs rollback storage -----------------------------------------------


def test_capture_on_a_shard_without_rollback_storage(full, plain):
    """A peer's capture request once enabled checkpoint capture implicitly and failed on shards without storage."""
    layers = [0, 2, 4, 5]
    before = plain.stats()
    with full.sequence() as a, plain.sequence() as b:
        reference = full.forward(a, 0, PREFIX, layers=layers)
        captured = plain.forward(b, 0, PREFIX, layers=layers)
        assert captured.ok, captured.error_message
        assert captured.result["captured_layers"] == layers
        assert outcome(captured) == outcome(reference)

        # A checkpointed capture on the shard with storage; the same capture without checkpoint here.
        reference = full.forward(a, 3, DRAFT, layers=layers, checkpoint=True)
        captured = plain.forward(b, 3, DRAFT, layers=layers)
        assert outcome(captured) == outcome(reference)

        # checkpoint: true is refused plainly, and changes nothing.
        for mtype in ("CAPTURE", "FORWARD"):
            extra = {"layers": layers} if mtype == "CAPTURE" else {}
            refused = plain.request(mtype, seq=b, pos=7, tokens=NEXT, checkpoint=True, parents=pure_chain(2), **extra)
            assert refused.error_code is ErrorCode.ROLLBACK_UNAVAILABLE
            assert "rollback storage" in refused.error_message
        assert outcome(plain.forward(b, 7, NEXT, layers=layers)) == outcome(full.forward(a, 7, NEXT, layers=layers))
    after = plain.stats()
    assert moved(before, after, "captures") == 3
    assert moved(before, after, "captured_rows") == len(layers) * (3 + 4 + 2)
    assert moved(before, after, "errors", "ROLLBACK_UNAVAILABLE") == 2
    assert after["checkpoint_writes"] == 0 and after["checkpointed_steps"] == 0 and after["checkpoint_bytes"] == 0


# ---- a 2-way split driven by the test --------------------------------------------------------------------


def test_two_way_split_matches_one_process(full, first, last):
    assert first.hello["model"]["fingerprint"] == last.hello["model"]["fingerprint"] == full.hello["model"]["fingerprint"]
    assert first.hello["layers"][1] == last.hello["layers"][0]

    with full.sequence() as whole, first.sequence() as front, last.sequence() as back:

        def split(mtype: str, pos: int, tokens: list[int], **fields) -> tuple[Reply, Reply]:
            head = first.call(mtype, seq=front, pos=pos, tokens=tokens, **fields)
            # Relay the first shard's hidden frame as it came off the wire.
            tail = last.call(mtype, seq=back, pos=pos, hidden=head.tensors["hidden"], return_logits=True, **fields)
            return head, tail

        def same_logits(one: Reply, tail: Reply) -> None:
            assert tail.result["ids"] == one.result["ids"]
            assert bytes(tail.tensors["logits"].data) == bytes(one.tensors["logits"].data)

        layers = [1, 4]
        one = full.call("CAPTURE", seq=whole, pos=0, tokens=PREFIX, layers=layers, return_logits=True)
        head, tail = split("CAPTURE", 0, PREFIX, layers=layers)
        same_logits(one, tail)
        assert tensor_bytes(head)["layer.1"] == tensor_bytes(one)["layer.1"]
        assert tensor_bytes(tail)["layer.4"] == tensor_bytes(one)["layer.4"]

        geometry = {"checkpoint": True, "parents": pure_chain(len(DRAFT))}
        one = full.call("FORWARD", seq=whole, pos=3, tokens=DRAFT, return_logits=True, **geometry)
        same_logits(one, split("FORWARD", 3, DRAFT, **geometry)[1])

        lengths = {shard.call("ROLLBACK", seq=seq, keep=KEEP).result["length"]
                   for shard, seq in ((full, whole), (first, front), (last, back))}
        assert lengths == {3 + KEEP}

        one = full.call("FORWARD", seq=whole, pos=3 + KEEP, tokens=NEXT, return_logits=True)
        same_logits(one, split("FORWARD", 3 + KEEP, NEXT)[1])
        token = one.result["ids"][-1]  # a single-token decode step after the rollback
        one = full.call("FORWARD", seq=whole, pos=7, tokens=[token], return_logits=True)
        same_logits(one, split("FORWARD", 7, [token])[1])


# ---- bad input: an error reply, the daemon stays up, nothing changes ------------------------------------


DROP = object()  # a header field to leave out


@dataclass
class Context:
    """What a bad request is aimed at: an open sequence with PREFIX + DRAFT in, DRAFT pending or committed."""

    shard: Shard
    seq: int
    id: int
    length: int = PREFIX_AND_DRAFT

    def header(self, mtype: str, **fields) -> dict:
        header = {"v": 1, "type": mtype, "id": self.id}
        if mtype in ("FORWARD", "CAPTURE"):
            header.update(seq=self.seq, pos=self.length)
            if not self.shard.takes_hidden:
                header["tokens"] = NEXT
        elif mtype not in ("HELLO", "STATS", "SHUTDOWN"):
            header["seq"] = self.seq
        header.update(fields)
        return {k: v for k, v in header.items() if v is not DROP}

    def message(self, mtype: str, *data, **fields) -> list:
        return frames(self.header(mtype, **fields), *data)

    def hidden(self, dtype="float32", shape=(len(NEXT), HIDDEN), nbytes=None, name="hidden", **fields) -> list:
        """A FORWARD carrying one tensor frame described as `dtype`/`shape` (holding `nbytes` bytes)."""
        itemsize = {**DTYPE_SIZES, "float64": 8}[dtype]  # float64 is not a wire dtype, but a client may send it
        size = math.prod(shape) * itemsize if nbytes is None else nbytes
        descriptor = {"name": name, "dtype": dtype, "shape": list(shape)}
        return self.message("FORWARD", bytes(size), tensors=[descriptor], **fields)

    def encode(self, record_type, **fields) -> list:
        """A typed record put on the wire without client-side validation."""
        return encode_request(record_type(id=self.id, **fields), validate=False)

    def forward(self, tokens=NEXT, record_type=Forward, **fields) -> list:
        fields.setdefault("seq", self.seq)
        fields.setdefault("pos", self.length)
        return self.encode(record_type, **self.shard.inputs(tokens), **fields)


PENDING, COMMITTED = "pending", "committed"


@dataclass
class Case:
    name: str
    shard: str
    code: ErrorCode
    build: object  # Context -> frames
    # Whether DRAFT is a pending checkpointed step or committed when the bad request arrives; each runs separately.
    modes: tuple = (PENDING, COMMITTED)
    echo: bool = True  # whether the request is readable enough for the reply to carry its id and type
    message: str | None = None  # a regex the error message must match


def hidden_frame_count(count: int):
    def build(c: Context) -> list:
        descriptor = {"name": "hidden", "dtype": "float32", "shape": [len(NEXT), HIDDEN]}
        return c.message("FORWARD", *[bytes(4 * len(NEXT) * HIDDEN)] * count, tensors=[descriptor])

    return build


def non_finite_rows(value: float) -> WireTensor:
    """NEXT's hidden rows with one element `value` (a NaN or an infinity)."""
    rows = _HIDDEN_ROWS[NEXT].clone()
    rows[-1, 3] = value
    return WireTensor.from_torch(rows)


def duplicate_key_header(c: Context) -> list:
    pairs = [("v", 1), ("type", "CLOSE"), ("id", c.id), ("seq", c.seq), ("seq", c.seq + 1)]
    return [b"\x85" + b"".join(msgpack.packb(x) for pair in pairs for x in pair)]


BAD_CASES = [
    # undecodable bytes and headers that are not maps
    Case("garbage-bytes", "full", ErrorCode.BAD_REQUEST, lambda c: [b"\xc1\x00 definitely not msgpack"], echo=False),
    Case("empty-frame", "full", ErrorCode.BAD_REQUEST, lambda c: [b""], echo=False),
    Case("truncated-msgpack", "full", ErrorCode.BAD_REQUEST, lambda c: [c.message("CLOSE")[0][:-2]], echo=False),
    Case("trailing-bytes", "full", ErrorCode.BAD_REQUEST, lambda c: [c.message("CLOSE")[0] + b"\x00"], echo=False),
    Case("header-is-a-list", "full", ErrorCode.BAD_REQUEST, lambda c: [msgpack.packb([1, "CLOSE", c.id, c.seq])], echo=False,
         message="must be a msgpack map"),
    Case("header-is-a-string", "full", ErrorCode.BAD_REQUEST, lambda c: [msgpack.packb("CLOSE")], echo=False),
    Case("duplicate-key", "full", ErrorCode.BAD_REQUEST, duplicate_key_header, message="duplicate"),
    Case("non-string-key", "full", ErrorCode.BAD_REQUEST, lambda c: frames({**c.header("CLOSE"), 7: 1})),
    # version and type
    Case("version-2", "full", ErrorCode.UNSUPPORTED_VERSION, lambda c: c.message("CLOSE", v=2), message="version 2.*version 1"),
    Case("version-missing", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", v=DROP), message="'v'"),
    Case("version-string", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", v="1")),
    Case("type-missing", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", type=DROP), message="'type'"),
    Case("type-not-a-string", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", type=3)),
    Case("unknown-type", "full", ErrorCode.UNKNOWN_TYPE, lambda c: c.message("FORWARDS"), echo=False, message="FORWARDS"),
    Case("lower-case-type", "full", ErrorCode.UNKNOWN_TYPE, lambda c: c.message("close"), echo=False),
    # ids, wrong types, missing and unknown fields
    Case("id-missing", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", id=DROP), echo=False, message="'id'"),
    Case("id-negative", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", id=-1), echo=False),
    Case("id-too-large", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", id=1 << 63), echo=False),
    Case("id-bool", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", id=True), echo=False),
    Case("seq-string", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", seq=str(c.seq)), message="seq"),
    Case("seq-float", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", seq=float(c.seq)), message="seq"),
    Case("pos-bool", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", pos=True), message="pos"),
    Case("pos-negative", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", pos=-1), message="pos"),
    Case("tokens-not-a-list", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", tokens=NEXT[0]), message="tokens"),
    Case("token-float", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", tokens=[88.0, 99]), message="tokens"),
    Case("token-negative", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", tokens=[88, -99]), message="tokens"),
    Case("token-nil", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", tokens=None)),
    Case("checkpoint-int", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", checkpoint=1, parents=[-1, 0]),
         message="checkpoint.*bool"),
    Case("return-logits-string", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", return_logits="yes")),
    Case("parents-string", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", checkpoint=True, parents="-1,0")),
    Case("keep-bool", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("ROLLBACK", keep=True), message="keep"),
    Case("keep-negative", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("ROLLBACK", keep=-1), message="keep"),
    Case("seq-missing", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", seq=DROP), message="seq"),
    Case("pos-missing", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", pos=DROP), message="pos"),
    Case("keep-missing", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("ROLLBACK"), message="keep"),
    Case("layers-missing", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CAPTURE"), message="layers"),
    Case("unknown-field", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", tokenz=NEXT), message="tokenz"),
    Case("field-of-another-type", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("CLOSE", keep=0), message="keep"),
    Case("tokens-and-hidden", "full", ErrorCode.BAD_REQUEST, lambda c: c.hidden()),
    Case("no-tokens-no-hidden", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", tokens=DROP)),
    Case("empty-tokens", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", tokens=[])),
    Case("token-outside-vocabulary", "full", ErrorCode.BAD_REQUEST, lambda c: c.forward(tokens=[88, VOCAB]), message="320"),
    Case("draft-outside-vocabulary", "full", ErrorCode.BAD_REQUEST,
         lambda c: c.forward(temperature=0.7, seed=1, drafts=[VOCAB]), message="draft token 320"),
    Case("hidden-nan", "last", ErrorCode.BAD_REQUEST,
         lambda c: c.encode(Forward, seq=c.seq, pos=c.length, hidden=non_finite_rows(float("nan"))),
         message="tensor 'hidden'.*non-finite"),
    Case("hidden-infinite", "last", ErrorCode.BAD_REQUEST,
         lambda c: c.encode(Forward, seq=c.seq, pos=c.length, hidden=non_finite_rows(float("inf"))),
         message="tensor 'hidden'.*non-finite"),
    Case("hidden-to-the-first-shard", "full", ErrorCode.BAD_REQUEST,
         lambda c: c.encode(Forward, seq=c.seq, pos=c.length, hidden=hidden_for(NEXT)), message="send tokens"),
    Case("tokens-to-a-later-shard", "last", ErrorCode.BAD_REQUEST,
         lambda c: c.encode(Forward, seq=c.seq, pos=c.length, tokens=NEXT), message="send hidden"),
    Case("return-logits-without-head", "first", ErrorCode.BAD_REQUEST, lambda c: c.forward(return_logits=True),
         message="return_logits"),
    # tensors: dtype, shape, byte length, frame count
    Case("hidden-dtype-not-the-shards", "last", ErrorCode.BAD_REQUEST,
         lambda c: c.encode(Forward, seq=c.seq, pos=c.length, hidden=hidden_for(NEXT, torch.bfloat16)),
         message="bfloat16"),
    Case("hidden-float16", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden("float16")),
    Case("hidden-int32", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden("int32")),
    Case("hidden-float64", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden("float64"), message="float64"),
    Case("hidden-narrow", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(shape=(2, HIDDEN // 2)), message="64"),
    Case("hidden-wide", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(shape=(2, HIDDEN + 1))),
    Case("hidden-1d", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(shape=(2 * HIDDEN,))),
    Case("hidden-3d", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(shape=(1, 2, HIDDEN))),
    Case("hidden-no-rows", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(shape=(0, HIDDEN))),
    Case("hidden-zero-width", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(shape=(2, 0))),
    Case("hidden-frame-short", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(nbytes=4 * 2 * HIDDEN - 1), message="512 bytes"),
    Case("hidden-frame-long", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(nbytes=4 * 2 * HIDDEN + 4), message="512 bytes"),
    Case("hidden-frame-of-bfloat16-size", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(nbytes=2 * 2 * HIDDEN)),
    Case("tensor-wrong-name", "last", ErrorCode.BAD_REQUEST, lambda c: c.hidden(name="hiddens"), message="hiddens"),
    Case("descriptor-extra-key", "last", ErrorCode.BAD_REQUEST, lambda c: c.message(
        "FORWARD", bytes(4 * 2 * HIDDEN), tensors=[{"name": "hidden", "dtype": "float32", "shape": [2, HIDDEN], "order": "C"}])),
    # more frames than FORWARD can carry at all: refused by count as they arrive, not by descriptor
    Case("too-many-frames", "last", ErrorCode.BAD_REQUEST, hidden_frame_count(3), message="at most 3 frame.*4 frames"),
    Case("too-few-frames", "last", ErrorCode.BAD_REQUEST, hidden_frame_count(0), message="1 tensor.*0 tensor frame"),
    Case("frame-without-descriptor", "full", ErrorCode.BAD_REQUEST, lambda c: c.message("FORWARD", b"\x00" * 8)),
    Case("tensor-on-close", "full", ErrorCode.BAD_REQUEST, lambda c: c.message(
        "CLOSE", bytes(4), tensors=[{"name": "hidden", "dtype": "float32", "shape": [1, 1]}])),
    # sizes
    Case("too-many-tokens", "limited", ErrorCode.TOO_LARGE, lambda c: c.forward(tokens=list(range(9))), message="limit 8"),
    Case("too-many-hidden-rows", "last", ErrorCode.TOO_LARGE, lambda c: c.hidden(shape=(4097, HIDDEN)), message="4097"),
    Case("too-many-frames-for-the-limit", "full", ErrorCode.TOO_LARGE, lambda c: c.message("CLOSE", *[b""] * 64),
         message="65 frames"),
    Case("header-too-large", "full", ErrorCode.TOO_LARGE, lambda c: c.message("CLOSE", padding=b"\x00" * (1 << 20)), echo=False),
    Case("too-many-capture-layers", "full", ErrorCode.TOO_LARGE, lambda c: c.message("CAPTURE", layers=list(range(257)))),
    Case("block-size-too-large", "limited", ErrorCode.TOO_LARGE, lambda c: c.encode(Propose, **propose_fields(c.seq, c.length, last_token=1, block_size=9))),
    Case("checkpoint-longer-than-storage", "full", ErrorCode.ROLLBACK_UNAVAILABLE,
         lambda c: c.forward(tokens=list(range(9)), checkpoint=True, parents=pure_chain(9)), message="at most 8"),
    # sequence state
    Case("pos-ahead", "full", ErrorCode.POSITION_MISMATCH, lambda c: c.forward(pos=c.length + 1), message="pos=8.*7"),
    Case("pos-behind", "full", ErrorCode.POSITION_MISMATCH, lambda c: c.forward(pos=c.length - 1)),
    Case("pos-zero", "last", ErrorCode.POSITION_MISMATCH, lambda c: c.forward(pos=0)),
    Case("verify-step-resent", "full", ErrorCode.POSITION_MISMATCH,
         lambda c: c.forward(tokens=DRAFT, pos=len(PREFIX), checkpoint=True, parents=pure_chain(len(DRAFT)))),
    Case("rollback-nothing-pending", "full", ErrorCode.NO_PENDING_STEP, lambda c: c.encode(Rollback, seq=c.seq, keep=KEEP),
         modes=(COMMITTED,)),
    Case("rollback-nothing-pending-later-shard", "last", ErrorCode.NO_PENDING_STEP,
         lambda c: c.encode(Rollback, seq=c.seq, keep=0), modes=(COMMITTED,)),
    Case("keep-beyond-the-step", "full", ErrorCode.BAD_REQUEST, lambda c: c.encode(Rollback, seq=c.seq, keep=len(DRAFT) + 1),
         message="keep=5", modes=(PENDING,)),
    Case("keep-beyond-the-step-replay-ssm", "limited", ErrorCode.BAD_REQUEST,
         lambda c: c.encode(Rollback, seq=c.seq, keep=len(DRAFT) + 1), modes=(PENDING,)),
    Case("checkpoint-without-storage", "plain", ErrorCode.ROLLBACK_UNAVAILABLE,
         lambda c: c.forward(checkpoint=True, parents=pure_chain(len(NEXT))), modes=(COMMITTED,)),
    Case("capture-checkpoint-without-storage", "plain", ErrorCode.ROLLBACK_UNAVAILABLE,
         lambda c: c.forward(record_type=Capture, layers=[1], checkpoint=True, parents=pure_chain(len(NEXT))), modes=(COMMITTED,)),
    Case("rollback-without-storage", "plain", ErrorCode.ROLLBACK_UNAVAILABLE, lambda c: c.encode(Rollback, seq=c.seq, keep=0),
         modes=(COMMITTED,)),
    Case("restore-without-snapshot", "full", ErrorCode.NO_SNAPSHOT, lambda c: c.encode(Restore, seq=c.seq)),
    Case("open-an-open-sequence", "full", ErrorCode.SEQUENCE_EXISTS, lambda c: c.encode(Open, seq=c.seq)),
    Case("open-from-a-prefix-entry-not-held", "full", ErrorCode.PREFIX_MISSING,
         lambda c: c.encode(Open, seq=c.seq + 10**9, prefix=12345), message="prefix entry 12345"),
    Case("save-prefix-with-checkpoint", "full", ErrorCode.BAD_REQUEST,
         lambda c: c.forward(checkpoint=True, parents=pure_chain(len(NEXT)), save_prefix=7), message="save_prefix"),
    Case("forward-unknown-sequence", "full", ErrorCode.NO_SUCH_SEQUENCE, lambda c: c.forward(seq=c.seq + 10**9, pos=0)),
    Case("capture-unknown-sequence", "last", ErrorCode.NO_SUCH_SEQUENCE,
         lambda c: c.forward(record_type=Capture, layers=[4], seq=c.seq + 10**9, pos=0)),
    Case("rollback-unknown-sequence", "full", ErrorCode.NO_SUCH_SEQUENCE, lambda c: c.encode(Rollback, seq=c.seq + 10**9, keep=0)),
    Case("snapshot-unknown-sequence", "full", ErrorCode.NO_SUCH_SEQUENCE, lambda c: c.encode(Snapshot, seq=c.seq + 10**9)),
    Case("restore-unknown-sequence", "full", ErrorCode.NO_SUCH_SEQUENCE, lambda c: c.encode(Restore, seq=c.seq + 10**9)),
    Case("close-unknown-sequence", "full", ErrorCode.NO_SUCH_SEQUENCE, lambda c: c.encode(Close, seq=c.seq + 10**9)),
    Case("propose-without-drafter", "full", ErrorCode.NO_DRAFTER, lambda c: c.encode(Propose, **propose_fields(c.seq, c.length, last_token=1, block_size=4))),
    Case("propose-block-size-zero", "full", ErrorCode.BAD_REQUEST, lambda c: c.encode(Propose, **propose_fields(c.seq, c.length, last_token=1, block_size=0))),
    # capture layers
    Case("capture-layers-empty", "full", ErrorCode.BAD_REQUEST, lambda c: c.forward(record_type=Capture, layers=[])),
    Case("capture-layers-repeated", "full", ErrorCode.BAD_REQUEST, lambda c: c.forward(record_type=Capture, layers=[1, 1]),
         message="repeats"),
    Case("capture-layer-outside-the-model", "first", ErrorCode.BAD_REQUEST,
         lambda c: c.forward(record_type=Capture, layers=[1, NUM_LAYERS]), message="capture layer 6"),
    # verify geometry: checked before anything happens to the sequence, also mid-pending-step
    Case("geometry-missing", "full", ErrorCode.GEOMETRY_REJECTED, lambda c: c.forward(checkpoint=True), message="missing"),
    Case("geometry-sibling", "full", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(tokens=[88, 99, 100], checkpoint=True, parents=[-1, 0, 0]), message="sibling"),
    Case("geometry-sibling-later-shard", "last", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(tokens=[88, 99, 100], checkpoint=True, parents=[-1, 0, 0]), message="sibling"),
    Case("geometry-sibling-capture", "first", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(record_type=Capture, layers=[1], tokens=[88, 99, 100], checkpoint=True, parents=[-1, 0, 0]),
         message="sibling"),
    Case("geometry-skipped-parent", "full", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(tokens=[88, 99, 100, 101], checkpoint=True, parents=[-1, 0, 1, 0]), message="skipped parent"),
    Case("geometry-truncated", "full", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(checkpoint=True, parents=[-1]), message="truncated"),
    Case("geometry-too-long", "full", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(checkpoint=True, parents=[-1, 0, 1]), message="too long"),
    Case("geometry-malformed-root", "full", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(checkpoint=True, parents=[0, 0]), message="malformed root"),
    Case("geometry-cyclic", "full", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(checkpoint=True, parents=[-1, 1]), message="cyclic"),
    Case("geometry-forward-parent", "full", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(tokens=[88, 99, 100], checkpoint=True, parents=[-1, 2, 1]), message="forward parent"),
    Case("geometry-out-of-range", "full", ErrorCode.GEOMETRY_REJECTED,
         lambda c: c.forward(checkpoint=True, parents=[-1, 5]), message="out of range"),
    Case("parents-without-checkpoint", "full", ErrorCode.BAD_REQUEST,
         lambda c: c.forward(parents=pure_chain(len(NEXT))), message="parents"),
]


def run_script(shard: Shard, seq: int, pending: bool, bad=None) -> tuple:
    """PREFIX, then DRAFT (checkpointed when `pending`), then `bad(...)`, then ROLLBACK to KEEP (when
    pending) and a FORWARD of NEXT: returns what the client observed of those last two."""
    shard.call("FORWARD", seq=seq, pos=0, **shard.inputs(PREFIX))
    shard.call("FORWARD", seq=seq, pos=len(PREFIX), **shard.inputs(DRAFT),
               **({"checkpoint": True, "parents": pure_chain(len(DRAFT))} if pending else {}))
    if bad is not None:
        bad()
    observed = []
    pos = PREFIX_AND_DRAFT
    if pending:
        rollback = shard.call("ROLLBACK", seq=seq, keep=KEEP)
        observed.append(outcome(rollback))
        pos = len(PREFIX) + KEEP
    observed.append(outcome(shard.forward(seq, pos, NEXT)))
    return tuple(observed)


@pytest.fixture(scope="module")
def references(fleet):
    """The script's outcome on a fresh sequence that never saw a bad request, per (shard, pending)."""
    cache = {}

    def reference(shard: Shard, name: str, pending: bool) -> tuple:
        key = (name, pending)
        if key not in cache:
            with shard.sequence() as seq:
                cache[key] = run_script(shard, seq, pending)
        return cache[key]

    return reference


BAD_RUNS = [(case, mode) for case in BAD_CASES for mode in case.modes]


@pytest.mark.parametrize("case, mode", BAD_RUNS,
                         ids=[case.name if len(case.modes) == 1 else f"{case.name}-{mode}" for case, mode in BAD_RUNS])
def test_bad_request_gets_an_error_and_changes_nothing(case, mode, request, references):
    shard = request.getfixturevalue(case.shard)
    pending = mode == PENDING
    expected = references(shard, case.shard, pending)
    before = shard.stats()
    replies = []

    with shard.sequence() as seq:
        context = Context(shard, seq, shard.client.next_id())

        def send_bad() -> None:
            replies.append(shard.client.exchange(case.build(context)))

        observed = run_script(shard, seq, pending, send_bad)

    (reply,) = replies
    assert not reply.ok and reply.tensors == {}
    assert reply.error_code is case.code, reply.error_message
    if case.message is not None:
        assert re.search(case.message, reply.error_message), reply.error_message
    if case.echo:
        assert reply.id == context.id, reply
    else:
        assert reply.id is None or reply.id == context.id
    # The daemon is still up, counted the error once, and the sequence behaves as if nothing had arrived.
    assert shard.daemon.alive()
    after = shard.stats()
    assert moved(before, after, "errors", case.code.value) == 1
    assert sum(after["errors"].values()) - sum(before["errors"].values()) == 1
    assert observed == expected


def test_bad_cases_cover_every_error_code_a_request_can_cause():
    codes = {case.code for case in BAD_CASES}
    # CAPACITY has its own tests; INTERNAL and SEQUENCE_FAILED need a compute error (test_compute_error_...);
    # FORBIDDEN needs a peer of another kind (test_reliability.py); ROWS_MISSING a second shard's ROWS
    # (test_relay.py, "rows from shard to shard").
    assert set(ErrorCode) - codes == {ErrorCode.CAPACITY, ErrorCode.INTERNAL, ErrorCode.SEQUENCE_FAILED, ErrorCode.FORBIDDEN,
                                      ErrorCode.ROWS_MISSING}


# ---- STATS -----------------------------------------------------------------------------------------------


def test_stats_counts_what_happened(full):
    before = full.stats()
    with full.sequence() as seq:
        during = full.stats()
        full.call("HELLO")
        full.forward(seq, 0, PREFIX)  # 3 tokens
        full.forward(seq, 3, DRAFT, checkpoint=True)  # 4 tokens, checkpointed
        full.call("ROLLBACK", seq=seq, keep=KEEP)
        full.forward(seq, 5, DRAFT[:3], checkpoint=True)  # 3 tokens, checkpointed
        full.call("ROLLBACK", seq=seq, keep=3)
        full.call("SNAPSHOT", seq=seq)
        full.forward(seq, 8, NEXT, layers=[0, 2, 5])  # CAPTURE of 2 tokens, 3 layers
        full.call("RESTORE", seq=seq)
        full.request("ROLLBACK", seq=seq, keep=0)  # NO_PENDING_STEP
        full.request("OPEN", seq=seq)  # SEQUENCE_EXISTS
        full.request("PROPOSE", **propose_fields(seq, 8, last_token=1, block_size=2))  # NO_DRAFTER
        full.client.exchange([b"\xc1"])  # BAD_REQUEST, not counted as a request of any type
        after_work = full.stats()
    after = full.stats()

    def delta(key, sub=None):
        return moved(before, after_work, key, sub)

    assert {t: delta("requests", t) for t in
            ("HELLO", "OPEN", "CLOSE", "FORWARD", "CAPTURE", "ROLLBACK", "SNAPSHOT", "RESTORE", "PROPOSE", "STATS")} == {
        "HELLO": 1, "OPEN": 2, "CLOSE": 0, "FORWARD": 3, "CAPTURE": 1, "ROLLBACK": 3, "SNAPSHOT": 1, "RESTORE": 1,
        "PROPOSE": 1, "STATS": 2,
    }
    assert {code: delta("errors", code) for code in ("NO_PENDING_STEP", "SEQUENCE_EXISTS", "NO_DRAFTER", "BAD_REQUEST")} == {
        "NO_PENDING_STEP": 1, "SEQUENCE_EXISTS": 1, "NO_DRAFTER": 1, "BAD_REQUEST": 1,
    }
    assert delta("forwards") == 4 and delta("captures") == 1
    assert delta("tokens_forwarded") == 3 + 4 + 3 + 2
    assert delta("captured_rows") == 2 * 3
    assert delta("checkpointed_steps") == 2
    assert delta("checkpoint_writes") == (4 + 3) * GDN_LAYERS
    assert delta("recurrence_log_tokens") == 0
    assert delta("rollbacks", "checkpoint") == 2
    assert delta("rollbacks_by_keep", str(KEEP)) == 1 and delta("rollbacks_by_keep", "3") == 1
    assert delta("snapshots") == 1 and delta("restores") == 1
    assert delta("sequences_opened") == 1 and moved(before, after, "sequences_closed") == 1
    assert delta("sequences_failed") == 0

    # Gauges: the open sequence's state and checkpoint storage, while it is open.
    assert moved(before, during, "open_sequences") == 1 and moved(during, after, "open_sequences") == -1
    assert moved(before, during, "state_bytes") == state_bytes(4096)
    assert moved(before, during, "checkpoint_bytes") == CHECKPOINT_BYTES_8
    assert moved(during, after, "state_bytes") == -state_bytes(4096)
    assert moved(during, after, "checkpoint_bytes") == -CHECKPOINT_BYTES_8
    assert after["failed_sequences"] == 0
    assert after["engine"] == {}  # the reference engine: no graphs to report

    for kind in ("FORWARD", "CAPTURE", "ROLLBACK", "SNAPSHOT", "RESTORE", "OPEN"):
        assert moved(before, after_work, "compute_seconds", kind) > 0, kind
    assert after["uptime_seconds"] > before["uptime_seconds"] > 0


def test_stats_weight_bytes_of_a_split_add_up(full, first, last):
    assert first.stats()["weight_bytes"] + last.stats()["weight_bytes"] == full.stats()["weight_bytes"]


def test_stats_of_replay_ssm_rollback(limited):
    before = limited.stats()
    with limited.sequence() as seq, limited.sequence() as reference:
        during = limited.stats()
        limited.forward(seq, 0, PREFIX)
        limited.forward(seq, 3, DRAFT, checkpoint=True)
        assert limited.call("ROLLBACK", seq=seq, keep=1).result["length"] == 4
        after_step = limited.forward(seq, 4, NEXT)
        limited.forward(reference, 0, PREFIX)
        limited.forward(reference, 3, DRAFT[:1])
        expected = limited.forward(reference, 4, NEXT)
        assert after_step.result["ids"] == expected.result["ids"]
        torch.testing.assert_close(as_torch(after_step.tensors["logits"]), as_torch(expected.tensors["logits"]), rtol=1e-4, atol=1e-4)
    after = limited.stats()
    assert moved(before, after, "recurrence_log_tokens") == len(DRAFT) * GDN_LAYERS
    assert moved(before, after, "checkpoint_writes") == 0
    assert moved(before, after, "checkpointed_steps") == 1
    assert moved(before, after, "rollbacks", "replay-ssm") == 1 and moved(before, after, "rollbacks", "checkpoint") == 0
    assert moved(before, after, "rollbacks_by_keep", "1") == 1
    assert moved(before, during, "checkpoint_bytes") == 2 * REPLAY_SSM_BYTES_4
    assert moved(before, during, "state_bytes") == 2 * state_bytes(24)


def _memory_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "SwapTotal"))


def test_compute_error_fails_only_its_sequence(workdir):
    """A prefill that fits every configured limit but not the machine's memory: an attention layer's causal
    mask of n x n bools cannot be allocated, part-way through the sequence's layers. The daemon must
    answer INTERNAL, mark only that sequence failed (SEQUENCE_FAILED until CLOSE), and keep serving."""
    overcommit = Path("/proc/sys/vm/overcommit_memory")
    if not overcommit.exists() or overcommit.read_text().strip() == "1":
        pytest.skip("with overcommit always on, the allocation would succeed and the OOM killer would act instead")
    # The mask must be far beyond memory (RAM + swap; twice that here), so allocating it fails at once; no
    # larger n than that: the rows before the mask are real bfloat16 work (each doubling of n doubles it).
    n = 1 << 16
    while n * n <= 2 * _memory_bytes():
        n *= 2
    if n > 1 << 20:
        pytest.skip("this machine has too much memory to run out of it quickly")
    # Layers 2:6 start with an attention layer, so the failure comes at once, after the KV rows were written.
    daemon = Daemon("compute-error", f"ipc://{workdir}/compute-error.sock", [
        "--layers", "2:6", "--dtype", "bfloat16", "--max-verify-tokens", "0",
        "--max-context", str(2 * n), "--allow-long-context", "--max-tokens-per-request", str(n),
    ], workdir)
    try:
        daemon.wait_ready()
        shard = Shard(daemon, daemon.client())
        prefix = hidden_for(PREFIX, torch.bfloat16)
        step = hidden_for(NEXT, torch.bfloat16)
        failing, healthy = new_seq(), new_seq()
        for seq in (failing, healthy):
            shard.call("OPEN", seq=seq)
            shard.call("FORWARD", seq=seq, pos=0, hidden=prefix)
        before = shard.stats()

        huge = WireTensor.from_torch(torch.zeros(n, HIDDEN, dtype=torch.bfloat16))
        reply = shard.request("FORWARD", seq=failing, pos=3, hidden=huge)
        assert reply.error_code is ErrorCode.INTERNAL and "allocate" in reply.error_message
        del huge

        after = shard.stats()
        assert moved(before, after, "sequences_failed") == 1
        assert after["failed_sequences"] == 1 and after["open_sequences"] == 2
        assert moved(before, after, "errors", "INTERNAL") == 1

        for mtype, fields in (("FORWARD", {"pos": 3, "hidden": step}), ("CAPTURE", {"pos": 3, "hidden": step, "layers": [2]}),
                              ("SNAPSHOT", {}), ("RESTORE", {}), ("ROLLBACK", {"keep": 0})):
            refused = shard.request(mtype, seq=failing, **fields)
            assert refused.error_code is ErrorCode.SEQUENCE_FAILED, (mtype, refused.error_message)
            assert "CLOSE" in refused.error_message
        assert moved(after, shard.stats(), "errors", "SEQUENCE_FAILED") == 5

        # The other sequence is untouched; the failed one closes, and its seq starts afresh.
        expected = shard.call("FORWARD", seq=healthy, pos=3, hidden=step, return_logits=True)
        assert shard.call("CLOSE", seq=failing).result == {"seq": failing, "length": 3}
        final = shard.stats()
        assert final["failed_sequences"] == 0 and final["sequences_failed"] == after["sequences_failed"]
        shard.call("OPEN", seq=failing)
        shard.call("FORWARD", seq=failing, pos=0, hidden=prefix)
        again = shard.call("FORWARD", seq=failing, pos=3, hidden=step, return_logits=True)
        assert outcome(again) == outcome(expected)
        assert daemon.alive()
        assert daemon.stop() == 0
    finally:
        daemon.stop()


# ---- readiness, signals, security ---------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_systemd_readiness_and_clean_stop_on_signal(signum, workdir):
    name = signal.Signals(signum).name
    notify_path = workdir / f"notify-{name}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        daemon = Daemon(f"notify-{name}", f"ipc://{workdir}/notify-{name}.sock", [], workdir,
                        env={"NOTIFY_SOCKET": str(notify_path)})
        try:
            messages = receive_until(notify, "READY=1", timeout=60)
            # READY=1 comes after the weights are loaded: HELLO answers at once.
            assert any(re.match(r"STATUS=loading weights (\d+)/\1 bytes", m) for m in messages[:-1]), messages
            hello = daemon.client().request("HELLO", timeout=2)
            assert hello.ok and hello.result["layers"] == [0, NUM_LAYERS]
            assert daemon.ipc_path.exists()

            stopping_at = time.monotonic()
            daemon.signal(signum)
            receive_until(notify, "STOPPING=1", timeout=5)
            assert daemon.wait(5) == 0
            assert time.monotonic() - stopping_at < 3
            assert not daemon.ipc_path.exists()
            assert f"signal {name}: stopping" in daemon.output()
        finally:
            daemon.stop()


def test_non_loopback_bind_without_keys_is_refused(workdir):
    port = free_tcp_endpoint().rsplit(":", 1)[1]
    result = subprocess.run(
        [sys.executable, "-m", "shardd", "serve", "--synthetic", "tiny", "--bind", f"tcp://0.0.0.0:{port}"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "refusing to bind tcp://0.0.0.0" in result.stderr and "--curve-secret-key" in result.stderr


def keygen(directory: Path, name: str) -> tuple[bytes, bytes]:
    result = subprocess.run([sys.executable, "-m", "shardd", "keygen", "--out", str(directory), "--name", name],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    assert str(public_file) in result.stdout and str(secret_file) in result.stdout
    public, no_secret = zmq.auth.load_certificate(public_file)
    assert no_secret is None  # the shareable file holds no secret
    same_public, secret = zmq.auth.load_certificate(secret_file)
    assert same_public == public and len(public) == len(secret) == 40
    return public, secret


def test_keygen_and_a_curve_protected_bind(workdir):
    keys, allowed = workdir / "keys", workdir / "allowed"
    server_public, _ = keygen(keys, "server")
    client_public, client_secret = keygen(keys, "client")
    stranger_public, stranger_secret = keygen(keys, "stranger")
    allowed.mkdir()
    shutil.copy(keys / "client.key", allowed)  # only the public half is shared with the server
    port = free_tcp_endpoint().rsplit(":", 1)[1]
    daemon = Daemon("curve", f"tcp://0.0.0.0:{port}", [
        "--curve-secret-key", str(keys / "server.key_secret"), "--curve-allow", str(allowed),
    ], workdir)
    local = f"tcp://127.0.0.1:{port}"
    try:
        allowed_client = Client(local, curve_serverkey=server_public, curve_publickey=client_public,
                                curve_secretkey=client_secret)
        hello = allowed_client.wait_ready(daemon.process, log=daemon.log)
        assert hello["layers"] == [0, NUM_LAYERS]
        # A client whose key is not allowed, and one without CURVE, get nothing through: once the handshake
        # is refused a DEALER has no peer, so the send itself may time out.
        stranger = Client(local, curve_serverkey=server_public, curve_publickey=stranger_public,
                          curve_secretkey=stranger_secret, sndtimeo=1000)
        plaintext = Client(local, sndtimeo=1000)
        for client in (stranger, plaintext):
            try:
                client.send_frames(encode_request(Forward(id=1, seq=1, pos=0, tokens=[1])))
            except zmq.Again:
                pass
            else:
                assert client.receive(timeout=1.0) is None
            client.close()
        assert allowed_client.call("STATS").result["requests"].get("FORWARD", 0) == 0
        allowed_client.close()
        assert daemon.stop() == 0
    finally:
        daemon.stop()
