"""The `shardd serve` daemons of scripts/bench_gpu.py's parts: started (under py-spy where asked), waited for and
stopped, and py-spy's stacks of them read back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench_measure import BLOCK

ROOT = Path(__file__).resolve().parent.parent
PYSPY_RATE = 1000  # samples a second: ~19 a verify step
PYSPY_STEADY = {"within": "serve_loop", "without": ("_capture", "prefill", "_freeze_heap")}


def e2e_devices(args) -> list[str]:
    """The daemons' devices: --e2e-devices, or every daemon on cuda:0 when only one GPU is there (they share it;
    a pipeline step runs its shards one after the other anyway)."""
    devices = args.e2e_devices.split(",")
    if any(d.startswith("cuda") for d in devices):
        import torch

        if torch.cuda.device_count() < len(set(devices)):
            devices = ["cuda:0"] * len(devices)
    return devices


def halves_and_prompt(args) -> tuple[list[tuple[int, int]], list[int]]:
    """The preset's layers in two halves (the two target daemons' ranges) and the seeded random prompt of
    --prompt-len tokens that the daemon parts decode."""
    import torch

    from common.presets import preset_config

    config = preset_config(args.preset)
    half = config.num_layers // 2
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    return [(0, half), (half, config.num_layers)], prompt


def stop_processes(processes: list, profiled: bool = False) -> None:
    """SIGTERM to every daemon first, so they stop in parallel, then wait (60 s at most) for each. `profiled`: each
    process is a py-spy whose child is the daemon: the daemon gets the SIGTERM (py-spy writes its stacks when its
    child exits)."""
    for process in processes:
        if profiled and process.poll() is None:
            for pid in child_pids(process.pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        else:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_for_hello(daemons: list[tuple[str, subprocess.Popen, str, Path]], timeout_s: float = 600,
                   stop: list | None = None) -> None:
    """Waits until every daemon, (name, process, endpoint, log), answers HELLO; raises with the tail of its log when
    one exits first or `timeout_s` (for all of them) passes, after stopping the processes `stop` names."""
    from coordinator.relay.client import ShardClient, ShardTimeout

    deadline = time.monotonic() + timeout_s
    try:
        for name, process, endpoint, log in daemons:
            client = ShardClient(endpoint, timeout_s=1.0)
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not come up: " + log.read_text()[-2000:])
                try:
                    client.hello(timeout_s=0.5)
                    break
                except ShardTimeout:
                    continue
            client.close()
    except BaseException:
        stop_processes(stop or [])
        raise


def without_prefix_cache(extra) -> list[str]:
    """The daemons of every part but `prefix` keep no prefix entries: repeated prompts measure the prefill itself, and
    the scheduler's prompt chunk stays its default (coordinator.scheduler)."""
    return [] if "--prefix-cache-gib" in extra else ["--prefix-cache-gib", "0"]


def start_daemons(args, ranges, mode: str, run_dir: Path, *, devices: list[str] | None = None,
                  env: dict | None = None, tag: str = "", tcp_ports: list[int] | None = None, max_sequences: int = 2,
                  extra: list[str] = (), direct_rows: bool = False, pyspy: list[Path] | None = None) -> tuple[list, list[str]]:
    """`shardd serve` per range, one GPU each, on ipc:// endpoints (tcp on loopback with `tcp_ports`); returns
    (processes, endpoints) once all are ready. `direct_rows`: each daemon but the last sends its rows straight to
    the next (--relay-to)."""
    devices = devices or args.e2e_devices.split(",")
    processes = []
    endpoints = [f"tcp://127.0.0.1:{tcp_ports[index]}" if tcp_ports else f"ipc://{run_dir}/shard{index}-{mode}{tag}.sock"
                 for index in range(len(ranges))]
    logs = [run_dir / f"shard{index}-{mode}{tag}.log" for index in range(len(ranges))]
    ready = 0  # daemons known to serve

    def wait_ready(upto: int) -> None:
        nonlocal ready
        wait_for_hello([(endpoints[i], processes[i], endpoints[i], logs[i]) for i in range(ready, upto)], stop=processes)
        ready = upto

    for index, layer_range in enumerate(ranges):
        endpoint = endpoints[index]
        if devices[index].startswith("cuda") and devices[index] in devices[ready:index]:
            # a GPU another daemon is still loading onto: one load at a time, so their transients never add up
            wait_ready(index)
        relay = ["--relay-to", endpoints[index + 1]] if direct_rows and index + 1 < len(ranges) else []
        log = open(logs[index], "w")
        # a range of None: a daemon that hosts only the synthetic DFlash drafter
        # The fast step of the one-process reference (a FastShard of BLOCK rows): a token's bits are a function of
        # the step's shape (cuBLAS picks its kernel by the rows), so one process and the daemons compare bit for bit
        # only when their R is the same, and the relay figure is then the split's cost alone.
        same_step = ["--step-rows", str(BLOCK)] if args.e2e_engine == "fast" and "--step-rows" not in extra else []
        layers = ["--layers", "none", "--draft", "synthetic"] if layer_range is None else [
            "--layers", f"{layer_range[0]}:{layer_range[1]}", "--engine", args.e2e_engine,
            *(["--quantize", args.fp8] if args.fp8 else []),
            "--rollback-mode", mode, "--max-verify-tokens", str(BLOCK), *same_step]
        command = [sys.executable, "-m", "shardd", "serve", "--synthetic", f"{args.preset}:{args.seed}", *layers,
                   "--device", devices[index], "--dtype", args.e2e_dtype, "--bind", endpoint, "--max-sequences", str(max_sequences),
                   "--max-context", str(args.prompt_len + args.tokens + 4 * BLOCK), *relay, *extra,
                   *without_prefix_cache(extra)]
        if devices[index] == "cpu":  # a CPU check: one torch thread per daemon, as the tests start them
            command += ["--threads", "1"]
        if pyspy is not None:
            command = under_pyspy(command, pyspy[index])
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                          env={**os.environ, **(env or {})}))
    wait_ready(len(processes))
    return processes, endpoints


def under_pyspy(command: list[str], stacks: Path) -> list[str]:
    """`command` with py-spy as its parent (attaching to a sibling needs ptrace rights it may lack), its stacks into
    `stacks`. --nonblocking: sampling pauses nothing (--native pauses the daemon per sample: PYSPY_NATIVE=1; on the
    GPU host it slowed a daemon's start past a 330 s limit)."""
    mode_flag = "--native" if os.environ.get("PYSPY_NATIVE") == "1" else "--nonblocking"
    return ["py-spy", "record", mode_flag, "--threads", "-r", str(PYSPY_RATE), "-f", "raw", "-o", str(stacks), "--",
            *command]


def serve_processes(args, specs: dict[str, list[str]], run_dir: Path, *, max_sequences: int = 2,
                    rollback: str = "checkpoint", pyspy: Path | None = None,
                    chained: bool = False) -> tuple[list, dict[str, str]]:
    """`shardd serve` per named spec (extra arguments), every one on `--dflash-device`; waits for every HELLO.
    `pyspy`: each daemon under py-spy, its stacks in NAME.txt there (stop them with `profiled=True`). `chained`: the
    specs in order are one pipeline whose shards send their rows on to the next (`--relay-to` under one relay key,
    as `shardctl launch` starts them: PROTOCOL.md, "Rows from shard to shard")."""
    from coordinator.launch import write_relay_key

    processes, endpoints = [], {}
    loading = []  # (name, process, endpoint, log) of the daemons not yet known to serve
    names = list(specs)
    relay_key = ["--relay-key", str(write_relay_key(run_dir / "relay.key"))] if chained else []
    for index, (name, extra) in enumerate(specs.items()):
        endpoint = f"ipc://{run_dir}/{name}.sock"
        if chained:
            following = [] if index == len(names) - 1 else ["--relay-to", f"ipc://{run_dir}/{names[index + 1]}.sock"]
            extra = [*extra, *relay_key, *following]
        log = open(run_dir / f"{name}.log", "w")
        command = [sys.executable, "-m", "shardd", "serve", "--synthetic", f"{args.preset}:{args.seed}",
                   "--device", args.dflash_device, "--dtype", args.dflash_dtype, "--engine", args.dflash_engine, "--bind", endpoint,
                   "--rollback-mode", rollback, "--max-verify-tokens", str(BLOCK), "--max-sequences", str(max_sequences),
                   "--max-context", str(args.prompt_len + args.tokens + 4 * BLOCK), *extra, *without_prefix_cache(extra)]
        if pyspy is not None:
            command = under_pyspy(command, pyspy / f"{name}.txt")
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        endpoints[name] = endpoint
        loading.append((name, processes[-1], endpoint, run_dir / f"{name}.log"))
        if args.dflash_device.startswith("cuda"):  # one load at a time on the shared GPU: their transients never add up
            wait_for_hello(loading, stop=processes)
            loading = []
    wait_for_hello(loading, stop=processes)
    return processes, endpoints


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (py-spy's child: the program it profiles)."""
    return [int(child) for task in Path(f"/proc/{pid}/task").glob("*")
            for child in (task / "children").read_text().split()]


def pyspy_top(path: Path, top: int = 40, within: str | None = None, without: tuple[str, ...] = ()) -> dict:
    """py-spy's collapsed stacks (`-f raw --threads`: "thread (0x..) [name];frame;frame count" per line) -> per
    thread with samples, its share of them, the `top` frames by the share of that thread's samples they are on
    (inclusive) and the innermost frames by theirs, the busiest four threads first. Only the stacks with a frame
    starting `within` (where given) and none containing a string of `without` count: a steady state's samples."""
    threads: dict[str, Counter] = {}  # inclusive
    leaves: dict[str, Counter] = {}  # the innermost frame (where the samples land)
    totals: Counter = Counter()
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        return {"error": str(error)}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if (within is not None and not any(frame.startswith(within) for frame in frames)) or \
                any(part in stack for part in without):
            continue
        thread, n = frames[0], int(count)
        totals[thread] += n
        leaf = re.sub(r":\d+\)$", ")", frames[-1])
        leaves.setdefault(thread, Counter())[leaf] += n
        seen = set()
        for frame in frames[1:]:
            name = re.sub(r":\d+\)$", ")", frame)  # one entry per function, whatever the line
            if name not in seen:
                seen.add(name)
                threads.setdefault(thread, Counter())[name] += n
    everything = sum(totals.values()) or 1
    return {thread: {"share_of_samples": round(n / everything, 3),
                     "top": [[name, round(c / n, 3)] for name, c in threads.get(thread, Counter()).most_common(top)],
                     "innermost": [[name, round(c / n, 3)]
                                   for name, c in leaves.get(thread, Counter()).most_common(20)]}
            for thread, n in totals.most_common(4)}
