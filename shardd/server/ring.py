"""Rows from shard to shard on the device (PROTOCOL.md, "Rows on the device").

Two daemons of one host (a shard and its `--relay-to` next shard, on one GPU or on two GPUs one process can
see) pass a step's rows through device memory instead of the host: the next shard (the reader) keeps a ring of
SLOTS row buffers and interprocess events, and hands their CUDA IPC handles to the previous shard (the writer)
once, in the reply to a RING. Per step the writer copies its rows into a slot on its stream, records the slot's
`written` event, publishes the put in the slot's flag and sends a small ROWS naming the slot (no rows in it)
without waiting for its device; the reader's stream waits for the flag (or, where the driver cannot, the host
polls `written`), copies the rows out of the slot and records `consumed`, which the writer waits for before it
writes that slot again.

The reader creates all of it (memory and both events' objects), so the writer's death frees nothing the reader
uses. A stream wait on an event a dead process recorded may never end (its context and work are torn down;
scripts/probe_cuda_ipc.py shows it), so neither wait uses one. The device wait (`DeviceRing.await_rows`) has the reader's stream wait for
the slot's flag, which the writer sets to the put's generation after its rows (shardd/engine/kernels/ring.py), through
the GPU's front end (cuStreamWaitValue32: no SM taken); a watcher thread of the reader ends a wait that has not
landed after --rows-wait or once the writer's process is gone. The step runs after it either way, and the daemon
reads the wait's outcome before it answers (a step that ran on no rows fails its sequences). Where the driver has
no stream memory operations the host polls `written` instead (`DeviceRing.take`), bounded the same way.

Nothing here is on the CPU reference path: a CPU shard refuses RING and its rows travel through the host. torch
is imported where it is used (the CLI imports this module for its defaults).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from shardd.obs import timeline

log = logging.getLogger("shardd")

SLOTS = 2  # one slot written while the other may still be read
DEFAULT_ROWS = 4096  # rows a slot holds: a decode batch or a few prompts' pieces; larger go by host


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
        # the device wait (shardd/engine/kernels/ring.py): per slot its flag (written by the writer), the flag as the last
        # wait saw it when it ended (`seen`) and an event after that wait; the waits the watcher may end
        self.flags = torch.zeros(SLOTS, dtype=torch.int32, device=device)
        self.seen = torch.zeros(SLOTS, dtype=torch.int32, device=device)
        self._waits_done = [torch.cuda.Event() for _ in range(SLOTS)]
        self._pending: dict[int, tuple[int, float]] = {}  # slot -> (generation, deadline) of a queued wait
        self._lock = threading.Lock()
        self.broken: Optional[str] = None  # a wait the watcher ended: this ring takes no more slot rows (new RING)
        self._watcher: Optional[threading.Thread] = None
        self._closed = threading.Event()
        self.writer_pid: Optional[int] = None
        self.writer_shares_gpu = False
        self._warm_up()
        try:
            self._memory = list(self.buffer.untyped_storage()._share_cuda_())
            self._flags_memory = list(self.flags.untyped_storage()._share_cuda_())
        except RuntimeError as error:  # e.g. memory the allocator maps in expandable segments
            raise RingUnavailable(f"its memory cannot be shared: {error}") from None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def share(self) -> dict:
        """The RING reply: what a writer opens the ring with."""
        return {"gpu": gpu_uuid(self.device), "slots": SLOTS, "rows": self.rows, "hidden": self.hidden,
                "dtype": str(self.dtype).removeprefix("torch."), "memory": self._memory[1:],
                "flags": self._flags_memory[1:],
                "written": [event.ipc_handle() for event in self.written],
                "consumed": [event.ipc_handle() for event in self.consumed]}

    def take(self, slot: int, n: int, timeout_s: float):
        """The host wait, where the driver has no front-end wait: the first n rows of `slot`, copied out of it once
        they landed (the writer may write the slot again once `consumed` happens). RingUnavailable when the
        writer's rows did not land in time or it died with them in flight."""
        import torch

        stream = torch.cuda.current_stream(self.device)
        if not self.landed(slot, timeout_s):
            raise RingUnavailable(self.not_landed(slot, timeout_s))
        rows = self.buffer[slot, :n].clone()
        self.consumed[slot].record(stream)
        return rows

    def await_rows(self, slot: int, n: int, generation: int, timeout_s: float) -> tuple:
        """The device wait: (the first n rows of `slot` copied out of it behind the wait, the DeviceWait whose
        outcome the daemon reads after the step). Nothing here waits on the host: the GPU's front end waits
        (cuStreamWaitValue32); the watcher ends it after `timeout_s` or a second after the writer's death."""
        import torch

        stream = torch.cuda.current_stream(self.device)
        self._start_watcher()
        with self._lock:
            self._pending[slot] = (generation, time.monotonic() + timeout_s)
        timeline.gpu("wait queued")
        flag = self.flags[slot:slot + 1]
        _wait_value(stream, flag, generation)
        # the value that ended the wait (it changes no more: see shardd/engine/kernels/ring.py)
        self.seen[slot:slot + 1].copy_(flag)
        self._waits_done[slot].record(stream)
        timeline.gpu("wait done")
        rows = self.buffer[slot, :n].clone()
        self.consumed[slot].record(stream)
        return rows, DeviceWait(self, slot, generation)

    def _warm_up(self) -> None:
        """Compile and load the watcher's kernel now (an end that ends nothing), not while a wait is queued."""
        import torch

        from shardd.engine.kernels import ring as kernels

        flags = torch.zeros(SLOTS, dtype=torch.int32, device=self.device)
        kernels.end_wait(flags, 1, 0, kernels.CANCELLED_VALUE)
        torch.cuda.current_stream(self.device).synchronize()

    def new_writer(self, pid: Optional[int], gpu: Optional[str] = None) -> None:
        """A (new) writer opened the ring (`gpu`: the UUID of the GPU its rows come from): its flags start over and
        the ring takes slot rows again (nothing waits then: the old writer's ROWS all came or were refused). Done
        on the device before the RING reply, so that no put of the new writer can be overwritten."""
        import torch

        self.writer_pid = pid
        self.writer_shares_gpu = gpu is not None and gpu == gpu_uuid(self.device)
        self.flags.zero_()
        self.broken = None
        torch.cuda.current_stream(self.device).synchronize()

    def _start_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="ring-watcher", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """Every WATCH_S while a device wait is queued and has not ended: end it (shardd.engine.kernels.ring.end_wait, on
        a side stream: the reader's own stream is the one waiting) with TIMED_OUT past its deadline, or with
        CANCELLED once the writer's process has been gone for a second. An ended wait breaks the ring (its slot's
        flag holds the end): the daemon refuses slot rows until the writer asks again (RING)."""
        import torch

        from shardd.engine.kernels import ring as kernels

        with torch.cuda.device(self.device):
            side = torch.cuda.Stream(self.device)
            dead_since = None
            while not self._closed.wait(WATCH_S):
                with self._lock:
                    pending = {slot: wait for slot, wait in self._pending.items() if not self._waits_done[slot].query()}
                    self._pending = dict(pending)
                now = time.monotonic()
                if not pending or pid_alive(self.writer_pid):
                    dead_since = None
                elif dead_since is None:
                    dead_since = now
                for slot, (generation, deadline) in pending.items():
                    if dead_since is not None and now - dead_since >= 1.0:
                        value, why = kernels.CANCELLED_VALUE, f"the previous shard's process {self.writer_pid} is gone"
                    elif now > deadline:
                        value, why = kernels.TIMED_OUT_VALUE, "its rows did not land within --rows-wait"
                    else:
                        continue
                    with torch.cuda.stream(side):
                        kernels.end_wait(self.flags, slot, generation, value)
                    side.synchronize()
                    self.broken = f"a device wait for slot {slot} was ended: {why}"
                    log.warning("ring slot %d: %s (the step behind it fails its sequences)", slot, why)

    def close(self) -> None:
        self._closed.set()

    def landed(self, slot: int, timeout_s: float) -> bool:
        """The host wait for the writer's rows in `slot`: bounded by `timeout_s` and by the writer's life."""
        return wait_for_event(self.written[slot], timeout_s, lambda: pid_alive(self.writer_pid))

    def not_landed(self, slot: int, timeout_s: float) -> str:
        return (f"the previous shard's rows did not land in slot {slot} within {timeout_s:g} s (its process "
                f"{'still runs' if pid_alive(self.writer_pid) else 'is gone'})")


WATCH_S = 0.05  # how often the watcher looks at a writer while device waits are queued


class DeviceWait:
    """One device wait for a slot's rows (DeviceRing.await_rows): the flag value that ended it on the device
    (`seen`, what a publish to the next shard reads) and, once it ended, its outcome on the host."""

    def __init__(self, ring: DeviceRing, slot: int, generation: int):
        self.ring, self.slot, self.generation = ring, slot, generation
        self.seen = ring.seen  # every slot's: seen[slot] is this wait's (a publish reads it by index)
        self._outcome: Optional[int] = None

    def outcome(self) -> int:
        """shardd.engine.kernels.ring's LANDED, TIMED_OUT, CANCELLED or POISONED; waits for the wait to end (bounded by
        the watcher). Read before the slot's next wait."""
        from shardd.engine.kernels.ring import outcome_of

        if self._outcome is None:
            self.ring._waits_done[self.slot].synchronize()
            self._outcome = outcome_of(int(self.seen[self.slot].item()), self.generation)
        return self._outcome

    def landed(self) -> bool:
        from shardd.engine.kernels.ring import LANDED

        return self.outcome() == LANDED

    def why(self) -> str:
        from shardd.engine.kernels import ring as kernels

        outcome = self.outcome()
        if outcome == kernels.TIMED_OUT:
            return f"the previous shard's rows did not land in slot {self.slot} within the wait's bound (--rows-wait)"
        if outcome == kernels.CANCELLED:
            return f"the previous shard's process ({self.ring.writer_pid}) died with its rows in slot {self.slot} in flight"
        if outcome == kernels.POISONED:
            return "the previous shard's own step ran without its rows (they never landed before it)"
        return "landed"


# ---- the GPU front end's wait (a stream memory operation of the CUDA driver) ----------------------------

_FRONT_END: Optional[object] = None  # the driver's cuStreamWaitValue32, or False where it has none


def front_end_waits() -> bool:
    """Whether the CUDA driver waits on a flag in a stream (cuStreamWaitValue32: the GPU's front end polls the
    flag, no SM taken; every driver of CUDA 12 and later on Linux)."""
    global _FRONT_END
    if _FRONT_END is None:
        import ctypes

        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _FRONT_END = fn
        except (OSError, AttributeError):
            _FRONT_END = False
    return _FRONT_END is not False


CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (int32)(*addr - value) >= 0


def _wait_value(stream, flag, value: int) -> None:
    rc = _FRONT_END(stream.cuda_stream, flag.data_ptr(), value, CU_STREAM_WAIT_VALUE_GEQ)
    if rc != 0:
        raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {rc}")


class RowsLost(Exception):
    """A step ran behind a device wait that ended without its rows (DeviceWait.why): its sequences' states took
    no rows, so they fail (INTERNAL); the coordinator re-fills them."""


def _opened(handles, device, dtype, shape):
    """A tensor of `shape` over the reader's memory its CUDA IPC handles name (DeviceRing.share's `memory`, `flags`)."""
    import torch

    handle, size, offset, counter, counter_offset, event, event_sync = handles
    storage = torch.UntypedStorage._new_shared_cuda(device.index, handle, size, offset, counter, counter_offset,
                                                    event, event_sync)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)


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
            self.buffer = _opened(shared["memory"], self.device, self.dtype, (self.slots, self.rows, self.hidden))
            flags = shared.get("flags")
            self.flags = None if flags is None else _opened(flags, self.device, torch.int32, (self.slots,))
            self.written = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in shared["written"]]
            self.consumed = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in shared["consumed"]]
        except RingUnavailable:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
            raise RingUnavailable(f"cannot open the next shard's ring: {type(error).__name__}: {error}") from None
        if len(self.written) != self.slots or len(self.consumed) != self.slots:
            raise RingUnavailable("the next shard's ring names a different number of events than slots")
        self.next = 0
        self.generations = [0] * self.slots  # puts into each slot so far: the last one's generation
        if self.flags is not None:  # the publish kernel compiled and loaded now (on a flag of its own)
            from shardd.engine.kernels import ring as kernels

            scratch = torch.zeros(SLOTS, dtype=torch.int32, device=self.device)
            kernels.publish(scratch, 1, 0, 1)
            kernels.publish(scratch, 1, 1, 2, own=scratch, own_slot=1, expected_own=1)

    def fits(self, parts: list) -> bool:
        return (all(p.device.type == "cuda" and p.dtype == self.dtype and p.dim() == 2 and p.shape[1] == self.hidden
                    for p in parts) and sum(p.shape[0] for p in parts) <= self.rows)

    def put(self, parts: list, timeout_s: float = 1.0, own=None) -> Optional[int]:
        """Copy `parts` (rows end to end) into the next slot on the device, publish the put's generation in the
        slot's flag (with POISON when `own`, this shard's own DeviceWait for its input rows, did not land) and
        record its `written`: the slot (its generation in `generations`), or None (the reader has not let go of
        the slot in time: send these rows through the host)."""
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
        self.generations[slot] += 1
        generation = self.generations[slot]
        if self.flags is not None:
            from shardd.engine.kernels import ring as kernels

            # from the previous put's value (poisoned or not); a wait the reader ended holds its end instead, and
            # the reader takes no more slot rows then (a new RING starts over), so a lost swap is final
            kernels.publish(self.flags, slot, generation - 1, generation, None if own is None else own.seen,
                            0 if own is None else own.slot, 0 if own is None else own.generation)
        self.written[slot].record(torch.cuda.current_stream(self.device))
        timeline.gpu("published")
        self.next = (slot + 1) % self.slots
        return slot
