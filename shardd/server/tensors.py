"""Tensors between the wire and the engine: rows already on the device (out of the ring), and every GPU tensor of
a reply brought to the host in one wait."""

from __future__ import annotations

import math

import torch

from common.model_config import dtype_name
from protocol import ErrorCode, ProtocolError


class DeviceRows:
    """Rows already on this shard's device where a FORWARD's tensor hidden (or a CAPTURE's carried) stands: copied
    out of its ring (behind `wait`, a shardd.server.ring.DeviceWait, with the device wait; None: after the host saw
    them land)."""

    def __init__(self, tensor, wait=None):
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.wait = wait

    @property
    def dtype(self) -> str:
        """Its dtype's wire name, as a WireTensor's."""
        return dtype_name(self.tensor.dtype)

    def to_torch(self, device=None):
        return self.tensor if device is None else self.tensor.to(device)


# Tensors for the wire. `WireTensor.from_torch` of a GPU tensor copies it into fresh pageable pages and waits for
# that copy alone, so a step of several prompts would wait once per tensor on the slower pageable path. Here every
# GPU tensor goes into pinned memory (PyTorch's caching host allocator) without blocking, then one wait for the
# device.


def on_host(tensors: list) -> list:
    """`tensors`, each in host memory (a CPU tensor as it is)."""
    copies, devices = [], set()
    for tensor in tensors:
        if tensor.device.type != "cpu":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            devices.add(tensor.device)
            tensor = host
        copies.append(tensor)
    _wait_for(devices)
    return copies


def joined_on_host(chunks: list):
    """The chunks (rows of one frame, item by item) as one host tensor: with any on a GPU, each copied straight
    into its rows of one pinned tensor (not a copy of each, then a join on the host)."""
    if len(chunks) == 1:
        return on_host(chunks)[0]
    first = chunks[0]
    if all(c.device.type == "cpu" for c in chunks) or any(c.dtype != first.dtype for c in chunks):
        return torch.cat(on_host(chunks))
    out = torch.empty((sum(c.shape[0] for c in chunks), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    devices, row = set(), 0
    for chunk in chunks:
        on_device = chunk.device.type != "cpu"
        out[row:row + chunk.shape[0]].copy_(chunk, non_blocking=on_device)
        if on_device:
            devices.add(chunk.device)
        row += chunk.shape[0]
    _wait_for(devices)
    return out


def _wait_for(devices) -> None:
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def check_finite(name: str, tensor) -> None:
    """BAD_REQUEST naming tensor `name` when a received tensor (a WireTensor over a frame) holds a NaN or an
    infinity: such rows would be folded into a sequence's state. One vectorised pass over the rows (min and max
    propagate NaN and show an infinity), about the cost of the copy into the step's staging buffer. Rows already on
    this shard's device (DeviceRows, out of its ring) are another shard's step output and are not read here: that
    would wait for the device."""
    if tensor is None or isinstance(tensor, DeviceRows):
        return
    rows = tensor.to_torch()
    if rows.device.type != "cpu" or rows.numel() == 0:
        return
    low, high = torch.aminmax(rows)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"tensor '{name}' holds a non-finite value (NaN or infinity): "
                                                   f"{list(rows.shape)} {str(rows.dtype).removeprefix('torch.')}")


def hidden_of(request):
    """A FORWARD/CAPTURE's hidden rows as a tensor over the frame (None with tokens)."""
    return request.hidden.to_torch() if request.hidden is not None else None
