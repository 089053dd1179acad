"""The two-daemon parts of scripts/bench_gpu.py: `e2e` (the split as shardctl ships it), `relay` (where a step's
time goes, and the arms beside it) and `relay-dflash` (a drafter daemon on the same path); `--parts e2e,relay`."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_daemons import PYSPY_RATE, PYSPY_STEADY, e2e_devices, halves_and_prompt, pyspy_top, start_daemons, stop_processes
from bench_measure import BLOCK, MEAN_COMMIT, median_ms, token_hash


# ---- e2e: two daemons on two GPUs ------------------------------------------------------------------------


def run_e2e(args) -> dict:
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import OracleDrafter
    from coordinator.relay.pipeline import Pipeline

    ranges, prompt = halves_and_prompt(args)
    devices = e2e_devices(args)
    out: dict = {"e2e_layers": [list(r) for r in ranges], "e2e_devices": devices}
    hashes: dict = {}
    tok_s: dict = {}
    step_ms: dict = {}
    reference = None
    run_dir = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    for storage_mode, modes in (("checkpoint", ("checkpoint", "replay", "checkpoint")), ("replay-ssm", ("replay-ssm", "replay-ssm"))):
        processes, endpoints = start_daemons(args, ranges, storage_mode, run_dir, devices=devices,
                                             direct_rows=SHIPPED_DIRECT_ROWS)
        try:  # the split as shipped (SHIPPED_*: rows shard to shard, both ends polling where the host allows)
            with Pipeline.connect(endpoints, timeout_s=600, busy_poll_s=SHIPPED_BUSY_POLL_S) as pipeline:
                out.setdefault("e2e_engine", [info.hello.get("engine") for info in pipeline.shards])
                if reference is None:
                    greedy_decode(pipeline, 98, prompt[:32], 4)
                    greedy = greedy_decode(pipeline, 1, prompt, args.tokens)
                    hashes["e2e/greedy"] = token_hash(greedy.tokens)
                    out["e2e_greedy_ms_per_token"] = round(greedy.decode_seconds / len(greedy.tokens) * 1e3, 3)
                    reference = greedy.tokens
                else:
                    greedy_decode(pipeline, 98, prompt[:32], 4)  # warm-up: capture this pair's graphs
                for mode in modes:
                    drafter = OracleDrafter.with_mean_commit(reference, len(prompt), block_size=BLOCK, mean_commit=MEAN_COMMIT)
                    result = speculative_decode(pipeline, 2, prompt, drafter, block_size=BLOCK, rollback=mode, max_new_tokens=args.tokens)
                    tok_s.setdefault(mode, []).append(len(result.tokens) / result.decode_seconds)
                    step_ms.setdefault(mode, []).append(result.decode_seconds / result.steps * 1e3)
                    hashes[f"e2e/{mode}"] = token_hash(result.tokens)
                    print(f"e2e {mode}: {tok_s[mode][-1]:.1f} tok/s", flush=True)
        finally:
            stop_processes(processes)
    out["e2e_tok_s"] = {mode: round(statistics.median(v), 2) for mode, v in tok_s.items()}
    out["e2e_step_ms"] = {mode: round(statistics.median(v), 3) for mode, v in step_ms.items()}
    out["hashes"] = hashes
    return out


# ---- relay: where a two-daemon step's time goes ----------------------------------------------------------


def phase_readings(pipeline, extra=()) -> tuple[list[dict], list[dict]]:
    """The daemons' STATS phases and the coordinator's client phases, one reading per shard (and `extra` client)."""
    clients = [*pipeline.clients, *extra]
    return [client.stats()["phases"] for client in clients], [client.phases.totals() for client in clients]


def shard_phases(before, after) -> list[dict]:
    """Per shard, {"daemon": ..., "client": ...} per_step_phases between two phase_readings, a step being one
    FORWARD or CAPTURE the first shard handled."""
    from protocol.timing import per_request_ms

    first = per_request_ms(before[0][0], after[0][0])
    steps = max(1, sum(row["requests"] for mtype, row in first.items() if mtype in ("FORWARD", "CAPTURE")))
    return [{"daemon": per_step_phases(d0, d1, steps), "client": per_step_phases(c0, c1, steps)}
            for d0, d1, c0, c1 in zip(before[0], after[0], before[1], after[1])]


def per_step_phases(before: dict, after: dict, steps: int) -> dict:
    """{type: {"requests": per step, phase: ms per step}} of what happened between two phase readings."""
    from protocol.timing import per_request_ms

    out = {}
    for mtype, row in per_request_ms(before, after).items():
        if mtype in ("STATS", "HELLO", "OPEN", "CLOSE"):  # the readings themselves, and once per sequence
            continue
        n = row.pop("requests")
        out[mtype] = {"requests": round(n / steps, 3), **{phase: round(ms * n / steps, 4) for phase, ms in row.items()}}
    return out


def relay_breakdown(result, before, after, drafter_is_a_client: bool = False) -> dict:
    """One decode's steps: per shard, the daemon's phases and the coordinator's phases of its requests (ms per
    step), the transport (coordinator wait minus the daemon's whole handling), and what is left of the step."""
    steps = max(result.steps, 1)
    step_ms = result.decode_seconds / steps * 1e3
    # a daemon-hosted drafter's time is its client's phases (one of the shards here), not counted twice
    shards, accounted = [], 0.0 if drafter_is_a_client else result.draft_seconds / steps * 1e3
    for index in range(len(before[0])):
        daemon = per_step_phases(before[0][index], after[0][index], steps)
        client = per_step_phases(before[1][index], after[1][index], steps)
        transport = {}
        for mtype, row in client.items():
            handled = sum(v for k, v in daemon.get(mtype, {}).items() if k != "requests")
            transport[mtype] = round(row.get("wait", 0.0) - handled, 4)
            accounted += sum(v for k, v in row.items() if k != "requests")
        # with ROLLBACKs pipelined behind the next FORWARD, only a shard's sum over its types is a delivery time
        shards.append({"daemon": daemon, "coordinator": client, "transport": transport,
                       "transport_ms": round(sum(transport.values()), 4)})
    return {"steps": result.steps, "step_ms": round(step_ms, 3), "draft_ms": round(result.draft_seconds / steps * 1e3, 4),
            "shards": shards, "coordinator_other_ms": round(step_ms - accounted, 4)}


def round_trip_ms(client, count: int = 200) -> float:
    """Median wall time of a STATS round trip: the transport and both ends' Python, no device work."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        client.stats()
        samples.append(time.perf_counter() - start)
    return median_ms(samples)


def daemon_profile_top(path: Path, top: int = 25) -> list[str]:
    """The functions with the most own time in a daemon's cProfile dump (SHARDD_PROFILE)."""
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(str(path), stream=text).sort_stats("tottime").print_stats(top)
    lines = [line.rstrip() for line in text.getvalue().splitlines()]
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return [line for line in lines[start:] if line.strip()]


# the relay's arms beside its shipped runs: tag -> (JSON key, extra `shardd serve` arguments)
# The headline two-daemon runs (the e2e and relay parts' e2e_* keys, relay_ms_per_step, e2e_vs_local) run the split
# as shardctl ships it: each shard's rows straight to the next (--relay-to, on a GPU through its device ring), the
# daemons' --busy-poll-ms left at its default (auto: polling on a GPU host with the CPUs for it) and the coordinator
# following its daemons (Pipeline.connect(busy_poll_s=None)). The arms below change one thing each; `-plain` is
# the split with neither (rows through the coordinator, nobody polling).
SHIPPED_DIRECT_ROWS = True
SHIPPED_BUSY_POLL_S = None  # the coordinator follows its daemons' HELLO
SHIPPED_TAGS = ("", "-direct-busy-timeline", "-direct-busy-pyspy")  # the headline runs and the profiled ones

RELAY_ARMS = {
    "-plain": ("relay_plain", []),
    "-busy": ("relay_busy_poll", []),
    "-direct": ("relay_direct", []),
    "-direct-busy": ("relay_direct_busy_poll", []),
}


def run_relay(args) -> dict:
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import OracleDrafter
    from coordinator.relay.pipeline import Pipeline

    ranges, prompt = halves_and_prompt(args)
    devices = e2e_devices(args)
    # the headline runs (tag "") as shipped (SHIPPED_*); an arm's daemons poll (--busy-poll-ms) or sleep (0) as
    # its tag says
    out: dict = {"relay_devices": devices, "relay_shipped": {"direct_rows": SHIPPED_DIRECT_ROWS,
                                                             "busy_poll_ms": "auto (the daemons' HELLO)"}}
    by_phase: dict = {}
    hashes: dict = {}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    runs = [] if args.arms_only else [(mode, {}, "") for mode in ("checkpoint", "replay-ssm")]
    if args.timeline:  # the shipped arm once more with GPU stamps (slower by their kernels: apart from the timed runs)
        runs.append(("checkpoint", {"SHARDD_TIMELINE": str(TIMELINE_STAMPS)}, "-direct-busy-timeline"))
    if args.daemon_profile:  # a short extra run under cProfile: slower, so apart from the timed runs
        Path(args.daemon_profile).mkdir(parents=True, exist_ok=True)
        runs.append(("checkpoint", {"SHARDD_PROFILE": str(Path(args.daemon_profile).resolve())}, "-profiled"))
    # the same runs, side by side in one JSON: both ends polling without sleeping (-busy), the rows going from
    # daemon to daemon (-direct: --relay-to; on a GPU through the next shard's device ring), and both (-direct-busy)
    if args.relay_arms:
        wanted = [f"-{name}" for name in args.relay_arms.split(",") if name]
        unknown = [tag for tag in wanted if tag not in RELAY_ARMS]
        if unknown:
            raise SystemExit(f"--relay-arms: unknown {unknown}; known: {[tag[1:] for tag in RELAY_ARMS]}")
    else:  # the plain split beside the shipped one; --busy-poll-ms / --direct-rows add the arms of one lever
        wanted = ["-plain"] + [tag for tag in ("-busy", "-direct", "-direct-busy")
                               if ("busy" not in tag or args.busy_poll_ms) and ("direct" not in tag or args.direct_rows)]
    arms = {tag: RELAY_ARMS[tag][0] for tag in wanted}
    runs += [(mode, {}, tag) for tag in wanted for mode in ("checkpoint", "replay-ssm")]
    if args.pyspy:  # the shipped arm once more, each daemon under py-spy: last, so a slow profile costs no timed run
        runs.append(("checkpoint", {}, "-direct-busy-pyspy"))
    for mode, env, tag in runs:
        shipped = tag in SHIPPED_TAGS
        busy, direct = "busy" in tag, "direct" in tag or (shipped and SHIPPED_DIRECT_ROWS)
        poll = [] if shipped else ["--busy-poll-ms", str(args.busy_poll_ms if busy else 0)]
        spied = None
        if "pyspy" in tag:
            Path(args.pyspy).mkdir(parents=True, exist_ok=True)
            spied = [Path(args.pyspy).resolve() / f"shard{index}.txt" for index in range(len(ranges))]
        try:
            processes, endpoints = start_daemons(args, ranges, mode, run_dir, devices=devices, env=env, tag=tag,
                                                 extra=[*poll, *RELAY_ARMS.get(tag, ("", []))[1]],
                                                 direct_rows=direct, pyspy=spied)
        except RuntimeError as error:  # the profiled run alone may fail (py-spy missing or refused): the rest stands
            if spied is None:
                raise
            out["relay_pyspy"] = {"error": str(error)[-2000:]}
            continue
        try:
            coordinator_poll = SHIPPED_BUSY_POLL_S if shipped else args.busy_poll_ms / 1000 if busy else 0
            with Pipeline.connect(endpoints, timeout_s=600, busy_poll_s=coordinator_poll) as pipeline:
                assert pipeline.direct_rows == direct, "the daemons' --relay-to does not name the next shard"
                greedy_decode(pipeline, 98, prompt[:32], 4)  # warm-up: capture the graphs
                if "SHARDD_TIMELINE" in env:
                    out["relay_timeline"] = timeline_run(pipeline, prompt, args)
                    continue
                if spied is not None:
                    pyspy_decodes(pipeline, prompt, args, spied[0].with_name("coordinator.txt"))
                    continue
                if shipped and "daemons_busy_poll_ms" not in out["relay_shipped"]:
                    out["relay_shipped"]["daemons_busy_poll_ms"] = [info.hello.get("busy_poll_ms") for info in pipeline.shards]
                if tag in arms:
                    settings = {"busy_poll_ms": args.busy_poll_ms if busy else 0.0, "direct_rows": direct,
                                "daemon_args": RELAY_ARMS[tag][1]}
                    out.setdefault(arms[tag], settings).update(arm_run(pipeline, prompt, mode, args, hashes, tag))
                    continue
                if tag:
                    reference = greedy_decode(pipeline, 1, prompt, min(args.tokens, 32)).tokens
                    drafter = OracleDrafter.with_mean_commit(reference, len(prompt), block_size=BLOCK, mean_commit=MEAN_COMMIT)
                    speculative_decode(pipeline, 2, prompt, drafter, block_size=BLOCK, rollback=mode,
                                       max_new_tokens=len(reference))
                    continue
                out.setdefault("relay_round_trip_ms", [round_trip_ms(client) for client in pipeline.clients])
                run = arm_run(pipeline, prompt, mode, args, hashes, tag)
                # the e2e part's keys too (summarize() turns them into relay_ms_per_step and e2e_vs_local)
                out.setdefault("e2e_tok_s", {})[mode] = run[f"e2e_tok_s_{mode}"]
                out.setdefault("e2e_step_ms", {})[mode] = run[f"e2e_step_ms_{mode}"]
                if "e2e_greedy_ms_per_token" in run:
                    out["e2e_greedy_ms_per_token"] = run["e2e_greedy_ms_per_token"]
                by_phase.update(run[f"relay_by_phase_{mode}"])
        finally:
            stop_processes(processes, profiled=spied is not None)
    if args.pyspy and "relay_pyspy" not in out:  # py-spy wrote each daemon's stacks when it exited
        # the daemons' serving loop only, without the graphs' capture and the prompts' prefill (the decodes' steps)
        out["relay_pyspy"] = {path.stem: pyspy_top(path, **({} if path.stem == "coordinator" else PYSPY_STEADY))
                              for path in sorted(Path(args.pyspy).resolve().glob("*.txt"))}
    out["relay_by_phase"] = by_phase
    if args.daemon_profile:
        out["daemon_profile_top"] = {path.name: daemon_profile_top(path) for path in sorted(Path(args.daemon_profile).glob("*.prof"))}
    out["hashes"] = hashes
    return out


def pyspy_decodes(pipeline, prompt, args, coordinator_file: Path) -> None:
    """Greedy and speculative (checkpoint) decodes over daemons each under py-spy (PYSPY_NATIVE=1: the CUDA
    driver's frames too), with the coordinator (this process) under a py-spy attached to it where this host lets it. Their
    busiest frames (`relay_pyspy`: bench_batch.pyspy_top, per thread) say where the host work between two GPU
    steps goes, function by function."""
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import OracleDrafter

    try:
        coordinator = subprocess.Popen(["py-spy", "record", "--nonblocking", "--threads", "-r", str(PYSPY_RATE), "-f", "raw",
                                        "-o", str(coordinator_file), "--pid", str(os.getpid())],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # attached before the decodes
    except OSError:
        coordinator = None
    reference = greedy_decode(pipeline, 1, prompt, args.tokens).tokens
    for _ in range(4):
        greedy_decode(pipeline, 1, prompt, args.tokens)
        drafter = OracleDrafter.with_mean_commit(reference, len(prompt), block_size=BLOCK, mean_commit=MEAN_COMMIT)
        speculative_decode(pipeline, 2, prompt, drafter, block_size=BLOCK, rollback="checkpoint",
                           max_new_tokens=args.tokens)
    if coordinator is not None:
        coordinator.send_signal(signal.SIGINT)
        try:
            coordinator.wait(timeout=60)
        except subprocess.TimeoutExpired:
            coordinator.kill()


TIMELINE_STAMPS = 16384  # per daemon: a timeline run's three greedy and three speculative decodes fit


def timeline_run(pipeline, prompt, args) -> dict:
    """The two daemons' GPU timelines (shardd/obs/timeline.py) over greedy and speculative (checkpoint) decodes: per
    kind, the median intervals of a step (relay_step_intervals)."""
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import OracleDrafter

    windows = {}
    reference = None
    for kind in ("greedy", "checkpoint"):
        start = time.time_ns()
        for _ in range(3):
            if kind == "greedy":
                reference = greedy_decode(pipeline, 1, prompt, args.tokens).tokens
            else:
                drafter = OracleDrafter.with_mean_commit(reference, len(prompt), block_size=BLOCK, mean_commit=MEAN_COMMIT)
                speculative_decode(pipeline, 2, prompt, drafter, block_size=BLOCK, rollback="checkpoint",
                                   max_new_tokens=args.tokens)
        windows[kind] = (start, time.time_ns())
    reports = [stats["timeline"] for stats in pipeline.stats()]
    return {kind: relay_step_intervals(reports, *window) for kind, window in windows.items()}


def relay_step_intervals(reports: list[dict], start_ns: int, end_ns: int) -> dict:
    """Two daemons' timelines (STATS `timeline`: the first shard's, the second's; one GPU, one clock) between two
    host times -> median microseconds of each interval of a step, from one first-shard step start to the next:
    first_step (its kernels), put (rows into the next shard's ring, publish), wait_queued_late (the second shard's
    wait reached its stream after the publish; <= 0: in time), noticed (the publish to the wait's end), to_step
    (the wait's end to its step: the rows' copy), second_step, reply (its step's end to its reply sent, host),
    coordinator (that reply to the first shard's next receive, host), launch (that receive to its next step start),
    cycle; `steps`: the cycles paired."""
    first, second = reports
    offset = first["offset_ns"]

    def gpu_events(report):
        return [(ns, label) for label, ns in report["gpu"] if start_ns + offset <= ns <= end_ns + offset]

    def host_events(report):  # on the GPU clock
        return [(ns + report["offset_ns"], label) for label, ns in report["host"] if start_ns <= ns <= end_ns]

    a, b = gpu_events(first), gpu_events(second)
    a_host, b_host = host_events(first), host_events(second)

    def after(events, t, label, before=None):
        return next((ns for ns, name in events if ns >= t and name.startswith(label) and (before is None or ns < before)), None)

    def last_before(events, t, label, since):
        found = [ns for ns, name in events if since <= ns < t and name.startswith(label)]
        return found[-1] if found else None

    starts = [ns for ns, label in a if label == "step start"]
    intervals: dict = {}
    for start, following in zip(starts, starts[1:]):
        a_end = after(a, start, "step end", following)
        published = a_end and after(a, a_end, "published", following)
        done = published and after(b, published, "wait done", following)
        queued = done and last_before(b, done, "wait queued", 0)  # the stamp just before it on that stream
        b_start = done and after(b, done, "step start", following)
        b_end = b_start and after(b, b_start, "step end", following)
        sent = b_end and after(b_host, b_end, "sent", following)  # its reply (a ROWS's, when its FORWARD waited)
        received = sent and last_before(a_host, following, "receive", sent)
        if not all((a_end, published, done, queued, b_start, b_end, sent, received)):
            continue  # a step without a ring put (the prefill's chunks), or one cut by the window
        cycle = {"first_step": a_end - start, "put": published - a_end, "wait_queued_late": queued - published,
                 "noticed": done - max(published, queued), "to_step": b_start - done, "second_step": b_end - b_start,
                 "reply": sent - b_end, "coordinator": received - sent, "launch": following - received,
                 "cycle": following - start}
        for name, ns in cycle.items():
            intervals.setdefault(name, []).append(ns / 1e3)
    out = {name: round(statistics.median(values), 1) for name, values in intervals.items()}
    out["steps"] = len(intervals.get("cycle", []))
    return out


def arm_run(pipeline, prompt, mode: str, args, hashes: dict, tag: str) -> dict:
    """Greedy and speculative (oracle) through one run's daemons: the runs as shipped (tag ""; run_relay files
    the figures under the e2e keys) and the arms (nobody polling and the rows through the coordinator, polling,
    the rows from daemon to daemon, or both: under the arm's key, `relay_plain`, `relay_busy_poll`, `relay_direct`,
    `relay_direct_busy_poll`; summarize() sets their relay
    against the one-process step). The greedy figures and phases (`relay_by_phase_<mode>`) with checkpoint."""
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import OracleDrafter

    out, readings, by_phase = {}, [], {}

    def after_prefill(tokens):  # the first commit is the prefill's: read the clocks once, there
        if not readings:
            readings.append(phase_readings(pipeline))

    if mode == "checkpoint":
        greedy = greedy_decode(pipeline, 1, prompt, args.tokens, on_commit=after_prefill)
        hashes[f"relay{tag}/greedy"] = token_hash(greedy.tokens)
        out["e2e_greedy_ms_per_token"] = round(greedy.decode_seconds / len(greedy.tokens) * 1e3, 3)
        by_phase["greedy"] = relay_breakdown(greedy, readings.pop(), phase_readings(pipeline))
        reference = greedy.tokens
    else:
        reference = greedy_decode(pipeline, 1, prompt, args.tokens).tokens
    drafter = OracleDrafter.with_mean_commit(reference, len(prompt), block_size=BLOCK, mean_commit=MEAN_COMMIT)
    result = speculative_decode(pipeline, 2, prompt, drafter, block_size=BLOCK, rollback=mode,
                                max_new_tokens=args.tokens, on_commit=after_prefill)
    hashes[f"relay{tag}/{mode}"] = token_hash(result.tokens)
    by_phase[mode] = relay_breakdown(result, readings.pop(), phase_readings(pipeline))
    step_ms = round(result.decode_seconds / result.steps * 1e3, 3)
    print(f"relay {mode}{f' ({tag[1:]})' if tag else ''}: {step_ms} ms per step", flush=True)
    return {**out, f"e2e_tok_s_{mode}": round(len(result.tokens) / result.decode_seconds, 2),
            f"e2e_step_ms_{mode}": step_ms, f"relay_by_phase_{mode}": by_phase}


# ---- dflash: the drafter on the same path, three daemons ---------------------------------------------------


DFLASH_MODES = ("checkpoint",)  # one mode: three daemons start per mode, and the relay is the same in both


def run_dflash_relay(args) -> dict:
    """Two target shards and a daemon hosting the synthetic DFlash drafter (three daemons; on one GPU when one is
    there): CAPTURE features and PROPOSE ride the same relay as FORWARD and ROLLBACK. `e2e_dflash_step_ms` per
    rollback mode, and where the step's time goes (`dflash_relay_by_phase`, the drafter daemon as the last shard).
    The drafter's own compute shows as that daemon's PROPOSE phases."""
    from coordinator.relay.client import ShardClient
    from coordinator.decoding import speculative_decode
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.relay.pipeline import Pipeline

    ranges, prompt = halves_and_prompt(args)
    devices = e2e_devices(args) + [e2e_devices(args)[-1]]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-dflash-"))
    step_ms, tok_s, by_phase, hashes = {}, {}, {}, {}
    for mode in DFLASH_MODES:
        processes, endpoints = start_daemons(args, [*ranges, None], mode, run_dir,
                                             devices=devices, tag="-dflash")
        try:
            with Pipeline.connect(endpoints[:2], timeout_s=600) as pipeline, \
                    ShardClient(endpoints[2], timeout_s=600) as draft_client:
                drafter = DFlashDrafterClient(draft_client, pipeline)
                block = min(BLOCK, drafter.max_block_size)
                speculative_decode(drafter.target, 98, prompt[:32], drafter, block_size=block, rollback=mode,
                                   max_new_tokens=4)  # warm-up
                readings: list = []

                def after_prefill(tokens):
                    if not readings:
                        readings.append(phase_readings(pipeline, [draft_client]))

                result = speculative_decode(drafter.target, 1, prompt, drafter, block_size=block, rollback=mode,
                                            max_new_tokens=args.tokens, on_commit=after_prefill)
                by_phase[mode] = relay_breakdown(result, readings.pop(), phase_readings(pipeline, [draft_client]), True)
                step_ms[mode] = round(result.decode_seconds / result.steps * 1e3, 3)
                tok_s[mode] = round(len(result.tokens) / result.decode_seconds, 2)
                by_phase[mode]["mean_commit"] = round(result.avg_commit, 2)
                hashes[f"dflash/{mode}"] = token_hash(result.tokens)
                print(f"dflash {mode}: {step_ms[mode]} ms per step, mean commit {result.avg_commit:.2f}", flush=True)
        finally:
            stop_processes(processes)
    # whatever the drafts, the verified output is the target's greedy one: the hashes join outputs_identical
    return {"e2e_dflash_step_ms": step_ms, "e2e_dflash_tok_s": tok_s, "dflash_relay_by_phase": by_phase, "hashes": hashes}


def phase_table(by_phase: dict) -> str:
    """relay_by_phase as text: per mode, one line per (shard, request type), ms per step in each phase."""
    daemon_phases = ("receive", "decode", "lookup", "launch", "wait", "copy", "compute", "encode", "send")
    client_phases = ("encode", "send", "wait", "receive", "decode")
    lines = []
    for mode, entry in by_phase.items():
        lines.append(f"{mode}: {entry['step_ms']} ms/step over {entry['steps']} steps; drafter {entry['draft_ms']} ms; "
                     f"coordinator outside the clients {entry['coordinator_other_ms']} ms")
        lines.append("  shard type       n/step | daemon " + " ".join(f"{p[:7]:>7}" for p in daemon_phases)
                     + " | coord " + " ".join(f"{p[:7]:>7}" for p in client_phases) + " | transport")
        for index, shard in enumerate(entry["shards"]):
            for mtype, row in shard["coordinator"].items():
                d = shard["daemon"].get(mtype, {})
                lines.append(f"  {index:>5} {mtype:<9} {row.get('requests', 0):>7} | daemon "
                             + " ".join(f"{d.get(p, 0.0):7.3f}" for p in daemon_phases)
                             + " | coord " + " ".join(f"{row.get(p, 0.0):7.3f}" for p in client_phases)
                             + f" | {shard['transport'].get(mtype, 0.0):7.3f}")
    return "\n".join(lines)
