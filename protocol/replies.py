"""The `Reply` record; encoding a success or error reply, decoding a reply, splitting a batch's reply by item."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import ErrorCode, RemoteError, _bad, _describe, clip_message
from .fields import _check_int
from .frames import (
    _MESSAGE_TYPES,
    _TYPE_VALUES,
    Frames,
    _check_version,
    _frame_views,
    _pack_or_raise,
    _tensors,
    _unpack_header,
)
from .messages import ID_LIMIT, PROTOCOL_VERSION, Batch, MessageType, Rollback
from .tensors import WireTensor, row_slice

_REPLY_KEYS = frozenset({"v", "id", "type", "ok", "result", "tensors", "error"})


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
