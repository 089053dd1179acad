#!/usr/bin/env python3
"""The benchmark this project started from, on our stack: Qwen3.5-27B (synthetic, its real shape) split over two
daemons, each held to 24 GB as an RTX 3090 would hold it, FP8 weights, checkpoint storage on, the 27B-shaped
DFlash drafter (`--draft synthetic:5`), a 1,024-token prompt and 256 new tokens; fast rollback (checkpoint)
against replay in blocks A1 (checkpoint), B (replay), A2 (checkpoint), one discarded warm-up and five measured
runs per block, every run's output hashed (all must be the same tokens, and those of the daemons' plain greedy).
Then FP8 against its own dequantized bf16 model (max |Δlogit|, top-1 agreement over a 256-token greedy run, both
through the GPU decode step), and the same two-daemon run in bf16 without the cap.

    python3 scripts/bench_seed.py --json bench/results/h200/seed_bench.json      # all three parts, <= --budget-s
    python3 scripts/bench_seed.py --parts fp8 --runs 2 --tokens 64                 # quick

Parts, each in its own process group: `fp8` and `bf16` (two daemons on --devices; `auto`: cuda:0,cuda:1 with two
GPUs, both on cuda:0 with one, cpu,cpu without), `compare` (one process, the first device). The whole run is held
to --budget-s: each part gets a share of what is left (unused time flows to the next part); a part fits its
measured runs per block to its share after the warm-up (never fewer than one, never more than --runs) and writes
its JSON after every run, so a part stopped at its limit (its process group terminated, then killed) keeps what
it measured, marked `timed_out`. Prints the seed's table last (median decode tok/s, wall time, acceptance,
average commit, A1-A2 drift). Exit 1 when a part failed or timed out, or when FP8 outputs differ.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAST, REPLAY = "checkpoint", "replay"
PARTS = ("fp8", "compare", "bf16")
SHARES = {"fp8": 0.45, "compare": 0.2, "bf16": 0.35}  # of the time left when the part starts, over the parts left
STOP_MARGIN_S = 20.0  # a part stops starting runs this long before its limit (at most): time to stop its daemons


def token_hash(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def resolve_devices(spec: str) -> list[str]:
    """'auto': cuda:0,cuda:1 on two GPUs, cuda:0 twice on one (each daemon under its own cap), cpu,cpu without."""
    if spec != "auto":
        devices = spec.split(",")
        return devices * 2 if len(devices) == 1 else devices
    import torch

    count = torch.cuda.device_count()
    return ["cuda:0", "cuda:1"] if count >= 2 else ["cuda:0", "cuda:0"] if count == 1 else ["cpu", "cpu"]


def write_json(path: str | None, value: dict) -> None:
    """Atomically: a part killed mid-write leaves the previous version, never half a file."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(temporary, target)


# ---- two daemons ----------------------------------------------------------------------------------------

def layer_ranges(args) -> list[tuple[int, int]]:
    """The two daemons' layers. The first one also holds the drafter (6.2 GB for the 27B shape's five draft layers),
    so by default it takes 7/16 of the layers (28 of the 27B's 64): an even split leaves the first daemon too little
    of its 24 GiB cap for the allocator's fragmentation."""
    from common.presets import preset_config

    layers = preset_config(args.preset).num_layers
    first = args.first_layers if args.first_layers is not None else max(1, layers * 7 // 16)
    if not 0 < first < layers:
        raise SystemExit(f"--first-layers {first}: the first daemon needs 1 to {layers - 1} of the {layers} layers")
    return [(0, first), (first, layers)]


def start_daemons(args, devices: list[str], quantize: str | None, cap: str | None, run_dir: Path,
                  out: dict) -> tuple[list, list[str]]:
    from coordinator.relay.client import ShardClient, ShardTimeout

    ranges = layer_ranges(args)
    out["ranges"] = [f"{begin}:{end}" for begin, end in ranges]
    processes, endpoints = [], []
    for index, (begin, end) in enumerate(ranges):
        endpoint = f"ipc://{run_dir}/shard{index}.sock"
        cuda = devices[index].startswith("cuda")
        command = [sys.executable, "-m", "shardd", "serve", "--synthetic", f"{args.preset}:{args.seed}",
                   "--layers", f"{begin}:{end}", "--device", devices[index],
                   "--dtype", "bfloat16" if cuda else "float32",  # cpu: a dry run, float32 is the fast CPU path
                   "--engine", "fast" if cuda else "reference",
                   "--bind", endpoint, "--rollback-mode", "checkpoint", "--max-verify-tokens", str(args.block),
                   "--max-sequences", "1", "--max-context", str(args.context),
                   "--max-tokens-per-request", str(args.prompt_len)]
        if not cuda:
            command += ["--threads", "1"]  # two daemons and this process share the cores
        if index == 0:  # the drafter beside the embedding it borrows (the head is read for it)
            command += ["--draft", f"synthetic:{args.draft_layers}"]
        if quantize:
            command += ["--quantize", quantize]
        if cap:
            command += ["--max-gpu-memory", cap]
        log = open(run_dir / f"shard{index}.log", "w")
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        endpoints.append(endpoint)
    out["daemon_pids"] = [process.pid for process in processes]
    out["daemon_devices"] = devices
    write_json(args.json, out)
    load_deadline = time.monotonic() + args.load_timeout  # the part's own limit is the parent's to enforce
    try:
        for index, (process, endpoint) in enumerate(zip(processes, endpoints)):
            client = ShardClient(endpoint, timeout_s=1.0)
            try:
                while True:
                    if process.poll() is not None or time.monotonic() > load_deadline:
                        raise RuntimeError(f"shard {index} did not come up: "
                                           + (run_dir / f"shard{index}.log").read_text()[-3000:])
                    try:
                        client.hello(timeout_s=0.5)
                        break
                    except ShardTimeout:
                        continue
            finally:
                client.close()
    except BaseException:
        stop_daemons(processes)  # the other one too, before the error is reported
        raise
    return processes, endpoints


def stop_daemons(processes: list) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_pair(args, quantize: str | None, cap: str | None, deadline: float) -> dict:
    """The seed's A/B/A over two daemons; the JSON (args.json) is rewritten after every run."""
    from coordinator import benchstats
    from coordinator.relay.client import ShardClient
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import make_drafter
    from coordinator.relay.pipeline import Pipeline
    from common.presets import preset_config

    config = preset_config(args.preset)
    prompt = prompt_ids(config.vocab_size, args.prompt_len, args.seed)
    devices = resolve_devices(args.devices)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-seed-"))
    out: dict = {"weights": quantize or "bfloat16", "cap": cap, "prompt_tokens": len(prompt), "new_tokens": args.tokens,
                 "block": args.block, "context": args.context, "draft": f"synthetic:{args.draft_layers}",
                 "runs_requested": args.runs, "complete": False}
    started = time.monotonic()
    processes, endpoints = start_daemons(args, devices, quantize, cap, run_dir, out)
    out["load_seconds"] = round(time.monotonic() - started, 1)
    try:
        with Pipeline.connect(endpoints, timeout_s=600) as pipeline:
            out["memory_plan"] = [shard.hello.get("memory") for shard in pipeline.shards]
            greedy = greedy_decode(pipeline, 1, prompt, args.tokens)
            out["greedy_tok_s"] = round(greedy.decode_tok_s, 2)
            out["greedy_tokens"] = greedy.tokens
            hashes = out["hashes"] = {"greedy": token_hash(greedy.tokens)}
            write_json(args.json, out)
            time.sleep(args.stall_s)  # tests: a part that overruns its limit
            draft_client = ShardClient(endpoints[0], timeout_s=600)
            sequences = iter(range(2, 1 << 30))

            def one_run(mode: str) -> dict:
                drafter = make_drafter("dflash", draft_client=draft_client, pipeline=pipeline)
                began = time.monotonic()
                result = speculative_decode(drafter.target, next(sequences), prompt, drafter, block_size=args.block,
                                            rollback=mode, max_new_tokens=args.tokens)
                return {**result.summary(), "hash": token_hash(result.tokens),
                        "run_seconds": round(time.monotonic() - began, 3)}

            warmup = one_run(FAST)  # discarded (compiles the verify and draft kernels)
            hashes["warm-up"] = warmup["hash"]
            # The runs that fit: a replay run costs about twice a checkpoint run (it runs the accepted tokens again).
            # First from the warm-up (which also compiled kernels: an overestimate), then from each A1 run.
            estimate = {FAST: warmup["run_seconds"], REPLAY: 2 * warmup["run_seconds"]}
            runs = max(1, min(args.runs, int((deadline - time.monotonic()) / (4 * estimate[FAST]))))
            blocks: dict[str, list[dict]] = {"A1": [], "B": [], "A2": []}
            out["runs"] = blocks
            for name, mode in (("A1", FAST), ("B", REPLAY), ("A2", FAST)):
                i = 0
                while i < runs:
                    if time.monotonic() + estimate[mode] > deadline:  # the part's limit would stop it midway
                        out.setdefault("cut_short", []).append(f"{name} after {i} runs")
                        break
                    run = one_run(mode)
                    estimate[mode] = run["run_seconds"]
                    if mode == FAST and name == "A1":  # A1's i+1 runs done; left: the rest of A1, B (2x), A2
                        estimate[REPLAY] = 2 * run["run_seconds"]
                        took = run["run_seconds"]
                        fit = int((deadline - time.monotonic() + (i + 1) * took) / (4 * took))
                        runs = max(i + 1, min(args.runs, fit))
                    blocks[name].append(run)
                    hashes[f"{name}/{i}"] = run["hash"]
                    out["runs_per_block"] = runs
                    print(f"{out['weights']} {name} ({mode}) run {i}: {run['decode_tok_s']:.1f} tok/s, "
                          f"commit {run['avg_commit'] or 0:.2f}, {run['run_seconds']:.1f} s", flush=True)
                    summarize(out, benchstats)
                    write_json(args.json, out)
                    i += 1
            out["device_memory"] = [client.hello().get("device_memory") for client in pipeline.clients]
            out["complete"] = True
            draft_client.close()
    finally:
        stop_daemons(processes)
    summarize(out, benchstats)
    return out


def summarize(out: dict, benchstats) -> None:
    """The blocks' medians, drift, checkpoint/replay and whether every output so far is the same tokens."""
    blocks = out.get("runs", {})
    out["blocks"] = {name: benchstats.summarize_runs(runs) for name, runs in blocks.items() if runs}
    medians = {name: block["decode_tok_s"] for name, block in out["blocks"].items()}
    if "A1" in medians and "A2" in medians:
        out["drift_a1_a2"] = round(benchstats.drift(medians["A1"], medians["A2"]), 4)
    fast = [medians[name] for name in ("A1", "A2") if name in medians]
    if fast and medians.get("B"):
        out["fast_vs_replay"] = round(statistics.mean(fast) / medians["B"], 3)
    out["outputs_identical"] = len(set(out.get("hashes", {}).values())) == 1


# ---- FP8 against its own dequantized bf16 model ------------------------------------------------------------

def step_logits(model, prompt: list[int], tokens: list[int] | None, n: int, context: int) -> tuple[list[int], object]:
    """Greedy decoding through `model`'s decode step (the GPU step on a FastShard): the prompt's prefill, then one
    token a step. With `tokens` the steps are fed those tokens (teacher forcing) instead of the model's own choice.
    Returns the chosen tokens and the [n, vocab] float32 logits that chose them."""
    import torch

    state = model.new_state(context)
    rows, chosen = [], []
    try:
        with torch.inference_mode():
            out = model.forward(state, 0, tokens=prompt)
            pos = len(prompt)
            for i in range(n):
                logits = out.logits[-1].float().clone()
                rows.append(logits)
                chosen.append(int(out.ids[-1]) if out.ids is not None else int(logits.argmax()))
                if i == n - 1:
                    break
                out = model.forward(state, pos, tokens=[tokens[i] if tokens is not None else chosen[-1]])
                pos += 1
    finally:
        model.release_state(state)
    return chosen, torch.stack(rows)


def release(cuda: bool) -> None:
    """What is no longer referenced (a FastShard's runner holds reference cycles) back to the device."""
    import torch

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def run_compare(args) -> dict:
    import torch

    from shardd.engine.fast.shard import FastShard
    from shardd.weights.loading import ModelSource, build_shard
    from shardd.engine.reference import rollback as rb
    from shardd.weights.quant import Fp8Linear

    device = resolve_devices(args.devices)[0]
    cuda = device.startswith("cuda")
    source = ModelSource(synthetic=f"{args.preset}:{args.seed}", quantize=args.quantize)
    config = source.config()
    storage = rb.RollbackStorage(FAST, args.block)
    dtype = "bfloat16" if cuda else "float32"
    model = build_shard(source, 0, config.num_layers, dtype=dtype, device=device, storage=storage, keep_fp8=True)
    prompt = prompt_ids(config.vocab_size, args.prompt_len, args.seed)

    def stepper():  # the decode step as the daemons run it: the fast engine on a GPU, the reference on the CPU
        return FastShard(model, max_sequences=1, max_context=args.context) if cuda else model

    out: dict = {"compare_weights": args.quantize, "device": device, "dtype": dtype, "complete": False}
    began = time.monotonic()
    fast = stepper()
    greedy, fp8_logits = step_logits(fast, prompt, None, args.compare_tokens, args.context)
    del fast
    release(cuda)  # its pools and graphs, before the dequantized copies are made
    out.update(compare_tokens=len(greedy), fp8_greedy_hash=token_hash(greedy), fp8_greedy_tokens=greedy,
               fp8_seconds=round(time.monotonic() - began, 1))
    write_json(args.json, out)
    # The dequantized model: every FP8 matrix multiplied out to the model's dtype (a bf16 checkpoint of the same
    # weights, as a user would get by dequantizing), everything else shared.
    modules = [module for layer in model.layers
               for module in (layer.mlp, layer.linear_attn if layer.is_gdn else layer.self_attn)]
    dequantized = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, Fp8Linear) and id(value) not in dequantized:
                dequantized[id(value)] = value.dequantized(getattr(torch, dtype))
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, Fp8Linear):
                setattr(module, name, dequantized[id(value)])
    del dequantized
    release(cuda)  # the FP8 bytes
    assert not any(isinstance(value, Fp8Linear) for module in modules for value in vars(module).values())
    fast = stepper()
    chosen, bf16_logits = step_logits(fast, prompt, greedy, len(greedy), args.context)
    delta = (fp8_logits - bf16_logits).abs()
    # how close each FP8 choice was: its logit minus the runner-up's (a flip needs a margin under the Δ at that step)
    top2 = fp8_logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    disagree = [i for i, (a, b) in enumerate(zip(chosen, greedy)) if a != b]
    out.update(median_top1_margin=round(statistics.median(margins), 4),
               disagreements=[{"step": i, "fp8_margin": round(margins[i], 4),
                               "delta_at_step": round(delta[i].max().item(), 4)} for i in disagree][:32])
    out.update(max_abs_delta_logit=round(delta.max().item(), 4), mean_abs_delta_logit=round(delta.mean().item(), 5),
               top1_agreement=round(sum(a == b for a, b in zip(chosen, greedy)) / len(greedy), 4),
               first_disagreement=next((i for i, (a, b) in enumerate(zip(chosen, greedy)) if a != b), None),
               complete=True)
    return out


# ---- the whole run ------------------------------------------------------------------------------------------

def size(value) -> str:
    from common.memory import fmt_gib

    return fmt_gib(value) if value is not None else "?"


def problem(part: dict) -> str:
    if part.get("stopped"):
        return "stopped (SIGTERM)"
    if part.get("skipped"):
        return f"skipped ({part['skipped']})"
    return "timed out" if part.get("timed_out") else f"failed (exit {part.get('failed')})"


def table(result: dict) -> str:
    lines = ["| weights | cap | mode | runs | decode tok/s (median) | wall s | acceptance | avg commit |",
             "|---|---|---|---|---|---|---|---|"]
    notes = []
    for part in ("fp8", "bf16"):
        run = result.get(part) or {}
        if {"timed_out", "failed", "skipped", "stopped"} & run.keys():
            notes.append(f"{part}: " + problem(run)
                         + (", partial results above" if run.get("blocks") else "")
                         + (f": {run['error'][-300:]}" if run.get("error") else ""))
        for name, mode in (("A1", FAST), ("B", REPLAY), ("A2", FAST)):
            b = (run.get("blocks") or {}).get(name)
            if b:
                lines.append(f"| {run['weights']} | {run['cap'] or 'none'} | {name} {mode} | {b['runs']} | "
                             f"{b['decode_tok_s']:.1f} | {b['wall_seconds']:.2f} | {(b['acceptance_rate'] or 0):.3f} | "
                             f"{(b['avg_commit'] or 0):.2f} |")
        if run.get("blocks"):
            drift = f"{run['drift_a1_a2']:.1%}" if "drift_a1_a2" in run else "n/a"
            ratio = f"{run['fast_vs_replay']:.2f}x" if "fast_vs_replay" in run else "n/a"
            lines.append(f"| {run['weights']} | | greedy {run.get('greedy_tok_s', 0):.1f} tok/s; drift A1-A2 {drift}; "
                         f"checkpoint/replay {ratio}; outputs identical: {run.get('outputs_identical')} | | | | | |")
        for index, plan in enumerate(run.get("memory_plan") or []):
            if plan:
                used = ((run.get("device_memory") or [None] * 2)[index] or {}).get("process_bytes")
                layers = (run.get("ranges") or ["?"] * 2)[index]
                notes.append(f"{run['weights']} daemon {index} (layers {layers}): planned {size(plan.get('total_bytes'))}"
                             + (f" of a {size(plan['cap_bytes'])} cap" if plan.get("cap_bytes") else "")
                             + f" (checkpoint_buffers {size(plan.get('items', {}).get('checkpoint_buffers'))})"
                             + (f"; the daemon holds {size(used)} after the runs" if used else ""))
    c = result.get("compare") or {}
    if "max_abs_delta_logit" in c:
        notes.append(f"FP8 vs its dequantized bf16 model over {c['compare_tokens']} greedy tokens (decode step): "
                     f"max |Δlogit| {c['max_abs_delta_logit']}, mean {c['mean_abs_delta_logit']}, top-1 agreement "
                     f"{c['top1_agreement']:.2%} (median top-1 margin {c.get('median_top1_margin')}; where they "
                     f"differ, FP8's margin: {[d['fp8_margin'] for d in c.get('disagreements', [])][:8]})")
    elif c:
        notes.append("compare: " + problem(c) + (f": {c['error'][-300:]}" if c.get("error") else ""))
    if "fp8_outputs_identical" in result:
        notes.append(f"FP8 outputs identical (the daemons' greedy and every A/B/A run): "
                     f"{result['fp8_outputs_identical']}; the one-process FP8 greedy gives the same tokens: "
                     f"{result['fp8_one_process_greedy_matches']}")
    return "\n".join(lines + [""] + notes)


def fp8_checks(merged: dict) -> None:
    """fp8_outputs_identical: the daemons' FP8 greedy and every A/B/A run (checkpoint and replay) are the same tokens;
    fp8_one_process_greedy_matches: the compare part's one-process greedy (all 64 layers in one FastShard, no shard
    boundary) gives them too, over the tokens both produced (None: a part is missing)."""
    fp8, compare = merged.get("fp8") or {}, merged.get("compare") or {}
    merged["fp8_outputs_identical"] = len(set(fp8["hashes"].values())) == 1 if fp8.get("hashes") else None
    merged["fp8_one_process_greedy_matches"] = None
    if fp8.get("greedy_tokens") and compare.get("fp8_greedy_tokens"):
        n = min(len(fp8["greedy_tokens"]), len(compare["fp8_greedy_tokens"]))
        merged["fp8_one_process_greedy_matches"] = fp8["greedy_tokens"][:n] == compare["fp8_greedy_tokens"][:n]


def run_part(part: str, child_args: list[str], path: str, timeout_s: float) -> dict:
    """One part in its own process group, held to timeout_s: past it the group (the part and its daemons) gets
    SIGTERM, then SIGKILL 20 s later; what the part wrote so far is kept, marked timed_out."""
    deadline = time.time() + timeout_s - min(STOP_MARGIN_S, timeout_s / 5)
    command = [sys.executable, __file__, "--part", part, "--json", path, "--deadline", f"{deadline:.3f}", *child_args]
    child = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    timed_out, stopped, code = False, False, None
    try:
        code = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(child.pid, signal.SIGTERM)
        try:
            code = child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
    except SystemExit:  # this process was stopped (SIGTERM): the part goes too, what it wrote is kept
        stopped = True
    finally:
        try:  # whatever of the group is left (a daemon that outlived its parent)
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if child.poll() is None:
            child.wait()
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        result = {}
    if stopped:
        result["stopped"] = "SIGTERM"
    elif timed_out:
        result["timed_out"] = True
    elif code != 0:
        result["failed"] = code
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # a child: one part
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # a child's, epoch seconds
    parser.add_argument("--stall-s", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: sleep after greedy
    parser.add_argument("--parts", default=",".join(PARTS), help="Which parts, in this order (default: %(default)s).")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="Seconds for all parts together (default %(default)s: one 9-minute device call).")
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize", default="fp8-block", choices=("fp8-block", "fp8-channel"))
    parser.add_argument("--cap", default="24GiB", help="--max-gpu-memory of each FP8 daemon (the seed's 3090s).")
    parser.add_argument("--devices", default="auto", help="The two daemons' devices (default auto: see above).")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--compare-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096, help="Each daemon's --max-context (checkpoint storage "
                        "for one sequence at this many tokens).")
    parser.add_argument("--runs", type=int, default=5, help="Measured runs per block at most (fewer when the part's "
                        "share of --budget-s does not hold them; at least one).")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--first-layers", type=int, default=None,
                        help="Layers of the first daemon, which also holds the drafter (default: 7/16 of them).")
    parser.add_argument("--load-timeout", type=float, default=600)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    if args.part:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # run the finally blocks: stop the daemons
        deadline = time.monotonic() + (args.deadline - time.time() if args.deadline else 1e9)
        try:
            if args.part == "compare":
                result = run_compare(args)
            else:
                fp8 = args.part == "fp8"
                result = run_pair(args, args.quantize if fp8 else None, args.cap if fp8 else None, deadline)
        except Exception as error:  # what was measured stays in the JSON; the error joins it
            try:
                result = json.loads(Path(args.json).read_text()) if args.json else {}
            except (OSError, ValueError):
                result = {}
            result["error"] = f"{type(error).__name__}: {error}"
            write_json(args.json, result)
            print(f"{args.part}: {result['error']}", file=sys.stderr)
            return 1
        if args.json:
            write_json(args.json, result)
        else:
            print(json.dumps(result, indent=2))
        return 0

    # stopped from outside (a session's outer timeout): the running part's group goes with this process (run_part)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    parts = [part for part in args.parts.split(",") if part]
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    child_args, skip = [], False
    for arg in sys.argv[1:]:  # the child gets every option but --json / --parts / --budget-s
        if skip:
            skip = False
        elif arg in ("--json", "--parts", "--budget-s"):
            skip = True
        elif arg.split("=", 1)[0] not in ("--json", "--parts", "--budget-s"):
            child_args.append(arg)
    merged: dict = {"devices": resolve_devices(args.devices), "budget_s": args.budget_s}
    end = time.monotonic() + args.budget_s
    for index, part in enumerate(parts):
        left = parts[index:]
        timeout_s = (end - time.monotonic()) * SHARES[part] / sum(SHARES[p] for p in left)
        if timeout_s < 10:
            merged[part] = {"skipped": f"{timeout_s:.0f} s of --budget-s left"}
            continue
        print(f"== {part} (at most {timeout_s:.0f} s)", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            path = handle.name
        began = time.monotonic()
        merged[part] = run_part(part, child_args, path, timeout_s)
        merged[part]["part_seconds"] = round(time.monotonic() - began, 1)
        fp8_checks(merged)
        write_json(args.json, merged)  # after every part, so a later part's failure loses nothing
        if merged[part].get("stopped"):
            break
    print(table(merged))
    problems = {"failed", "timed_out", "skipped", "stopped"}
    failed = [part for part in parts if part not in merged or problems & merged[part].keys()]
    return 1 if failed or merged["fp8_outputs_identical"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
