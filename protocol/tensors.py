"""A tensor as it travels: dtype name, shape, and the raw little-endian C-order bytes.

torch is imported only inside `from_torch` / `to_torch`, so the package imports without it.
"""

from __future__ import annotations

import ctypes
import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Union

from .errors import ErrorCode, ProtocolError

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
}

FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16"})

Buffer = Union[memoryview, bytes, bytearray]


def _check_little_endian() -> None:
    # The wire is little-endian; raw bytes from a big-endian host would be silently wrong.
    if sys.byteorder != "little":
        raise RuntimeError("protocol tensors require a little-endian host")


def as_byte_view(buffer: Any) -> memoryview:
    """A flat unsigned-byte memoryview over any buffer (bytes, bytearray, zmq.Frame, ...), no copy."""
    view = memoryview(buffer)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]


@dataclass(frozen=True)
class WireTensor:
    """`data` holds exactly prod(shape) * itemsize bytes, C-contiguous row-major, little-endian."""

    dtype: str
    shape: tuple[int, ...]
    data: Buffer
    # (tensor, first row) when this is a row_slice of `tensor`: lets concat_rows hand back consecutive slices of
    # one tensor as a view of it instead of copying them (the relay passes a shard's rows on this way). Not part
    # of the value: a slice equals the same bytes made any other way.
    origin: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unsupported dtype {self.dtype!r}; supported: {sorted(DTYPE_SIZES)}")
        shape = tuple(self.shape)
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"shape must be non-negative ints, got {list(self.shape)!r}")
        object.__setattr__(self, "shape", shape)
        data = as_byte_view(self.data)
        want = expected_nbytes(self.dtype, shape)
        if data.nbytes != want:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"{self.dtype}{list(shape)} needs {want} bytes, data has {data.nbytes}",
            )
        object.__setattr__(self, "data", data)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def descriptor(self, name: str) -> dict[str, Any]:
        """The header entry that announces this tensor's frame."""
        return {"name": name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_torch(cls, tensor: Any) -> "WireTensor":
        """Wrap a torch tensor. Zero-copy for contiguous CPU tensors; others are copied to contiguous CPU.

        The returned data aliases the tensor's memory (and keeps it alive): do not modify the
        tensor before the frames are sent.
        """
        import torch  # only the tensor calls need it: protocol/ imports without torch

        _check_little_endian()
        dtype = _torch_dtype_names(torch).get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"dtype {tensor.dtype} cannot travel; supported: {sorted(DTYPE_SIZES)}")
        if tensor.device.type != "cpu":
            tensor = tensor.detach().to("cpu")
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return cls(dtype, tuple(tensor.shape), b"")
        # A ctypes array over the tensor's memory exports the buffer without numpy and without a
        # copy; it holds a reference to the tensor so the memory outlives every view of it.
        raw = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
        raw._owner = tensor  # type: ignore[attr-defined]
        return cls(dtype, tuple(tensor.shape), memoryview(raw).cast("B"))

    def to_torch(self, device: Any = None) -> Any:
        """A torch tensor over the same memory (no copy) or, with `device`, a copy there.

        Without `device` the result shares memory with the frame; if the frame is read-only
        (bytes, a received zmq frame) treat the tensor as read-only too.
        """
        import torch  # only the tensor calls need it: protocol/ imports without torch

        _check_little_endian()
        if self.origin is not None and device is None and self.data.nbytes:  # a row slice: a view of its base's
            base, first = self.origin                                       # tensor, made once per frame
            return base.to_torch()[first:first + self.shape[0]]
        cached = self.__dict__.get("_torch")
        if cached is not None and device is None:
            return cached
        torch_dtype = getattr(torch, self.dtype)
        if self.data.nbytes == 0:
            tensor = torch.empty(self.shape, dtype=torch_dtype)
        else:
            _quiet_read_only_warning()
            tensor = torch.frombuffer(self.data, dtype=torch_dtype).view(self.shape)
        if device is not None:
            return tensor.to(device)
        # kept for the row slices of this tensor (a batch's items, the relay's parts), each a view of it: one
        # frombuffer per frame instead of one per item. Not part of the value (the fields are).
        object.__setattr__(self, "_torch", tensor)
        return tensor


_READ_ONLY_FILTERED = False


def _quiet_read_only_warning() -> None:
    """torch warns on every read-only buffer (a received frame) it wraps; `to_torch`'s docstring states that
    contract instead. One process-wide filter for that one message, installed once: a `catch_warnings` block
    around each call cost more than the rest of decoding a batch item."""
    global _READ_ONLY_FILTERED
    if not _READ_ONLY_FILTERED:
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        _READ_ONLY_FILTERED = True


def _torch_dtype_names(torch: Any) -> dict[Any, str]:
    return {getattr(torch, name): name for name in DTYPE_SIZES}


def concat_rows(parts: "list[WireTensor]") -> WireTensor:
    """Row blocks [n_i, ...] of one dtype and row shape as one [sum n_i, ...] (row-major: the bytes end to end);
    one block is returned as it is, without a copy."""
    if len(parts) == 1:
        return parts[0]
    rows = sum(part.shape[0] for part in parts)
    joined = _consecutive_slices(parts)
    if joined is not None:
        base, first = joined
        return row_slice(base, first, rows)
    return WireTensor(parts[0].dtype, (rows, *parts[0].shape[1:]), b"".join(part.data for part in parts))


def _consecutive_slices(parts: "list[WireTensor]") -> "tuple[WireTensor, int] | None":
    """(tensor, first row) when `parts` are row slices of one tensor, each starting where the previous ended."""
    origin = parts[0].origin
    if origin is None:
        return None
    base, first = origin
    at = first
    for part in parts:
        if part.origin is None or part.origin[0] is not base or part.origin[1] != at:
            return None
        at += part.shape[0]
    return base, first


def row_slice(tensor: WireTensor, start: int, rows: int) -> WireTensor:
    """Rows start .. start+rows-1 of a [n, ...] tensor, a view of its bytes (no copy)."""
    row_bytes = tensor.nbytes // tensor.shape[0] if tensor.shape[0] else 0
    base, first = tensor.origin if tensor.origin is not None else (tensor, 0)
    # valid by construction (the bytes of `rows` whole rows of a checked tensor): built without __post_init__'s
    # checks, which cost more than the rest of decoding a batch item's rows
    part = object.__new__(WireTensor)
    part.__dict__.update(dtype=tensor.dtype, shape=(rows, *tensor.shape[1:]),
                         data=tensor.data[start * row_bytes:(start + rows) * row_bytes], origin=(base, first + start))
    return part
