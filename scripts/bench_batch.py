"""The `batch` parts of scripts/bench_gpu.py: many streams sharing each step through the scheduler.

- `batch-local`: one process, the whole model as one FastShard (bf16, replay-ssm storage for 33 sequences):
  `batch_tok_s` by concurrency 1/4/8/16/32, greedy and with the oracle drafter (mean commit ~7 of 16); then
  the identity checks: each stream equal to the same request alone (greedy, oracle, seeded sampling with the
  ngram drafter), the same prompts equal whatever the concurrency, and the oracle at 8 streams on a
  checkpoint-storage shard sharing the weights.
- `batch-daemons`: two `shardd serve` daemons (layers 0:L/2, L/2:L; both on cuda:0 when there is one GPU),
  `--max-sequences 33`, the first sending each batch's rows to the second (`--relay-to`, as shardctl chains
  them): the same sweep over the Pipeline; then `shardctl serve` over them, 8 streams over HTTP
  against the same 8 streams without HTTP.

Throughput is new tokens of all streams over the wall time from submitting them to the last one's end (prefill
included), 512-token prompts (seeded, one per stream), 64 new tokens each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench_daemons import (child_pids, e2e_devices, free_port, halves_and_prompt, pyspy_top, start_daemons,
                           stop_processes)
from bench_relay import phase_readings, relay_breakdown

CONCURRENCY = (1, 4, 8, 16, 32)
BLOCK = 16
MEAN_COMMIT = 7.0
SAMPLED_STREAMS = 8
ALONE = (0, 5, 31)  # streams also decoded alone, as the identity check


def stream_prompts(args, count: int) -> list[list[int]]:
    """One seeded random prompt of --prompt-len tokens per stream."""
    import torch

    from common.presets import preset_config

    vocab = preset_config(args.preset).vocab_size
    return [torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed + 1 + i)).tolist()
            for i in range(count)]


def run_streams(target, prompts, args, *, references=None, sampling=None, ngram=False, rollback="replay-ssm",
                max_sequences=None, stats=None, wrap=None):
    """The prompts together through one scheduler: (token lists, aggregate tok/s, mean commit). With `stats` (a
    dict) also `decode_tok_s`: the tokens committed after the last prompt's first token, over the time after it
    (the decode steps' rate, without the prefill that dominates the aggregate of 512-token prompts and 64 new
    tokens), `step_ms` (the median stream's decode seconds over its steps) and `steps` (all streams'). `wrap(index,
    oracle)`: the drafter stream `index` decodes with instead of its oracle (with `references`)."""
    from coordinator.drafting.drafters import NgramDrafter, OracleDrafter
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import decode_all

    def drafter(index):
        if references is not None:
            oracle = OracleDrafter.with_mean_commit(references[index], len(prompts[index]), block_size=BLOCK,
                                                    mean_commit=MEAN_COMMIT)
            return wrap(index, oracle) if wrap else oracle
        return NgramDrafter() if ngram else None

    commits: list[tuple[float, bool, int]] = []  # (when, a request's first commit, tokens)
    seen: set[int] = set()

    def on_commit(index):
        def record(ids):
            commits.append((time.perf_counter(), index not in seen, len(ids)))
            seen.add(index)
        return record

    requests = [Request(prompt, args.tokens, sampling=sampling, drafter=drafter(i), block_size=BLOCK,
                        on_commit=on_commit(i)) for i, prompt in enumerate(prompts)]
    started = time.perf_counter()
    results = decode_all(target, requests, max_sequences=max_sequences or len(prompts), rollback=rollback,
                         batch_rows=args.batch_rows, prefill_chunk=getattr(args, "prefill_chunk", None))
    ended = time.perf_counter()
    seconds = ended - started
    if stats is not None:
        prefilled = max((when for when, first, _ in commits if first), default=ended)
        after = sum(n for when, first, n in commits if when > prefilled and not first)
        stats["decode_tok_s"] = round(after / (ended - prefilled), 1) if ended > prefilled and after else None
        steps = [r.decode_seconds / r.steps * 1e3 for r in results if r.steps]
        stats["step_ms"] = round(statistics.median(steps), 3) if steps else None
        stats["steps"] = sum(r.steps for r in results)
    commits = [c for r in results for c in r.commits]
    return ([r.tokens for r in results], round(sum(len(r.tokens) for r in results) / seconds, 1),
            round(statistics.mean(commits), 2) if commits else None)


def sweep(target, prompts, args, label: str) -> dict:
    """batch_tok_s by concurrency, greedy then oracle; the tokens of every stream at every concurrency."""
    out = {"tok_s": {"greedy": {}, "oracle": {}}, "decode_tok_s": {"greedy": {}, "oracle": {}}, "mean_commit": {},
           "checks": {}}
    # warm-up: kernels compiled, graphs captured, for every path the sweep takes (each prompt chunk's position,
    # decode and verify steps, rollbacks), so the first measured run (the widest) pays no compilation
    warm = argparse.Namespace(**{**vars(args), "tokens": min(args.tokens, 2 * BLOCK)})
    reference, _, _ = run_streams(target, prompts[:2], warm)
    run_streams(target, prompts[:2], warm, references=reference)
    widest = max(CONCURRENCY)
    stats: dict = {}
    greedy, out["tok_s"]["greedy"][str(widest)], _ = run_streams(target, prompts[:widest], args, stats=stats)
    out["decode_tok_s"]["greedy"][str(widest)] = stats["decode_tok_s"]
    print(f"{label} greedy x{widest}: {out['tok_s']['greedy'][str(widest)]} tok/s "
          f"(decode only {stats['decode_tok_s']})", flush=True)
    for c in CONCURRENCY[:-1]:
        tokens, out["tok_s"]["greedy"][str(c)], _ = run_streams(target, prompts[:c], args, stats=stats)
        out["decode_tok_s"]["greedy"][str(c)] = stats["decode_tok_s"]
        out["checks"][f"greedy_x{c}_equals_x{widest}"] = tokens == greedy[:c]
        print(f"{label} greedy x{c}: {out['tok_s']['greedy'][str(c)]} tok/s (decode only {stats['decode_tok_s']})",
              flush=True)
    for c in CONCURRENCY:
        tokens, out["tok_s"]["oracle"][str(c)], out["mean_commit"][str(c)] = run_streams(target, prompts[:c], args,
                                                                                      references=greedy, stats=stats)
        out["decode_tok_s"]["oracle"][str(c)] = stats["decode_tok_s"]
        out["checks"][f"oracle_x{c}_equals_greedy"] = tokens == greedy[:c]
        print(f"{label} oracle x{c}: {out['tok_s']['oracle'][str(c)]} tok/s, mean commit {out['mean_commit'][str(c)]} "
              f"(decode only {stats['decode_tok_s']})", flush=True)
    out["greedy"] = greedy
    return out


def in_step_prefill(target, prompts, args, checks: dict) -> dict:
    """Greedy aggregate tok/s at 1/8/32 streams with every prompt in chunks of one sequence's step (BLOCK rows)
    inside the batched step beside the decode rows, not through the prefill path: the spare rows of a fixed step
    cost little (the batch-step part times them), so many streams' prompts should go faster so.
    The chunking changes a prompt's bits (the prefill path rounds differently), so its checks compare these runs
    with each other: each stream the same whatever the concurrency."""
    chunked = argparse.Namespace(**{**vars(args), "prefill_chunk": BLOCK})
    tok_s, first = {}, None
    for c in (1, 8, 32):
        tokens, tok_s[str(c)], _ = run_streams(target, prompts[:c], chunked)
        print(f"local greedy x{c}, prompts in {BLOCK}-row chunks in the step: {tok_s[str(c)]} tok/s", flush=True)
        if first is None:
            first = tokens[0]
        else:
            checks[f"prefill_chunk16_x{c}_stream0_equals_x1"] = tokens[0] == first
    return tok_s


def fixed_step(args, fast_shard) -> dict:
    """FastShard's `step_rows` (R, the rows every batched step holds): --daemon-step-rows, else what `shardd serve`
    defaults to; nothing for a FastShard without batched steps."""
    import inspect

    if "step_rows" not in inspect.signature(fast_shard.__init__).parameters:
        return {}
    if args.daemon_step_rows:
        return {"step_rows": args.daemon_step_rows}
    try:
        from shardd.engine.select import DEFAULT_STEP_ROWS
    except ImportError:
        return {}
    return {"step_rows": max(DEFAULT_STEP_ROWS, BLOCK)}


def run_batch_local(args) -> dict:
    import torch

    from coordinator.sampling import Sampling
    from coordinator.scheduler.scheduler import DEFAULT_BATCH_ROWS as SCHEDULER_ROWS
    from protocol.layout import CHECKPOINT, REPLAY_SSM
    from shardd.engine.fast.shard import FastShard
    from shardd.engine.reference import rollback as rb
    from shardd.engine.reference.shard import ShardModel
    from common.presets import preset_config
    from shardd.synthetic.model import synthetic_weights
    from shardd.local import LocalTarget

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    config = preset_config(args.preset)
    context = args.prompt_len + args.tokens + 2 * BLOCK
    started = time.perf_counter()
    weights = synthetic_weights(config, 0, config.num_layers, args.seed, dtype=torch.bfloat16, device=device)
    model = ShardModel(config, weights, 0, config.num_layers, dtype=torch.bfloat16, device=device,
                       storage=rb.RollbackStorage(REPLAY_SSM, BLOCK))
    del weights
    shard = FastShard(model, max_sequences=max(CONCURRENCY) + 1, max_context=context, **fixed_step(args, FastShard))
    out: dict = {"batch_preset": args.preset, "batch_prompt_len": args.prompt_len, "batch_new_tokens": args.tokens,
                 # None: the scheduler's default (at least DEFAULT_BATCH_ROWS; prompts in chunks of half of it)
                 "batch_rows": args.batch_rows, "batch_scheduler_default_rows": SCHEDULER_ROWS,
                 "batch_fixed_step_rows_local": getattr(shard, "batch_rows", None),
                 "batch_build_s": round(time.perf_counter() - started, 1)}
    target = LocalTarget.from_shards([shard], context)
    prompts = stream_prompts(args, max(CONCURRENCY))
    result = sweep(target, prompts, args, "local")
    greedy = result.pop("greedy")
    checks = result.pop("checks")
    for index in ALONE:  # the same request alone
        alone, _, _ = run_streams(target, [prompts[index]], args)
        checks[f"greedy_stream{index}_equals_alone"] = alone[0] == greedy[index]
    sampled = Sampling(temperature=0.8, top_p=0.95, seed=1000)
    together, _, _ = run_streams(target, prompts[:SAMPLED_STREAMS], args, sampling=sampled, ngram=True)
    for index in (0, SAMPLED_STREAMS - 1):
        alone, _, _ = run_streams(target, [prompts[index]], args, sampling=sampled, ngram=True)
        checks[f"sampled_ngram_stream{index}_equals_alone"] = alone[0] == together[index]
    if getattr(args, "prefill_chunk", None) != BLOCK:
        out["batch_tok_s_local_prefill_chunk16"] = in_step_prefill(target, prompts, args, checks)
    out["batch_tok_s_local"] = result["tok_s"]
    out["batch_mean_commit_local"] = result["mean_commit"]
    out["batch_decode_tok_s_local"] = result["decode_tok_s"]
    out["batch_prefill_ms_local"] = prefill_seconds(target, args)
    # last: a second state pool with checkpoint storage beside the first (~27 GiB more) does not fit an 80 GB
    # card, which then measures everything above and says so here
    try:
        checkpointing = LocalTarget.from_shards(
            [shard.sharing_weights(rb.RollbackStorage(CHECKPOINT, BLOCK), max_sequences=9)], context)
        tokens, out["batch_checkpoint_oracle_x8_tok_s"], _ = run_streams(checkpointing, prompts[:8], args,
                                                                        references=greedy, rollback=CHECKPOINT)
        checks["checkpoint_oracle_x8_equals_greedy"] = tokens == greedy[:8]
    except torch.OutOfMemoryError as error:
        out["batch_checkpoint_skipped"] = f"out of memory: {str(error).splitlines()[0][:200]}"
    out["batch_checks_local"] = checks
    out["batch_greedy_digest_local"] = digest(greedy)
    return out


def run_batch_daemons(args) -> dict:
    from coordinator.relay.pipeline import Pipeline

    ranges, _ = halves_and_prompt(args)
    devices = e2e_devices(args)
    prompts = stream_prompts(args, max(CONCURRENCY))
    out: dict = {"batch_daemon_devices": devices}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    # the one process's R, always named: bench_daemons.start_daemons otherwise gives the daemons BLOCK rows (the
    # relay benchmark's one-process reference), and a token's bits follow the step's rows (cuBLAS picks its kernel by
    # them), so daemons_equal_one_process compared two different steps
    from shardd.engine.fast.shard import FastShard

    rows = fixed_step(args, FastShard).get("step_rows")
    extra = ["--step-rows", str(rows)] if rows and args.e2e_engine == "fast" else []
    # chained as shardctl launches them (--relay-to: each batch's rows from shard to shard, one ROWS a step)
    processes, endpoints = start_daemons(args, ranges, "replay-ssm", run_dir, devices=devices,
                                         max_sequences=max(CONCURRENCY) + 1, extra=extra, direct_rows=True)
    try:
        # the coordinator polls as `shardctl generate` does by default (`--busy-poll-ms auto`: as its daemons,
        # where the host has the CPUs; both ends on a dedicated GPU host)
        with Pipeline.connect(endpoints, timeout_s=600, busy_poll_s=None) as pipeline:
            out["batch_step_rows_daemons"] = pipeline.step_rows
            out["batch_daemons_direct_rows"] = pipeline.direct_rows
            out["batch_coordinator_busy_poll_ms"] = [client.busy_poll_s * 1e3 for client in pipeline.clients]
            result = sweep(pipeline, prompts, args, "daemons")
            greedy = result.pop("greedy")
            out["batch_tok_s_daemons"] = result["tok_s"]
            out["batch_mean_commit_daemons"] = result["mean_commit"]
            out["batch_decode_tok_s_daemons"] = result["decode_tok_s"]
            out["batch_checks_daemons"] = result["checks"]
            out["batch_greedy_digest_daemons"] = digest(greedy)
            out["batch_relay_by_phase"] = batch_phases(pipeline, args)
            out["batch_prefill_ms_daemons"] = prefill_seconds(pipeline, args)
            out["batch_prefill_by_phase"] = prefill_phases(pipeline, args)
            streams = 8
            for client in pipeline.clients:  # as `shardctl serve`'s engine waits for replies (--busy-poll-ms 0)
                client.busy_poll_s = 0.0
            # as `shardctl serve` runs them (it chunks prompts by its own default)
            _, direct, _ = run_streams(pipeline, prompts[:streams], argparse.Namespace(**{**vars(args),
                                                                                        "prefill_chunk": None}))
        try:
            out["batch_http"] = http_streams(args, endpoints, prompts[:streams], run_dir)
            out["batch_http"]["http_vs_direct"] = round(out["batch_http"]["tok_s"] / direct, 3)
            if os.environ.get("BENCH_HTTP_PYSPY"):  # where the serve's time goes: a second run, under py-spy
                profiled = http_streams(args, endpoints, prompts[:streams], run_dir,
                                        pyspy=Path(os.environ["BENCH_HTTP_PYSPY"]))
                out["batch_http"]["profiled_tok_s"] = profiled["tok_s"]
                out["batch_http"]["profile_top"] = profiled.get("profile_top")
        except Exception as error:  # noqa: BLE001 - e.g. the serve extra (fastapi, uvicorn, httpx) not installed
            out["batch_http"] = {"streams": streams, "tok_s": None, "error": f"{type(error).__name__}: {error}"}
            print(f"HTTP part failed: {out['batch_http']['error']}", flush=True)
        out["batch_http"]["direct_tok_s"] = direct
    finally:
        stop_processes(processes)
    return out


def _phases_of(pipeline, prompts, args) -> dict:
    """The prompts together once to warm this shape (graphs, prompt positions), then again between two phase
    readings: bench_relay.relay_breakdown of that run (a step = one FORWARD to the first shard), with its wall ms."""

    class Steps:  # what relay_breakdown reads of a decode result
        def __init__(self, steps, seconds):
            self.steps, self.decode_seconds, self.draft_seconds = steps, seconds, 0.0

    run_streams(pipeline, prompts, args)
    before = phase_readings(pipeline)
    started = time.perf_counter()
    run_streams(pipeline, prompts, args)
    seconds = time.perf_counter() - started
    after = phase_readings(pipeline)
    first = after[1][0].get("FORWARD", {}).get("requests", 0) - before[1][0].get("FORWARD", {}).get("requests", 0)
    return {"ms": round(seconds * 1e3, 2), **relay_breakdown(Steps(max(first, 1), seconds), before, after)}


def batch_phases(pipeline, args, concurrency=(1, 8, 32)) -> dict:
    """Where a batched two-daemon decode step's time goes (the two-daemon over one-process miss): greedy streams
    with prompts of one block (so the steps are decode steps), the daemons' STATS phases and the coordinator's
    client phases per step."""
    short = argparse.Namespace(**{**vars(args), "prompt_len": BLOCK})
    prompts = stream_prompts(short, max(concurrency))
    out = {}
    for c in concurrency:
        out[f"x{c}"] = _phases_of(pipeline, prompts[:c], short)
        print(f"daemons greedy x{c}, {BLOCK}-token prompts: {out[f'x{c}']['step_ms']} ms a step over "
              f"{out[f'x{c}']['steps']} steps", flush=True)
    return out


def prefill_seconds(target, args, concurrency=(1, 8)) -> dict:
    """{streams: ms} for that many --prompt-len prompts and one new token each (the prefill steps alone), after a
    warm-up of the same shape: against one process, what the daemons add to a prompt (the aggregate's other part)."""
    single = argparse.Namespace(**{**vars(args), "tokens": 1})
    prompts = stream_prompts(args, max(concurrency))
    out = {}
    for c in concurrency:
        run_streams(target, prompts[:c], single)
        started = time.perf_counter()
        run_streams(target, prompts[:c], single)
        out[str(c)] = round((time.perf_counter() - started) * 1e3, 2)
    return out


def prefill_phases(pipeline, args, concurrency=(1, 8)) -> dict:
    """The daemons' and the coordinator's phases of the prefill steps of `concurrency` --prompt-len prompts (one
    new token each), ms per step: where the time a prompt takes over two daemons beyond one process goes."""
    single = argparse.Namespace(**{**vars(args), "tokens": 1})
    prompts = stream_prompts(args, max(concurrency))
    out = {}
    for c in concurrency:
        out[f"x{c}"] = _phases_of(pipeline, prompts[:c], single)
        print(f"daemons prefill x{c} of {args.prompt_len} tokens: {out[f'x{c}']['ms']} ms in {out[f'x{c}']['steps']} "
              "steps", flush=True)
    return out


def http_streams(args, endpoints, prompts, run_dir: Path, pyspy: Path | None = None,
                 serve_args: Sequence[str] = ("--drafter", "none")) -> dict:
    """`shardctl serve` (with `serve_args`: --drafter none) over the daemons; the prompts as concurrent greedy
    completions: tok/s and each stream's text digest (`stream_digests`). `pyspy`: the serve runs under `py-spy
    record` (its collapsed stacks, every thread, written there) and the result carries `profile_top` (the engine
    thread's busiest frames)."""
    import httpx

    port = free_port()
    log = open(run_dir / "serve.log", "w")
    command = [sys.executable, "-m", "coordinator.cli", "serve", "--shards", ",".join(endpoints), *serve_args,
               "--port", str(port), "--timeout", "600", "--log-level", "warning"]
    if args.batch_rows:
        command += ["--batch-rows", str(args.batch_rows)]
    if pyspy is not None:  # py-spy as the serve's parent (attaching to a sibling needs ptrace rights it may lack)
        command = ["py-spy", "record", "--nonblocking", "--threads", "-r", "250", "-f", "raw", "-o", str(pyspy),
                   "--"] + command
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("shardctl serve did not come up: " + (run_dir / "serve.log").read_text()[-2000:])
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        # one client with a connection per stream, made and connected before the clock starts (as a load generator
        # keeps its connections): a fresh httpx client per request costs milliseconds of the client's own CPU (its
        # SSL context among them), which would spread the requests' arrival and count as the server's time; the
        # threads wait at a barrier and post together, as the run without HTTP submits together
        client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=len(prompts)))

        def complete(prompt, answers, index, barrier):
            body = {"model": model, "prompt": prompt, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
            barrier.wait()
            answers[index] = client.post(url + "/v1/completions", json=body).json()

        def together(batch):
            answers = [None] * len(batch)
            barrier = threading.Barrier(len(batch) + 1)
            threads = [threading.Thread(target=complete, args=(p, answers, i, barrier)) for i, p in enumerate(batch)]
            for thread in threads:
                thread.start()
            barrier.wait()
            started = time.perf_counter()
            for thread in threads:
                thread.join()
            return answers, time.perf_counter() - started

        try:
            together(prompts)  # warm-up: every connection opened, the batch's path run once
            answers, seconds = together(prompts)
        finally:
            client.close()
        failed = [answer for answer in answers if "usage" not in answer]
        if failed:
            raise RuntimeError(f"a completion failed: {failed[0]}")
        tokens = sum(a["usage"]["completion_tokens"] for a in answers)
        result = {"streams": len(prompts), "tok_s": round(tokens / seconds, 1), "completion_tokens": tokens,
                  "stream_digests": [digest([answer["choices"][0]["text"]]) for answer in answers]}
    finally:
        stop_serve(process, profiled=pyspy is not None)
    if pyspy is not None:
        result["profile_top"] = pyspy_top(pyspy)
    return result


def stop_serve(process: subprocess.Popen, profiled: bool) -> None:
    """SIGTERM to the serve; under py-spy, SIGINT to py-spy first (it writes its stacks), then SIGTERM to the
    serve it started."""
    if not profiled:
        process.terminate()
        process.wait(timeout=60)
        return
    children = child_pids(process.pid)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    finally:
        for child in children:
            try:
                os.kill(child, signal.SIGTERM)
            except ProcessLookupError:
                pass


def digest(streams: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(streams).encode()).hexdigest()[:16]


def summarize_batch(merged: dict) -> None:
    """`batch_identical`, and the ratios the issue's targets are stated in."""
    checks = {**merged.get("batch_checks_local", {}), **{f"daemons/{k}": v for k, v in merged.get("batch_checks_daemons", {}).items()}}
    if not checks:
        return
    if "batch_greedy_digest_local" in merged and "batch_greedy_digest_daemons" in merged:
        checks["daemons_equal_one_process"] = merged["batch_greedy_digest_local"] == merged["batch_greedy_digest_daemons"]
    merged["batch_checks"] = checks
    merged["batch_identical"] = all(checks.values())
    targets = {}
    for where in ("local", "daemons"):
        tok_s = merged.get(f"batch_tok_s_{where}")
        if tok_s:
            greedy = tok_s["greedy"]
            targets[f"{where}_greedy_x8_over_x1"] = round(greedy["8"] / greedy["1"], 2)  # target >= 6
            targets[f"{where}_greedy_x32_over_x1"] = round(greedy["32"] / greedy["1"], 2)  # target >= 20
            targets[f"{where}_oracle_x8_tok_s"] = tok_s["oracle"]["8"]  # target >= 2000 in one process
            chunked = merged.get(f"batch_tok_s_{where}_prefill_chunk16")
            if chunked:  # prompts inside the batched step, over the same one-stream run's figure
                targets[f"{where}_greedy_prefill_chunk16_x8_over_x1"] = round(chunked["8"] / greedy["1"], 2)
                targets[f"{where}_greedy_prefill_chunk16_x32_over_x1"] = round(chunked["32"] / greedy["1"], 2)
            decode = merged.get(f"batch_decode_tok_s_{where}") or {}
            if decode.get("greedy", {}).get("1"):  # the same ratios without the prefill
                g = decode["greedy"]
                targets[f"{where}_decode_greedy_x8_over_x1"] = round((g.get("8") or 0) / g["1"], 2)
                targets[f"{where}_decode_greedy_x32_over_x1"] = round((g.get("32") or 0) / g["1"], 2)
                targets[f"{where}_decode_oracle_x8_tok_s"] = decode.get("oracle", {}).get("8")
    if merged.get("batch_tok_s_local") and merged.get("batch_tok_s_daemons"):
        local, daemons = merged["batch_tok_s_local"], merged["batch_tok_s_daemons"]
        targets["daemons_over_local"] = {kind: {c: round(daemons[kind][c] / local[kind][c], 3) for c in local[kind]}
                                         for kind in local}  # target >= 0.9 everywhere
    if "batch_http" in merged:
        targets["http_vs_direct_x8"] = merged["batch_http"].get("http_vs_direct")  # target >= 0.9
    merged["batch_targets"] = targets


def batch_table(merged: dict) -> str:
    """The short table the GPU script prints last."""
    lines = ["streams     " + "".join(f"{c:>9}" for c in CONCURRENCY)]
    for where in ("local", "daemons"):
        tok_s = merged.get(f"batch_tok_s_{where}")
        if not tok_s:
            continue
        for kind in ("greedy", "oracle"):
            row = tok_s.get(kind, {})
            lines.append(f"{where[:7]:7} {kind:6}" + "".join(f"{row.get(str(c), '-'):>9}" for c in CONCURRENCY))
        decode = merged.get(f"batch_decode_tok_s_{where}") or {}
        for kind in ("greedy", "oracle"):  # after the last prompt's first token: the steps' rate, no prefill
            row = decode.get(kind, {})
            if row:
                lines.append(f"{where[:7]:7} {kind[:2] + '/dec':6}" + "".join(f"{str(row.get(str(c), '-')):>9}"
                                                                    for c in CONCURRENCY))
        chunked = merged.get(f"batch_tok_s_{where}_prefill_chunk16")
        if chunked:  # greedy, every prompt in 16-row chunks inside the batched step
            lines.append(f"{where[:7]:7} {'gr/c16':6}" + "".join(f"{str(chunked.get(str(c), '-')):>9}"
                                                                for c in CONCURRENCY))
    if "batch_http" in merged:
        http = merged["batch_http"]
        lines.append(f"HTTP x{http['streams']}: {http['tok_s']} tok/s, without HTTP {http.get('direct_tok_s')} "
                     f"({http.get('http_vs_direct') or http.get('error')})")
    lines.append(f"batch_identical: {merged.get('batch_identical')}"
                 + "".join(f"\n  differs: {name}" for name, ok in merged.get("batch_checks", {}).items() if not ok))
    lines.append("targets: " + json.dumps(merged.get("batch_targets", {})))
    return "\n".join(lines)
