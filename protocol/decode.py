"""Request frames to a checked record: a one-sequence request, or a batch whose bad items are refused alone."""

from __future__ import annotations

from typing import Optional

from .checks import _check_request
from .errors import ErrorCode, ItemRefused, ProtocolError, _bad, _describe, _too_large
from .fields import (
    _REQUEST_SCHEMA,
    _TENSOR_SPECS,
    _check_int,
    _field_values,
    _Fields,
    _request_tensors,
)
from .frames import (
    _MESSAGE_TYPES,
    Frames,
    _check_sizes,
    _check_version,
    _tensors,
    _unpack_header,
)
from .limits import Limits
from .messages import (
    BATCH_RECORD_TYPES,
    BATCH_REFUSED_FIELDS,
    BATCH_TENSORS,
    COMMON_FIELDS,
    ID_LIMIT,
    RECORD_TYPES,
    REQUEST_FIELDS,
    TOKEN_LIMIT,
    Batch,
    Capture,
    MessageType,
    Request,
)
from .records import _record
from .tensors import WireTensor, row_slice

_COMMON_KEYS = frozenset(f.name for f in COMMON_FIELDS)
# per type, the header keys a one-sequence request may carry
_REQUEST_KEYS = {mtype: _COMMON_KEYS | {spec.name for spec in specs} for mtype, specs in REQUEST_FIELDS.items()}
# per record type of a batch item, the fields it may carry, and their names
_ITEM_FIELDS = {RECORD_TYPES[mtype]: (_Fields.of(specs), frozenset(spec.name for spec in specs)) for mtype, specs in (
    (mtype, tuple(spec for spec in REQUEST_FIELDS[mtype] if spec.name not in BATCH_REFUSED_FIELDS))
    for mtype in BATCH_RECORD_TYPES)}
_ROWS = frozenset({"rows"})  # a batch item's count of its rows of tensor 'hidden'; not a record field
# per batchable type, the batch-level fields beside `items`: a FORWARD batch's rows from shard to shard
_TICKET_FIELDS = ("send_rows", "rows_ticket")
_BATCH_TICKETS = {MessageType.FORWARD: frozenset(_TICKET_FIELDS)}
_NO_TENSORS = {mtype: {name: None for name in specs} for mtype, specs in _TENSOR_SPECS.items()}  # read only
# per batchable type, its batch's tensor frames' specs by name (a FORWARD batch's `carried` is its CAPTURE items')
_BATCH_TENSOR_SPECS = {mtype: {name: _TENSOR_SPECS[mtype].get(name) or _TENSOR_SPECS[MessageType.CAPTURE][name]
                               for name in names} for mtype, names in BATCH_TENSORS.items()}


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
