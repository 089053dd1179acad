"""The device ring's device wait (shardd/server/ring.py DeviceRing.await_rows, shardd/engine/kernels/ring.py) on a GPU: a
reader in this process, a writer in a child process that opens the ring from its handles, as a next and a
previous shard do, through the GPU front end's wait (cuStreamWaitValue32). The wait ends in
every case, and says how: the rows landed (and they are the writer's), the writer's own rows never did
(poisoned), the writer died with nothing put (cancelled by the watcher within a few seconds, not after
--rows-wait), the bound passed (timed out); a wait the watcher ended breaks the ring until the next RING, and a
writer that puts late cannot turn it into a landed one. CPU hosts have no ring: these tests skip there."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

WRITER = textwrap.dedent("""
    import pickle, sys, time
    import torch
    from shardd.server.ring import RingWriter

    class Own:  # a stand-in for this writer's own DeviceWait: its ring's flags as seen, its slot, the generation
        def __init__(self, device, landed):
            self.seen = torch.tensor([0, 7 if landed else 0], dtype=torch.int32, device=device)
            self.slot, self.generation = 1, 7

    shared, action = pickle.load(open(sys.argv[1], "rb")), sys.argv[2]
    writer = RingWriter(shared)
    rows = torch.arange(4 * writer.hidden, device=writer.device).reshape(4, writer.hidden).to(writer.dtype)
    if action in ("put", "poison"):
        writer.put([rows], own=Own(writer.device, landed=action == "put"))
        torch.cuda.synchronize()
        print("put", writer.generations, flush=True)
    else:
        print("idle", flush=True)
        if action == "late":  # put into slot 1 (its first put: generation 1) once told to
            sys.stdin.readline()
            writer.next = 1
            writer.put([rows])
            torch.cuda.synchronize()
            print("put", flush=True)
        time.sleep(60)
""")


def _writer(tmp_path, ring, action: str) -> subprocess.Popen:
    handles = tmp_path / f"ring_{action}.pickle"
    handles.write_bytes(pickle.dumps(ring.share()))
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(handles), action], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    ring.new_writer(child.pid)
    assert child.stdout.readline().split()[0] in ("put", "idle")
    return child


def test_a_device_wait_ends_landed_poisoned_cancelled_or_timed_out(tmp_path):
    from shardd.engine.kernels import ring as kernels
    from shardd.server.ring import DeviceRing, front_end_waits

    if not front_end_waits():
        pytest.skip("this driver has no stream memory operations")
    device = torch.device("cuda", 0)
    ring = DeviceRing(8, 64, torch.bfloat16, device)
    try:
        child = _writer(tmp_path, ring, "put")
        child.wait(timeout=60)
        rows, wait = ring.await_rows(0, 4, 1, timeout_s=30)
        assert wait.outcome() == kernels.LANDED and wait.landed()
        expected = torch.arange(4 * 64, device=device).reshape(4, 64).to(torch.bfloat16)
        assert torch.equal(rows, expected)

        child = _writer(tmp_path, ring, "poison")  # a new writer: the flags start over
        child.wait(timeout=60)
        _, wait = ring.await_rows(0, 4, 1, timeout_s=30)
        assert wait.outcome() == kernels.POISONED and "ran without its rows" in wait.why()
        assert ring.broken is None

        child = _writer(tmp_path, ring, "late")  # alive, puts only after the bound: the wait ends timed out
        started = time.monotonic()
        _, wait = ring.await_rows(1, 4, 1, timeout_s=0.5)
        assert wait.outcome() == kernels.TIMED_OUT and time.monotonic() - started < 10
        assert ring.broken is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "put"
        assert int(ring.flags[1].item()) == kernels.TIMED_OUT_VALUE  # its late swap lost: the end holds
        child.kill()
        child.wait(timeout=30)

        child = _writer(tmp_path, ring, "idle")
        assert ring.broken is None  # a new RING takes slot rows again
        started = time.monotonic()
        _, wait = ring.await_rows(1, 4, 1, timeout_s=120)  # it dies with the wait queued: cancelled, long before 120 s
        time.sleep(0.2)
        child.kill()
        child.wait(timeout=30)
        assert wait.outcome() == kernels.CANCELLED and time.monotonic() - started < 15
        assert "died" in wait.why()
        torch.cuda.synchronize()  # nothing of this process's stream is left waiting
    finally:
        ring.close()
