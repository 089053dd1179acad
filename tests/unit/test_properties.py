"""Property: every request, however malformed, gets exactly one well-formed reply, and an error reply changes
no sequence. Requests are generated from the schema (`protocol.messages`): each field a valid value, an
out-of-range one or junk of another type, fields left out or added, tensor frames that match their
descriptors or do not. The daemon is driven in-process (`ShardDaemon.handle`, the code behind the socket)."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import ErrorCode, MessageType, decode_reply, pure_chain
from protocol.messages import ID_LIMIT, REQUEST_FIELDS, REQUEST_TENSORS
from shardd.config import ShardConfig
from shardd.server.daemon import ShardDaemon
from shardd.weights.loading import ModelSource, build_shard
from shardd.engine.reference.rollback import RollbackStorage

HIDDEN = 64
OWNER = b"client-a"

junk = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.binary(max_size=4),
                 st.floats(allow_nan=False), st.lists(st.integers(0, 3), max_size=2),
                 st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=1))


def field_values(spec):
    if spec.kind == "bool":
        valid = st.booleans()
    elif spec.kind == "int_list":
        valid = st.lists(st.integers(-2, 330), max_size=6)
    else:
        low = spec.minimum if spec.minimum is not None else 0
        valid = st.integers(low, low + 12)
        edges = st.sampled_from([low - 1, -(1 << 63), (1 << 64) - 1, spec.limit if spec.limit else 1 << 40])
        valid = st.one_of(valid, valid, valid, edges)
    if spec.name == "seq":
        valid = st.sampled_from([1, 2, 3])  # 1 and 2 are open: most requests reach a real sequence
    return st.one_of(valid, valid, valid, valid, junk)


@st.composite
def tensor_frames(draw, mtype):
    specs = REQUEST_TENSORS[mtype]
    if not specs or draw(st.booleans()):
        return [], []
    spec = draw(st.sampled_from(specs))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int32", "float64"]))
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, HIDDEN]), min_size=1, max_size=3))
    nbytes = 4 if dtype in ("float32", "int32") else 2 if dtype == "bfloat16" else 8
    for dim in shape:
        nbytes *= dim
    nbytes = draw(st.sampled_from([nbytes, nbytes, nbytes + 1, 0]))
    name = draw(st.sampled_from([spec.name, spec.name, "junk"]))
    return [{"name": name, "dtype": dtype, "shape": shape}], [bytes(nbytes)]


@st.composite
def requests(draw):
    names = [t.value for t in MessageType]
    type_name = draw(st.one_of(st.sampled_from(names), st.sampled_from(names), st.sampled_from(names), junk))
    header = {
        "v": draw(st.one_of(st.just(1), st.just(1), st.just(1), st.just(1), st.integers(0, 3), junk)),
        "type": type_name,
        "id": draw(st.one_of(st.integers(0, ID_LIMIT - 1), st.integers(0, ID_LIMIT - 1), st.just(-1), junk)),
    }
    frames = []
    if isinstance(type_name, str) and type_name in names:
        mtype = MessageType(type_name)
        for spec in REQUEST_FIELDS[mtype]:
            if draw(st.integers(0, 9)) < (9 if spec.required else 5):
                header[spec.name] = draw(field_values(spec))
        if header.get("checkpoint") is True and isinstance(header.get("tokens"), list) and draw(st.booleans()):
            header["parents"] = pure_chain(len(header["tokens"]))
        descriptors, frames = draw(tensor_frames(mtype))
        if descriptors:
            header["tensors"] = descriptors
    if draw(st.integers(0, 9)) == 0:
        header[draw(st.sampled_from(["extra", "layer", "Seq"]))] = draw(junk)
    return [msgpack.packb(header, use_bin_type=True), *frames]


def digest(value, seen=None) -> str:
    """Every tensor and plain value reachable from `value`, hashed: equal digests, equal state."""
    seen = set() if seen is None else seen
    hasher = hashlib.sha256()

    def walk(item):
        if isinstance(item, torch.Tensor):
            hasher.update(repr((item.dtype, tuple(item.shape))).encode())
            hasher.update(item.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(item, (int, float, str, bytes, bool, type(None))):
            hasher.update(repr(item).encode())
        elif isinstance(item, dict):
            for key in sorted(item, key=repr):
                hasher.update(repr(key).encode())
                walk(item[key])
        elif isinstance(item, (list, tuple)):
            for element in item:
                walk(element)
        elif hasattr(item, "__dict__") and id(item) not in seen:
            seen.add(id(item))
            walk(vars(item))
        else:
            hasher.update(type(item).__name__.encode())

    walk(value)
    return hasher.hexdigest()


@pytest.fixture(scope="module")
def shard():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only spins on the shared cores
    yield build_shard(ModelSource(synthetic="tiny"), 0, 6, dtype="float32", device="cpu",
                      storage=RollbackStorage("checkpoint", 4))
    torch.set_num_threads(threads)


def fresh_daemon(shard) -> ShardDaemon:
    daemon = ShardDaemon(shard, ShardConfig(max_sequences=3, max_context=24, max_tokens_per_request=8))
    for seq in (1, 2):
        for request in ({"type": "OPEN", "seq": seq}, {"type": "FORWARD", "seq": seq, "pos": 0, "tokens": [5, 6, 7]}):
            assert decode_reply(daemon.handle([msgpack.packb({"v": 1, "id": 1, **request})], OWNER)).ok
    # sequence 2 has a pending checkpointed step: a ROLLBACK may still follow
    step = {"v": 1, "id": 1, "type": "FORWARD", "seq": 2, "pos": 3, "tokens": [8, 9], "checkpoint": True,
            "parents": pure_chain(2)}
    assert decode_reply(daemon.handle([msgpack.packb(step)], OWNER)).ok
    return daemon


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                    HealthCheck.function_scoped_fixture])
@given(st.lists(requests(), min_size=1, max_size=6))
def test_every_request_gets_one_reply_and_errors_change_nothing(shard, batch):
    daemon = fresh_daemon(shard)
    for frames in batch:
        before = digest(daemon.sequences.entries)
        reply_frames = daemon.handle(frames, OWNER)
        reply = decode_reply(reply_frames)  # exactly one message, and a valid reply
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        if type(header.get("id")) is int and 0 <= header["id"] < ID_LIMIT and reply.ok:
            assert reply.id == header["id"]
        if not reply.ok:
            assert reply.error_code is not ErrorCode.INTERNAL, reply.error_message
            assert digest(daemon.sequences.entries) == before, (header, reply.error_code, reply.error_message)


# ---- the codec's fast field check against its field-by-field reference ---------------------------------

def _fast_and_reference(mtype, header) -> tuple:
    """What `_field_values` (the fast check) and `_ordered_field_values` (the reference) make of `header`: the
    values with their types, or the refusal."""
    from protocol import ProtocolError
    from protocol.fields import _REQUEST_SCHEMA, _field_values, _ordered_field_values

    def outcome(check, fields):
        try:
            values = check(header, fields, mtype)
        except ProtocolError as error:
            return ("refused", error.code, error.message)
        return ("values", list(values.items()), [type(v) for v in values.values()])

    return outcome(_field_values, _REQUEST_SCHEMA[mtype]), outcome(_ordered_field_values, REQUEST_FIELDS[mtype])


def _good_value(spec):
    """A value the field takes (its bounds included)."""
    low = -1000 if spec.minimum is None else spec.minimum
    high = low + 1000 if spec.limit is None else spec.limit - 1
    if spec.kind == "int":
        return st.integers(low, high)
    if spec.kind == "int_list":
        return st.lists(st.integers(low, high), max_size=3)
    if spec.kind == "float":
        return st.one_of(st.floats(spec.minimum, spec.limit), st.sampled_from([spec.minimum, spec.limit]))
    if spec.kind == "str":
        return st.text(max_size=min(spec.limit or 3, 3))
    return st.booleans()


def _wrong_value(spec):
    """A value near or past the field's bounds, or of another kind."""
    edges = [spec.minimum, spec.limit] if spec.kind in ("int", "float", "int_list") else []
    near = [v + d for v in edges if v is not None for d in (-1, 0, 1)]
    of_its_kind = {  # wrong in its own kind: an item out of range or a bool in a list, a string too long
        "int_list": st.lists(st.sampled_from([*near, True]), min_size=1, max_size=3),
        "str": st.text(min_size=(spec.limit or 0) + 1, max_size=(spec.limit or 0) + 2),
    }.get(spec.kind, st.sampled_from(near or [0]))
    return st.one_of(of_its_kind, of_its_kind, of_its_kind, st.sampled_from(near or [0]), st.integers(-3, 3), st.booleans(), st.none(),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                     st.lists(st.one_of(st.sampled_from(near or [0]), st.integers(-3, 3), st.booleans()), max_size=3))


@st.composite
def _headers(draw):
    """A request type's header: every field good or absent (required ones too, now and then), and at most one
    field given a value that may be wrong, so that both the whole header passing and each field's refusal come up."""
    mtype = draw(st.sampled_from(sorted(REQUEST_FIELDS, key=lambda t: t.value)))
    specs = REQUEST_FIELDS[mtype]
    header = {spec.name: draw(_good_value(spec)) for spec in specs if draw(st.integers(0, 19)) > 0}
    if specs and draw(st.booleans()):  # by kind first: a type's few list or string fields come up as often as its ints
        kind = draw(st.sampled_from(sorted({spec.kind for spec in specs})))
        spec = draw(st.sampled_from([spec for spec in specs if spec.kind == kind]))
        header[spec.name] = draw(_wrong_value(spec))
    return mtype, header


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(_headers())
def test_the_fast_field_check_decides_as_the_field_by_field_one(drawn):
    """protocol/fields.py's `_field_values` checks the common case by header key; whatever it accepts, refuses or
    returns must be what `_ordered_field_values` (the readable reference, the one the errors come from) does."""
    fast, reference = _fast_and_reference(*drawn)
    assert fast == reference


def _edge_values(spec) -> list:
    """A field's values at and past its bounds and of every other kind: each one the fast check must decide as
    the reference does (the property above draws them too, this goes through every one of them)."""
    bounds = [v + d for v in (spec.minimum, spec.limit) if v is not None for d in (-1, 0, 1)]
    good = spec.minimum if spec.minimum is not None else 0
    most = spec.limit if spec.kind == "str" and spec.limit is not None else 8  # a string's most characters
    return [*bounds, *(float(v) for v in bounds), True, False, None, "", "x" * most, "x" * (most + 1),
            float("nan"), float("inf"), [], [good], [good, True], *([good, v] for v in bounds), [1.0], {"a": 1}]


@pytest.mark.parametrize("mtype", sorted(REQUEST_FIELDS, key=lambda t: t.value), ids=lambda t: t.value)
def test_the_fast_field_check_decides_every_edge_value_as_the_reference(mtype):
    specs = REQUEST_FIELDS[mtype]
    least = {"int": 0, "int_list": [], "str": "", "bool": False, "float": 0.0}  # where a field has no minimum
    required = {spec.name: least[spec.kind] if spec.minimum is None else spec.minimum for spec in specs if spec.required}
    for spec in specs:
        for value in _edge_values(spec):
            fast, reference = _fast_and_reference(mtype, {**required, spec.name: value})
            assert fast == reference, (spec.name, value)
