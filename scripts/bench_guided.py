"""The `guided` part of scripts/bench_gpu.py (`--parts guided`): the scheduler's step with every stream constrained
to a JSON schema, against the same streams unconstrained."""

from __future__ import annotations

import statistics
import time

from bench_measure import BLOCK

GUIDED_STREAMS = 8
GUIDED_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 400},
                                                  "notes": {"type": "array", "items": {"type": "string"}}},
                 "required": ["title", "notes"]}


def run_guided(args) -> dict:
    """One process, the whole model (bf16, CUDA graphs) as one FastShard under the scheduler: 8 greedy streams with
    the n-gram drafter, each constrained to GUIDED_SCHEMA (a matcher per stream, masks on the head) against the same
    streams unconstrained; the mean wall time of a step (`guided_step_ms`, `plain_step_ms`) and their ratio
    (`guided_step_ratio`, target <= 1.10). Replay-ssm storage, as the batch parts use: checkpoint storage for the
    fixed step's rows (another ~21.5 GiB) does not fit beside the weights on an 80 GB card, and the mask's cost
    is the head's, the same in every rollback mode."""
    import torch

    from common.presets import preset_config
    from coordinator.drafting.drafters import NgramDrafter
    from coordinator.guided import GrammarCompiler, GrammarSpec
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import Scheduler
    from coordinator.tokenizer import HFTokenizer
    from protocol.layout import REPLAY_SSM
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
                       storage=rb.RollbackStorage(REPLAY_SSM, BLOCK))
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
            "guided_block": BLOCK, "guided_rollback": REPLAY_SSM,
            "guided_tokens": {name: [n for _, n in rs] for name, rs in runs.items()},
            "plain_step_ms": round(plain, 3), "guided_step_ms": round(guided, 3),
            "guided_step_ratio": round(guided / plain, 3)}
