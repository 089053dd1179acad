"""Frames <-> records. One message = [msgpack header, tensor frame, tensor frame, ...].

Decoding never copies a tensor frame: `WireTensor.data` is a memoryview of the frame.
Everything is validated before a record exists, so a handler only ever sees a well-formed
request; every failure is a `ProtocolError` carrying the code for the error reply.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import msgpack

from .errors import ErrorCode, ItemRefused, ProtocolError, RemoteError
from .geometry import check_verify_geometry
from .limits import Limits
from .messages import (
    BATCH_RECORD_TYPES,
    BATCH_REFUSED_FIELDS,
    BATCH_TENSORS,
    COMMON_FIELDS,
    ID_LIMIT,
    PROTOCOL_VERSION,
    RECORD_TYPES,
    REQUEST_FIELDS,
    REQUEST_TENSORS,
    SAMPLING_EPS,
    TOKEN_LIMIT,
    Capture,
    FieldSpec,
    Forward,
    MessageType,
    Propose,
    Request,
    Rollback,
    Rows,
    TensorSpec,
    Batch,
    samples,
)
from .tensors import DTYPE_SIZES, WireTensor, as_byte_view, concat_rows, expected_nbytes, row_slice

Frames = list  # of bytes | bytearray | memoryview | zmq.Frame

_COMMON_KEYS = frozenset(f.name for f in COMMON_FIELDS)
_FAST_KINDS = frozenset({"int", "bool", "int_list", "float", "str"})


@dataclass(frozen=True)
class _Fields:
    """A type's header fields as `_field_values` checks them, built once at import."""

    specs: tuple[FieldSpec, ...]
    checks: dict[str, tuple[str, Any, Any]]  # name -> (kind, minimum, limit)
    required: frozenset
    defaults: dict[str, Any]  # every field's default, in spec order (the order the values come back in)

    @classmethod
    def of(cls, specs: tuple[FieldSpec, ...]) -> "_Fields":
        assert all(spec.kind in _FAST_KINDS for spec in specs), "a kind _field_values cannot check"
        assert all(None not in (spec.minimum, spec.limit) for spec in specs if spec.kind in ("int", "float")), \
            "_field_values compares a number with both bounds"
        return cls(specs, {spec.name: (spec.kind, spec.minimum, spec.limit) for spec in specs},
                   frozenset(spec.name for spec in specs if spec.required),
                   {spec.name: spec.default for spec in specs})


_REQUEST_SCHEMA = {mtype: _Fields.of(specs) for mtype, specs in REQUEST_FIELDS.items()}
# per type, the header keys a one-sequence request may carry
_REQUEST_KEYS = {mtype: _COMMON_KEYS | {spec.name for spec in specs} for mtype, specs in REQUEST_FIELDS.items()}
# per record type of a batch item, the fields it may carry, and their names
_ITEM_FIELDS = {RECORD_TYPES[mtype]: (_Fields.of(specs), frozenset(spec.name for spec in specs)) for mtype, specs in (
    (mtype, tuple(spec for spec in REQUEST_FIELDS[mtype] if spec.name not in BATCH_REFUSED_FIELDS))
    for mtype in BATCH_RECORD_TYPES)}
_REPLY_KEYS = frozenset({"v", "id", "type", "ok", "result", "tensors", "error"})
_DESCRIPTOR_KEYS = frozenset({"name", "dtype", "shape"})
_INT_TYPE = frozenset({int})
_ROWS = frozenset({"rows"})  # a batch item's count of its rows of tensor 'hidden'; not a record field
# per batchable type, the batch-level fields beside `items`: a FORWARD batch's rows from shard to shard
_TICKET_FIELDS = ("send_rows", "rows_ticket")
_BATCH_TICKETS = {MessageType.FORWARD: frozenset(_TICKET_FIELDS)}
_TYPE_NAMES = frozenset(t.value for t in MessageType)
# a type's name -> the type (and each type -> its name): a dict lookup, cheaper than MessageType(...) per message
_MESSAGE_TYPES = {t.value: t for t in MessageType}
_TYPE_VALUES = {t: t.value for t in MessageType}
# Per record type, its fields in order (what the encoders walk) and, per message type, its tensor frames' names.
_FIELD_NAMES = {record: tuple(f.name for f in dataclasses.fields(record))
                for record in (*RECORD_TYPES.values(), *BATCH_RECORD_TYPES.values())}
_FIELD_SETS = {record: frozenset(names) for record, names in _FIELD_NAMES.items()}
_TENSOR_NAMES = {mtype: frozenset(spec.name for spec in specs) for mtype, specs in REQUEST_TENSORS.items()}
# what encode_request walks per record type: its header fields and its tensor fields, each in field order
_ENCODE_NAMES = {record: (tuple(name for name in names if name != "id" and name not in _TENSOR_NAMES[record.type]),
                          tuple(name for name in names if name in _TENSOR_NAMES[record.type]))
                 for record, names in _FIELD_NAMES.items() if record in RECORD_TYPES.values()}
# per type, its tensor frames' specs by name; a batch carries tensor 'hidden' alone
_TENSOR_SPECS = {mtype: {spec.name: spec for spec in specs} for mtype, specs in REQUEST_TENSORS.items()}
_NO_TENSORS = {mtype: {name: None for name in specs} for mtype, specs in _TENSOR_SPECS.items()}  # read only
# per batchable type, its batch's tensor frames' specs by name (a FORWARD batch's `carried` is its CAPTURE items')
_BATCH_TENSOR_SPECS = {mtype: {name: _TENSOR_SPECS[mtype].get(name) or _TENSOR_SPECS[MessageType.CAPTURE][name]
                               for name in names} for mtype, names in BATCH_TENSORS.items()}
# Per record type, the default of each field that has one: a decoded record is filled in from these (_record).
_DEFAULTS = {record: {f.name: f.default for f in dataclasses.fields(record) if f.default is not dataclasses.MISSING}
             for record in RECORD_TYPES.values()}
assert not any(hasattr(record, "__post_init__") or any(f.default_factory is not dataclasses.MISSING
                                                        for f in dataclasses.fields(record))
               for record in _FIELD_NAMES), "_record and with_id build records without their __init__"
# The receiver's limits are not known when a request is encoded.
_NO_LIMITS = Limits(
    max_tokens_per_request=sys.maxsize, max_frame_bytes=sys.maxsize, max_total_bytes=sys.maxsize,
    max_frames=sys.maxsize, max_header_bytes=sys.maxsize, max_capture_layers=sys.maxsize,
    max_batch_items=sys.maxsize,
)


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def _too_large(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.TOO_LARGE, message)


MAX_ERROR_MESSAGE = 400  # characters of an error message: a hostile value is quoted by its prefix only


def clip_message(message: str) -> str:
    """`message` cut to MAX_ERROR_MESSAGE characters, saying how much was left out."""
    message = str(message)
    if len(message) <= MAX_ERROR_MESSAGE:
        return message
    return f"{message[:MAX_ERROR_MESSAGE]}... ({len(message) - MAX_ERROR_MESSAGE} more characters)"


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


# --- frames and header -------------------------------------------------------------------

def pack_message(header: Mapping[str, Any], tensors: Mapping[str, WireTensor] | None = None) -> Frames:
    """[msgpack(header + tensor descriptors), data, data, ...]. The one place frames are assembled."""
    header = dict(header)
    if not tensors:
        return [msgpack.packb(header, use_bin_type=True)]
    header["tensors"] = [t.descriptor(name) for name, t in tensors.items()]
    return [msgpack.packb(header, use_bin_type=True), *[t.data for t in tensors.values()]]


def _pack_or_raise(code: ErrorCode, header: Mapping[str, Any], tensors: Mapping[str, WireTensor] | None = None) -> Frames:
    try:
        return pack_message(header, tensors)
    except (TypeError, ValueError, OverflowError) as exc:  # a value msgpack cannot represent
        raise ProtocolError(code, f"header cannot be encoded: {exc}") from exc


def _frame_views(frames: Any) -> list[memoryview]:
    if not isinstance(frames, (list, tuple)) or not frames:
        raise _bad("a message is a non-empty list of frames")
    try:
        return [as_byte_view(frame) for frame in frames]
    except (TypeError, ValueError) as exc:
        raise _bad(f"frame is not a byte buffer: {exc}") from exc


def _reject_duplicate_keys(pairs: list) -> dict:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key in map")
    return result


def _unpack_header(view: memoryview, strict_map_key: bool) -> dict:
    size = view.nbytes
    try:
        header = msgpack.unpackb(
            view, raw=False, strict_map_key=strict_map_key, use_list=True,
            object_pairs_hook=_reject_duplicate_keys,
            max_str_len=size, max_bin_len=size, max_array_len=size, max_map_len=size, max_ext_len=size,
        )
    except Exception as exc:  # msgpack raises many types for garbage (ExtraData, FormatError, UnicodeDecodeError, ...)
        raise _bad(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(header, dict):
        raise _bad(f"header must be a msgpack map, got {_describe(header)}")
    return header


def _check_version(header: dict) -> None:
    if "v" not in header:
        raise _bad("missing field 'v' (protocol version)")
    version = header["v"]
    if type(version) is not int:
        raise _bad(f"field 'v' must be an int, got {_describe(version)}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} is not supported; this side speaks version {PROTOCOL_VERSION}",
        )


def _check_int(value: Any, what: str, minimum: Optional[int], limit: Optional[int]) -> int:
    if type(value) is not int:  # `type is`, not isinstance: True/False are ints in Python
        raise _bad(f"{what} must be an int, got {_describe(value)}")
    if (minimum is not None and value < minimum) or (limit is not None and value >= limit):
        low = "" if minimum is None else f"{minimum} <= "
        high = "" if limit is None else f" < {limit}"
        raise _bad(f"{what} = {value} is out of range ({low}x{high})")
    return value


def _ints_within(values: list, minimum: Optional[int], limit: Optional[int]) -> bool:
    """Whether every item is an int in [minimum, limit): the common case, checked without a call per item."""
    if not _INT_TYPE.issuperset(map(type, values)):  # `type is int`: True/False are ints in Python, not ids
        return False
    if not values:
        return True
    return (minimum is None or min(values) >= minimum) and (limit is None or max(values) < limit)


def _present_value(value: Any, spec: FieldSpec, mtype: MessageType) -> Any:
    """A present field's value, checked against its spec; the error message is built only for a refusal."""
    kind = spec.kind
    if kind == "int":
        if type(value) is int and (spec.minimum is None or value >= spec.minimum) and (
                spec.limit is None or value < spec.limit):
            return value
        return _check_int(value, f"field '{spec.name}' of {mtype.value}", spec.minimum, spec.limit)
    if kind == "bool" and type(value) is bool:
        return value
    if kind == "int_list" and type(value) is list and _ints_within(value, spec.minimum, spec.limit):
        return value
    what = f"field '{spec.name}' of {mtype.value}"
    if kind == "bool":
        raise _bad(f"{what} must be a bool, got {_describe(value)}")
    if kind == "float":
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _bad(f"{what} must be a finite number, got {_describe(value)}")
        if (spec.minimum is not None and value < spec.minimum) or (spec.limit is not None and value > spec.limit):
            raise _bad(f"{what} = {value} is out of range ({spec.minimum} <= x <= {spec.limit})")
        return float(value)
    if kind == "str":  # limit: the most characters
        if type(value) is not str:
            raise _bad(f"{what} must be a string, got {_describe(value)}")
        if spec.limit is not None and len(value) > spec.limit:
            raise _bad(f"{what} is {len(value)} characters, more than {spec.limit}")
        if spec.minimum is not None and len(value) < spec.minimum:
            raise _bad(f"{what} is {len(value)} characters, fewer than {spec.minimum}")
        return value
    if kind == "int_list":
        if type(value) is not list:
            raise _bad(f"{what} must be a list of ints, got {_describe(value)}")
        if not _ints_within(value, spec.minimum, spec.limit):
            for i, item in enumerate(value):  # the first bad item names itself
                _check_int(item, f"{what}[{i}]", spec.minimum, spec.limit)
        return value
    raise AssertionError(f"schema kind {spec.kind!r} has no validator")


def _field_values(header: dict, fields: _Fields, mtype: MessageType) -> dict[str, Any]:
    """Every field of `fields` from `header`, in spec order: checked where present, the default where absent and
    optional. The common case, every required field present and every value good, is checked by the header's keys
    alone; anything else goes through `_ordered_field_values`, so the first bad field in spec order is reported."""
    if fields.required <= header.keys():
        values = fields.defaults.copy()
        checks = fields.checks
        for name, value in header.items():
            check = checks.get(name)
            if check is None:  # v, type, id, tensors; a batch item's rows
                continue
            kind, minimum, limit = check
            if kind == "int":
                good = type(value) is int and minimum <= value < limit
            elif kind == "int_list":
                good = type(value) is list and _ints_within(value, minimum, limit)
            elif kind == "bool":
                good = type(value) is bool
            elif kind == "float":  # an int (made a float there) goes through the ordered checks
                good = type(value) is float and math.isfinite(value) and minimum <= value <= limit
            else:  # str
                good = type(value) is str and (limit is None or len(value) <= limit) and \
                    (minimum is None or len(value) >= minimum)
            if not good:
                break
            values[name] = value
        else:
            return values
    return _ordered_field_values(header, fields.specs, mtype)


def _ordered_field_values(header: dict, specs: tuple[FieldSpec, ...], mtype: MessageType) -> dict[str, Any]:
    """`_field_values` field by field, in spec order (so the first bad one is the one reported)."""
    values = {}
    for spec in specs:
        name = spec.name
        if name in header:
            values[name] = _present_value(header[name], spec, mtype)
        elif spec.required:
            raise _bad(f"missing field '{name}' of {mtype.value}")
        else:
            values[name] = spec.default
    return values


def _descriptor(entry: Any, index: int) -> tuple[str, str, tuple[int, ...]]:
    what = f"tensors[{index}]"
    if not isinstance(entry, dict):
        raise _bad(f"{what} must be a map {{name, dtype, shape}}, got {_describe(entry)}")
    if set(entry) != _DESCRIPTOR_KEYS:
        unknown = sorted(map(str, set(entry) - _DESCRIPTOR_KEYS))
        missing = sorted(_DESCRIPTOR_KEYS - set(entry))
        raise _bad(f"{what} must have exactly name, dtype, shape (unknown: {unknown}, missing: {missing})")
    name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
    if type(name) is not str or not name:
        raise _bad(f"{what}.name must be a non-empty string, got {_describe(name)}")
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        raise _bad(f"tensor '{name}': unsupported dtype {dtype!r}; supported: {sorted(DTYPE_SIZES)}")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(f"tensor '{name}': shape must be a list of non-negative ints, got {_describe(shape)}")
    return name, dtype, tuple(shape)


def _tensors(descriptors: Any, views: list[memoryview]) -> dict[str, WireTensor]:
    """Match descriptors to frames 1..N; each WireTensor's data is the frame itself."""
    if descriptors is None:
        raise _bad("field 'tensors' must be a list, got nil")
    if type(descriptors) is not list:
        raise _bad(f"field 'tensors' must be a list, got {_describe(descriptors)}")
    if len(descriptors) != len(views):
        raise _bad(f"header describes {len(descriptors)} tensor(s) but {len(views)} tensor frame(s) follow")
    tensors: dict[str, WireTensor] = {}
    for index, (entry, view) in enumerate(zip(descriptors, views)):
        name, dtype, shape = _descriptor(entry, index)
        if name in tensors:
            raise _bad(f"tensor '{name}' described twice")
        want = expected_nbytes(dtype, shape)
        if view.nbytes != want:
            raise _bad(f"tensor '{name}': {dtype}{list(shape)} needs {want} bytes, frame {index + 1} has {view.nbytes}")
        tensors[name] = WireTensor(dtype, shape, view)
    return tensors


def _request_tensors(found: dict[str, WireTensor], by_name: dict[str, TensorSpec], mtype: MessageType) -> dict:
    for name, tensor in found.items():
        spec = by_name.get(name)
        if spec is None:
            allowed = sorted(by_name) or "none"
            raise _bad(f"{mtype.value} does not take tensor '{name}' (allowed: {allowed})")
        if len(tensor.shape) != spec.ndim:
            raise _bad(f"tensor '{name}' must be {spec.ndim}-D, got shape {list(tensor.shape)}")
        if tensor.dtype not in spec.dtypes:
            raise _bad(f"tensor '{name}' must be one of {sorted(spec.dtypes)}, got {tensor.dtype}")
    return {name: found.get(name) for name in by_name}


# --- requests ----------------------------------------------------------------------------

def decode_request(frames: Frames, limits: Limits | None = None) -> Request:
    """Validate a request message and return its typed record, or raise ProtocolError."""
    limits = limits or Limits()
    views = _check_sizes(frames, limits)
    header = _unpack_header(views[0], strict_map_key=True)
    _check_version(header)

    type_name = header.get("type")
    if "type" not in header:
        raise _bad("missing field 'type'")
    if type(type_name) is not str:
        raise _bad(f"field 'type' must be a string, got {_describe(type_name)}")
    mtype = _MESSAGE_TYPES.get(type_name)
    if mtype is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {type_name!r}; known: {[t.value for t in MessageType]}",
        )

    if "items" in header and mtype in BATCH_RECORD_TYPES:
        return _decode_batch(header, views, mtype, limits)
    allowed = _REQUEST_KEYS[mtype]
    if not header.keys() <= allowed:
        unknown = sorted(str(key) for key in header if key not in allowed)
        raise _bad(f"unknown field(s) {unknown} in {mtype.value} request; allowed: {sorted(allowed)}")
    if "id" not in header:
        raise _bad("missing field 'id'")
    request_id = _check_int(header["id"], "field 'id'", 0, ID_LIMIT)

    values = _field_values(header, _REQUEST_SCHEMA[mtype], mtype)
    if "tensors" in header or len(views) > 1:
        found = _tensors(header.get("tensors", []), views[1:])
        tensors = _request_tensors(found, _TENSOR_SPECS[mtype], mtype)
    else:  # no descriptor, no tensor frame: what _tensors and _request_tensors find then
        tensors = _NO_TENSORS[mtype]
    record = _record(RECORD_TYPES[mtype], {"id": request_id}, values, tensors)
    _check_request(record, limits)
    return record


def _decode_batch(header: dict, views: list[memoryview], mtype: MessageType, limits: Limits) -> Batch:
    """A batched FORWARD/CAPTURE/ROLLBACK. The envelope (the item list, each item's `seq` and `rows`, the one
    `hidden` frame, the batch's size) is refused whole; a bad field of one item refuses that item alone: its place
    in `items` holds the ProtocolError."""
    allowed = _COMMON_KEYS | {"items"} | _BATCH_TICKETS.get(mtype, frozenset())
    unknown = sorted(str(key) for key in header if key not in allowed)
    if unknown:
        raise _bad(f"unknown field(s) {unknown} in a batched {mtype.value} request (every per-sequence field goes in "
                   f"its item); allowed: {sorted(allowed)}")
    if "id" not in header:
        raise _bad("missing field 'id'")
    request_id = _check_int(header["id"], "field 'id'", 0, ID_LIMIT)
    items = header["items"]
    if type(items) is not list or not items:
        raise _bad(f"field 'items' of {mtype.value} must be a non-empty list of maps, got {_describe(items)}")
    if len(items) > limits.max_batch_items:
        raise _too_large(f"{len(items)} items in one {mtype.value}, limit {limits.max_batch_items}")
    tickets = {name: _check_int(header[name], f"field '{name}' of a batched {mtype.value}", 0, ID_LIMIT)
               for name in _TICKET_FIELDS if name in header}
    found = _tensors(header.get("tensors", []), views[1:])
    tensors = _request_tensors(found, _BATCH_TENSOR_SPECS[mtype], mtype)
    hidden, carried, token_mask = tensors.get("hidden"), tensors.get("carried"), tensors.get("token_mask")
    rows_ticket = tickets.get("rows_ticket")
    if rows_ticket is not None and hidden is not None:
        raise _bad(f"a batched {mtype.value} with field 'rows_ticket' takes its rows from the previous shard's ROWS, "
                   "not from tensor 'hidden'")
    seqs: set[int] = set()
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad(f"items[{index}] must be a map, got {_describe(item)}")
        if "seq" not in item:
            raise _bad(f"items[{index}] has no field 'seq'")
        seq = _check_int(item["seq"], f"field 'seq' of items[{index}]", 0, ID_LIMIT)
        if seq in seqs:
            raise _bad(f"sequence {seq} appears twice in one batch (items name distinct sequences)")
        seqs.add(seq)
    rows = _batch_rows(items, hidden, mtype, ticketed=rows_ticket is not None)
    if rows_ticket is not None and carried is not None:
        raise _bad(f"a batched {mtype.value} with field 'rows_ticket' takes its carried rows from the previous shard's "
                   "ROWS, not from tensor 'carried'")
    if mtype is MessageType.ROWS:
        carried_rows = _passed_rows(items, rows, carried, hidden is not None)
    else:
        carried_rows = ([0] * len(items) if rows_ticket is not None else
                        _carried_rows(items, rows, carried, mtype, counted=hidden is not None))
    mask_rows = _mask_rows(items, token_mask)
    total = sum(rows) if hidden is not None else sum(len(item["tokens"]) for item in items
                                                      if type(item.get("tokens")) is list)
    if total > limits.max_tokens_per_request:
        raise _too_large(f"{total} rows in one batch, limit {limits.max_tokens_per_request}")
    decoded: list = []
    start = carried_start = mask_start = 0
    ticket = {"rows_ticket": rows_ticket} if rows_ticket is not None else None
    for item, n, m, k in zip(items, rows, carried_rows, mask_rows):
        parts = {}
        if hidden is not None:
            parts["hidden"] = row_slice(hidden, start, n)
            start += n
        if m:
            parts["carried"] = row_slice(carried, carried_start, m)
            carried_start += m
        if k:
            parts["token_mask"] = row_slice(token_mask, mask_start, k)
            mask_start += k
        try:
            decoded.append(_decode_item(item, parts, mtype, limits, ticket and {**ticket, "ticket_rows": n}))
        except ProtocolError as error:
            decoded.append(ItemRefused(error.code, error.message, item["seq"]))
    return BATCH_RECORD_TYPES[mtype](id=request_id, items=tuple(decoded), **tickets)


def _item_record(mtype: MessageType, item: dict) -> type:
    """A batch item's record type: its batch's, but a FORWARD batch's item with `layers` is a CAPTURE."""
    if mtype is MessageType.FORWARD and "layers" in item:
        return Capture
    return RECORD_TYPES[mtype]


def _passed_rows(items: list, rows: list[int], carried: Optional[WireTensor], hosted: bool) -> list[int]:
    """A batched ROWS' items' rows of tensor `carried` (the carried rows their FORWARDs passed on): one per row of
    each item that `carries` (its `rows`, or its `slot_rows` in a device slot), in item order."""
    if carried is None:
        return [0] * len(items)
    taken = [0 if item.get("carries") is not True or "slot_carried" in item else n if hosted else
             _check_int(item.get("slot_rows"), f"field 'slot_rows' of items[{index}]", 1, ID_LIMIT)
             for index, (item, n) in enumerate(zip(items, rows))]
    if sum(taken) != carried.shape[0]:
        raise _bad(f"the items' rows add up to {sum(taken)}, tensor 'carried' has {carried.shape[0]}")
    return taken


def _carried_rows(items: list, rows: list[int], carried: Optional[WireTensor], mtype: MessageType,
                  counted: bool) -> list[int]:
    """Each item's rows of tensor `carried`: a CAPTURE item with `carried_layers` takes one per input row (its
    `rows`, or its `tokens`), in item order, and together they are the tensor's rows."""
    if "carried" not in BATCH_TENSORS[mtype]:
        return [0] * len(items)
    taken = []
    for index, (item, n) in enumerate(zip(items, rows)):
        if "carried_layers" not in item or _item_record(mtype, item) is not Capture:
            taken.append(0)
            continue
        if not counted:
            tokens = item.get("tokens")
            if type(tokens) is not list:
                raise _bad(f"items[{index}] has field 'carried_layers' but no 'tokens' to count its rows of tensor "
                           f"'carried' by")
            n = len(tokens)
        taken.append(n)
    have = carried.shape[0] if carried is not None else 0
    if sum(taken) != have or (carried is not None and not any(taken)):
        raise _bad(f"the rows of the items with 'carried_layers' add up to {sum(taken)}, tensor 'carried' has "
                   f"{have if carried is not None else 'none'}")
    return taken


def _mask_rows(items: list, token_mask: Optional[WireTensor]) -> list[int]:
    """Each item's rows of tensor `token_mask`: its `mask_rows`, in item order; together the tensor's rows."""
    taken = []
    for index, item in enumerate(items):
        taken.append(_check_int(item["mask_rows"], f"field 'mask_rows' of items[{index}]", 1, TOKEN_LIMIT)
                     if "mask_rows" in item else 0)
    have = token_mask.shape[0] if token_mask is not None else 0
    if sum(taken) != have or (token_mask is not None and not any(taken)):
        raise _bad(f"the items' mask_rows add up to {sum(taken)}, tensor 'token_mask' has "
                   f"{have if token_mask is not None else 'none'}")
    return taken


def _batch_rows(items: list, hidden: Optional[WireTensor], mtype: MessageType, ticketed: bool = False) -> list[int]:
    """Each item's rows of tensor `hidden` (all 0 without it); they must add up to its rows. `ticketed` (a batch
    with rows_ticket): each item's rows of the ROWS it waits for."""
    if ticketed:
        return [_check_int(item.get("rows"), f"field 'rows' of items[{index}] (its rows of the ROWS of "
                                             f"rows_ticket)", 1, ID_LIMIT) for index, item in enumerate(items)]
    if hidden is None:
        with_rows = [index for index, item in enumerate(items) if "rows" in item]
        if with_rows:
            raise _bad(f"field 'rows' of items[{with_rows[0]}] counts rows of tensor 'hidden', which this "
                       f"{mtype.value} does not carry")
        return [0] * len(items)
    if hidden.shape[1] < 1:
        raise _bad(f"tensor 'hidden' has zero width: shape {list(hidden.shape)}")
    rows = []
    for index, item in enumerate(items):
        if "rows" not in item:
            raise _bad(f"items[{index}] has no field 'rows' (its rows of tensor 'hidden')")
        rows.append(_check_int(item["rows"], f"field 'rows' of items[{index}]", 1, ID_LIMIT))
    if sum(rows) != hidden.shape[0]:
        raise _bad(f"the items' rows add up to {sum(rows)}, tensor 'hidden' has {hidden.shape[0]}")
    return rows


def _record(record_type: type, *values: dict) -> Request:
    """`record_type(**values)`, the dicts of `values` merged in order, for values the decoder has checked, built
    without the frozen dataclass's __init__ (which sets each of a FORWARD's ~20 fields through object.__setattr__:
    most of the time of decoding a batch item): the records have no __post_init__ and no default factories, so the
    defaults and then the values in the instance's __dict__ are the same record."""
    record = object.__new__(record_type)
    fields = record.__dict__
    fields.update(_DEFAULTS[record_type])
    for part in values:
        fields.update(part)
    return record


def new_record(record_type: type, values: Mapping[str, Any]) -> Request:
    """`record_type(**values)`, built as the decoder builds its records (no __init__: a FORWARD's ~25 fields one
    object.__setattr__ each were most of the time of a coordinator's per-item record); a name that is not a
    field is a TypeError, as __init__ would raise."""
    unknown = values.keys() - _FIELD_SETS[record_type]
    if unknown:
        raise TypeError(f"{record_type.__name__} has no field(s) {sorted(unknown)}")
    return _record(record_type, values)


def with_id(record: Any, request_id: int) -> Any:
    """`dataclasses.replace(record, id=request_id)`, the same fields in the same order, without the dataclass
    __init__ (one object.__setattr__ for each of a FORWARD's ~25 fields, on every send); a record whose
    __dict__ is not exactly its fields goes through replace."""
    names = _FIELD_NAMES.get(type(record))
    values = record.__dict__
    if names is None or len(values) != len(names) or not values.keys() <= _FIELD_SETS[type(record)]:
        return dataclasses.replace(record, id=request_id)
    copy = object.__new__(type(record))
    copy.__dict__.update({name: values[name] for name in names}, id=request_id)
    return copy


def _decode_item(item: dict, tensors: dict, mtype: MessageType, limits: Limits, ticket: Optional[dict] = None):
    """One item of a batch as its record (`tensors`: its rows of the batch's tensors, by name)."""
    record_type = _item_record(mtype, item)
    fields, names = _ITEM_FIELDS[record_type]
    kind = record_type.type
    keys = item.keys() - _ROWS
    if keys & BATCH_REFUSED_FIELDS:
        refused = sorted(keys & BATCH_REFUSED_FIELDS)
        raise _bad(f"field '{refused[0]}' of {kind.value} is not available in a batch: send that request alone")
    if not keys <= names:
        unknown = sorted(str(key) for key in keys - names)
        raise _bad(f"unknown field(s) {unknown} in a {kind.value} item; allowed: {sorted(names | {'rows'})}")
    values = _field_values(item, fields, kind)
    values["id"] = 0
    values.update(tensors)
    if ticket is not None:  # the batch's rows_ticket and this item's rows of it, as a one-sequence FORWARD has them
        values.update(ticket)
    record = _record(record_type, values)
    _check_request(record, limits)
    return record


def _check_sizes(frames: Any, limits: Limits) -> list[memoryview]:
    views = _frame_views(frames)
    if len(views) > limits.max_frames:
        raise _too_large(f"{len(views)} frames, limit {limits.max_frames} (header included)")
    if views[0].nbytes > limits.max_header_bytes:
        raise _too_large(f"header of {views[0].nbytes} bytes, limit {limits.max_header_bytes}")
    total = views[0].nbytes
    for index in range(1, len(views)):
        nbytes = views[index].nbytes
        if nbytes > limits.max_frame_bytes:
            raise _too_large(f"frame {index} of {nbytes} bytes, limit {limits.max_frame_bytes}")
        total += nbytes
    if total > limits.max_total_bytes:
        raise _too_large(f"message of {total} bytes, limit {limits.max_total_bytes}")
    return views


PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _check_request(record: Request, limits: Limits) -> None:
    """Rules that span fields: token source, sizes, checkpoint geometry, capture layers."""
    if isinstance(record, Forward):
        kind = record.type  # its .value only in a refusal's message
        if (record.tokens is not None) + (record.hidden is not None) + (record.rows_ticket is not None) != 1:
            raise _bad(f"{kind.value} needs exactly one of field 'tokens', tensor 'hidden' or field 'rows_ticket'")
        if (record.rows_ticket is None) != (record.ticket_rows is None):
            raise _bad(f"fields 'rows_ticket' and 'ticket_rows' of {kind.value} go together")
        n = record.n_tokens
        if n < 1:
            raise _bad(f"{kind.value} needs at least one token")
        if n > limits.max_tokens_per_request:
            raise _too_large(f"{n} tokens in one request, limit {limits.max_tokens_per_request}")
        if record.hidden is not None and record.hidden.shape[1] < 1:
            raise _bad(f"tensor 'hidden' has zero width: shape {list(record.hidden.shape)}")
        if record.checkpoint:
            check_verify_geometry(record.parents, n)
        elif record.parents is not None:
            raise _bad("field 'parents' is only allowed with checkpoint: true")
        if record.save_prefix is not None and record.checkpoint:
            raise _bad(f"field 'save_prefix' of {kind.value} needs a step that stays (not checkpoint: true)")
        # PENALTY_FIELDS spelt out: a generator of getattrs cost more than the rest of these checks
        penalised = (record.presence_penalty is not None or record.frequency_penalty is not None
                     or record.repetition_penalty is not None)
        if record.repetition_penalty is not None and record.repetition_penalty <= 0:
            raise _bad(f"field 'repetition_penalty' = {record.repetition_penalty} must be > 0")
        if not penalised:
            for name in ("output_tokens", "prompt_tokens"):
                if getattr(record, name) is not None:
                    raise _bad(f"field '{name}' of {kind.value} is only read by a penalty "
                               f"({', '.join(PENALTY_FIELDS)})")
        masked = record.token_mask is not None
        if masked != (record.mask_rows is not None):
            raise _bad(f"field 'mask_rows' and tensor 'token_mask' of {kind.value} go together")
        if masked:
            answered = len(record.drafts or ()) + 1
            if record.mask_rows != answered or record.token_mask.shape[0] != answered:
                raise _bad(f"tensor 'token_mask' of {kind.value} has {record.token_mask.shape[0]} rows (mask_rows "
                           f"{record.mask_rows}); the answered rows are len(drafts) + 1 = {answered}")
            if record.token_mask.shape[1] < 1:
                raise _bad(f"tensor 'token_mask' has zero width: shape {list(record.token_mask.shape)}")
        if record.drafts is not None:
            proposing = isinstance(record, Capture) and record.propose is not None
            if not (samples(record.temperature) or penalised or record.logprobs is not None or proposing or masked):
                raise _bad(f"field 'drafts' of {kind.value} needs temperature > 0, a penalty, logprobs, a token mask or "
                           f"propose "
                           f"(a temperature below {SAMPLING_EPS:g} is greedy, and greedy drafts are compared with "
                           f"the argmax ids by the coordinator)")
            if len(record.drafts) >= n:
                raise _bad(f"{len(record.drafts)} drafts for {n} rows: a verify has one row more than drafts")
        if (record.prompt_logprobs is None) != (record.next_tokens is None):
            raise _bad(f"fields 'prompt_logprobs' and 'next_tokens' of {kind.value} go together")
        if record.next_tokens is not None and not 1 <= len(record.next_tokens) <= n:
            raise _bad(f"field 'next_tokens' holds {len(record.next_tokens)} tokens for {n} rows: 1 to {n}, one per "
                       "row scored from the first")
    if isinstance(record, Capture):
        layers = record.layers
        if not layers:
            raise _bad("field 'layers' of CAPTURE must not be empty")
        if len(layers) > limits.max_capture_layers:
            raise _too_large(f"{len(layers)} capture layers, limit {limits.max_capture_layers}")
        if len(set(layers)) != len(layers):
            raise _bad(f"field 'layers' of CAPTURE repeats a layer: {layers}")
        if record.carried is not None and record.carried_layers is None:
            raise _bad("field 'carried_layers' and tensor 'carried' of CAPTURE go together")
        if record.carried_layers is not None and record.carried is None and record.rows_ticket is None:
            raise _bad("field 'carried_layers' of CAPTURE needs tensor 'carried', or field 'rows_ticket' (the "
                       "previous shard's ROWS bring the carried rows)")
        if record.carried_layers is not None and record.propose is None:
            raise _bad("field 'carried_layers' of CAPTURE goes with field 'propose'")
        if record.carried_layers is not None:
            if len(set(record.carried_layers)) != len(record.carried_layers) or not record.carried_layers:
                raise _bad(f"field 'carried_layers' must be distinct and non-empty, got {record.carried_layers}")
            if record.carried is not None and record.carried.shape[0] != record.n_tokens:
                raise _bad(f"tensor 'carried' has {record.carried.shape[0]} rows for {record.n_tokens} tokens")
        if record.propose is not None:
            if record.drafts is None:  # a prompt chunk: all its rows join the drafter's context
                if record.checkpoint:
                    raise _bad("field 'propose' of a checkpointed CAPTURE needs the block's drafts: field 'drafts' "
                               "of n - 1 tokens (without drafts, a prompt chunk, it is not checkpointed)")
            elif len(record.drafts) != record.n_tokens - 1:
                raise _bad("field 'propose' of CAPTURE needs the block's drafts: field 'drafts' of n - 1 tokens")
    if isinstance(record, Rows):
        if record.refused + (record.hidden is not None) + (record.slot is not None) != 1:
            raise _bad("ROWS carries tensor 'hidden', field 'refused' or field 'slot', exactly one")
        if (record.slot is None) != (record.slot_rows is None):
            raise _bad("fields 'slot' and 'slot_rows' of ROWS go together")
        if record.slot_gen is not None and record.slot is None:
            raise _bad("field 'slot_gen' of ROWS goes with 'slot'")
        n = record.hidden.shape[0] if record.hidden is not None else record.slot_rows or 0
        if n > limits.max_tokens_per_request:
            raise _too_large(f"{n} rows, limit {limits.max_tokens_per_request}")
        if record.carried is not None and (record.refused or record.carried.shape[0] != n):
            raise _bad(f"tensor 'carried' of ROWS goes with the rows, one per row ({n}), got "
                       f"{list(record.carried.shape)}")
        if record.slot_carried is not None and (record.slot is None or not record.carries or
                                                 record.carried is not None):
            raise _bad("field 'slot_carried' of ROWS goes with 'slot' and 'carries', without tensor 'carried'")
        if bool(record.carries) != (record.carried is not None or record.slot_carried is not None):
            raise _bad("field 'carries' of ROWS goes with tensor 'carried' or field 'slot_carried'")
    if isinstance(record, Propose):
        if record.block_size > limits.max_tokens_per_request:
            raise _too_large(f"block_size {record.block_size}, limit {limits.max_tokens_per_request}")
        features = record.features
        if features is not None:
            if features.shape[1] < 1:
                raise _bad(f"tensor 'features' has zero width: shape {list(features.shape)}")
            if features.shape[0] > limits.max_tokens_per_request:
                raise _too_large(f"{features.shape[0]} feature rows, limit {limits.max_tokens_per_request}")
        _check_propose_saves(record)


def _check_propose_saves(record: Propose) -> None:
    ids, lengths = record.save_prefix, record.save_lengths
    if (ids is None) != (lengths is None):
        raise _bad("fields 'save_prefix' and 'save_lengths' of PROPOSE go together")
    if ids is None:
        return
    if not ids or len(ids) != len(lengths):
        raise _bad(f"fields 'save_prefix' and 'save_lengths' of PROPOSE need as many items, at least one "
                   f"(got {len(ids)} and {len(lengths)})")
    if len(set(ids)) != len(ids):
        raise _bad(f"field 'save_prefix' of PROPOSE repeats an entry id: {ids}")
    if any(b <= a for a, b in zip(lengths, lengths[1:])) or lengths[-1] > record.pos:
        raise _bad(f"field 'save_lengths' of PROPOSE must ascend and end at most at pos {record.pos}: {lengths}")


def encode_request(record: Request, validate: bool = True) -> Frames:
    """Frames for a request record. With `validate` (the default) the record is checked against the schema and the
    rules between fields, as the receiver checks it (size limits aside, which are the receiver's), so a client
    learns of a malformed request before sending; `validate=False` exists for tests that must put a bad request on
    the wire."""
    if isinstance(record, Batch):
        return _encode_batch(record, validate)
    mtype = record.type
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": _TYPE_VALUES[mtype], "id": record.id}
    tensors: dict[str, WireTensor] = {}
    header_names, tensor_names = _ENCODE_NAMES[type(record)]
    present = record.__dict__  # read directly: cheaper than a getattr for each of a FORWARD's ~25 fields
    for name in header_names:
        value = present[name] if name in present else getattr(record, name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            header[name] = list(value)
        else:
            header[name] = value
    for name in tensor_names:
        value = present[name] if name in present else getattr(record, name)
        if value is not None:
            tensors[name] = value
    frames = _pack_or_raise(ErrorCode.BAD_REQUEST, header, tensors)
    if validate:
        _check_int(record.id, "field 'id'", 0, ID_LIMIT)
        _field_values(header, _REQUEST_SCHEMA[mtype], mtype)
        if tensors:  # no tensor, nothing _request_tensors checks
            _request_tensors(tensors, _TENSOR_SPECS[mtype], mtype)
        _check_request(record, _NO_LIMITS)
    return frames


def _encode_batch(record: Batch, validate: bool) -> Frames:
    """A batched request: each item's fields in `items`, its hidden rows (if any) after the previous item's in
    one `hidden` frame, with `rows` saying how many."""
    items, hidden, carried, token_mask = [], [], [], []
    for item in record.items:
        # the fields that are set, read off the record's __dict__ at once (a getattr for each of a FORWARD's ~25
        # fields would be most of the time of encoding an item)
        entry: dict[str, Any] = {name: value for name, value in item.__dict__.items() if value is not None}
        entry.pop("id", None)
        ticket = entry.pop("rows_ticket", None)
        if ticket is not None:  # the batch's, on the wire once; the item says its rows
            if validate and ticket != getattr(record, "rows_ticket", None):
                raise _bad(f"an item's rows_ticket {ticket} is not its batch's ({getattr(record, 'rows_ticket', None)})")
            entry["rows"] = entry.pop("ticket_rows", None)
        rows = entry.pop("hidden", None)
        carried_rows = entry.pop("carried", None)
        mask = entry.pop("token_mask", None)
        if mask is not None:
            token_mask.append(mask)
        for name, value in entry.items():
            if type(value) is tuple:
                entry[name] = list(value)
        if rows is not None:
            entry["rows"] = rows.shape[0]
            hidden.append(rows)
        if carried_rows is not None:
            carried.append(carried_rows)
        items.append(entry)
    header = {"v": PROTOCOL_VERSION, "type": record.type.value, "id": record.id, "items": items}
    for name in _TICKET_FIELDS:
        if getattr(record, name, None) is not None:
            header[name] = getattr(record, name)
    if hidden and validate and len(hidden) != len(items):
        raise _bad("a batch carries hidden rows for every item or for none")
    tensors = {}
    for name, parts in (("hidden", hidden), ("carried", carried), ("token_mask", token_mask)):
        try:
            if parts:
                tensors[name] = concat_rows(parts)
        except ProtocolError as error:  # rows of different widths or dtypes
            raise _bad(f"the items' {name} rows do not stack: {error.message}") from error
    frames = _pack_or_raise(ErrorCode.BAD_REQUEST, header, tensors)
    if validate:  # as the receiver decodes it (the header as built: msgpack would hand back the same values)
        described = {**header, "tensors": [t.descriptor(name) for name, t in tensors.items()]}
        decoded = _decode_batch(described, frames, record.type, _NO_LIMITS)
        for index, item in enumerate(decoded.items):
            if isinstance(item, ProtocolError):
                raise ProtocolError(item.code, f"items[{index}]: {item.message}")
    return frames


def _peek_header(frames: Any) -> Optional[dict]:
    try:
        view = as_byte_view(frames[0])
        if view.nbytes > Limits.max_header_bytes:
            return None
        header = msgpack.unpackb(view, raw=False, strict_map_key=False)
    except Exception:
        return None
    return header if isinstance(header, dict) else None


def peek_id(frames: Any) -> Optional[int]:
    """Best-effort request id of a message that may not decode (for its error reply)."""
    header = _peek_header(frames)
    value = header.get("id") if header else None
    return value if type(value) is int and 0 <= value < ID_LIMIT else None


def peek_type(frames: Any) -> Optional[str]:
    """Best-effort message type of a message that may not decode (None unless a known type)."""
    return peek_kind(frames)[0]


def peek_kind(frames: Any) -> tuple[Optional[str], bool]:
    """`peek_type`, and whether the message names several sequences (header field `items`): what says how many
    tensor frames it may carry."""
    header = _peek_header(frames)
    value = header.get("type") if header else None
    return (value if type(value) is str and value in _TYPE_NAMES else None), bool(header) and "items" in header


# --- replies -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    id: Optional[int]
    type: Optional[MessageType]
    ok: bool
    result: dict = field(default_factory=dict)
    tensors: dict[str, WireTensor] = field(default_factory=dict)
    error_code: Optional[ErrorCode] = None
    error_message: Optional[str] = None

    def raise_for_error(self) -> "Reply":
        """Return self when ok, else raise RemoteError(code, message) as the daemon reported it."""
        if not self.ok:
            raise RemoteError(self.error_code, self.error_message)
        return self


def _ok_reply(request_id: Optional[int], mtype: Optional[MessageType], result: dict, tensors: dict) -> Reply:
    """`Reply(request_id, mtype, True, result, tensors)` without the frozen dataclass's __init__ (half the time of
    building it: seven object.__setattr__), its fields in the same order."""
    reply = object.__new__(Reply)
    reply.__dict__.update(id=request_id, type=mtype, ok=True, result=result, tensors=tensors, error_code=None,
                          error_message=None)
    return reply


assert not hasattr(Reply, "__post_init__") and [f.name for f in dataclasses.fields(Reply)] == [
    "id", "type", "ok", "result", "tensors", "error_code", "error_message"], "_ok_reply builds every field of Reply"


def _reply_header(request_id: Optional[int], message_type: Any, ok: bool) -> dict[str, Any]:
    if request_id is not None:
        _check_int(request_id, "reply id", 0, ID_LIMIT)
    type_name = _TYPE_VALUES.get(message_type) if type(message_type) in (MessageType, str) else None
    if type_name is None and message_type is not None:  # not a type (MessageType raises), or not a str
        type_name = MessageType(message_type).value
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": type_name, "ok": ok}


def encode_reply(
    request_id: Optional[int],
    type: MessageType | str | None,
    result: Mapping[str, Any],
    tensors: Mapping[str, WireTensor] | None = None,
) -> Frames:
    """A success reply: header {v, id, type, ok: true, result, tensors}, then one frame per tensor."""
    header = _reply_header(request_id, type, True)
    header["result"] = dict(result)
    header["tensors"] = []
    return _pack_or_raise(ErrorCode.INTERNAL, header, tensors)


def encode_error(request_id: Optional[int], type: MessageType | str | None, code: ErrorCode, message: str) -> Frames:
    """An error reply: header {v, id, type, ok: false, error: {code, message}}, no tensor frames."""
    header = _reply_header(request_id, type, False)
    header["error"] = {"code": ErrorCode(code).value, "message": clip_message(message)}
    return _pack_or_raise(ErrorCode.INTERNAL, header)


def decode_reply(frames: Frames) -> Reply:
    """Parse a reply; tensors alias the frames. Malformed replies raise ProtocolError(BAD_REQUEST)."""
    views = _frame_views(frames)
    # Result maps are the daemon's to shape (STATS may key by layer): allow non-string keys.
    header = _unpack_header(views[0], strict_map_key=False)
    _check_version(header)
    if not header.keys() <= _REPLY_KEYS:
        unknown = sorted(str(key) for key in header if key not in _REPLY_KEYS)
        raise _bad(f"unknown field(s) {unknown} in reply")
    for key in ("id", "type", "ok"):
        if key not in header:
            raise _bad(f"reply is missing field '{key}'")
    request_id = header["id"]
    if request_id is not None:
        _check_int(request_id, "reply id", 0, ID_LIMIT)
    type_name = header["type"]
    mtype = _MESSAGE_TYPES.get(type_name) if type(type_name) is str else None
    if mtype is None and type_name is not None:  # not a type's name (MessageType raises), or not a str
        try:
            mtype = MessageType(type_name)
        except (ValueError, TypeError):
            raise _bad(f"reply type {type_name!r} is not a message type") from None
    ok = header["ok"]
    if type(ok) is not bool:
        raise _bad(f"reply field 'ok' must be a bool, got {_describe(ok)}")
    tensors = _tensors(header.get("tensors", []), views[1:])
    if ok:
        if "error" in header:
            raise _bad("reply with ok: true carries 'error'")
        result = header.get("result")
        if not isinstance(result, dict):
            raise _bad(f"reply field 'result' must be a map, got {_describe(result)}")
        return _ok_reply(request_id, mtype, result, tensors)
    if "result" in header or tensors:
        raise _bad("reply with ok: false carries a result or tensors")
    error = header.get("error")
    if not isinstance(error, dict) or set(error) != {"code", "message"}:
        raise _bad(f"reply field 'error' must be a map {{code, message}}, got {_describe(error)}")
    try:
        code = ErrorCode(error["code"])
    except (ValueError, TypeError):
        raise _bad(f"reply error code {error['code']!r} is not a known code") from None
    if type(error["message"]) is not str:
        raise _bad(f"reply error message must be a string, got {_describe(error['message'])}")
    return Reply(request_id, mtype, False, {}, {}, code, error["message"])


def split_batch_reply(reply: Reply, sent: Batch) -> list[Reply]:
    """The reply to a batched request as one Reply per item, as if each item had been sent alone: `ok` with its
    result and its rows of each tensor (views, no copy), or its own error. ProtocolError(BAD_REQUEST) when the
    reply does not fit the request (another item count, rows that do not add up)."""
    items = reply.result.get("items")
    if not isinstance(items, list) or len(items) != len(sent.items):
        raise _bad(f"reply to a batch of {len(sent.items)} items carries {_describe(items)} as 'items'")
    starts = {name: 0 for name in reply.tensors}
    out = []
    for index, (result, item) in enumerate(zip(items, sent.items)):
        if not isinstance(result, dict):
            raise _bad(f"reply items[{index}] must be a map, got {_describe(result)}")
        if "error" in result:
            error = result["error"]
            try:
                code = ErrorCode(error["code"])
                message = str(error["message"])
            except (ValueError, TypeError, KeyError):
                raise _bad(f"reply items[{index}] carries a malformed error {_describe(error)}") from None
            out.append(Reply(reply.id, reply.type, False, {}, {}, code, message))
            continue
        tensors = {}
        if not isinstance(item, Rollback):
            names = [f"layer.{layer}" for layer in result.get("captured_layers", ())]
            if "ids" in result:
                names.append("logits")
            elif result.get("rows_sent") is not True:  # rows sent on to the next shard come back without them
                names.append("hidden")
            for name in names:
                if name == "logits" and not item.return_logits:
                    continue
                tensor = reply.tensors.get(name)
                n = item.n_tokens
                if tensor is None or starts[name] + n > tensor.shape[0]:
                    raise _bad(f"reply tensor {name!r} has no rows for items[{index}]")
                tensors[name] = row_slice(tensor, starts[name], n)
                starts[name] += n
        out.append(Reply(reply.id, reply.type, True, result, tensors))
    left = {name: reply.tensors[name].shape[0] - start for name, start in starts.items()
            if reply.tensors[name].shape[0] != start}
    if left:
        raise _bad(f"reply tensors hold rows no item claims: {left}")
    return out
