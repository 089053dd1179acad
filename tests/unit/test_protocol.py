"""Wire protocol v1: round trips, zero-copy decoding, validation codes, verify geometry.

Frames are plain bytes here; the daemon tests cover real sockets. Bad requests are built
with msgpack directly, so the decoder is tested against bytes the codec did not write.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from protocol import (
    PROTOCOL_VERSION,
    Ring,
    Capture,
    CaptureBatch,
    ForwardBatch,
    ItemRefused,
    Close,
    ErrorCode,
    Forward,
    Hello,
    Limits,
    MessageType,
    Open,
    Propose,
    Rows,
    ProtocolError,
    RemoteError,
    Restore,
    Rollback,
    Shutdown,
    Snapshot,
    Stats,
    WireTensor,
    check_verify_geometry,
    decode_reply,
    decode_request,
    encode_error,
    encode_reply,
    encode_request,
    peek_id,
    peek_kind,
    peek_type,
    pure_chain,
)
from protocol.tensors import concat_rows, row_slice

REPO_ROOT = Path(__file__).resolve().parents[2]


def wire(tensor: torch.Tensor) -> WireTensor:
    return WireTensor.from_torch(tensor)


def message(header: dict, *data) -> list:
    return [msgpack.packb(header, use_bin_type=True), *data]


def rejection(frames, limits: Limits | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_request(frames, limits)
    return info.value


FORWARD = {"v": 1, "type": "FORWARD", "id": 7, "seq": 3, "pos": 0, "tokens": [11, 12, 13]}
OPEN = {"v": 1, "type": "OPEN", "id": 1, "seq": 3}


def without(header: dict, key: str) -> dict:
    return {k: v for k, v in header.items() if k != key}


def hidden_message(shape, dtype="float32", nbytes=None, **fields) -> list:
    size = nbytes if nbytes is not None else 4 * shape[0] * shape[1]
    header = {**without(FORWARD, "tokens"), **fields,
              "tensors": [{"name": "hidden", "dtype": dtype, "shape": list(shape)}]}
    return message(header, bytes(size))


# --- round trips -------------------------------------------------------------------------

HIDDEN_F32 = torch.arange(12, dtype=torch.float32).reshape(3, 4)
HIDDEN_BF16 = torch.tensor([[1.5, -2.0, 3.25], [0.0, 7.0, -0.5]], dtype=torch.bfloat16)

ROUND_TRIP_RECORDS = [
    Hello(1),
    Stats(2),
    Shutdown(3),
    Open(4, seq=9),
    Close(5, seq=9),
    Snapshot(6, seq=9),
    Restore(7, seq=9),
    Rollback(8, seq=9, keep=2),
    Forward(10, seq=9, pos=0, tokens=[1, 2, 3]),
    Forward(11, seq=9, pos=3, tokens=[4, 5, 6, 7], checkpoint=True, parents=[-1, 0, 1, 2], return_logits=True),
    Forward(12, seq=(1 << 63) - 1, pos=5, hidden=wire(HIDDEN_F32)),
    Capture(13, seq=9, pos=0, tokens=[2**31 - 1], layers=[0]),
    Capture(14, seq=9, pos=7, hidden=wire(HIDDEN_BF16), checkpoint=True, parents=[-1, 0], layers=[5, 2, 40]),
    Propose(15, seq=9, pos=3, last_token=42, block_size=4),
    Propose(16, seq=9, pos=3, last_token=42, block_size=4, features=wire(torch.ones(2, 5, dtype=torch.float16))),
    Propose(17, seq=9, pos=0, last_token=0, block_size=1, features=wire(torch.empty(0, 5))),
    Forward(18, seq=9, pos=4, tokens=[1, 2], send_rows=(1 << 62) + 5),
    Capture(19, seq=9, pos=4, rows_ticket=7, ticket_rows=2, send_rows=8, checkpoint=True, parents=[-1, 0],
            layers=[3]),
    Rows(20, seq=9, pos=4, ticket=7, hidden=wire(HIDDEN_BF16)),
    Rows(21, seq=9, pos=4, ticket=8, refused=True),
    Rows(22, seq=9, pos=4, ticket=8, slot=1, slot_rows=16),
    Rows(24, seq=9, pos=4, ticket=8, slot=0, slot_rows=16, slot_gen=3),
    Rows(26, seq=9, pos=4, ticket=8, slot=0, slot_rows=16, slot_gen=3, carries=True, slot_carried=2),
    Rows(27, seq=9, pos=4, ticket=8, slot=0, slot_rows=2, slot_gen=3, carries=True, carried=wire(torch.ones(2, 6))),
    Ring(23, rows=4096, pid=4321),
    Ring(25, rows=64, pid=7, gpu="GPU-2f1c0d3e-77aa-4b61-9a0e-1d2c3b4a5f60"),
]


@pytest.mark.parametrize("record", ROUND_TRIP_RECORDS, ids=lambda r: f"{r.type.value}-{r.id}")
def test_every_request_round_trips(record):
    frames = encode_request(record)
    decoded = decode_request([bytes(f) for f in frames], Limits())
    assert decoded == record
    assert type(decoded) is type(record)
    assert decoded.type is record.type
    n_tensors = sum(isinstance(getattr(record, n, None), WireTensor) for n in ("hidden", "features", "carried"))
    assert len(frames) == 1 + n_tensors


def test_every_message_type_has_a_round_trip_case():
    assert {r.type for r in ROUND_TRIP_RECORDS} == set(MessageType)


def test_forward_header_bytes_on_the_wire():
    frames = encode_request(Forward(7, seq=3, pos=4, tokens=[5, 6], checkpoint=True, parents=[-1, 0]))
    assert len(frames) == 1
    assert msgpack.unpackb(frames[0], raw=False) == {
        "v": 1, "type": "FORWARD", "id": 7, "seq": 3, "pos": 4, "tokens": [5, 6],
        "checkpoint": True, "parents": [-1, 0], "return_logits": False,
    }


def test_hidden_frame_is_raw_little_endian_row_major():
    frames = encode_request(Forward(1, seq=0, pos=0, hidden=wire(HIDDEN_F32)))
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["tensors"] == [{"name": "hidden", "dtype": "float32", "shape": [3, 4]}]
    expected = b"".join(int(i).to_bytes(4, "little") for i in
                        [0, 0x3F800000, 0x40000000, 0x40400000])  # 0.0, 1.0, 2.0, 3.0
    assert bytes(frames[1])[:16] == expected


def test_bfloat16_values_survive():
    record = decode_request(encode_request(Capture(1, seq=0, pos=0, hidden=wire(HIDDEN_BF16), layers=[1])))
    out = record.hidden.to_torch()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, HIDDEN_BF16)


def test_to_torch_with_device_copies():
    frame = bytearray((0x3F800000).to_bytes(4, "little") + (0x40000000).to_bytes(4, "little"))
    tensor = WireTensor("float32", (2,), frame).to_torch(device="cpu")
    assert tensor.tolist() == [1.0, 2.0]


def test_non_contiguous_tensor_is_sent_in_row_major_order():
    transposed = HIDDEN_F32.t()
    assert not transposed.is_contiguous()
    assert torch.equal(wire(transposed).to_torch(), transposed)


def test_unsupported_torch_dtype_cannot_travel():
    with pytest.raises(ValueError, match="float64"):
        wire(torch.zeros(2, dtype=torch.float64))


def test_wire_tensor_rejects_wrong_byte_length():
    with pytest.raises(ProtocolError) as info:
        WireTensor("float32", (2, 2), bytes(15))
    assert info.value.code is ErrorCode.BAD_REQUEST


def test_ok_reply_round_trips_with_tensors():
    logits = torch.randn(3, 10)
    tensors = {
        "hidden": wire(HIDDEN_BF16),
        "logits": wire(logits),
        "scalar": wire(torch.tensor(2.5)),        # shape ()
        "empty": wire(torch.empty(0, 4, dtype=torch.int64)),
        "ids": wire(torch.tensor([1, 2, 3], dtype=torch.int32)),
        "mask": wire(torch.tensor([0, 255], dtype=torch.uint8)),
    }
    frames = encode_reply(41, MessageType.FORWARD, {"seq": 9, "length": 3, "ids": [4, 5, 6]}, tensors)
    reply = decode_reply([bytes(f) for f in frames])
    assert (reply.id, reply.type, reply.ok) == (41, MessageType.FORWARD, True)
    assert reply.result == {"seq": 9, "length": 3, "ids": [4, 5, 6]}
    assert list(reply.tensors) == list(tensors)
    assert torch.equal(reply.tensors["hidden"].to_torch(), HIDDEN_BF16)
    assert torch.equal(reply.tensors["logits"].to_torch(), logits)
    assert reply.tensors["scalar"].shape == () and reply.tensors["scalar"].to_torch().item() == 2.5
    empty = reply.tensors["empty"].to_torch()
    assert empty.shape == (0, 4) and empty.dtype == torch.int64
    assert reply.tensors["ids"].to_torch().tolist() == [1, 2, 3]
    assert reply.tensors["mask"].to_torch().tolist() == [0, 255]
    assert reply.raise_for_error() is reply
    assert (reply.error_code, reply.error_message) == (None, None)


def test_error_reply_round_trips():
    frames = encode_error(5, "ROLLBACK", ErrorCode.NO_PENDING_STEP, "nothing pending on seq 9")
    assert msgpack.unpackb(frames[0], raw=False) == {
        "v": 1, "id": 5, "type": "ROLLBACK", "ok": False,
        "error": {"code": "NO_PENDING_STEP", "message": "nothing pending on seq 9"},
    }
    reply = decode_reply(frames)
    assert (reply.id, reply.type, reply.ok) == (5, MessageType.ROLLBACK, False)
    assert (reply.error_code, reply.error_message) == (ErrorCode.NO_PENDING_STEP, "nothing pending on seq 9")
    with pytest.raises(RemoteError) as info:
        reply.raise_for_error()
    assert info.value.code is ErrorCode.NO_PENDING_STEP


def test_error_reply_to_an_undecodable_request_has_nil_id_and_type():
    reply = decode_reply(encode_error(None, None, ErrorCode.BAD_REQUEST, "garbage"))
    assert (reply.id, reply.type, reply.error_code) == (None, None, ErrorCode.BAD_REQUEST)


@pytest.mark.parametrize("header, data, code", [
    ({"v": 1, "id": 1, "type": "HELLO", "ok": True, "result": {}, "junk": 1}, [], ErrorCode.BAD_REQUEST),
    ({"v": 1, "id": 1, "type": "HELLO", "result": {}}, [], ErrorCode.BAD_REQUEST),
    ({"v": 1, "id": 1, "type": "HELLO", "ok": 1, "result": {}}, [], ErrorCode.BAD_REQUEST),
    ({"v": 1, "id": 1, "type": "HELLO", "ok": True}, [], ErrorCode.BAD_REQUEST),
    ({"v": 1, "id": 1, "type": "HELLO", "ok": False, "error": {"code": "NOPE", "message": ""}}, [], ErrorCode.BAD_REQUEST),
    ({"v": 1, "id": 1, "type": "HELLO", "ok": False, "error": {"code": "INTERNAL"}}, [], ErrorCode.BAD_REQUEST),
    ({"v": 1, "id": 1, "type": "WHAT", "ok": True, "result": {}}, [], ErrorCode.BAD_REQUEST),
    ({"v": 1, "id": 1, "type": "HELLO", "ok": True, "result": {}, "tensors": []}, [b"x"], ErrorCode.BAD_REQUEST),
    ({"v": 2, "id": 1, "type": "HELLO", "ok": True, "result": {}}, [], ErrorCode.UNSUPPORTED_VERSION),
])
def test_malformed_reply_is_rejected(header, data, code):
    with pytest.raises(ProtocolError) as info:
        decode_reply(message(header, *data))
    assert info.value.code is code


def test_garbage_reply_is_rejected():
    with pytest.raises(ProtocolError) as info:
        decode_reply([b"\xc1"])
    assert info.value.code is ErrorCode.BAD_REQUEST


# --- zero copy ---------------------------------------------------------------------------

def test_decoded_request_tensor_is_the_frame_memory():
    frame = bytearray(4 * 2 * 3)
    header = {**without(FORWARD, "tokens"), "tensors": [{"name": "hidden", "dtype": "float32", "shape": [2, 3]}]}
    record = decode_request(message(header, frame))
    assert record.hidden.data.obj is frame
    tensor = record.hidden.to_torch()
    assert tensor.sum().item() == 0.0
    frame[0:4] = (0x40800000).to_bytes(4, "little")  # 4.0f
    assert bytes(record.hidden.data[:4]) == bytes(frame[:4])
    assert tensor[0, 0].item() == 4.0  # the torch tensor aliases the frame too


def test_decoded_reply_tensor_is_the_frame_memory():
    frame = bytearray(8)
    header = {"v": 1, "id": 1, "type": "FORWARD", "ok": True, "result": {},
              "tensors": [{"name": "logits", "dtype": "int64", "shape": [1, 1]}]}
    reply = decode_reply(message(header, frame))
    frame[0] = 9
    assert reply.tensors["logits"].to_torch().item() == 9


def test_zmq_frames_decode_without_copy():
    hidden = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    frames = [zmq.Frame(bytes(f)) for f in encode_request(Forward(3, seq=1, pos=0, hidden=wire(hidden)))]
    record = decode_request(frames)
    assert record.hidden.data.obj is frames[1]
    assert torch.equal(record.hidden.to_torch(), hidden)
    assert peek_id(frames) == 3


def test_a_batch_relayed_whole_is_passed_on_without_a_copy():
    """The relay splits a shard's batch reply into items and joins the surviving items' rows for the next shard:
    when every item goes on, in order, the joined frame is the received one (a view); otherwise the rows are
    copied. Either way the bytes are the items' rows end to end."""
    received = decode_reply(message({"v": 1, "id": 1, "type": "FORWARD", "ok": True, "result": {},
                                     "tensors": [{"name": "hidden", "dtype": "float32", "shape": [4, 1]}]},
                                    zmq.Frame(bytes(range(16))))).tensors["hidden"]
    memory = received.data.obj  # the received frame
    rows = [row_slice(received, 0, 1), row_slice(received, 1, 2), row_slice(received, 3, 1)]
    joined = concat_rows(rows)
    assert joined == received and joined.data.obj is memory
    assert concat_rows(rows[1:]) == row_slice(received, 1, 3) and concat_rows(rows[1:]).data.obj is memory
    for parts in ([rows[0], rows[2]], [rows[1], rows[0]], [rows[0], row_slice(wire(torch.zeros(1, 1)), 0, 1)]):
        copied = concat_rows(parts)
        assert bytes(copied.data) == b"".join(bytes(part.data) for part in parts)
        assert copied.shape == (sum(part.shape[0] for part in parts), 1)
    # a slice of a slice remembers the first tensor
    assert concat_rows([row_slice(rows[1], 0, 1), row_slice(rows[1], 1, 1), rows[2]]) == row_slice(received, 1, 3)


# --- batches with CAPTURE items: propose and carried rows ----------------------------------------------------

def rows_of(seq: int, n: int, width: int) -> WireTensor:
    return wire(torch.arange(n * width, dtype=torch.float32).reshape(n, width) + 1000 * seq)


def verify_item(seq: int, n: int, *, carried: bool = True, **fields) -> Capture:
    """A DFlash verify of `n` rows on the head shard: capture layer 3, propose, layers 0 and 1 carried."""
    extra = dict(carried_layers=[0, 1], carried=rows_of(-seq, n, 8)) if carried else {}
    fields = {"drafts": list(range(1, n)), **extra, **fields}
    return Capture(0, seq=seq, pos=5, hidden=rows_of(seq, n, 4), checkpoint=True, parents=pure_chain(n), layers=[3],
                   propose=2, **fields)


def test_a_forward_batch_carries_capture_items_with_propose_and_their_carried_rows_end_to_end():
    items = (Forward(0, seq=1, pos=0, hidden=rows_of(1, 2, 4)), verify_item(2, 3),
             Capture(0, seq=3, pos=0, hidden=rows_of(3, 1, 4), layers=[3]), verify_item(4, 2))
    for batch in (ForwardBatch(9, items=items), CaptureBatch(9, items=items[1:])):
        frames = encode_request(batch)
        header = msgpack.unpackb(frames[0])
        assert [(t["name"], t["shape"]) for t in header["tensors"]] == [
            ("hidden", [sum(item.n_tokens for item in batch.items), 4]), ("carried", [5, 8])]
        assert bytes(frames[2]) == bytes(items[1].carried.data) + bytes(items[3].carried.data)  # in item order
        decoded = decode_request([bytes(frame) for frame in frames])
        assert type(decoded) is type(batch) and decoded.items == batch.items
        assert [type(item) for item in decoded.items] == [type(item) for item in batch.items]
    assert peek_kind(frames) == ("CAPTURE", True) and peek_kind(encode_request(items[1])) == ("CAPTURE", False)


def test_a_batch_items_bad_propose_is_its_error_alone():
    """Each item's propose and carried rows are checked as the one-sequence CAPTURE checks them: the item is
    refused with the same code and message, the others decode."""
    bad = [verify_item(2, 3, drafts=[1]),  # drafts of another length than n - 1
           Capture(0, seq=4, pos=5, hidden=rows_of(4, 2, 4), layers=[3], carried_layers=[0, 1],
                   carried=rows_of(4, 2, 8))]  # carried rows without propose
    plain_propose = {"seq": 6, "pos": 0, "tokens": [1], "propose": 1}  # not a CAPTURE item: an unknown field
    items = (verify_item(1, 2), *bad, verify_item(5, 1, carried=False))
    frames = encode_request(ForwardBatch(9, items=items), validate=False)
    decoded = decode_request(frames)
    assert decoded.items[0] == items[0] and decoded.items[-1] == items[-1]
    for item, refused in zip(bad, decoded.items[1:-1]):
        with pytest.raises(ProtocolError) as alone:
            encode_request(item)
        assert isinstance(refused, ItemRefused) and refused.seq == item.seq
        assert (refused.code, refused.message) == (alone.value.code, alone.value.message)
    header = {"v": 1, "type": "FORWARD", "id": 3, "items": [{"seq": 1, "pos": 0, "tokens": [1]}, plain_propose]}
    refused = decode_request(message(header)).items[1]
    assert refused.code is ErrorCode.BAD_REQUEST and "unknown field(s) ['propose'] in a FORWARD item" in refused.message


def test_a_prompt_chunk_proposes_without_drafts_and_only_uncheckpointed():
    """`propose` without `drafts` is a prompt chunk's (every row joins the drafter's context): it round-trips when
    not checkpointed; a checkpointed CAPTURE without drafts is refused by name."""
    chunk = Capture(0, seq=3, pos=0, hidden=rows_of(3, 6, 4), layers=[3], propose=2, carried_layers=[0, 1],
                    carried=rows_of(-3, 6, 8))
    assert decode_request(encode_request(chunk)) == chunk
    checkpointed = dataclasses.replace(chunk, checkpoint=True, parents=pure_chain(6))
    with pytest.raises(ProtocolError) as refused:
        encode_request(checkpointed)
    assert refused.value.code is ErrorCode.BAD_REQUEST and "prompt chunk" in refused.value.message


def test_carried_rows_that_do_not_add_up_refuse_the_batch_whole():
    def batch(items, carried_rows):
        hidden = {"name": "hidden", "dtype": "float32", "shape": [sum(item["rows"] for item in items), 4]}
        carried = {"name": "carried", "dtype": "float32", "shape": [carried_rows, 8]}
        header = {"v": 1, "type": "FORWARD", "id": 3, "items": items, "tensors": [hidden, carried]}
        return message(header, bytes(16 * hidden["shape"][0]), bytes(32 * carried_rows))

    verify = {"pos": 5, "rows": 2, "layers": [3], "checkpoint": True, "parents": [-1, 0], "drafts": [1], "propose": 2,
              "carried_layers": [0, 1]}
    plain = {"seq": 2, "pos": 0, "rows": 3}
    assert len(decode_request(batch([{"seq": 1, **verify}, plain], 2)).items) == 2
    for what, frames in {
        "too few carried rows": batch([{"seq": 1, **verify}, plain], 1),
        "too many": batch([{"seq": 1, **verify}, plain], 3),
        "no item takes them": batch([plain], 2),
        "an item's carried_layers without the tensor": message({"v": 1, "type": "CAPTURE", "id": 3, "items": [
            {"seq": 1, "tokens": [1, 2], **{k: v for k, v in verify.items() if k != "rows"}}]}),
        "rows that cannot be counted": message({"v": 1, "type": "CAPTURE", "id": 3, "items": [
            {"seq": 1, "tokens": 5, **{k: v for k, v in verify.items() if k != "rows"}}],
            "tensors": [{"name": "carried", "dtype": "float32", "shape": [2, 8]}]}, bytes(64)),
    }.items():
        error = rejection(frames)
        assert error.code is ErrorCode.BAD_REQUEST and "carried" in error.message, what


def test_int_lists_refuse_bools_floats_and_out_of_range_ids_by_item():
    for bad, index in (([1, True, 2], 1), ([1, 2.0], 1), ([-1], 0), ([0, 1 << 31], 1)):
        error = rejection(message({**FORWARD, "tokens": bad}))
        assert error.code is ErrorCode.BAD_REQUEST and f"tokens' of FORWARD[{index}]" in error.message, error.message
    assert decode_request(message({**FORWARD, "tokens": [0, (1 << 31) - 1]})).tokens == [0, (1 << 31) - 1]


def test_from_torch_aliases_a_contiguous_cpu_tensor_and_keeps_it_alive():
    tensor = torch.zeros(4, dtype=torch.bfloat16)
    wt = wire(tensor)
    tensor[1] = 1.0
    assert bytes(wt.data[2:4]) == (0x3F80).to_bytes(2, "little")  # bfloat16 1.0
    del tensor
    assert wt.to_torch().tolist() == [0.0, 1.0, 0.0, 0.0]


# --- verify geometry ---------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_pure_chain_is_accepted(n):
    check_verify_geometry(list(range(-1, n - 1)), n)
    tokens = list(range(n))
    record = decode_request(message({**FORWARD, "tokens": tokens, "checkpoint": True, "parents": list(range(-1, n - 1))}))
    assert record.checkpoint and record.parents == list(range(-1, n - 1))


GEOMETRY_CASES = [
    ("missing", None, 3),
    ("truncated", [-1, 0], 3),
    ("truncated", [], 1),
    ("too long", [-1, 0, 1, 2], 3),
    ("malformed root", [0, 0, 1], 3),
    ("malformed root", [-1, -1, 1], 3),
    ("sibling", [-1, 0, 0], 3),
    ("sibling", [-1, 0, 1, 1], 4),
    ("skipped parent", [-1, 0, 1, 0], 4),
    ("cyclic", [-1, 1, 1], 3),
    ("forward parent", [-1, 2, 0], 3),
    ("out of range", [-1, 0, 3], 3),
    ("out of range", [-1, -2, 1], 3),
    ("out of range", [5], 1),
    ("malformed root", [0], 1),
]


@pytest.mark.parametrize("reason, parents, n", GEOMETRY_CASES, ids=[f"{c[0]}-{c[1]}" for c in GEOMETRY_CASES])
def test_geometry_rejection(reason, parents, n):
    with pytest.raises(ProtocolError) as info:
        check_verify_geometry(parents, n)
    assert info.value.code is ErrorCode.GEOMETRY_REJECTED
    assert reason in info.value.message
    for kind in ("FORWARD", "CAPTURE"):
        header = {**FORWARD, "type": kind, "tokens": list(range(n)), "checkpoint": True}
        if kind == "CAPTURE":
            header["layers"] = [0]
        if parents is not None:
            header["parents"] = parents
        error = rejection(message(header))
        assert error.code is ErrorCode.GEOMETRY_REJECTED
        assert reason in error.message


def test_geometry_cases_cover_every_reason():
    reasons = set()
    for _, parents, n in GEOMETRY_CASES:
        with pytest.raises(ProtocolError) as info:
            check_verify_geometry(parents, n)
        reasons.add(info.value.message.split(": ")[1])
    assert reasons == {"missing", "truncated", "too long", "malformed root", "sibling", "skipped parent",
                       "cyclic", "forward parent", "out of range"}


def test_geometry_is_checked_for_hidden_input_too():
    frames = hidden_message((2, 4), checkpoint=True, parents=[-1, 0, 1])
    assert rejection(frames).code is ErrorCode.GEOMETRY_REJECTED


def test_encode_refuses_bad_geometry_unless_asked_not_to_validate():
    record = Forward(1, seq=0, pos=0, tokens=[1, 2], checkpoint=True)
    with pytest.raises(ProtocolError) as info:
        encode_request(record)
    assert info.value.code is ErrorCode.GEOMETRY_REJECTED
    frames = encode_request(record, validate=False)
    assert rejection(frames).code is ErrorCode.GEOMETRY_REJECTED


@pytest.mark.parametrize("record", [
    Open(1, seq=-1),
    Rollback(1 << 63, seq=0, keep=0),
    Forward(1, seq=0, pos=0, tokens=[1, True]),
    Forward(1, seq=0, pos=0, tokens=[]),
    Forward(1, seq=0, pos=0, tokens=[1], parents=[-1]),
    Forward(1, seq=0, pos=0, hidden=wire(torch.zeros(2, 3, dtype=torch.int32))),
    Forward(1, seq=0, pos=0, hidden=wire(torch.zeros(6))),
    Capture(1, seq=0, pos=0, tokens=[1], layers=[2, 2]),
    Propose(1, seq=0, pos=0, last_token=1, block_size=0),
    Forward(1, seq=0, pos=0, tokens=[1], rows_ticket=5, ticket_rows=1),
    Forward(1, seq=0, pos=0, rows_ticket=5),
    Forward(1, seq=0, pos=0, tokens=[1], ticket_rows=1),
    Forward(1, seq=0, pos=0, rows_ticket=5, ticket_rows=0),
    Rows(1, seq=0, pos=0, ticket=5),
    Rows(1, seq=0, pos=0, ticket=5, refused=True, hidden=wire(torch.zeros(2, 3))),
    Rows(1, seq=0, pos=0, ticket=5, slot=0),
    Rows(1, seq=0, pos=0, ticket=5, slot_rows=4, hidden=wire(torch.zeros(4, 3))),
    Rows(1, seq=0, pos=0, ticket=5, slot=0, slot_rows=4, hidden=wire(torch.zeros(4, 3))),
    Rows(1, seq=0, pos=0, ticket=5, slot=16, slot_rows=4),
    Rows(1, seq=0, pos=0, ticket=5, slot_gen=2, hidden=wire(torch.zeros(4, 3))),
    Rows(1, seq=0, pos=0, ticket=5, slot=0, slot_rows=4, slot_gen=0),
    Rows(1, seq=0, pos=0, ticket=5, slot=0, slot_rows=4, slot_carried=2),
    Rows(1, seq=0, pos=0, ticket=5, hidden=wire(torch.zeros(4, 3)), carries=True, slot_carried=2),
    Rows(1, seq=0, pos=0, ticket=5, slot=0, slot_rows=4, carries=True, slot_carried=2,
         carried=wire(torch.zeros(4, 6))),
    Rows(1, seq=0, pos=0, ticket=5, slot=0, slot_rows=4, carries=True),
    Rows(1, seq=0, pos=0, ticket=5, slot=0, slot_rows=4, carries=True, slot_carried=0),
    Ring(1, rows=0),
    Ring(1, rows=4, gpu="G" * 129),
], ids=["seq-negative", "id-too-big", "token-bool", "no-tokens", "parents-without-checkpoint", "hidden-int",
        "hidden-1d", "layers-repeated", "block-size-zero", "tokens-and-ticket", "ticket-without-rows",
        "rows-without-ticket", "ticket-zero-rows", "rows-empty", "rows-refused-with-rows",
        "slot-without-rows", "slot-rows-without-slot", "slot-and-hidden", "slot-out-of-range", "slot-gen-without-slot",
        "slot-gen-zero", "slot-carried-without-carries", "slot-carried-without-slot", "slot-carried-and-carried",
        "carries-nothing", "slot-carried-zero", "ring-zero-rows", "ring-gpu-too-long"])
def test_encode_refuses_what_the_receiver_refuses(record):
    """The client-side check of encode_request gives the receiver's verdict without decoding the frames."""
    with pytest.raises(ProtocolError) as info:
        encode_request(record)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert rejection(encode_request(record, validate=False)).message == info.value.message


# --- bad input ---------------------------------------------------------------------------

BAD = ErrorCode.BAD_REQUEST

BAD_HEADERS = [
    ("header not a map", [1, 2, 3]),
    ("id is a string", {**OPEN, "id": "1"}),
    ("id is bool", {**OPEN, "id": True}),
    ("id negative", {**OPEN, "id": -1}),
    ("id too big", {**OPEN, "id": 1 << 63}),
    ("seq is float", {**OPEN, "seq": 1.0}),
    ("seq is bool", {**OPEN, "seq": False}),
    ("v is bool", {**OPEN, "v": True}),
    ("type not a string", {**OPEN, "type": 5}),
    ("checkpoint is int", {**FORWARD, "checkpoint": 1}),
    ("return_logits is string", {**FORWARD, "return_logits": "yes"}),
    ("tokens is a string", {**FORWARD, "tokens": "abc"}),
    ("token is bool", {**FORWARD, "tokens": [1, True]}),
    ("token negative", {**FORWARD, "tokens": [-1]}),
    ("token too big", {**FORWARD, "tokens": [1 << 31]}),
    ("tokens empty", {**FORWARD, "tokens": []}),
    ("tokens nil", {**FORWARD, "tokens": None}),
    ("pos negative", {**FORWARD, "pos": -1}),
    ("parents without checkpoint", {**FORWARD, "parents": [-1, 0, 1]}),
    ("parents not a list", {**FORWARD, "checkpoint": True, "parents": "chain"}),
    ("no token source", without(FORWARD, "tokens")),
    ("keep negative", {"v": 1, "type": "ROLLBACK", "id": 1, "seq": 0, "keep": -1}),
    ("layers repeated", {**FORWARD, "type": "CAPTURE", "layers": [1, 1]}),
    ("layers empty", {**FORWARD, "type": "CAPTURE", "layers": []}),
    ("layer negative", {**FORWARD, "type": "CAPTURE", "layers": [-1]}),
    ("block_size zero", {"v": 1, "type": "PROPOSE", "id": 1, "seq": 0, "pos": 0, "last_token": 1, "block_size": 0}),
    ("missing id", without(OPEN, "id")),
    ("missing v", without(OPEN, "v")),
    ("missing type", without(OPEN, "type")),
    ("missing seq", without(OPEN, "seq")),
    ("missing pos", without(FORWARD, "pos")),
    ("missing keep", {"v": 1, "type": "ROLLBACK", "id": 1, "seq": 0}),
    ("missing layers", {**FORWARD, "type": "CAPTURE"}),
    ("missing block_size", {"v": 1, "type": "PROPOSE", "id": 1, "seq": 0, "pos": 0, "last_token": 1}),
    ("missing PROPOSE pos", {"v": 1, "type": "PROPOSE", "id": 1, "seq": 0, "last_token": 1, "block_size": 4}),
    ("PROPOSE pos negative", {"v": 1, "type": "PROPOSE", "id": 1, "seq": 0, "pos": -1, "last_token": 1, "block_size": 4}),
    ("tensors nil", {**OPEN, "tensors": None}),
    ("non-string map key", {**OPEN, 5: 1}),
]


@pytest.mark.parametrize("header", [h for _, h in BAD_HEADERS], ids=[name for name, _ in BAD_HEADERS])
def test_bad_header_is_bad_request(header):
    assert rejection(message(header)).code is BAD


def test_wrong_type_message_names_the_field():
    error = rejection(message({**FORWARD, "checkpoint": 1}))
    assert "checkpoint" in error.message and "bool" in error.message


@pytest.mark.parametrize("frames", [
    [b"\xc1\x00\xff"],           # never-used msgpack byte
    [b""],                       # empty header frame
    [b"\x85\xa1v"],              # truncated map
    [msgpack.packb(OPEN) + b"\x00"],  # trailing bytes
    [],                          # no frames at all
    ["not bytes"],               # not a buffer
    [12345],
], ids=["invalid-byte", "empty", "truncated", "trailing", "no-frames", "str-frame", "int-frame"])
def test_garbage_is_bad_request(frames):
    assert rejection(frames).code is BAD
    assert peek_id(frames) is None


def test_duplicate_header_key_is_bad_request():
    raw = b"\x84" + b"".join(msgpack.packb(x) for x in ("v", 1, "type", "OPEN", "id", 1, "id", 2))
    assert rejection([raw]).code is BAD


def test_unknown_field_is_rejected_by_name():
    error = rejection(message({**OPEN, "sequ": 3}))
    assert error.code is BAD and "sequ" in error.message
    error = rejection(message({"v": 1, "type": "HELLO", "id": 1, "seq": 3}))
    assert error.code is BAD and "seq" in error.message


@pytest.mark.parametrize("type_name", ["FOO", "hello", ""])
def test_unknown_type(type_name):
    error = rejection(message({**OPEN, "type": type_name}))
    assert error.code is ErrorCode.UNKNOWN_TYPE


def test_version_mismatch_names_both_versions_and_comes_first():
    # A v2 client with fields v1 does not know still learns about the version, not the fields.
    error = rejection(message({"v": 2, "type": "FORWARD2", "id": "x", "shiny": True}))
    assert error.code is ErrorCode.UNSUPPORTED_VERSION
    assert "version 2" in error.message and f"version {PROTOCOL_VERSION}" in error.message


@pytest.mark.parametrize("descriptor", [
    {"name": "hidden", "dtype": "float64", "shape": [2, 4]},
    {"name": "hidden", "dtype": "f32", "shape": [2, 4]},
    {"name": "hidden", "dtype": "float32", "shape": "2x4"},
    {"name": "hidden", "dtype": "float32", "shape": [2, -4]},
    {"name": "hidden", "dtype": "float32", "shape": [2, True]},
    {"name": "hidden", "dtype": "float32"},
    {"name": "hidden", "dtype": "float32", "shape": [2, 4], "order": "F"},
    {"name": "", "dtype": "float32", "shape": [2, 4]},
], ids=["float64", "alias", "shape-string", "negative-dim", "bool-dim", "no-shape", "extra-key", "empty-name"])
def test_bad_descriptor_is_bad_request(descriptor):
    header = {**without(FORWARD, "tokens"), "tensors": [descriptor]}
    assert rejection(message(header, bytes(32))).code is BAD


@pytest.mark.parametrize("nbytes", [31, 33, 0])
def test_frame_length_must_match_shape(nbytes):
    error = rejection(hidden_message((2, 4), nbytes=nbytes))
    assert error.code is BAD and "32 bytes" in error.message


def test_frame_count_must_match_descriptors():
    too_many = hidden_message((2, 4)) + [bytes(32)]
    assert rejection(too_many).code is BAD
    too_few = hidden_message((2, 4))[:1]
    assert rejection(too_few).code is BAD
    frames_without_descriptor = message(OPEN, bytes(4))
    assert rejection(frames_without_descriptor).code is BAD


@pytest.mark.parametrize("frames", [
    message({**OPEN, "tensors": [{"name": "hidden", "dtype": "float32", "shape": [1, 1]}]}, bytes(4)),
    hidden_message((8,), nbytes=32),                   # 1-D hidden
    hidden_message((2, 4), dtype="int32"),             # integer hidden
    hidden_message((2, 0), nbytes=0),                  # zero-width hidden
    hidden_message((0, 4), nbytes=0),                  # zero tokens
    message({**FORWARD, "tensors": [{"name": "hidden", "dtype": "float32", "shape": [3, 1]}]}, bytes(12)),  # both sources
    message({**without(FORWARD, "tokens"), "tensors": [{"name": "hidden", "dtype": "float32", "shape": [1, 1]}] * 2},
            bytes(4), bytes(4)),                        # duplicate name
    message({**without(FORWARD, "tokens"), "tensors": [{"name": "features", "dtype": "float32", "shape": [1, 1]}]},
            bytes(4)),                                  # tensor of another type
], ids=["tensor-on-open", "hidden-1d", "hidden-int", "hidden-zero-width", "hidden-zero-rows", "tokens-and-hidden",
        "duplicate-name", "wrong-name"])
def test_bad_tensor_use_is_bad_request(frames):
    assert rejection(frames).code is BAD


def test_too_many_tokens():
    assert rejection(message({**FORWARD, "tokens": [1] * 4097})).code is ErrorCode.TOO_LARGE
    decode_request(message({**FORWARD, "tokens": [1] * 4096}))
    small = Limits(max_tokens_per_request=4)
    assert rejection(message({**FORWARD, "tokens": [1] * 5}), small).code is ErrorCode.TOO_LARGE
    decode_request(message({**FORWARD, "tokens": [1] * 4}), small)
    assert rejection(hidden_message((5, 2)), small).code is ErrorCode.TOO_LARGE
    propose = {"v": 1, "type": "PROPOSE", "id": 1, "seq": 0, "pos": 0, "last_token": 1, "block_size": 5}
    assert rejection(message(propose), small).code is ErrorCode.TOO_LARGE


def test_oversized_frame():
    frames = hidden_message((4, 8))  # 128 bytes
    assert rejection(frames, Limits(max_frame_bytes=64)).code is ErrorCode.TOO_LARGE
    decode_request(frames, Limits(max_frame_bytes=128))


def test_other_size_limits():
    frames = hidden_message((4, 8))
    assert rejection(frames, Limits(max_total_bytes=128)).code is ErrorCode.TOO_LARGE
    assert rejection(frames, Limits(max_header_bytes=16)).code is ErrorCode.TOO_LARGE
    assert rejection(frames, Limits(max_frames=1)).code is ErrorCode.TOO_LARGE
    capture = message({**FORWARD, "type": "CAPTURE", "layers": [0, 1, 2]})
    assert rejection(capture, Limits(max_capture_layers=2)).code is ErrorCode.TOO_LARGE
    decode_request(capture, Limits(max_capture_layers=3))


def test_peek_id_and_type_of_undecodable_requests():
    assert peek_id(message({**OPEN, "id": 77, "type": "NOPE"})) == 77
    assert peek_id(message({**OPEN, "id": 77, "seq": "bad"})) == 77
    assert peek_type(message({**OPEN, "id": 77, "seq": "bad"})) == "OPEN"
    assert peek_type(message({**OPEN, "type": "NOPE"})) is None
    assert peek_id(message({**OPEN, "id": True})) is None
    assert peek_id(message({**OPEN, "id": -3})) is None
    assert peek_id(message([77])) is None


def test_unencodable_values_raise_protocol_errors():
    with pytest.raises(ProtocolError) as info:
        encode_request(Open(1, seq=object()))
    assert info.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolError) as info:
        encode_reply(1, "STATS", {"x": object()})
    assert info.value.code is ErrorCode.INTERNAL


def test_encode_reply_refuses_bad_id_and_type():
    with pytest.raises(ProtocolError):
        encode_reply(True, "HELLO", {})
    with pytest.raises(ValueError):
        encode_reply(1, "NOPE", {})


# --- packaging ---------------------------------------------------------------------------

def test_import_protocol_does_not_import_torch():
    code = "import sys, protocol; protocol.decode_request(protocol.encode_request(protocol.Hello(1))); " \
           "print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_protocol_md_documents_every_field_type_and_code():
    from protocol import REQUEST_FIELDS, REQUEST_TENSORS

    text = (REPO_ROOT / "PROTOCOL.md").read_text()
    names = {spec.name for specs in REQUEST_FIELDS.values() for spec in specs}
    names |= {spec.name for specs in REQUEST_TENSORS.values() for spec in specs}
    names |= {t.value for t in MessageType} | {c.value for c in ErrorCode}
    undocumented = sorted(name for name in names if f"`{name}`" not in text)
    assert not undocumented, f"PROTOCOL.md does not mention {undocumented}"
