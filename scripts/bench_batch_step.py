"""The `batch-step` part of scripts/bench_gpu.py (`--parts batch-step`; `--batch-step-device cpu`: a smoke run under
TRITON_INTERPRET=1): one process, the batched fixed-shape step by R rows."""

from __future__ import annotations

import gc
import time

from bench_measure import BLOCK, copy_bandwidth, median_ms


def run_batch_step(args) -> dict:
    """One process, the whole model (bf16, CUDA graphs) as FastShards of R = 16 .. 256 rows over one copy of the
    weights: the time of one step (wall: packing, replay, copy back, one synchronize; and device time of the graph
    replay) filled with 1, 2, 4, .. R/16 sequences of 16-row blocks, and with R sequences of one greedy row each
    (tokens/s if every row commits). The sequences sit at --prompt-len tokens of context; their caches and states
    are zeros (what they hold does not change the work). Also checks that the first sequence's logits row in
    the fullest step is bit-identical to that sequence stepped alone (`batch_step_identical`)."""
    import torch

    from shardd.engine.batch import BatchItem
    from shardd.engine.fast.shard import FastShard
    from shardd.engine.fast.weights import fuse_layers
    from shardd.engine.reference import rollback as rb
    from shardd.engine.reference.shard import ShardModel
    from common.presets import preset_config
    from shardd.synthetic.model import synthetic_weights

    device = torch.device(args.batch_step_device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    config = preset_config(args.preset)
    bandwidth = copy_bandwidth(torch, device) if cuda else float("inf")  # the CPU: a smoke run of the code
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    weights = synthetic_weights(config, 0, config.num_layers, args.seed, dtype=dtype, device=device)
    model = ShardModel(config, weights, 0, config.num_layers, dtype=dtype, device=device,
                       storage=rb.RollbackStorage(None, 0))  # no rollback storage: the step's cost alone
    del weights
    layers = fuse_layers(model)
    floor_ms = model.weight_bytes() / bandwidth * 1e3
    out: dict = {"preset": args.preset, "dtype": str(dtype).removeprefix("torch."),
                 "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                 "batch_step_block": BLOCK, "batch_step_context": args.prompt_len, "floor_ms": round(floor_ms, 3),
                 "batch_step_build_s": round(time.perf_counter() - t0, 1)}
    print(f"built {args.preset} in {out['batch_step_build_s']} s; floor {out['floor_ms']} ms", flush=True)
    generator = torch.Generator().manual_seed(args.seed)
    rows_list = [int(r) for r in args.step_rows.split(",")]
    context = args.prompt_len + 2 * BLOCK
    runs, step_rows_ms, step_rows_block_ms, identical = [], {}, {}, True
    deadline = time.monotonic() + args.batch_step_budget_s
    for rows in rows_list:
        if time.monotonic() > deadline:
            print(f"R={rows}: skipped (over --batch-step-budget-s)", flush=True)
            continue
        shard = FastShard(model, max_sequences=rows, max_context=context, layers=layers, step_rows=rows)
        states = [shard.new_state(context) for _ in range(rows)]
        fills = [(k, BLOCK) for k in (1, 2, 4, 8, 16) if k * BLOCK <= rows] + [(rows, 1)]
        for sequences, n in fills:
            ids = torch.randint(0, config.vocab_size, (sequences, n), generator=generator).tolist()
            items = [BatchItem(states[i], args.prompt_len, tokens=ids[i]) for i in range(sequences)]

            def step():
                for state in states[:sequences]:
                    state.length = args.prompt_len  # timing only: every step at the same positions
                return shard.forward_batch(items)

            step()  # captures the graph
            walls, devices = [], []
            for _ in range(args.repeats):
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                step()
                walls.append(time.perf_counter() - start)
                if not cuda:
                    devices.append(walls[-1])
                    continue
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                shard.runner.run(())  # the graph replay alone, on the same control
                end.record()
                end.synchronize()
                devices.append(begin.elapsed_time(end) / 1e3)
            ms = median_ms(walls)
            run = {"step_rows": rows, "sequences": sequences, "rows_per_sequence": n, "rows_used": sequences * n,
                   "ms_per_step": ms, "device_ms_per_step": median_ms(devices),
                   "tok_s_if_all_commit": round(sequences * n / ms * 1e3, 1),
                   "x_floor": round(ms / floor_ms, 3) if floor_ms else None}
            runs.append(run)
            print(f"R={rows:4d} {sequences:4d} x {n:2d} rows: {ms:8.3f} ms/step (device {run['device_ms_per_step']:.3f}), "
                  f"{run['tok_s_if_all_commit']:9.1f} tok/s if all commit, {run['x_floor'] or 0:.3f}x floor", flush=True)
            if n == 1:
                step_rows_ms[str(rows)] = ms
            elif sequences * n == rows:
                step_rows_block_ms[str(rows)] = ms
        # exactness: sequence 0's row in the fullest step equals sequence 0 stepped alone, from the same state
        state, token = states[0], [int(ids[0][0])]
        saved = (state.gdn.recurrent.clone(), state.gdn.conv.clone())
        state.length = args.prompt_len
        full = shard.forward_batch([BatchItem(s, args.prompt_len, tokens=[token[0] if i == 0 else 7])
                                    for i, s in enumerate(states)])[0].logits.clone()
        state.gdn.recurrent.copy_(saved[0])
        state.gdn.conv.copy_(saved[1])
        state.length = args.prompt_len
        alone = shard.forward(state, args.prompt_len, tokens=token).logits
        same = bool(torch.equal(full, alone))
        identical = identical and same
        print(f"R={rows}: sequence 0 alone == in a full step: {same}", flush=True)
        shard = states = state = items = step = full = alone = saved = None  # this R's pools, before the next R's
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    out["batch_step_runs"] = runs
    out["step_rows_ms"] = step_rows_ms  # R -> ms of a step of R greedy rows (R sequences, R GDN states read)
    out["step_rows_block_ms"] = step_rows_block_ms  # R -> ms of a step of R/16 sequences' 16-row blocks
    out["batch_step_identical"] = identical
    # the R to default to: the most rows per second of full 16-row blocks for a step at most 1.25x the 16-row
    # step's time (a stream's latency), among the R measured
    if "16" in step_rows_block_ms:
        budget = 1.25 * step_rows_block_ms["16"]
        fits = [int(r) for r, ms in step_rows_block_ms.items() if ms <= budget]
        out["recommended_step_rows"] = max(fits, key=lambda r: r / step_rows_block_ms[str(r)])
    return out


def batch_step_table(merged: dict) -> str:
    lines = ["R      seqs x rows   ms/step  device ms   tok/s (all commit)  x floor"]
    for run in merged["batch_step_runs"]:
        lines.append(f"R={run['step_rows']:<4d} {run['sequences']:5d} x {run['rows_per_sequence']:2d}  "
                     f"{run['ms_per_step']:8.3f}  {run['device_ms_per_step']:9.3f}  {run['tok_s_if_all_commit']:18.1f}  "
                     f"{run['x_floor'] or 0:7.3f}")
    lines.append(f"step_rows_ms (R greedy rows) {merged['step_rows_ms']}")
    lines.append(f"step_rows_block_ms (R/16 blocks) {merged['step_rows_block_ms']}")
    lines.append(f"identical {merged['batch_step_identical']}; recommended R {merged.get('recommended_step_rows')}")
    return "\n".join(lines)
