#!/usr/bin/env python3
"""Rollback cost, side by side, in one process: replay vs checkpoint vs replay-ssm.

Runs one shard (any layer range, default the whole model) of a synthetic model, prefills a prompt,
then runs the same schedule of speculative steps in each mode: verify a block of T tokens, keep a
seeded number of them (mean commit about 6 of 16 by default), roll the rest back. Modes run in
A/B/A order (replay, checkpoint, replay-ssm, then again) so drift shows. Prints a table and writes
JSON. Also checks the GPU path against a fresh recompute: after the steps, every mode's GDN state
must match the others.

    python scripts/bench_rollback.py --synthetic small --device cpu               # quick, anywhere
    python scripts/bench_rollback.py --synthetic qwen3.5-27b --device cuda:0 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.presets import parse_synthetic, preset_config  # noqa: E402
from protocol.layout import (  # noqa: E402
    CHECKPOINT,
    REPLAY,
    REPLAY_SSM,
    SHARD_ROLLBACK_MODES,
    check_layer_range,
    parse_layer_range,
)
from shardd.weights.loading import DTYPES  # noqa: E402
from shardd.engine.reference import rollback as rb  # noqa: E402
from shardd.engine.reference.shard import ShardModel  # noqa: E402
from shardd.synthetic.model import synthetic_weights  # noqa: E402

MODES = (REPLAY, CHECKPOINT, REPLAY_SSM)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def keep_schedule(steps: int, block: int, mean_commit: float, seed: int) -> list[int]:
    """keep = accepted drafts + 1 (t0); accepted drawn around mean_commit - 1, clipped to the block."""
    rng = random.Random(seed)
    spread = min(mean_commit - 1, block - mean_commit)
    out = []
    for _ in range(steps):
        accepted = round(rng.uniform(mean_commit - 1 - spread, mean_commit - 1 + spread))
        out.append(max(0, min(block - 1, accepted)) + 1)
    return out


def run_mode(mode, shards, prompt, blocks, keeps, device, timings):
    """One pass of the schedule in `mode`; returns the final state. Step times go to `timings`."""
    shard = shards[CHECKPOINT if mode == REPLAY else mode]
    state = shard.new_state(len(prompt) + sum(len(b) for b in blocks) + 16)
    shard.forward(state, 0, tokens=prompt)
    sync(device)
    for block, keep in zip(blocks, keeps):
        pos = state.length
        start = time.perf_counter()
        if mode == REPLAY:
            shard.snapshot(state)
            shard.forward(state, pos, tokens=block)
            if keep < len(block):
                shard.restore(state)
                shard.forward(state, pos, tokens=block[:keep])
            sync(device)
            rollback_s = None
        else:
            shard.forward(state, pos, tokens=block, checkpoint=True)
            sync(device)
            mid = time.perf_counter()
            if keep < len(block):
                shard.rollback(state, keep)
            sync(device)
            rollback_s = time.perf_counter() - mid
        timings["step"].append(time.perf_counter() - start)
        if rollback_s is not None:
            timings["rollback"].append(rollback_s)
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic", default="small")
    parser.add_argument("--layers", default=None, help="BEGIN:END (default all)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2, help="A/B/A: each mode runs this many times, interleaved")
    parser.add_argument("--mean-commit", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    preset, seed = parse_synthetic(args.synthetic)
    config = preset_config(preset)
    begin, end = parse_layer_range(args.layers) if args.layers else (0, config.num_layers)
    check_layer_range(begin, end, config.num_layers)
    dtype = DTYPES[args.dtype]
    t0 = time.perf_counter()
    weights = synthetic_weights(config, begin, end, seed, dtype=dtype, device=device)
    sync(device)
    build_s = time.perf_counter() - t0
    shards = {
        mode: ShardModel(config, weights, begin, end, dtype=dtype, device=device, storage=rb.RollbackStorage(mode, args.block))
        for mode in SHARD_ROLLBACK_MODES
    }
    rng = random.Random(args.seed)
    prompt = [rng.randrange(config.vocab_size) for _ in range(args.prompt_len)]
    blocks = [[rng.randrange(config.vocab_size) for _ in range(args.block)] for _ in range(args.steps)]
    keeps = keep_schedule(args.steps, args.block, args.mean_commit, args.seed)

    # Warm-up (kernels, allocator) on a short schedule, discarded.
    for mode in MODES:
        run_mode(mode, shards, prompt[:32], blocks[:3], keeps[:3], device, {"step": [], "rollback": []})

    # Greedy baseline: one token per forward.
    plain = shards[CHECKPOINT]
    state = plain.new_state(args.prompt_len + 64)
    plain.forward(state, 0, tokens=prompt)
    decode = []
    for i in range(16):
        sync(device)
        start = time.perf_counter()
        plain.forward(state, args.prompt_len + i, tokens=[blocks[0][i % args.block]])
        sync(device)
        decode.append(time.perf_counter() - start)

    timings = {mode: {"step": [], "rollback": []} for mode in MODES}
    finals = {}
    order = []
    for r in range(args.rounds):
        sequence = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in sequence:
            order.append(mode)
            per_round = {"step": [], "rollback": []}
            finals[mode] = run_mode(mode, shards, prompt, blocks, keeps, device, per_round)
            timings[mode]["step"].extend(per_round["step"])
            timings[mode]["rollback"].extend(per_round["rollback"])
            timings[mode].setdefault("round_medians", []).append(statistics.median(per_round["step"]))

    # Every mode kept the same tokens: states must agree (a fresh recompute is the replay mode).
    reference = finals[REPLAY]
    max_rel = {}
    for mode in SHARD_ROLLBACK_MODES:
        worst = 0.0
        for layer, s in finals[mode].gdn.items():
            ref = reference.gdn[layer].recurrent
            worst = max(worst, ((s.recurrent - ref).norm() / ref.norm().clamp_min(1e-30)).item())
        max_rel[mode] = worst
        assert finals[mode].length == reference.length

    mean_commit = statistics.mean(keeps)
    decode_ms = statistics.median(decode) * 1e3
    rows = []
    for mode in MODES:
        step_ms = statistics.median(timings[mode]["step"]) * 1e3
        rounds = timings[mode]["round_medians"]
        rows.append(
            {
                "mode": mode,
                "step_ms_median": step_ms,
                "rollback_ms_median": statistics.median(timings[mode]["rollback"]) * 1e3 if timings[mode]["rollback"] else None,
                "round_medians_ms": [x * 1e3 for x in rounds],
                "drift": (max(rounds) - min(rounds)) / min(rounds),
                "tokens_per_s": mean_commit / (step_ms / 1e3),
                "checkpoint_bytes_per_sequence": 0 if mode == REPLAY else shards[mode].checkpoint_bytes_per_sequence(),
                "max_rel_state_diff_vs_replay": max_rel.get(mode, 0.0),
            }
        )
    base = rows[0]["step_ms_median"]
    for row in rows:
        row["speedup_vs_replay"] = base / row["step_ms_median"]
    record = {
        "script": "scripts/bench_rollback.py",
        "argv": sys.argv[1:],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "model": {"synthetic": args.synthetic, "layers": [begin, end], "dtype": args.dtype,
                  "gdn_layers": len(shards[CHECKPOINT].gdn_layers), "weight_bytes": shards[CHECKPOINT].weight_bytes()},
        "weights_build_s": build_s,
        "prompt_len": args.prompt_len, "block": args.block, "steps": args.steps, "rounds": args.rounds,
        "order": order, "mean_commit": mean_commit,
        "greedy_decode_ms_median": decode_ms, "greedy_tokens_per_s": 1e3 / decode_ms,
        "modes": rows,
    }
    print(f"{record['device']}  {args.synthetic} layers {begin}:{end} {args.dtype}  block {args.block}, "
          f"mean commit {mean_commit:.2f}, {args.steps} steps x {args.rounds} rounds")
    print(f"greedy decode: {decode_ms:.2f} ms/token = {1e3 / decode_ms:.1f} tok/s")
    print(f"{'mode':<11} {'step ms':>9} {'rollback ms':>12} {'tok/s':>8} {'vs replay':>10} {'drift':>7} {'ckpt MiB/seq':>13} {'state rel diff':>15}")
    for row in rows:
        rollback_ms = f"{row['rollback_ms_median']:.3f}" if row["rollback_ms_median"] is not None else "-"
        print(f"{row['mode']:<11} {row['step_ms_median']:>9.2f} {rollback_ms:>12} {row['tokens_per_s']:>8.1f} "
              f"{row['speedup_vs_replay']:>9.2f}x {row['drift']:>6.1%} {row['checkpoint_bytes_per_sequence'] / 2**20:>13.1f} "
              f"{row['max_rel_state_diff_vs_replay']:>15.2e}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
