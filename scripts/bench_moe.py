"""The `moe` part of scripts/bench_gpu.py (`--parts moe`): the MoE shape's greedy and verify steps against the floors
of the bytes each reads."""

from __future__ import annotations

import statistics
import time

from bench_measure import BLOCK, copy_bandwidth, cuda_seconds, median_ms, profile_top


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
