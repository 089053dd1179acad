#!/usr/bin/env python3
"""The GPU fast path, measured: one command on the GPU machine, one JSON out.

    python3 scripts/bench_gpu.py --json bench/results/h200/gpu_bench.json          # every part that fits
    python3 scripts/bench_gpu.py --part local --preset small --tokens 32           # one part, quick

Parts, each in its own process (so one part's memory never weighs on the next):
- `local`: one process, one GPU, the whole model as one FastShard (bf16, CUDA graphs): the copy
  bandwidth and the weight-read floor, greedy decode, each rollback mode with the `oracle` drafter at a
  mean commit near 7 of 16 after a 512-token prompt (A/B/A order), the step and rollback alone, prefill of
  a 1024-token prompt, a step at a 32k-token context, and the top kernels of one step (profile).
- `transformers`: `transformers`' greedy decode on the same synthetic weights, in its own process.
- `e2e`: two `shardd serve` daemons (layers 0:L/2 and L/2:L; one GPU each, or both on the one GPU there
  is) and the same decoding over the pipeline, the split as shardctl ships it (rows shard to shard, both ends
  polling where the host allows: SHIPPED_*).
- `relay`: the same two daemons (as shipped, and `relay_plain`: rows through the coordinator, nobody
  polling), and where each request's time goes (`relay_by_phase`: the daemons'
  STATS phases and the coordinator's client phases, protocol/timing.py, per verify step).
- `prefix` (scripts/bench_prefix.py): prefix caching over two daemons: a second turn's time to first token, many
  requests sharing a system prompt, a flood of distinct prompts under a small cache.
- `batch` (`batch-local`, `batch-daemons`; scripts/bench_batch.py): many streams through the scheduler,
  aggregate tok/s by concurrency, greedy and oracle, one process and two daemons, HTTP at 8 streams, and
  `batch_identical`.
- `dflash-batch`: two daemons with the drafter beside the last shard, --streams concurrent streams through the
  scheduler with the oracle and with DFlash (the real drafter proposing every step, the oracle's schedule
  committing), side by side (`dflash_batch_vs_oracle`); then `shardctl serve --drafter dflash`, fixed blocks and
  `--block-size auto`, against `--drafter none` at 1 and 8 HTTP streams (`dflash_batch_http`), and
  `dflash_batch_identical`.
- `batch-step`: one process, the batched step by R = 16 .. 256 rows: ms per step filled with 16-row
  blocks of 1 .. R/16 sequences and with R one-row greedy sequences (`step_rows_ms`), tokens/s if every row
  commits, and a row of a full step bit-identical to its sequence alone (`batch_step_identical`).

- `moe`: one process, one GPU, the `--moe-preset` MoE shape (35B-A3B) in bf16 (with `--fp8`: its linears, the
  experts among them, weight-only FP8, the floors counting FP8 bytes) as one FastShard: the greedy step
  against the floor of the bytes a decode step reads (its row's experts, the shared expert, attention/GDN, head),
  and a 16-row checkpointed verify step against the floor of the distinct experts its rows select
  (`moe_greedy_floor_ratio`, `moe_verify_floor_ratio`, `moe_distinct_experts`), and each step's heaviest
  kernels (`moe_greedy_kernels`, `moe_verify_kernels`: ms per step and launches).

- `guided`: one process, 8 streams under the scheduler constrained to a JSON schema against the same streams
  unconstrained: `guided_step_ms`, `plain_step_ms`, `guided_step_ratio` (the masks' cost per step).

Every output (greedy, each mode, one process and two daemons) is hashed: `outputs_identical` says
whether they are all the same tokens.
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
sys.path.insert(0, str(ROOT / "scripts"))
from bench_batch import batch_table, child_pids, pyspy_top, run_batch_daemons, run_batch_local, summarize_batch  # noqa: E402
from bench_prefix import run_prefix  # noqa: E402

MODES = ("checkpoint", "replay-ssm", "replay")
BLOCK = 16
MEAN_COMMIT = 7.0


def token_hash(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


# ---- local: one process, one GPU ------------------------------------------------------------------------


def cuda_seconds(torch, device, fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, the device synchronized before and after each."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - began)
    return samples


def copy_bandwidth(torch, device) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = [torch.empty_like(src) for _ in range(2)]
    for i in range(3):
        dst[i % 2].copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(10):
        start.record()
        dst[i % 2].copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times)


def matmul_peak(torch, device) -> float:
    """bf16 FLOP/s of an 8192^3 product on random data."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize(device)
    return 10 * 2 * 8192**3 / (time.perf_counter() - start)


def profile_top(torch, fn, repeats: int, top: int = 12) -> list[dict]:
    """The kernels that take most of the device time of fn(), per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in profiler.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            rows.append((device_us / repeats / 1e3, event.count // repeats, event.key[:90]))
    rows.sort(reverse=True)
    total = sum(ms for ms, _, _ in rows)
    return [{"ms_per_call": round(ms, 3), "launches": count, "kernel": name} for ms, count, name in rows[:top]] + [
        {"ms_per_call": round(total, 3), "launches": sum(c for _, c, _ in rows), "kernel": "(all kernels)"}]


def step_floors(config, model, shards: dict, context: int, bandwidth: float) -> tuple[dict, dict]:
    """The bytes a step must move, by part, and each step's floor in ms at `bandwidth`: every weight once but the
    embedding table, of which a step reads its rows only; each GDN layer's recurrent state and conv window read
    and written (float32); each attention layer's K/V of the context read and the step's rows written; and what a
    checkpointed verify writes for its rollback (checkpoint: the float32 states of every row; replay-ssm: its log)."""
    from protocol.layout import CHECKPOINT, REPLAY_SSM

    itemsize = 2  # bf16
    embedding = model.embed_tokens.nbytes if model.embed_tokens is not None else 0
    gdn = len(model.gdn_layers)
    kv_row = 2 * config.num_key_value_heads * config.head_dim * itemsize * len(model.attention_layers)
    parts = {
        "weights_but_embedding": model.weight_bytes() - embedding,
        "embedding_row": config.hidden_size * itemsize,
        "gdn_state_read_write": 2 * gdn * (config.recurrent_state_bytes() + config.conv_state_bytes()),
        "kv_read": kv_row * context,
        "kv_row_write": kv_row,
        "checkpoint_writes": shards[CHECKPOINT].checkpoint_bytes_per_sequence(),
        "replay_ssm_writes": shards[REPLAY_SSM].checkpoint_bytes_per_sequence(),
    }
    base = parts["weights_but_embedding"] + parts["gdn_state_read_write"] + parts["kv_read"]
    rows = {"greedy": 1, CHECKPOINT: BLOCK, REPLAY_SSM: BLOCK}
    extra = {"greedy": 0, CHECKPOINT: parts["checkpoint_writes"], REPLAY_SSM: parts["replay_ssm_writes"]}
    floors = {step: round((base + n * (parts["embedding_row"] + parts["kv_row_write"]) + extra[step]) / bandwidth * 1e3, 3)
              for step, n in rows.items()}
    return parts, floors


def run_local(args) -> dict:
    import torch

    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import OracleDrafter
    from shardd.local import LocalTarget
    from protocol.layout import CHECKPOINT, REPLAY_SSM
    from shardd.engine.reference import rollback as rb
    from shardd.engine.fast.shard import FastShard
    from shardd.engine.reference.shard import ShardModel
    from common.presets import preset_config
    from shardd.synthetic.model import synthetic_weights

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    config = preset_config(args.preset)
    out: dict = {"preset": args.preset, "dtype": "bfloat16", "block": BLOCK, "device": torch.cuda.get_device_name(device)}
    bandwidth = copy_bandwidth(torch, device)
    peak = matmul_peak(torch, device)
    out["copy_bandwidth_tb_s"] = round(bandwidth / 1e12, 3)
    out["bf16_matmul_tflop_s"] = round(peak / 1e12, 1)

    t0 = time.perf_counter()
    if args.fp8:  # FP8 linears (shardd.weights.quant.Fp8Linear, the weight-only GEMM); the floor counts their bytes + scales
        from shardd.weights.loading import ModelSource
        from shardd.weights.reader import shard_shapes

        out["quantize"] = args.fp8
        if args.fp8_pdl:  # every fixed tile config with programmatic dependent launch: the A/B against a plain run
            import dataclasses

            from shardd.engine.kernels import fp8_gemm

            fp8_gemm.TILE_TABLE.update({key: dataclasses.replace(c, pdl=True) for key, c in fp8_gemm.TILE_TABLE.items()})
            out["fp8_pdl"] = True
        weights = ModelSource(synthetic=f"{args.preset}:{args.seed}", quantize=args.fp8).tensors(
            shard_shapes(config, 0, config.num_layers), dtype=torch.bfloat16, device=device, keep_fp8=True)
    else:
        weights = synthetic_weights(config, 0, config.num_layers, args.seed, dtype=torch.bfloat16, device=device)
    model = ShardModel(config, weights, 0, config.num_layers, dtype=torch.bfloat16, device=device,
                       storage=rb.RollbackStorage(CHECKPOINT, BLOCK))
    del weights
    weight_bytes = model.weight_bytes()
    context = 4096  # the shards' cache length; the 32k step runs on a shard built for 32k (see attention's launch)
    shards = {CHECKPOINT: FastShard(model, max_sequences=2, max_context=context)}
    shards[REPLAY_SSM] = shards[CHECKPOINT].sharing_weights(rb.RollbackStorage(REPLAY_SSM, BLOCK))
    out["build_s"] = round(time.perf_counter() - t0, 1)
    out["weight_bytes"] = weight_bytes
    out["floor_ms"] = round(weight_bytes / bandwidth * 1e3, 3)
    out["checkpoint_bytes_per_sequence"] = shards[CHECKPOINT].checkpoint_bytes_per_sequence()
    out["replay_ssm_bytes_per_sequence"] = shards[REPLAY_SSM].checkpoint_bytes_per_sequence()
    print(f"built {args.preset} in {out['build_s']} s; floor {out['floor_ms']} ms", flush=True)

    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=generator).tolist()

    # greedy: the reference output, and its speed (a short warm-up run captures the graphs first)
    for shard in shards.values():  # warm-up: compiles the kernels and captures the graphs of each shard
        greedy_decode(LocalTarget.from_shards([shard], context), 99, prompt[:32], 4)
    target = LocalTarget.from_shards([shards[CHECKPOINT]], context)
    greedy = greedy_decode(target, 1, prompt, args.tokens)
    out["greedy_ms_per_token"] = round(greedy.decode_seconds / len(greedy.tokens) * 1e3, 3)
    # the first token comes from the prefill: the decode steps are one fewer than the tokens
    out["greedy_ms_per_decode_step"] = round(greedy.decode_seconds / greedy.steps * 1e3, 3)
    out["greedy_tok_s"] = round(len(greedy.tokens) / greedy.decode_seconds, 2)
    hashes = {"greedy": token_hash(greedy.tokens)}
    print(f"greedy {out['greedy_ms_per_token']} ms/token", flush=True)

    # speculative decoding with the oracle drafter, each mode, A/B/A
    tok_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    local_steps: dict[str, list[float]] = {}
    commits: dict[str, float] = {}
    for mode in (*MODES, *reversed(MODES)):
        shard = shards[CHECKPOINT if mode == "replay" else mode]
        target = LocalTarget.from_shards([shard], context)
        drafter = OracleDrafter.with_mean_commit(greedy.tokens, len(prompt), block_size=BLOCK, mean_commit=MEAN_COMMIT)
        result = speculative_decode(target, 2, prompt, drafter, block_size=BLOCK, rollback=mode, max_new_tokens=args.tokens)
        tok_s[mode].append(len(result.tokens) / result.decode_seconds)
        local_steps.setdefault(mode, []).append(result.decode_seconds / result.steps * 1e3)
        commits[mode] = result.avg_commit
        hashes[f"local/{mode}"] = token_hash(result.tokens)
        print(f"{mode}: {tok_s[mode][-1]:.1f} tok/s, mean commit {result.avg_commit:.2f}", flush=True)
    out["tok_s"] = {mode: round(statistics.median(v), 2) for mode, v in tok_s.items()}
    out["tok_s_runs"] = {mode: [round(x, 2) for x in v] for mode, v in tok_s.items()}
    out["mean_commit"] = {mode: round(v, 2) for mode, v in commits.items()}
    # a decode step's wall time as the two-daemon runs measure theirs (decode_seconds / steps): the relay's baseline
    out["local_step_ms"] = {mode: round(statistics.median(v), 3) for mode, v in local_steps.items()}

    # the step and the rollback alone
    def timed(fn, repeats):
        return cuda_seconds(torch, device, fn, repeats)

    def device_timed(fn, repeats):
        """Device time of fn's work, by events on the stream (what the next step waits for)."""
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return samples

    block = torch.randint(0, config.vocab_size, (BLOCK,), generator=generator).tolist()
    step_ms, rollback_ms, rollback_wall_ms = {}, {}, {}
    for mode in (CHECKPOINT, REPLAY_SSM):
        shard = shards[mode]
        state = shard.new_state(context)
        shard.forward(state, 0, tokens=prompt)
        pos = state.length
        forwards, rollbacks, walls = [], [], []
        for i in range(args.repeats):
            forwards += timed(lambda: shard.forward(state, pos, tokens=block, checkpoint=True), 1)
            measure = device_timed if i % 2 == 0 else timed
            (rollbacks if i % 2 == 0 else walls).extend(measure(lambda: shard.rollback(state, int(MEAN_COMMIT)), 1))
            state.length = pos  # timing only: the next step goes to the same position
        step_ms[mode], rollback_ms[mode], rollback_wall_ms[mode] = median_ms(forwards), median_ms(rollbacks), median_ms(walls)
        if mode == REPLAY_SSM:  # its rollback queues no work: the kept tokens re-run inside the next step
            clean = []  # steps after a rollback that kept the whole block (nothing to re-run)
            shard.forward(state, pos, tokens=block, checkpoint=True)  # the pending step the first rollback keeps
            for _ in range(args.repeats):
                shard.rollback(state, BLOCK)
                state.length = pos
                clean += timed(lambda: shard.forward(state, pos, tokens=block, checkpoint=True), 1)
            out["replay_ssm_rerun_ms"] = round(step_ms[mode] - median_ms(clean), 3)
            out["replay_ssm_step_without_rerun_ms"] = median_ms(clean)
        shard.release_state(state)
    # replay: snapshot, verify, restore, forward the kept tokens again
    shard = shards[CHECKPOINT]
    state = shard.new_state(context)
    shard.forward(state, 0, tokens=prompt)
    pos = state.length

    def replay_step():
        shard.snapshot(state)
        shard.forward(state, pos, tokens=block)
        shard.restore(state)
        shard.forward(state, pos, tokens=block[: int(MEAN_COMMIT)])
        state.length = pos

    step_ms["replay"] = median_ms(timed(replay_step, args.repeats))
    def greedy_step():
        shard.forward(state, pos, tokens=block[:1])
        state.length = pos

    out["greedy_step_ms"] = median_ms(timed(greedy_step, args.repeats))
    shard.release_state(state)
    out["step_ms"] = step_ms
    out["rollback_ms"] = rollback_ms  # device time: what the next step waits for
    out["rollback_wall_ms"] = rollback_wall_ms  # host call plus a synchronize
    out["floor_ratio_step"] = {mode: round(ms / out["floor_ms"], 3) for mode, ms in step_ms.items()}
    out["floor_ratio_greedy"] = round(out["greedy_ms_per_token"] / out["floor_ms"], 3)
    honest = step_floors(config, model, shards, pos, bandwidth)
    out["floor_parts_bytes"], out["floor_step_ms"] = honest
    out["floor_step_ratio"] = {
        "greedy": round(out["greedy_ms_per_decode_step"] / out["floor_step_ms"]["greedy"], 3),
        **{mode: round(step_ms[mode] / out["floor_step_ms"][mode], 3) for mode in (CHECKPOINT, REPLAY_SSM)}}
    if args.fp8:  # the FP8 step's targets, as multiples of the FP8 floor
        out["fp8_targets"] = {"greedy": 1.35, "verify": 1.45,
                              "greedy_met": out["floor_ratio_greedy"] <= 1.35,
                              "verify_met": all(r <= 1.45 for m, r in out["floor_ratio_step"].items() if m != "replay")}
    out["rollback_share_of_step"] = {mode: round(rollback_ms[mode] / step_ms[mode], 4) for mode in rollback_ms}
    print(f"step {step_ms} rollback {rollback_ms}", flush=True)

    # prefill of a 1024-token prompt (the reference model's chunked path, over the pooled state)
    long_prompt = torch.randint(0, config.vocab_size, (1024,), generator=generator).tolist()
    state = shard.new_state(context)

    def prefill():
        state.length = 0
        shard.forward(state, 0, tokens=long_prompt)

    prefill()
    seconds = statistics.median(timed(prefill, 3))
    out["prefill_path"] = "fla + flash attention" if shard.prefill_kernels else "reference model code"
    out["profile_prefill_top"] = profile_top(torch, prefill, 1)
    out["prefill_tok_s"] = round(1024 / seconds, 1)
    out["prefill_tflop_s"] = round(2 * weight_bytes / 2 * 1024 / seconds / 1e12, 1)
    out["prefill_share_of_peak"] = round(out["prefill_tflop_s"] * 1e12 / peak, 3)

    shard.release_state(state)
    # a step at a 32k-token context, on a shard built for it: the cache is synthetic (what it holds does not
    # change the work)
    shard = shards[CHECKPOINT].sharing_weights(rb.RollbackStorage(CHECKPOINT, BLOCK), max_sequences=1,
                                                  max_context=args.long_context + 2 * BLOCK)
    state = shard.new_state(args.long_context + 2 * BLOCK)
    pos = args.long_context
    state.length = pos
    shard.forward(state, pos, tokens=block, checkpoint=True)
    shard.rollback(state, 0)
    samples = []
    for _ in range(args.repeats):
        samples += timed(lambda: shard.forward(state, pos, tokens=block, checkpoint=True), 1)
        shard.rollback(state, 0)
    out["step_ms_at_32k_context"] = median_ms(samples)
    out["floor_ratio_step_at_32k"] = round(out["step_ms_at_32k_context"] / out["floor_ms"], 3)

    def step_and_back():
        shard.forward(state, pos, tokens=block, checkpoint=True)
        shard.rollback(state, 0)

    out["profile_step_at_32k_top"] = profile_top(torch, step_and_back, 5)
    shard.release_state(state)

    # where one step's time goes: the top kernels
    shard = shards[CHECKPOINT]
    state = shard.new_state(context)
    state.length = pos = 600
    out["profile_step_top"] = profile_top(torch, step_and_back, 5)
    shard.release_state(state)
    out["hashes"] = hashes
    return out


# ---- transformers: the baseline on the same weights -------------------------------------------------------


def run_transformers(args) -> dict:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from common.presets import preset_config
    from shardd.synthetic.model import synthetic_tensor

    device = torch.device("cuda:0")
    config = preset_config(args.preset)
    hf = config.to_hf_dict()
    fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields)).eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            name = key if key == "lm_head.weight" else key.removeprefix("model.")
            tensor.copy_(synthetic_tensor(config, name, tuple(tensor.shape), args.seed, device).to(tensor.dtype))
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=generator)[None].to(device)

    def generate(new_tokens):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            ids = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize(device)
        return time.perf_counter() - start, ids[0, prompt.shape[1]:].tolist()

    generate(2)
    short, _ = generate(1)
    new = min(args.tokens, 32)
    full, tokens = generate(new + 1)
    try:
        import fla  # noqa: F401
        with_fla = True
    except ImportError:
        with_fla = False
    return {"transformers_ms_per_token": round((full - short) / new * 1e3, 3), "transformers_tokens": new,
            "transformers_with_fla": with_fla,
            "transformers_version": __import__("transformers").__version__}


# ---- e2e: two daemons on two GPUs ------------------------------------------------------------------------


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


# ---- dflash: the real drafter's PROPOSE every step, on one GPU ------------------------------------------------


def run_dflash_drafter(args) -> dict:
    """--parts dflash's first part, in a process of its own, so that none of its GPU memory (the drafter's graphs
    keep private pools) is held while the placements' daemons load on the same GPU."""
    if not args.dflash_device.startswith("cuda"):
        return {}
    out = drafter_in_process(args)
    print(f"drafter PROPOSE in process: fast {out['draft_propose_ms_fast']} ms, reference "
          f"{out['draft_propose_ms_reference']} ms, floor {out['draft_floor_ms']} ms", flush=True)
    return out


def drafter_in_process(args) -> dict:
    """PROPOSE's compute alone, in this process: the drafter (`--draft`) of the preset's target, its fast path
    (CUDA graphs) and its reference (eager), one context step of MEAN_COMMIT rows plus a 16-row block, against
    the weight-read floor of the drafter and the target head it borrows."""
    import torch

    from shardd.draft.model import DFlashDrafter
    from common.draft_config import parse_draft, synthetic_draft_config
    from shardd.draft.synthetic import synthetic_draft_weights
    from shardd.engine.fast.draft import FastDrafter
    from common.presets import preset_config
    from shardd.synthetic.model import synthetic_tensor

    device = torch.device(args.dflash_device)
    torch.cuda.set_device(device)
    target = preset_config(args.preset)
    _, layers = parse_draft(args.draft)
    config = synthetic_draft_config(target, num_layers=layers)
    vocab_shape = (target.vocab_size, target.hidden_size)
    embed = synthetic_tensor(target, "embed_tokens.weight", vocab_shape, args.seed, device).to(torch.bfloat16)
    head = synthetic_tensor(target, "lm_head.weight", vocab_shape, args.seed, device).to(torch.bfloat16)
    reference = DFlashDrafter(config, synthetic_draft_weights(config, args.seed, dtype=torch.bfloat16),
                              target_embed=embed, target_lm_head=head, device=device, dtype=torch.bfloat16)
    bandwidth = copy_bandwidth(torch, device)
    read_bytes = reference.weight_bytes() + head.nbytes  # the layers, fc, and the head for the mask rows
    context = args.prompt_len + args.tokens + 4 * BLOCK
    fast = FastDrafter(reference, max_sequences=1, max_context=context)
    generator = torch.Generator().manual_seed(args.seed)
    prompt_rows = torch.randn(args.prompt_len, config.feature_size, generator=generator).to(torch.bfloat16)
    step_rows = torch.randn(int(MEAN_COMMIT), config.feature_size, generator=generator).to(torch.bfloat16)
    out = {"draft_read_bytes": read_bytes, "draft_floor_ms": round(read_bytes / bandwidth * 1e3, 3),
           "draft_layers": layers, "draft_rows_per_step": fast.batch_rows}
    for name, model in (("fast", fast), ("reference", reference)):
        state = model.new_state(context)
        model.add_context(state, prompt_rows)
        start_length = state.length

        def propose():
            model.crop(state, start_length)
            model.add_context(state, step_rows)
            model.propose(state, 1, BLOCK)

        for _ in range(3):
            propose()
        out[f"draft_propose_ms_{name}"] = median_ms(cuda_seconds(torch, device, propose, args.repeats))
        if name == "fast":
            out["profile_propose_top"] = profile_top(torch, propose, 5)
        model.release_state(state)
    out["draft_floor_ratio"] = round(out["draft_propose_ms_fast"] / out["draft_floor_ms"], 3)
    # the daemon's drafter beside a batched verify: one step of R = 8 blocks for every count up to 8 sequences
    batched = FastDrafter(reference, max_sequences=32, max_context=context, step_rows=8 * BLOCK)
    out["draft_batch_rows_per_step"] = batched.batch_rows
    out["draft_batch_ms"] = {}
    for count in (1, 8, 32):
        states = [batched.new_state(context) for _ in range(count)]
        batched.add_context_batch([(state, prompt_rows) for state in states])

        def propose_all():
            for state in states:
                batched.crop(state, args.prompt_len)
            batched.add_context_batch([(state, step_rows) for state in states])
            batched.propose_batch([(state, 1, BLOCK) for state in states])

        for _ in range(3):
            propose_all()
        samples = []
        for _ in range(args.repeats):
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            propose_all()
            torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - began)
        out["draft_batch_ms"][str(count)] = median_ms(samples)
        if count in (1, 8):
            out.setdefault("profile_batch_top", {})[str(count)] = profile_top(torch, propose_all, 5)
        for state in states:
            batched.release_state(state)
    out["draft_batch_8_vs_1"] = round(out["draft_batch_ms"]["8"] / out["draft_batch_ms"]["1"], 3)
    return out


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


class TimedTarget:
    """A decode target whose verify forwards (at most BLOCK rows: not the prefill) and rollbacks are timed;
    `on_decode()` runs once, before the first verify (after the prefill)."""

    def __init__(self, target, on_decode=None):
        self.target = target
        self.seconds = {"verify": 0.0, "rollback": 0.0}
        self.on_decode = on_decode
        self.at_decode = None

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, seq, pos, tokens, **kwargs):
        if self.at_decode is None and len(tokens) <= BLOCK and self.on_decode is not None:
            self.at_decode = self.on_decode()
        began = time.perf_counter()
        ids = self.target.forward(seq, pos, tokens, **kwargs)
        if len(tokens) <= BLOCK:
            self.seconds["verify"] += time.perf_counter() - began
        return ids

    def rollback(self, seq, keep):
        began = time.perf_counter()
        self.target.rollback(seq, keep)
        self.seconds["rollback"] += time.perf_counter() - began


class ProposingOracle:
    """The real DFlash drafter's PROPOSE every step (its whole cost: features sent, context appended, a block
    drafted), then the oracle's tokens: the steps commit as at the oracle's mean acceptance, so the time is
    the real drafter's even though synthetic weights accept nothing."""

    name = "dflash (real PROPOSE, oracle commits)"

    def __init__(self, dflash, oracle):
        self.dflash, self.oracle = dflash, oracle
        self.seconds = 0.0
        self.on_first, self.at_decode = None, None

    def propose(self, history, n):
        if self.at_decode is None and self.on_first is not None:
            self.at_decode = self.on_first()
        began = time.perf_counter()
        self.dflash.propose(history, n)
        self.seconds += time.perf_counter() - began
        return self.oracle.propose(history, n)

    # A scheduler stream: its sequence opened, closed and re-filled through the DFlash client's target, and its
    # forwards prepared and collected by it, so the real drafter's context follows as with DFlash alone.
    @property
    def target(self):
        return self.dflash.target

    def prepare(self, forward):
        return self.dflash.prepare(forward)

    def collect(self, forward, answer):
        return self.dflash.collect(forward, answer)


def run_dflash(args) -> dict:
    """Two target daemons (layers 0:L/2, L/2:L) and the drafter in each placement, all on one GPU: the drafter
    in its own daemon ("own"), beside the first shard's layers ("first"), beside the last ("last": it proposes
    the next block in the verify's reply, no PROPOSE round trip; "last-propose": the same daemon asked with
    PROPOSE every step). Per
    placement and mean commit: tok/s with the real PROPOSE every step, the oracle's on the same daemons, and
    the per-step breakdown (client wall time of propose / verify / rollback; daemon compute from STATS; relay =
    the step's wall time beyond the daemons' compute)."""
    import torch

    from coordinator.relay.client import ShardClient
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.drafting.drafters import OracleDrafter
    from coordinator.relay.pipeline import Pipeline
    from common.presets import preset_config

    out: dict = {"dflash_draft": args.draft, "dflash_device": args.dflash_device, "dflash_block": BLOCK}
    config = preset_config(args.preset)
    half = config.num_layers // 2
    placements = [placement for placement in args.placements.split(",") if placement]
    if not placements:
        return out
    specs = {"first": ["--layers", f"0:{half}"], "last": ["--layers", f"{half}:{config.num_layers}"]}
    hosts = {"last-propose": "last"}  # a placement measured on another placement's daemon
    for placement in placements:
        host = hosts.get(placement, placement)
        if host in ("first", "last"):
            if "--draft" not in specs[host]:
                specs[host] += ["--draft", args.draft]
        else:
            specs[host] = ["--layers", "none", "--draft", args.draft]
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    commits = [float(c) for c in args.commits.split(",")]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-dflash-"))
    processes, endpoints = serve_processes(args, specs, run_dir)
    hashes: dict = {}
    try:
        stats_clients = {name: ShardClient(endpoint, timeout_s=60) for name, endpoint in endpoints.items()}
        draft_clients = {name: ShardClient(endpoints[hosts.get(name, name)], timeout_s=600) for name in placements}

        def drafter_client(placement):
            dflash = DFlashDrafterClient(draft_clients[placement], pipeline)
            if placement == "last-propose":
                dflash.proposes_in_reply = False
            return dflash

        def compute_seconds():
            return {name: dict(client.stats()["compute_seconds"]) for name, client in stats_clients.items()}

        def daemon_ms(before, after, steps):
            """Daemon compute per decode step by request type (a step's types), summed over the daemons."""
            totals: dict = {}
            for name in after:
                for kind, seconds in after[name].items():
                    if kind not in ("FORWARD", "CAPTURE", "PROPOSE", "ROLLBACK"):
                        continue
                    totals[kind] = totals.get(kind, 0.0) + seconds - before[name].get(kind, 0.0)
            return {kind: round(seconds / steps * 1e3, 3) for kind, seconds in sorted(totals.items()) if seconds > 0}

        with Pipeline.connect([endpoints["first"], endpoints["last"]], timeout_s=600) as pipeline:
            greedy_decode(pipeline, 90, prompt[:32], 4)  # warm-up
            greedy = greedy_decode(pipeline, 1, prompt, args.tokens)
            hashes["dflash/greedy"] = token_hash(greedy.tokens)
            out["dflash_greedy_ms_per_token"] = round(greedy.decode_seconds / len(greedy.tokens) * 1e3, 3)
            runs: dict = {}

            def oracle_run(commit):
                target = TimedTarget(pipeline, compute_seconds)
                drafter = OracleDrafter.with_mean_commit(greedy.tokens, len(prompt), block_size=BLOCK, mean_commit=commit)
                result = speculative_decode(target, 2, prompt, drafter, block_size=BLOCK, max_new_tokens=args.tokens)
                return result, target, None, daemon_ms(target.at_decode, compute_seconds(), result.steps)

            def dflash_run(placement, commit):
                dflash = drafter_client(placement)
                target = TimedTarget(dflash.target)
                oracle = OracleDrafter.with_mean_commit(greedy.tokens, len(prompt), block_size=BLOCK, mean_commit=commit)
                drafter = ProposingOracle(dflash, oracle)
                # the daemons' compute from the first PROPOSE on (it carries the prompt's features: a decode cost)
                drafter.on_first = compute_seconds
                result = speculative_decode(target, 3, prompt, drafter, block_size=BLOCK, max_new_tokens=args.tokens)
                return result, target, drafter, daemon_ms(drafter.at_decode, compute_seconds(), result.steps)

            def record(key, commit, run):
                result, target, drafter, daemon = run
                steps = result.steps
                entry = {
                    "tok_s": round(len(result.tokens) / result.decode_seconds, 2),
                    "mean_commit": round(result.avg_commit, 2),
                    "step_ms": round(result.decode_seconds / steps * 1e3, 3),
                    "propose_ms": round(drafter.seconds / steps * 1e3, 3) if drafter else 0.0,
                    "proposals_in_reply": drafter.dflash.proposals_in_reply if drafter else 0,
                    "verify_ms": round(target.seconds["verify"] / steps * 1e3, 3),
                    "rollback_ms": round(target.seconds["rollback"] / steps * 1e3, 3),
                    "daemon_ms": daemon,
                }
                entry["relay_ms"] = round(entry["step_ms"] - sum(daemon.values()), 3)
                runs.setdefault(key, {}).setdefault(f"{commit:g}", []).append(entry)
                hashes[f"dflash/{key}/{commit:g}"] = token_hash(result.tokens)
                print(f"{key} commit {commit:g}: {entry['tok_s']} tok/s, step {entry['step_ms']} ms "
                      f"(propose {entry['propose_ms']}, verify {entry['verify_ms']}, rollback {entry['rollback_ms']}, "
                      f"relay {entry['relay_ms']})", flush=True)

            for placement in placements:  # warm-up: each drafter's graphs, each daemon's first PROPOSE
                dflash = drafter_client(placement)
                speculative_decode(dflash.target, 91, prompt[:64], dflash, block_size=BLOCK, max_new_tokens=4)
            for commit in commits:
                record("oracle", commit, oracle_run(commit))
                for placement in placements:
                    record(placement, commit, dflash_run(placement, commit))
                record("oracle", commit, oracle_run(commit))  # A/B/A: the oracle before and after
            # the real drafter's own tokens (synthetic weights: about one token per step), still the greedy output
            dflash = drafter_client(placements[0])
            real = speculative_decode(dflash.target, 4, prompt, dflash, block_size=BLOCK, max_new_tokens=args.tokens)
            hashes["dflash/real"] = token_hash(real.tokens)
            out["dflash_real_tok_s"] = round(len(real.tokens) / real.decode_seconds, 2)
            out["dflash_real_mean_commit"] = round(real.avg_commit, 2)
            out["dflash_real_identical_to_greedy"] = real.tokens == greedy.tokens
    finally:
        stop_processes(processes)

    def median_entry(entries):
        return {key: (round(statistics.median(e[key] for e in entries), 3) if not isinstance(entries[0][key], dict)
                      else entries[len(entries) // 2][key]) for key in entries[0]}

    out["dflash_runs"] = {key: {c: median_entry(v) for c, v in by_commit.items()} for key, by_commit in runs.items()}
    oracle = out["dflash_runs"]["oracle"]
    out["dflash_vs_oracle"] = {
        placement: {c: {"tok_s": round(entry["tok_s"] / oracle[c]["tok_s"], 3),
                        "step": round(entry["step_ms"] / oracle[c]["step_ms"], 3)}
                    for c, entry in out["dflash_runs"][placement].items()}
        for placement in placements
    }
    best = max(placements, key=lambda p: out["dflash_vs_oracle"][p][f"{max(commits):g}"]["tok_s"])
    out["dflash_best_placement"] = best
    out["hashes"] = hashes
    return out


def dflash_table(merged: dict) -> str:
    """The short table the GPU script prints last."""
    lines = [f"drafter PROPOSE (in process): fast {merged.get('draft_propose_ms_fast')} ms, reference "
             f"{merged.get('draft_propose_ms_reference')} ms, floor {merged.get('draft_floor_ms')} ms "
             f"(x{merged.get('draft_floor_ratio')})"]
    runs = merged.get("dflash_runs", {})
    lines.append(f"{'run':<12} {'commit':>6} {'tok/s':>8} {'step ms':>8} {'propose':>8} {'verify':>8} {'rollback':>8} "
                 f"{'relay':>7} {'vs oracle':>9}")
    for key, by_commit in runs.items():
        for commit, e in by_commit.items():
            ratio = merged.get("dflash_vs_oracle", {}).get(key, {}).get(commit, {}).get("tok_s", 1.0 if key == "oracle" else "")
            lines.append(f"{key:<12} {commit:>6} {e['tok_s']:>8} {e['step_ms']:>8} {e['propose_ms']:>8} {e['verify_ms']:>8} "
                         f"{e['rollback_ms']:>8} {e['relay_ms']:>7} {ratio:>9}")
    lines.append(f"best placement: {merged.get('dflash_best_placement')}; real drafter {merged.get('dflash_real_tok_s')} tok/s "
                 f"(commit {merged.get('dflash_real_mean_commit')}), identical to greedy: "
                 f"{merged.get('dflash_real_identical_to_greedy')}; all outputs identical: {merged.get('outputs_identical')}")
    return "\n".join(lines)


# ---- dflash-batch: DFlash streams in the scheduler's batches, and through shardctl serve -------------------

HTTP_STREAMS = (1, 8)
AVERAGED = ("tok_s", "decode_tok_s", "step_ms", "mean_commit")  # the oracle's figures: its two runs' mean


def run_dflash_batch(args) -> dict:
    """Two target daemons (layers 0:L/2, L/2:L) with the drafter beside the last shard (the shipped placement:
    it proposes the next block in the verify's reply), chained as `shardctl launch` chains them (the rows, and the
    first shard's captured layers with them, go from shard to shard), replay-ssm storage for every stream, all on
    `--dflash-device`. Per --streams count, that many streams together through the scheduler: the oracle, then
    DFlash (the real drafter proposing every step, the oracle's commit schedule deciding what is accepted:
    `ProposingOracle`), then the oracle again (A/B/A). Then `shardctl serve --drafter dflash` (the real drafter's
    own tokens) beside `--drafter none` on the same daemons, HTTP_STREAMS concurrent greedy completions."""
    from bench_batch import digest, run_streams, stream_prompts
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.relay.client import ShardClient
    from coordinator.relay.pipeline import Pipeline
    from common.presets import preset_config

    streams = [int(count) for count in args.streams.split(",")]
    layers = preset_config(args.preset).num_layers
    specs = {"first": ["--layers", f"0:{layers // 2}"],
             "last": ["--layers", f"{layers // 2}:{layers}", "--draft", args.draft]}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-dflash-batch-"))
    widest = max(*streams, *HTTP_STREAMS)
    spied = Path(args.pyspy).resolve() if args.pyspy else None
    if spied is not None:
        spied.mkdir(parents=True, exist_ok=True)
    processes, endpoints = serve_processes(args, specs, run_dir, max_sequences=widest + 1, rollback="replay-ssm",
                                           pyspy=spied, chained=True)
    shards = [endpoints["first"], endpoints["last"]]
    prompts = stream_prompts(args, widest)
    out: dict = {"dflash_batch_streams": streams, "dflash_batch_draft": args.draft,
                 "dflash_batch_device": args.dflash_device, "dflash_batch_engine": args.dflash_engine}
    runs: dict = {"oracle": {}, "dflash": {}}
    checks: dict = {}
    try:
        with Pipeline.connect(shards, timeout_s=600) as pipeline, ShardClient(endpoints["last"], timeout_s=600) as client:
            dflash = DFlashDrafterClient(client, pipeline)
            drafters: list = []

            def proposing(index, oracle):
                drafters.append(ProposingOracle(dflash.fresh(), oracle))
                return drafters[-1]

            def run(kind, count, greedy, args=args):
                drafters.clear()
                stats: dict = {}
                before = phase_readings(pipeline)
                tokens, tok_s, commit = run_streams(pipeline, prompts[:count], args, references=greedy, stats=stats,
                                                    wrap=proposing if kind == "dflash" else None)
                after = phase_readings(pipeline)
                entry = {"tok_s": tok_s, "decode_tok_s": stats["decode_tok_s"], "step_ms": stats["step_ms"],
                         "mean_commit": commit, "steps": stats["steps"], "digest": digest(tokens),
                         # where a scheduler step's time goes: per shard, the daemon's phases and the coordinator's
                         # phases of its requests, ms per step (steps: the first shard's requests)
                         "phases_per_step": shard_phases(before, after)}
                if kind == "dflash":  # blocks the head shard proposed in a verify's reply (no PROPOSE sent)
                    entry["proposals_in_reply"] = sum(d.dflash.proposals_in_reply for d in drafters)
                print(f"dflash-batch {kind} x{count}: {tok_s} tok/s (decode {entry['decode_tok_s']}), step "
                      f"{entry['step_ms']} ms, mean commit {commit}", flush=True)
                return tokens, entry

            # warm-up: every path the runs take (prompt chunks, verify steps, the drafter's first PROPOSE and replies)
            warm = argparse.Namespace(**{**vars(args), "tokens": min(args.tokens, 2 * BLOCK)})
            reference, _, _ = run_streams(pipeline, prompts[:2], warm)
            run("oracle", 2, reference, warm)
            run("dflash", 2, reference, warm)
            greedy, _, _ = run_streams(pipeline, prompts[:max(streams)], args)
            alone = None  # stream 0's DFlash tokens decoded by itself
            for count in streams:
                entries = []
                for kind in ("oracle", "dflash", "oracle"):  # A/B/A: the oracle before and after
                    tokens, entry = run(kind, count, greedy)
                    entries.append(entry)
                    checks[f"{kind}_x{count}_equals_greedy"] = checks.get(f"{kind}_x{count}_equals_greedy", True) \
                        and tokens == greedy[:count]
                    if kind == "dflash":
                        if count == 1:
                            alone = tokens[0]
                        elif alone is None:
                            alone = run("dflash", 1, greedy)[0][0]
                        checks[f"dflash_x{count}_stream0_equals_alone"] = tokens[0] == alone
                runs["dflash"][str(count)] = entries[1]
                runs["oracle"][str(count)] = {key: (round((a + b) / 2, 3) if key in AVERAGED and None not in (a, b) else a)
                                              for (key, a), b in zip(entries[0].items(), entries[2].values())}
            # per shard, whether its prefill's graphs replay each set of captured layers (a set that stays eager
            # costs a prompt its launches)
            out["dflash_batch_prefill_graphs"] = [shard.get("engine", {}).get("prefill_graphs")
                                                  for shard in pipeline.stats()]
        out["dflash_batch_http"] = dflash_http(args, shards, endpoints["last"], prompts, run_dir, checks)
    finally:
        stop_processes(processes, profiled=spied is not None)
    if spied is not None:  # each daemon's busiest frames over the whole part (py-spy wrote them as it exited)
        out["dflash_batch_pyspy"] = {path.stem: pyspy_top(path, **PYSPY_STEADY) for path in sorted(spied.glob("*.txt"))}
    out["dflash_batch_runs"] = runs
    out["dflash_batch_vs_oracle"] = {
        count: {figure: round(runs["dflash"][count][key] / runs["oracle"][count][key], 3)
                for figure, key in (("step", "step_ms"), ("tok_s", "tok_s"), ("decode_tok_s", "decode_tok_s"))
                if runs["dflash"][count][key] and runs["oracle"][count][key]}
        for count in runs["dflash"]}
    out["dflash_batch_checks"] = checks
    out["dflash_batch_identical"] = all(checks.values())
    return out


def dflash_http(args, shards: list[str], draft_shard: str, prompts, run_dir: Path, checks: dict) -> dict:
    """`shardctl serve --drafter dflash` (the drafter beside the last shard, its own proposals), the same with
    `--block-size auto` (`dflash-auto`), and `--drafter none` over the same daemons, HTTP_STREAMS concurrent greedy
    completions each: tok/s by drafter and streams, `dflash_vs_none` and `dflash_auto_vs_none`; into `checks`,
    DFlash's texts equal to greedy's and stream 0's to itself alone."""
    from bench_batch import http_streams

    dflash = ["--drafter", "dflash", "--draft-shard", draft_shard, "--rollback", "replay-ssm"]
    serve_args = {"none": ["--drafter", "none"], "dflash": dflash, "dflash-auto": [*dflash, "--block-size", "auto"]}
    out: dict = {name: {} for name in serve_args}
    try:
        for count in HTTP_STREAMS:
            for drafter, extra in serve_args.items():
                out[drafter][str(count)] = http_streams(args, shards, prompts[:count], run_dir, serve_args=extra)
                print(f"dflash-batch HTTP {drafter} x{count}: {out[drafter][str(count)]['tok_s']} tok/s", flush=True)
    except Exception as error:  # noqa: BLE001 - e.g. the serve extra (fastapi, uvicorn, httpx) not installed
        out["error"] = f"{type(error).__name__}: {error}"
        print(f"dflash-batch HTTP failed: {out['error']}", flush=True)
        return out
    for count in HTTP_STREAMS:
        none = out["none"][str(count)]
        for name in ("dflash", "dflash-auto"):
            runs = out[name]
            checks[f"http_{name}_x{count}_equals_greedy"] = runs[str(count)]["stream_digests"] == none["stream_digests"]
            checks[f"http_{name}_x{count}_stream0_equals_alone"] = (runs[str(count)]["stream_digests"][0]
                                                                    == runs[str(HTTP_STREAMS[0])]["stream_digests"][0])
    for name in ("dflash", "dflash-auto"):
        out[f"{name.replace('-', '_')}_vs_none"] = {
            str(count): round(out[name][str(count)]["tok_s"] / out["none"][str(count)]["tok_s"], 3)
            for count in HTTP_STREAMS}
    return out


def dflash_batch_table(merged: dict) -> str:
    """The short table the GPU script prints last."""
    lines = [f"{'streams':>7} {'run':<7} {'tok/s':>8} {'decode':>8} {'step ms':>8} {'commit':>6} "
             f"{'step vs oracle':>14} {'tok/s vs oracle':>15}"]
    for count, dflash in merged.get("dflash_batch_runs", {}).get("dflash", {}).items():
        oracle = merged["dflash_batch_runs"]["oracle"][count]
        ratio = merged.get("dflash_batch_vs_oracle", {}).get(count, {})
        for kind, e in (("oracle", oracle), ("dflash", dflash)):
            lines.append(f"{count:>7} {kind:<7} {e['tok_s']:>8} {str(e['decode_tok_s']):>8} {str(e['step_ms']):>8} "
                         f"{str(e['mean_commit']):>6} {ratio.get('step', '') if kind == 'dflash' else '':>14} "
                         f"{ratio.get('tok_s', '') if kind == 'dflash' else '':>15}")
    http = merged.get("dflash_batch_http", {})
    for count, ratio in http.get("dflash_vs_none", {}).items():
        auto = http.get("dflash_auto_vs_none", {}).get(count)
        lines.append(f"HTTP x{count}: dflash {http['dflash'][count]['tok_s']} tok/s, none {http['none'][count]['tok_s']} "
                     f"tok/s ({ratio})" + (f"; --block-size auto {http['dflash-auto'][count]['tok_s']} tok/s ({auto})"
                                           if auto is not None else ""))
    if "error" in http:
        lines.append(f"HTTP failed: {http['error']}")
    lines.append(f"dflash_batch_identical: {merged.get('dflash_batch_identical')}"
                 + "".join(f"\n  differs: {name}" for name, ok in merged.get("dflash_batch_checks", {}).items() if not ok))
    return "\n".join(lines)


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


PYSPY_RATE = 1000  # samples a second: ~19 a verify step
PYSPY_STEADY = {"within": "serve_loop", "without": ("_capture", "prefill", "_freeze_heap")}


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


# ---- delay: two hosts, simulated by a delaying relay ----------------------------------------------------------

DELAYS_MS = (0.0, 0.1, 0.5, 2.0)
DELAY_BLOCKS = (4, 8, 16)
DELAY_REPEATS = 3


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_proxy(target_port: int, delay_ms: float) -> tuple[subprocess.Popen, int]:
    """scripts/delay_proxy.py in front of a daemon's port: (process, the port to connect to)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "delay_proxy.py"), "--listen", f"127.0.0.1:{port}",
                                "--to", f"127.0.0.1:{target_port}", "--delay-ms", str(delay_ms)],
                               stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise RuntimeError("the delay proxy did not start")
    return process, port


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def run_relay_vs_delay(args) -> dict:
    """The two daemons on tcp loopback, each behind a relay that adds a one-way delay to everything it carries
    (0, 0.1, 0.5, 2 ms: a second host on a fast, an ordinary and a slow link); greedy and checkpoint speculative
    decoding at block sizes 4, 8, 16 (oracle drafter at the same commit fraction). The step time's slope against
    the one-way delay, halved, is the number of round trips a step waits for."""
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.drafters import OracleDrafter
    from coordinator.relay.pipeline import Pipeline
    from common.presets import preset_config

    ranges, prompt = halves_and_prompt(args)
    ports = [free_port(), free_port()]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-delay-"))
    processes, endpoints = start_daemons(args, ranges, "checkpoint", run_dir, devices=e2e_devices(args), tag="-tcp",
                                         tcp_ports=ports)
    greedy_ms, step_ms, tok_s, hashes = [], {b: [] for b in DELAY_BLOCKS}, {b: [] for b in DELAY_BLOCKS}, {}
    try:
        with Pipeline.connect(endpoints, timeout_s=600) as pipeline:
            greedy_decode(pipeline, 98, prompt[:32], 4)  # warm-up: capture the graphs
            reference = greedy_decode(pipeline, 1, prompt, args.tokens).tokens
        for delay in DELAYS_MS:
            proxies = [start_proxy(port, delay) for port in ports]
            try:
                with Pipeline.connect([f"tcp://127.0.0.1:{port}" for _, port in proxies], timeout_s=600) as pipeline:
                    greedy_decode(pipeline, 97, prompt[:8], 2)  # the connections' first requests
                    # the least disturbed of `repeats` runs (a shared host adds noise, never removes time)
                    runs = [greedy_decode(pipeline, 1, prompt, args.tokens) for _ in range(DELAY_REPEATS)]
                    greedy = min(runs, key=lambda r: r.decode_seconds / r.steps)
                    greedy_ms.append(round(greedy.decode_seconds / greedy.steps * 1e3, 3))
                    hashes[f"delay{delay}/greedy"] = token_hash(greedy.tokens)
                    for block in DELAY_BLOCKS:
                        drafter = OracleDrafter.with_mean_commit(reference, len(prompt), block_size=block,
                                                                 mean_commit=block * MEAN_COMMIT / BLOCK)
                        runs = [speculative_decode(pipeline, 2, prompt, drafter, block_size=block,
                                                   rollback="checkpoint", max_new_tokens=args.tokens)
                                for _ in range(DELAY_REPEATS)]
                        result = min(runs, key=lambda r: r.decode_seconds / r.steps)
                        step_ms[block].append(round(result.decode_seconds / result.steps * 1e3, 3))
                        tok_s[block].append(round(len(result.tokens) / result.decode_seconds, 2))
                        hashes[f"delay{delay}/block{block}"] = token_hash(result.tokens)
                print(f"delay {delay} ms: greedy {greedy_ms[-1]} ms/token, tok/s by block "
                      f"{ {b: tok_s[b][-1] for b in DELAY_BLOCKS} }", flush=True)
            finally:
                for process, _ in proxies:
                    process.kill()
                    process.wait()
    finally:
        stop_processes(processes)
    delays = list(DELAYS_MS)
    return {"relay_vs_delay": {
        "delays_ms_one_way": delays,
        "blocks": list(DELAY_BLOCKS),
        "greedy_ms_per_token": greedy_ms,
        "step_ms": {str(b): v for b, v in step_ms.items()},
        "tok_s": {str(b): v for b, v in tok_s.items()},
        # d(step)/d(one-way delay) / 2: round trips a step waits for (two shards: 2 when nothing else waits)
        "round_trips_per_step": {"greedy": round(slope(delays, greedy_ms) / 2, 2),
                                 **{str(b): round(slope(delays, v) / 2, 2) for b, v in step_ms.items()}},
        "hidden_bytes_per_row": preset_config(args.preset).hidden_size * (2 if args.e2e_dtype == "bfloat16" else 4),
    }, "hashes": hashes}


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


# ---- batch-step: the batched fixed-shape step by R -------------------------------------------------------


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


# ---- constrained decoding --------------------------------------------------------------------------------

GUIDED_STREAMS = 8
GUIDED_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 400},
                                                  "notes": {"type": "array", "items": {"type": "string"}}},
                 "required": ["title", "notes"]}


def run_guided(args) -> dict:
    """One process, the whole model (bf16, CUDA graphs) as one FastShard under the scheduler: 8 greedy streams with
    the n-gram drafter, each constrained to GUIDED_SCHEMA (a matcher per stream, masks on the head) against the same
    streams unconstrained; the mean wall time of a step (`guided_step_ms`, `plain_step_ms`) and their ratio
    (`guided_step_ratio`, target <= 1.10)."""
    import torch

    from common.presets import preset_config
    from coordinator.drafting.drafters import NgramDrafter
    from coordinator.guided import GrammarCompiler, GrammarSpec
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import Scheduler
    from coordinator.tokenizer import HFTokenizer
    from protocol.layout import CHECKPOINT
    from shardd.engine.fast.shard import FastShard
    from shardd.engine.reference import rollback as rb
    from shardd.engine.reference.shard import ShardModel
    from shardd.local import LocalTarget
    from shardd.synthetic.model import synthetic_weights

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    config = preset_config(args.preset)
    weights = synthetic_weights(config, 0, config.num_layers, args.seed, dtype=torch.bfloat16, device=device)
    model = ShardModel(config, weights, 0, config.num_layers, dtype=torch.bfloat16, device=device,
                       storage=rb.RollbackStorage(CHECKPOINT, BLOCK))
    del weights
    context = args.prompt_len + args.tokens + 2 * BLOCK
    target = LocalTarget.from_shards([FastShard(model, max_sequences=GUIDED_STREAMS, max_context=context)], context)
    tokenizer = HFTokenizer.synthetic_for(config.vocab_size)
    compiler = GrammarCompiler(tokenizer, config.vocab_size)
    spec = GrammarSpec.json_schema(GUIDED_SCHEMA)
    prompt = torch.randint(0, 256, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed)).tolist()

    def step_ms(guided: bool) -> tuple[float, int]:
        times: list[float] = []
        last = [time.perf_counter()]

        def on_step(report) -> None:
            now = time.perf_counter()
            if report.prefill_rows == 0:
                times.append(now - last[0])
            last[0] = now

        scheduler = Scheduler(target, max_sequences=GUIDED_STREAMS, on_step=on_step)
        requests = [Request(prompt, args.tokens, drafter=NgramDrafter(), block_size=BLOCK,
                            guide=compiler.guide(spec) if guided else None) for _ in range(GUIDED_STREAMS)]
        scheduler.run_all(requests)
        return statistics.mean(times[1:]) * 1e3, sum(len(r.result.tokens) for r in requests)

    step_ms(True)  # warm: graphs captured, the grammar compiled
    runs = {"plain": [], "guided": []}
    for _ in range(3):  # A/B/A/B...
        for name in ("plain", "guided"):
            runs[name].append(step_ms(name == "guided"))
    plain = statistics.median(ms for ms, _ in runs["plain"])
    guided = statistics.median(ms for ms, _ in runs["guided"])
    return {"preset": args.preset, "device": torch.cuda.get_device_name(device), "guided_streams": GUIDED_STREAMS,
            "guided_block": BLOCK, "guided_tokens": {name: [n for _, n in rs] for name, rs in runs.items()},
            "plain_step_ms": round(plain, 3), "guided_step_ms": round(guided, 3),
            "guided_step_ratio": round(guided / plain, 3)}


# ---- moe: the sparse step ----------------------------------------------------------------------------------


def moe_floor_bytes(config, model, shard, context: int, rows: int, distinct: list[int], *, checkpoint: bool) -> dict:
    """The bytes a step of `rows` rows must move on a MoE shard, by part (as step_floors counts a dense one): every
    weight once but the embedding table and the routed experts, of which it reads the `distinct` experts its rows
    select in each layer; the GDN states, the K/V of the context, and a checkpointed verify's rollback writes."""
    itemsize = 2  # bf16 activations and K/V
    moe, h = config.moe, config.hidden_size
    expert = expert_bytes(model)  # bf16, or FP8 bytes and their scales
    embedding = model.embed_tokens.nbytes if model.embed_tokens is not None else 0
    layers = model.end - model.begin
    kv_row = 2 * config.num_key_value_heads * config.head_dim * itemsize * len(model.attention_layers)
    return {
        "dense_weights": model.weight_bytes() - embedding - layers * moe.num_experts * expert,
        "routed_experts": sum(distinct) * expert,
        "embedding_rows": rows * h * itemsize,
        "gdn_state_read_write": 2 * len(model.gdn_layers) * (config.recurrent_state_bytes() + config.conv_state_bytes()),
        "kv_read": kv_row * context,
        "kv_rows_write": rows * kv_row,
        "checkpoint_writes": shard.checkpoint_bytes_per_sequence() if checkpoint else 0,
    }


def expert_bytes(model) -> int:
    """What one routed expert's three matrices hold (the first sparse layer's first expert): bf16 elements, or FP8
    bytes with their scales."""
    from shardd.engine.reference.moe import SparseMoeBlock

    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    first = block.experts[0]
    return sum(m.nbytes for m in (first.gate_proj, first.up_proj, first.down_proj))


def run_moe(args) -> dict:
    import torch

    from coordinator.decoding import greedy_decode
    from common.presets import preset_config
    from protocol.layout import CHECKPOINT
    from shardd.engine.fast.shard import FastShard
    from shardd.engine.kernels import moe as moe_kernels
    from shardd.engine.reference import rollback as rb
    from shardd.engine.reference.shard import ShardModel
    from shardd.local import LocalTarget
    from shardd.synthetic.model import synthetic_weights

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    config = preset_config(args.moe_preset)
    if config.moe is None:
        raise SystemExit(f"--moe-preset {args.moe_preset} is not a MoE shape")
    out: dict = {"moe_preset": args.moe_preset, "dtype": "bfloat16", "block": BLOCK,
                 "device": torch.cuda.get_device_name(device)}
    if args.fp8:  # the experts and every other linear FP8 (weight-only); the floors count their bytes + scales
        out["quantize"] = args.fp8
    bandwidth = copy_bandwidth(torch, device)
    out["copy_bandwidth_tb_s"] = round(bandwidth / 1e12, 3)
    t0 = time.perf_counter()
    if args.fp8:
        from shardd.weights.loading import ModelSource
        from shardd.weights.reader import shard_shapes

        weights = ModelSource(synthetic=f"{args.moe_preset}:{args.seed}", quantize=args.fp8).tensors(
            shard_shapes(config, 0, config.num_layers), dtype=torch.bfloat16, device=device, keep_fp8=True)
    else:
        weights = synthetic_weights(config, 0, config.num_layers, args.seed, dtype=torch.bfloat16, device=device)
    model = ShardModel(config, weights, 0, config.num_layers, dtype=torch.bfloat16, device=device,
                       storage=rb.RollbackStorage(CHECKPOINT, BLOCK))
    del weights
    context = 4096
    shard = FastShard(model, max_sequences=2, max_context=context)
    out["moe_build_s"] = round(time.perf_counter() - t0, 1)
    out["moe_weight_bytes"] = model.weight_bytes()
    print(f"built {args.moe_preset} in {out['moe_build_s']} s", flush=True)

    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    block = torch.randint(0, config.vocab_size, (BLOCK,), generator=generator).tolist()
    greedy_decode(LocalTarget.from_shards([shard], context), 99, prompt[:32], 4)  # compiles, captures the graphs
    state = shard.new_state(context)
    shard.forward(state, 0, tokens=prompt)
    pos = state.length

    def greedy():
        shard.forward(state, pos, tokens=block[:1])
        state.length = pos  # timing only: every step goes to the same position

    def verify():
        shard.forward(state, pos, tokens=block, checkpoint=True)
        state.length = pos

    greedy_ms = median_ms(cuda_seconds(torch, device, greedy, args.repeats))
    verify_ms = median_ms(cuda_seconds(torch, device, verify, args.repeats))
    # where each step's device time goes: its kernels, heaviest first (the graph's replay shows its kernels)
    out["moe_greedy_kernels"] = profile_top(torch, greedy, args.repeats, top=16)
    out["moe_verify_kernels"] = profile_top(torch, verify, args.repeats, top=16)

    # the experts each timed step's rows select, per layer: the same steps once more, eagerly, their routing recorded
    eager = FastShard(model, max_sequences=1, max_context=context, use_graphs=False, layers=shard.layers)
    recorded: list[torch.Tensor] = []
    routed_experts = moe_kernels.routed_experts

    def recording(x, experts, *rest):
        recorded.append(experts.clone())
        return routed_experts(x, experts, *rest)

    distinct = {}
    moe_kernels.routed_experts = recording
    try:
        for name, tokens in (("greedy", block[:1]), ("verify", block)):
            probe = eager.new_state(context)
            eager.forward(probe, 0, tokens=prompt)
            recorded.clear()
            eager.forward(probe, pos, tokens=tokens)
            distinct[name] = [len(torch.unique(experts[:len(tokens)])) for experts in recorded]
            eager.release_state(probe)
    finally:
        moe_kernels.routed_experts = routed_experts
    floors = {name: moe_floor_bytes(config, model, shard, pos, rows, distinct[name], checkpoint=name == "verify")
              for name, rows in (("greedy", 1), ("verify", BLOCK))}
    floor_ms = {name: round(sum(parts.values()) / bandwidth * 1e3, 3) for name, parts in floors.items()}
    out["moe_floor_parts_bytes"] = floors
    out["moe_floor_step_ms"] = floor_ms
    out["moe_greedy_step_ms"], out["moe_verify_step_ms"] = greedy_ms, verify_ms
    out["moe_distinct_experts"] = {name: round(statistics.mean(d), 1) for name, d in distinct.items()}
    out["moe_distinct_experts_by_layer"] = distinct
    out["moe_greedy_floor_ratio"] = round(greedy_ms / floor_ms["greedy"], 3)
    out["moe_verify_floor_ratio"] = round(verify_ms / floor_ms["verify"], 3)
    out["moe_targets"] = {"ratio": 1.35, "greedy_met": out["moe_greedy_floor_ratio"] <= 1.35,
                          "verify_met": out["moe_verify_floor_ratio"] <= 1.35}
    print(f"moe greedy {greedy_ms} ms ({out['moe_greedy_floor_ratio']}x floor), verify {verify_ms} ms "
          f"({out['moe_verify_floor_ratio']}x floor, {out['moe_distinct_experts']['verify']} experts a layer)",
          flush=True)
    return out


# ---- the whole run ---------------------------------------------------------------------------------------

PARTS = {"local": run_local, "transformers": run_transformers, "e2e": run_e2e, "relay": run_relay,
         "delay": run_relay_vs_delay, "relay-dflash": run_dflash_relay,
         "dflash-drafter": run_dflash_drafter, "dflash-placements": run_dflash,
         "dflash-batch": run_dflash_batch,
         "batch-local": run_batch_local, "batch-daemons": run_batch_daemons, "batch-step": run_batch_step,
         "prefix": run_prefix, "guided": run_guided, "moe": run_moe}
BUNDLES = {"batch": ("batch-local", "batch-daemons"),  # --parts batch: the throughput sweep (scripts/bench_batch.py)
           "dflash": ("dflash-drafter", "dflash-placements")}  # the drafter in process, then beside the daemons


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=sorted(PARTS), help="Run one part in this process.")
    parser.add_argument("--parts", default="local,transformers,e2e",
                        help=f"Comma-separated, of {sorted(PARTS)} and the bundles "
                             + "; ".join(f"{name}: {', '.join(parts)}" for name, parts in BUNDLES.items()) + ".")
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--moe-preset", default="qwen3.5-35b-a3b", help="The moe part's MoE shape.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128, help="New tokens per decode.")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--long-context", type=int, default=32768)
    parser.add_argument("--e2e-devices", default="cuda:0,cuda:1", help="Devices of the two daemons.")
    parser.add_argument("--e2e-dtype", default="bfloat16")
    parser.add_argument("--e2e-engine", default="fast", help="The daemons' --engine (reference: a CPU check).")
    parser.add_argument("--busy-poll-ms", type=float, default=0.0,
                        help="relay: also the runs with daemons (--busy-poll-ms) and coordinator polling without "
                             "sleeping for this long (relay_busy_poll, side by side with the shipped runs).")
    parser.add_argument("--direct-rows", action="store_true",
                        help="relay: also the runs with the rows going from daemon to daemon (--relay-to; "
                             "relay_direct, and relay_direct_busy_poll with --busy-poll-ms).")
    parser.add_argument("--relay-arms", default="",
                        help="relay: the arms to run beside the shipped runs, by name (plain, busy, direct, "
                             "direct-busy); default: as --busy-poll-ms and --direct-rows say.")
    parser.add_argument("--daemon-profile", default=None, help="relay: also a short run with the daemons under cProfile, "
                        "dumps in this directory, their top functions in the JSON.")
    parser.add_argument("--arms-only", action="store_true", help="relay: only the arms (--relay-arms) and the "
                        "profiled runs, without the shipped runs (relay_ms_per_step then comes from each arm).")
    parser.add_argument("--pyspy", default=None, help="relay: also a run of the shipped arm with each daemon under "
                        "py-spy (stacks in this directory; `relay_pyspy`: their busiest frames); dflash-batch: every "
                        "daemon under py-spy (`dflash_batch_pyspy`).")
    parser.add_argument("--timeline", action="store_true", help="relay: also a run of the shipped arm with the "
                        "daemons' GPU timelines on (SHARDD_TIMELINE): `relay_timeline`, where a step's time goes.")
    parser.add_argument("--fp8", choices=("fp8-block", "fp8-channel"), default=None,
                        help="FP8 linears in this layout (the head and embedding bf16); the floor is their bytes.")
    parser.add_argument("--fp8-pdl", action="store_true",
                        help="With --fp8: the FP8 GEMM's fixed tile configs with programmatic dependent launch.")
    parser.add_argument("--batch-rows", type=int, default=None,
                        help="The batch parts' scheduler rows per step (default: the scheduler's, as shardctl serve).")
    parser.add_argument("--daemon-step-rows", type=int, default=None,
                        help="The batch parts' fixed step R (FastShard step_rows in process, shardd serve --step-rows; "
                             "default: shardd's).")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="The batch parts' prompt chunk (default: the scheduler's, half of --batch-rows); at most "
                             "the shards' per-sequence step (16) packs prompt chunks into the batched step.")
    parser.add_argument("--prefix-history", type=int, default=4000, help="The prefix part's second-turn prompt.")
    parser.add_argument("--prefix-system", type=int, default=2000, help="The prefix part's shared system prompt.")
    parser.add_argument("--prefix-streams", type=int, default=32, help="The prefix part's requests sharing it.")
    parser.add_argument("--prefix-repeats", type=int, default=3)
    parser.add_argument("--prefix-cache-gib", type=float, default=16, help="The prefix part's daemons' cache.")
    parser.add_argument("--prefix-flood-gib", type=float, default=1, help="The prefix part's flood daemons' cache.")
    parser.add_argument("--prefix-flood-prompts", type=int, default=32)
    parser.add_argument("--prefix-flood-length", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--draft", default="synthetic:5", help="The dflash part's drafter (shardd serve --draft).")
    parser.add_argument("--commits", default="3,5,7", help="The dflash part's mean commits per step.")
    parser.add_argument("--placements", default="own,first,last,last-propose",
                        help="Where the dflash part's drafter runs: its own daemon, beside the first or the last shard "
                             "(proposing in the verify reply; last-propose: with a PROPOSE every step).")
    parser.add_argument("--dflash-device", default="cuda:0", help="The one device of every dflash-part daemon.")
    parser.add_argument("--dflash-engine", default="fast", help="The dflash-part daemons' --engine (reference: a CPU smoke run).")
    parser.add_argument("--dflash-dtype", default="bfloat16")
    parser.add_argument("--streams", default="1,8,32", help="The dflash-batch part's concurrent streams.")
    parser.add_argument("--step-rows", default="16,32,64,128,256", help="The batch-step part's R values.")
    parser.add_argument("--batch-step-device", default="cuda:0", help="The batch-step part's device (cpu: a smoke "
                        "run under TRITON_INTERPRET=1).")
    parser.add_argument("--batch-step-budget-s", type=float, default=200,
                        help="The batch-step part starts no new R after this many seconds.")
    args = parser.parse_args()

    if args.part:
        result = PARTS[args.part](args)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n") if args.json else print(json.dumps(result, indent=2))
        return 0

    merged: dict = {"hashes": {}}
    for part in [name for part in args.parts.split(",") for name in BUNDLES.get(part, (part,))]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            path = handle.name
        command = [sys.executable, __file__, "--part", part, "--json", path, "--preset", args.preset,
                   "--moe-preset", args.moe_preset, "--seed", str(args.seed),
                   "--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens), "--repeats", str(args.repeats),
                   "--long-context", str(args.long_context), "--e2e-devices", args.e2e_devices, "--e2e-dtype", args.e2e_dtype,
                   "--e2e-engine", args.e2e_engine, *(["--daemon-profile", args.daemon_profile] if args.daemon_profile else []),
                   "--busy-poll-ms", str(args.busy_poll_ms), *(["--direct-rows"] if args.direct_rows else []),
                   *(["--relay-arms", args.relay_arms] if args.relay_arms else []), *(["--timeline"] if args.timeline else []),
                   *(["--arms-only"] if args.arms_only else []), *(["--pyspy", args.pyspy] if args.pyspy else []),
                   *(["--fp8", args.fp8] if args.fp8 else []), *(["--fp8-pdl"] if args.fp8_pdl else []),
                   "--draft", args.draft, "--commits", args.commits, "--placements", args.placements,
                   "--dflash-device", args.dflash_device, "--dflash-engine", args.dflash_engine,
                   "--dflash-dtype", args.dflash_dtype, "--streams", args.streams, *(["--batch-rows", str(args.batch_rows)] if args.batch_rows else []),
                   *(["--daemon-step-rows", str(args.daemon_step_rows)] if args.daemon_step_rows else []),
                   *(["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []),
                   "--step-rows", args.step_rows, "--batch-step-budget-s", str(args.batch_step_budget_s),
                   "--prefix-history", str(args.prefix_history), "--prefix-system", str(args.prefix_system),
                   "--prefix-streams", str(args.prefix_streams), "--prefix-repeats", str(args.prefix_repeats),
                   "--prefix-cache-gib", str(args.prefix_cache_gib), "--prefix-flood-gib", str(args.prefix_flood_gib),
                   "--prefix-flood-prompts", str(args.prefix_flood_prompts),
                   "--prefix-flood-length", str(args.prefix_flood_length),
                   "--batch-step-device", args.batch_step_device]
        print(f"== {part}", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if part == "transformers":  # the baseline as a plain install runs it: without flash-linear-attention
            env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if "fla" not in p)
        done = subprocess.run(command, cwd=ROOT, env=env)
        if done.returncode != 0:
            merged.setdefault("failed_parts", []).append(part)
        else:
            result = json.loads(Path(path).read_text())
            merged["hashes"].update(result.pop("hashes", {}))
            merged.update(result)
        summarize(merged)
        text = json.dumps(merged, indent=2) + "\n"
        if args.json:  # after every part, so a later part's failure loses nothing
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text)
    print(text)
    if "relay_by_phase" in merged:  # the per-phase table last, where a short tail of the output shows it
        for name, top in merged.get("daemon_profile_top", {}).items():
            print(f"== cProfile of {name} (tottime)\n" + "\n".join(top[:16]))
        print("== relay by phase (ms per step)\n" + phase_table(merged["relay_by_phase"]))
    for kind, intervals in merged.get("relay_timeline", {}).items():  # microseconds, medians of a step
        print(f"== relay timeline, {kind} (us, median of {intervals.get('steps')} steps): "
              + ", ".join(f"{name} {value}" for name, value in intervals.items() if name != "steps"))
    if "dflash_runs" in merged:
        print(dflash_table(merged))
    if "dflash_batch_runs" in merged:
        print("== dflash-batch: DFlash streams beside the oracle's, and through shardctl serve\n" + dflash_batch_table(merged))
    if "batch_checks" in merged:
        print("== batch: aggregate tok/s by concurrent streams\n" + batch_table(merged))
    if "batch_step_runs" in merged:
        print("== batch-step: one step of R rows\n" + batch_step_table(merged))
    identical = merged["outputs_identical"] or not merged["hashes"]  # a part that decodes nothing hashes nothing
    return 0 if identical and merged.get("batch_step_identical", True) and "failed_parts" not in merged else 1


def summarize(merged: dict) -> None:
    """The ratios the targets are stated in, from the parts run so far."""
    if "transformers_ms_per_token" in merged and "tok_s" in merged:
        best = max(merged["tok_s"].values())
        merged["transformers_tok_s"] = round(1e3 / merged["transformers_ms_per_token"], 2)
        merged["vs_transformers"] = round(best * merged["transformers_ms_per_token"] / 1e3, 2)
        merged["greedy_vs_transformers"] = round(merged["transformers_ms_per_token"] / merged["greedy_ms_per_token"], 2)
    if "e2e_step_ms" in merged and "tok_s" in merged:
        # relay: the two-daemon step's wall time beyond the one-process step's (same mode, same schedule)
        local_step = {m: 1e3 * merged["mean_commit"][m] / merged["tok_s"][m] for m in merged["e2e_step_ms"] if m in merged["tok_s"]}
        merged["relay_ms_per_step"] = {m: round(merged["e2e_step_ms"][m] - local_step[m], 3) for m in local_step}
        merged["relay_share_of_step"] = {m: round(merged["relay_ms_per_step"][m] / merged["e2e_step_ms"][m], 3) for m in local_step}
        merged["e2e_vs_local"] = {m: round(merged["e2e_tok_s"][m] / merged["tok_s"][m], 3) for m in merged["e2e_tok_s"] if m in merged["tok_s"]}
    if "e2e_step_ms" in merged and "local_step_ms" in merged:
        # the same measure on both sides: decode_seconds / steps of a local run and of a two-daemon run
        merged["relay_ms_per_step_measured"] = {m: round(merged["e2e_step_ms"][m] - merged["local_step_ms"][m], 3)
                                                for m in merged["e2e_step_ms"] if m in merged["local_step_ms"]}
    if "e2e_greedy_ms_per_token" in merged and "greedy_ms_per_token" in merged:  # target: <= 1.05
        merged["e2e_greedy_vs_local"] = round(merged["e2e_greedy_ms_per_token"] / merged["greedy_ms_per_token"], 3)
    for key, _ in RELAY_ARMS.values():  # the same ratios for each arm
        arm = merged.get(key)
        if not arm or "tok_s" not in merged:
            continue
        for m in ("checkpoint", "replay-ssm"):
            if f"e2e_step_ms_{m}" in arm and m in merged["tok_s"]:
                local_step = 1e3 * merged["mean_commit"][m] / merged["tok_s"][m]
                arm[f"relay_ms_per_step_{m}"] = round(arm[f"e2e_step_ms_{m}"] - local_step, 3)
                arm[f"e2e_vs_local_{m}"] = round(arm[f"e2e_tok_s_{m}"] / merged["tok_s"][m], 3)
        if "e2e_greedy_ms_per_token" in arm and "greedy_ms_per_token" in merged:
            arm["e2e_greedy_vs_local"] = round(arm["e2e_greedy_ms_per_token"] / merged["greedy_ms_per_token"], 3)
    summarize_batch(merged)
    # The batch parts hash no single output: their streams are checked by batch_identical.
    merged["outputs_identical"] = (len(set(merged["hashes"].values())) <= 1 and merged.get("batch_identical", True)
                                   and merged.get("dflash_batch_identical", True))


if __name__ == "__main__":
    sys.exit(main())
