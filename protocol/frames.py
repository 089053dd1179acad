"""A message's frames and msgpack header: assembled, taken apart, or peeked at when it may not decode."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import msgpack

from .errors import ErrorCode, ProtocolError, _bad, _describe, _too_large
from .limits import Limits
from .messages import ID_LIMIT, PROTOCOL_VERSION, MessageType
from .tensors import DTYPE_SIZES, WireTensor, as_byte_view, expected_nbytes

Frames = list  # of bytes | bytearray | memoryview | zmq.Frame

_DESCRIPTOR_KEYS = frozenset({"name", "dtype", "shape"})
_TYPE_NAMES = frozenset(t.value for t in MessageType)
# a type's name -> the type (and each type -> its name): a dict lookup, cheaper than MessageType(...) per message
_MESSAGE_TYPES = {t.value: t for t in MessageType}
_TYPE_VALUES = {t: t.value for t in MessageType}


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
