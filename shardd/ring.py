"""Rows from shard to shard on the device (PROTOCOL.md, "Rows on the device").

Two daemons of one host (a shard and its `--relay-to` next shard, on one GPU or on two GPUs one process can
see) pass a step's rows through device memory instead of the host: the next shard (the reader) keeps a ring of
SLOTS row buffers and interprocess events, and hands their CUDA IPC handles to the previous shard (the writer)
once, in the reply to a RING. Per step the writer copies its rows into a slot on its stream, records the slot's
`written` event and sends a small ROWS naming the slot (no rows in it) without waiting for its device; the reader
waits for `written` (on the host, bounded, by default; or on its stream, `--ring-wait device`), copies the rows
out of the slot and records `consumed`, which the writer waits for before it writes that slot again.

The reader creates all of it (memory and both events' objects), so the writer's death frees nothing the reader
uses. A device-side wait on an event a dead process recorded may never end (its context and work are torn
down), hence the host wait by default: bounded by --rows-wait and by the writer's life.

Nothing here is on the CPU reference path: a CPU shard refuses RING and its rows travel through the host. torch
is imported where it is used (the CLI imports this module for its defaults).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

log = logging.getLogger("shardd")

SLOTS = 2  # one slot written while the other may still be read
DEFAULT_ROWS = 4096  # rows a slot holds (--device-rows): a decode batch or a few prompts' pieces; larger go by host
WAITS = ("host", "device")


class RingUnavailable(Exception):
    """This pair of daemons cannot pass rows on the device (the reason); their rows go through the host."""


def gpu_uuid(device) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def local_device(uuid: str) -> Optional[int]:
    """The index, in this process, of the GPU with this UUID (None: not visible here)."""
    import torch

    for index in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", index)) == uuid:
            return index
    return None


def pid_alive(pid: Optional[int]) -> bool:
    """Whether process `pid` of this host still runs (True when unknown: only a known death ends a wait early)."""
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process: it exists
        return True
    return True


def wait_for_event(event, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll `event` from the host until it has happened (True), `timeout_s` passed or `alive()` says its recorder
    died and it still has not happened a second later (False)."""
    if event.query():
        return True
    start = time.monotonic()
    dead_since = None
    spins = 0
    while not event.query():
        spins += 1
        if spins % 256 == 0:
            now = time.monotonic()
            if now - start > timeout_s:
                return False
            if dead_since is None and not alive():
                dead_since = now
            if dead_since is not None and now - dead_since > 1.0:
                return False
            time.sleep(0)
    return True


class DeviceRing:
    """The reader's ring: SLOTS x rows x hidden of `dtype` on `device`, and per slot its two events."""

    def __init__(self, rows: int, hidden: int, dtype, device):
        import torch

        if device.type != "cuda":
            raise RingUnavailable(f"this shard runs on {device}, not a GPU")
        self.rows, self.hidden, self.dtype, self.device = rows, hidden, dtype, device
        self.buffer = torch.zeros((SLOTS, rows, hidden), dtype=dtype, device=device)
        self.written = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]  # recorded by the writer
        self.consumed = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]  # recorded here
        stream = torch.cuda.current_stream(device)
        for event in self.written + self.consumed:
            event.record(stream)
        stream.synchronize()
        self.writer_pid: Optional[int] = None
        try:
            self._memory = list(self.buffer.untyped_storage()._share_cuda_())
        except RuntimeError as error:  # e.g. memory the allocator maps in expandable segments
            raise RingUnavailable(f"its memory cannot be shared: {error}") from None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def share(self) -> dict:
        """The RING reply: what a writer opens the ring with."""
        return {"gpu": gpu_uuid(self.device), "slots": SLOTS, "rows": self.rows, "hidden": self.hidden,
                "dtype": str(self.dtype).removeprefix("torch."), "memory": self._memory[1:],
                "written": [event.ipc_handle() for event in self.written],
                "consumed": [event.ipc_handle() for event in self.consumed]}

    def take(self, slot: int, n: int, wait: str, timeout_s: float):
        """The first n rows of `slot`, copied out of it (the writer may write the slot again once `consumed`
        happens). RingUnavailable when the writer's rows did not land in time or it died with them in flight."""
        import torch

        stream = torch.cuda.current_stream(self.device)
        if wait == "device":
            stream.wait_event(self.written[slot])
        elif not self.landed(slot, timeout_s):
            raise RingUnavailable(self.not_landed(slot, timeout_s))
        rows = self.buffer[slot, :n].clone()
        self.consumed[slot].record(stream)
        return rows

    def landed(self, slot: int, timeout_s: float) -> bool:
        """The host wait for the writer's rows in `slot`: bounded by `timeout_s` and by the writer's life."""
        return wait_for_event(self.written[slot], timeout_s, lambda: pid_alive(self.writer_pid))

    def not_landed(self, slot: int, timeout_s: float) -> str:
        return (f"the previous shard's rows did not land in slot {slot} within {timeout_s:g} s (its process "
                f"{'still runs' if pid_alive(self.writer_pid) else 'is gone'})")

    def gate(self, slot: int, n: int, timeout_s: float) -> "RowsGate":
        """The first n rows of `slot` as a view the step reads once they have landed (`RowsGate`): the host wait
        for them moves from the ROWS's arrival to the step's launch, after its inputs are prepared."""
        return RowsGate(self, slot, n, timeout_s)


class RowsNotLanded(Exception):
    """A gated step's rows did not land in the ring (the writer's rows late past --rows-wait, or it died with them
    in flight): raised before the step changed anything."""


class RowsGate:
    """Rows of one ring slot for the request that reads them (the host wait, `--ring-wait host`): `view` is the
    slot's rows; the fast step prepares everything else, calls `wait()` (idempotent; RowsNotLanded when they did
    not land: nothing changed yet) and only then queues its reads of `view`. After the whole request the daemon
    `settle`s the gate: the slot's `consumed` recorded behind every read (the writer may write the slot again
    once it happened and the ROWS is acknowledged, which comes after)."""

    def __init__(self, ring: DeviceRing, slot: int, n: int, timeout_s: float):
        self.ring, self.slot, self.timeout_s = ring, slot, timeout_s
        self.view = ring.buffer[slot, :n]
        self.landed: Optional[bool] = None  # None: not waited for yet
        self.released = False

    def wait(self) -> None:
        if self.landed is None:
            self.landed = self.ring.landed(self.slot, self.timeout_s)
        if not self.landed:
            raise RowsNotLanded(self.ring.not_landed(self.slot, self.timeout_s))

    def settle(self) -> Optional[str]:
        """After the request (run or refused): the slot released; the problem when its rows never landed."""
        if not self.released:
            import torch

            self.ring.consumed[self.slot].record(torch.cuda.current_stream(self.ring.device))
            self.released = True
        return self.ring.not_landed(self.slot, self.timeout_s) if self.landed is False else None


class RingWriter:
    """The writer's view of a reader's ring (the RING reply `shared`), opened in this process."""

    def __init__(self, shared: dict):
        import torch

        try:
            index = local_device(str(shared["gpu"]))
            if index is None:
                raise RingUnavailable(f"the next shard's GPU {shared['gpu']} is not visible to this process")
            self.device = torch.device("cuda", index)
            self.rows, self.hidden, self.slots = int(shared["rows"]), int(shared["hidden"]), int(shared["slots"])
            self.dtype = getattr(torch, str(shared["dtype"]))
            handle, size, offset, counter, counter_offset, event, event_sync = shared["memory"]
            storage = torch.UntypedStorage._new_shared_cuda(index, handle, size, offset, counter, counter_offset,
                                                            event, event_sync)
            self.buffer = torch.empty(0, dtype=self.dtype, device=self.device).set_(
                storage, 0, (self.slots, self.rows, self.hidden))
            self.written = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in shared["written"]]
            self.consumed = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in shared["consumed"]]
        except RingUnavailable:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
            raise RingUnavailable(f"cannot open the next shard's ring: {type(error).__name__}: {error}") from None
        if len(self.written) != self.slots or len(self.consumed) != self.slots:
            raise RingUnavailable("the next shard's ring names a different number of events than slots")
        self.next = 0

    def fits(self, parts: list) -> bool:
        return (all(p.device.type == "cuda" and p.dtype == self.dtype and p.dim() == 2 and p.shape[1] == self.hidden
                    for p in parts) and sum(p.shape[0] for p in parts) <= self.rows)

    def put(self, parts: list, timeout_s: float = 1.0) -> Optional[int]:
        """Copy `parts` (rows end to end) into the next slot on the device, record its `written`: the slot, or
        None (the reader has not let go of the slot in time: send these rows through the host)."""
        import torch

        slot = self.next
        # the reader recorded `consumed` before acknowledging the slot's last ROWS; it happened long ago in a
        # step-by-step exchange (a host poll, never a device wait on another process's event)
        if not wait_for_event(self.consumed[slot], timeout_s):
            return None
        start = 0
        for part in parts:
            self.buffer[slot, start:start + part.shape[0]].copy_(part, non_blocking=True)
            start += part.shape[0]
        self.written[slot].record(torch.cuda.current_stream(self.device))
        self.next = (slot + 1) % self.slots
        return slot
