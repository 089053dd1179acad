"""Does CUDA IPC work between two daemons of this host? (the relay's device-to-device rows)

Two independent processes (this script as `--role writer` and `--role reader`, started apart, as two `shardd serve`
are) over a ZeroMQ pair on ipc://: the reader allocates a ring of row buffers and interprocess events and sends
their handles once; the writer opens them, and per step runs a long kernel, copies its rows into a ring slot,
records its own interprocess event and sends the step's number at once (before the GPU is done). The reader makes
its stream wait for that event (on the device, the host not waiting), sums the slot and records "consumed" for the
writer's next use of the slot. Prints whether every step's sum was the writer's rows, and the host times of the
reader's wait + launch against the writer's kernel (the host must not have waited for it). Then a writer killed
with its rows in flight: whether the reader's wait on its event ends, polled from the host and on the stream.

Usage: python scripts/probe_cuda_ipc.py [--steps 200] [--rows 128] [--hidden 5120]
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import time


def reader(endpoint: str, steps: int, rows: int, hidden: int) -> dict:
    import torch
    import zmq
    from torch.multiprocessing.reductions import reduce_tensor

    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.bind(endpoint)
    ring = torch.zeros((2, rows, hidden), dtype=torch.bfloat16, device="cuda")
    consumed = [torch.cuda.Event(interprocess=True) for _ in range(2)]
    for event in consumed:
        event.record()
    torch.cuda.synchronize()
    rebuild, args = reduce_tensor(ring)
    socket.send(pickle.dumps({"ring": args, "consumed": [e.ipc_handle() for e in consumed]}))
    written = [torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), h) for h in pickle.loads(socket.recv())]
    sums, host_ms = [], []
    for step in range(steps):
        message = socket.recv()
        assert int(message) == step
        started = time.perf_counter()
        slot = step % 2
        torch.cuda.current_stream().wait_event(written[slot])
        sums.append(torch.stack([ring[slot].amin(), ring[slot].amax()]).float())
        consumed[slot].record()
        host_ms.append((time.perf_counter() - started) * 1e3)
        socket.send(b"ack")  # after `consumed` is recorded: the writer may wait for it before its next use
    torch.cuda.synchronize()
    values = [tuple(s.tolist()) for s in sums]
    socket.send(b"done")
    expected = [(float(step + 1), float(step + 1)) for step in range(steps)]  # every element the step's
    wrong = sum(1 for got, want in zip(values, expected) if got != want)
    host_ms.sort()
    return {"steps": steps, "wrong_sums": wrong, "reader_host_ms_median": host_ms[len(host_ms) // 2],
            "reader_host_ms_max": host_ms[-1]}


def writer(endpoint: str, steps: int, rows: int, hidden: int) -> dict:
    import torch
    import zmq
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.connect(endpoint)
    shared = pickle.loads(socket.recv())
    ring = rebuild_cuda_tensor(*shared["ring"])
    consumed = [torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), h) for h in shared["consumed"]]
    written = [torch.cuda.Event(interprocess=True) for _ in range(2)]
    socket.send(pickle.dumps([e.ipc_handle() for e in written]))
    out = torch.empty((rows, hidden), dtype=torch.bfloat16, device="cuda")
    kernel_ms, send_ms = [], []
    acks = 0
    for step in range(steps):
        slot = step % 2
        while acks < step - 1:  # the ROWS that last used this slot was acknowledged (as RowsLink waits)
            assert socket.recv() == b"ack"
            acks += 1
        started = time.perf_counter()
        torch.cuda._sleep(2_000_000)  # ~1 ms of device time: the shard's graph
        out.fill_(step + 1)
        torch.cuda.current_stream().wait_event(consumed[slot])
        ring[slot].copy_(out)
        written[slot].record()
        socket.send(str(step).encode())
        send_ms.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    while True:
        message = socket.recv()
        if message == b"done":
            break
    send_ms.sort()
    return {"writer_host_ms_median": send_ms[len(send_ms) // 2]}


def dead_writer(endpoint: str, wait: str) -> dict:
    """The reader's side of a writer killed with its rows in flight: does a wait on its event ever end?"""
    import torch
    import zmq

    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.bind(endpoint)
    written = torch.cuda.Event(interprocess=True)
    written.record()
    torch.cuda.synchronize()
    socket.send(pickle.dumps(written.ipc_handle()))
    assert socket.recv() == b"recorded"
    started = time.monotonic()
    if wait == "device":
        torch.cuda.current_stream().wait_event(written)
        probe = torch.ones(1, device="cuda") * 2
        done = lambda: torch.cuda.current_stream().query()  # noqa: E731
    else:
        done = written.query
    while not done() and time.monotonic() - started < 8:
        time.sleep(0.01)
    ended = done()
    return {f"dead_writer_{wait}_wait_ended": ended, f"dead_writer_{wait}_wait_s": round(time.monotonic() - started, 3)}


def killed_writer(endpoint: str) -> None:
    import os
    import signal

    import torch
    import zmq

    socket = zmq.Context.instance().socket(zmq.PAIR)
    socket.connect(endpoint)
    written = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), pickle.loads(socket.recv()))
    torch.cuda._sleep(4_000_000_000)  # ~2 s of device time, then the record the reader waits for
    written.record()
    socket.send(b"recorded")
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("reader", "writer", "dead-host", "dead-device", "killed"))
    parser.add_argument("--endpoint")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.role in ("reader", "writer"):
        run = reader if args.role == "reader" else writer
        print(json.dumps(run(args.endpoint, args.steps, args.rows, args.hidden)))
        return 0
    if args.role == "killed":
        killed_writer(args.endpoint)
        return 0
    if args.role:
        print(json.dumps(dead_writer(args.endpoint, args.role.removeprefix("dead-"))))
        return 0
    endpoint = f"ipc://{tempfile.mkdtemp()}/probe"
    common = ["--endpoint", endpoint, "--steps", str(args.steps), "--rows", str(args.rows), "--hidden", str(args.hidden)]
    procs = [subprocess.Popen([sys.executable, __file__, "--role", role, *common], stdout=subprocess.PIPE, text=True)
             for role in ("reader", "writer")]
    result = {"cuda_ipc": False}
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
        if all(p.returncode == 0 for p in procs):
            result = {"cuda_ipc": True, **json.loads(outs[0]), **json.loads(outs[1])}
            result["cuda_ipc"] = result["wrong_sums"] == 0
        else:
            result["returncodes"] = [p.returncode for p in procs]
    except subprocess.TimeoutExpired:
        result["error"] = "timed out"
        for p in procs:
            p.kill()
    print(json.dumps(result), flush=True)
    for wait in ("host", "device"):  # a writer killed with its rows in flight
        endpoint = f"ipc://{tempfile.mkdtemp()}/dead"
        procs = [subprocess.Popen([sys.executable, __file__, "--role", role, "--endpoint", endpoint],
                                  stdout=subprocess.PIPE, text=True) for role in (f"dead-{wait}", "killed")]
        try:
            out = procs[0].communicate(timeout=25)[0]
            result.update(json.loads(out) if procs[0].returncode == 0 else {f"dead_writer_{wait}": "reader failed"})
        except subprocess.TimeoutExpired:
            result[f"dead_writer_{wait}"] = "the reader hung"
        for p in procs:
            p.kill()
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["cuda_ipc"] else 1


if __name__ == "__main__":
    sys.exit(main())
