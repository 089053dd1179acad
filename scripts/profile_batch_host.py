"""The scheduler's host cost per step, on the CPU: many streams through `Scheduler` over
`LocalTarget`, with the 27B's vocabulary (248,320: a 16-row verify's logits are 16 MB of float32) and tiny
layers, so what is left is the host path (planning, drafting, packing, the head's answer, commits, rollbacks).

Engines: `fast-stub` — a FastShard (checkpoint storage, R = --step-rows) whose device step is replaced by a no-op
(its Triton kernels would run in the interpreter here; on the GPU they are a graph replay): everything around
the step is the real code; `reference` — the reference ShardModel (its compute included; a small model).

    PYTHONPATH=$PWD python scripts/profile_batch_host.py --engine fast-stub --streams 1,8,32
    PYTHONPATH=$PWD python scripts/profile_batch_host.py --engine fast-stub --streams 32 --profile oracle

Prints per engine/mode/streams: decode steps, host ms per decode step (the steps after every prompt is in).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from common.model_config import config_from_dict
from common.presets import PRESETS
from coordinator.drafting.drafters import OracleDrafter
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import Scheduler
from protocol.layout import CHECKPOINT
from shardd.local import LocalTarget
from shardd.engine.reference import rollback as rb
from shardd.engine.reference.shard import ShardModel
from shardd.synthetic.model import synthetic_weights

BLOCK = 16


def build(engine: str, vocab: int, step_rows: int, sequences: int, context: int):
    config = config_from_dict({**PRESETS["tiny"], "vocab_size": vocab, "num_hidden_layers": 2,
                               "full_attention_interval": 2})
    weights = synthetic_weights(config, 0, config.num_layers, seed=0, dtype=torch.float32, device="cpu")
    model = ShardModel(config, weights, 0, config.num_layers, dtype=torch.float32, device="cpu",
                       storage=rb.RollbackStorage(CHECKPOINT, BLOCK))
    if engine == "reference":
        return LocalTarget.from_shards([model], context)
    from shardd.engine.fast.shard import FastShard

    shard = FastShard(model, max_sequences=sequences, max_context=context, step_rows=step_rows, use_graphs=False)
    shard.prefill_kernels = False
    shard.runner.run = lambda capture=(): {}  # the device step: a graph replay on the GPU, not host work
    return LocalTarget.from_shards([shard], context)


def run(target, prompts, tokens, references=None, batch_rows=256):
    """(decode steps, seconds in them, token lists)."""
    requests = [Request(prompt, tokens, block_size=BLOCK,
                        drafter=None if references is None else OracleDrafter.with_mean_commit(
                            references[i], len(prompt), block_size=BLOCK, mean_commit=7.0))
                for i, prompt in enumerate(prompts)]
    scheduler = Scheduler(target, max_sequences=len(prompts), batch_rows=batch_rows)
    for request in requests:
        scheduler.submit(request)
    while any(r.state in ("queued", "prefill") for r in requests) or scheduler._incoming:
        scheduler.step()
    steps, started = 0, time.perf_counter()
    while not all(r.done.is_set() for r in requests):
        scheduler.step()
        steps += 1
    return steps, time.perf_counter() - started, [r.outcome().tokens for r in requests]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="fast-stub", choices=("fast-stub", "reference"))
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--step-rows", type=int, default=128, help="the FastShard's R")
    parser.add_argument("--batch-rows", type=int, default=512, help="the scheduler's rows per step")
    parser.add_argument("--profile", choices=("greedy", "oracle"), help="cProfile the widest run of this mode")
    args = parser.parse_args()
    torch.set_num_threads(1)
    streams = [int(s) for s in args.streams.split(",")]
    target = build(args.engine, args.vocab, args.step_rows, max(streams) + 1, args.prompt_len + args.tokens + BLOCK)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (args.prompt_len,), generator=g).tolist() for _ in range(max(streams))]
    run(target, prompts[:1], 2, batch_rows=args.batch_rows)  # warm-up
    print(f"engine {args.engine}, vocab {args.vocab}, R {args.step_rows}, scheduler rows {args.batch_rows}")
    print(f"{'mode':8} {'streams':>7} {'steps':>6} {'host ms/step':>13}")
    for n in streams:
        greedy_steps, seconds, greedy = run(target, prompts[:n], args.tokens, batch_rows=args.batch_rows)
        print(f"{'greedy':8} {n:7d} {greedy_steps:6d} {1000 * seconds / greedy_steps:13.2f}", flush=True)
        steps, seconds, tokens = run(target, prompts[:n], args.tokens, references=greedy, batch_rows=args.batch_rows)
        print(f"{'oracle':8} {n:7d} {steps:6d} {1000 * seconds / steps:13.2f}   equal to greedy: {tokens == greedy}",
              flush=True)
        if args.profile and n == max(streams):
            profiler = cProfile.Profile()
            profiler.enable()
            run(target, prompts[:n], args.tokens, references=greedy if args.profile == "oracle" else None,
                batch_rows=args.batch_rows)
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
