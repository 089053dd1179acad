"""A request record to frames, checked as the receiver would check it (size limits aside)."""

from __future__ import annotations

import sys
from typing import Any

from .checks import _check_request
from .decode import _TICKET_FIELDS, _decode_batch
from .errors import ErrorCode, ProtocolError, _bad
from .fields import (
    _REQUEST_SCHEMA,
    _TENSOR_SPECS,
    _check_int,
    _field_values,
    _request_tensors,
)
from .frames import _TYPE_VALUES, Frames, _pack_or_raise
from .limits import Limits
from .messages import (
    ID_LIMIT,
    PROTOCOL_VERSION,
    RECORD_TYPES,
    REQUEST_TENSORS,
    Batch,
    Request,
)
from .records import _FIELD_NAMES
from .tensors import WireTensor, concat_rows

# Per message type, its tensor frames' names.
_TENSOR_NAMES = {mtype: frozenset(spec.name for spec in specs) for mtype, specs in REQUEST_TENSORS.items()}
# what encode_request walks per record type: its header fields and its tensor fields, each in field order
_ENCODE_NAMES = {record: (tuple(name for name in names if name != "id" and name not in _TENSOR_NAMES[record.type]),
                          tuple(name for name in names if name in _TENSOR_NAMES[record.type]))
                 for record, names in _FIELD_NAMES.items() if record in RECORD_TYPES.values()}
# The receiver's limits are not known when a request is encoded.
_NO_LIMITS = Limits(
    max_tokens_per_request=sys.maxsize, max_frame_bytes=sys.maxsize, max_total_bytes=sys.maxsize,
    max_frames=sys.maxsize, max_header_bytes=sys.maxsize, max_capture_layers=sys.maxsize,
    max_batch_items=sys.maxsize,
)


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
