"""The one-process parts of scripts/bench_gpu.py (`--parts local,transformers`): the whole model as one FastShard
on one GPU against its floors, and transformers' greedy decode on the same weights."""

from __future__ import annotations

import statistics
import time

from bench_measure import BLOCK, MEAN_COMMIT, copy_bandwidth, cuda_seconds, median_ms, profile_top, token_hash

MODES = ("checkpoint", "replay-ssm", "replay")


# ---- local: one process, one GPU ------------------------------------------------------------------------


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
