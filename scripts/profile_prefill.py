"""Where a prefill call's time goes, by prompt length (GPU only): the fast shard's prefill path (fla + flash
attention, eager), 27B shape, bf16, one sequence. For each length: wall ms of the call (median of 3 after a
warm-up), the host ms until the call returns without a synchronize (the Python and the launches), the device
ms of its kernels (the profiler's sum) and their count. A call whose wall time is near its host time and far
above its kernels' is launch-bound: a CUDA graph of a fixed chunk would remove most of it.

    PYTHONPATH=$PWD python scripts/profile_prefill.py --json bench/results/h200/prefill_profile.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--lengths", default="64,128,256,512,1024,2048")
    parser.add_argument("--rule", default="direct", choices=("direct", "public", "both"),
                        help="fla's gated delta rule through its forward functions (the prefill's default), its public "
                             "wrapper, or both one after the other (an A/B in one process)")
    parser.add_argument("--prefill-rows", default="0,512",
                        help="comma-separated pieces to compare: 0 = one eager call, P = pieces of P rows, each whole "
                             "piece replayed from CUDA graphs (`shardd serve --prefill-rows`)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from bench_measure import profile_top
    from bench_seed import write_json
    from protocol.layout import CHECKPOINT
    from shardd.engine.fast import prefill
    from shardd.engine.fast.graph import PrefillGraphs
    from shardd.engine.fast.shard import FastShard
    from shardd.engine.reference import rollback as rb
    from shardd.engine.reference.shard import ShardModel
    from common.presets import preset_config
    from shardd.synthetic.model import synthetic_weights

    device = torch.device("cuda:0")
    config = preset_config(args.preset)
    weights = synthetic_weights(config, 0, config.num_layers, 0, dtype=torch.bfloat16, device=device)
    model = ShardModel(config, weights, 0, config.num_layers, dtype=torch.bfloat16, device=device,
                       storage=rb.RollbackStorage(CHECKPOINT, 16))
    del weights
    lengths = [int(n) for n in args.lengths.split(",")]
    shard = FastShard(model, max_sequences=1, max_context=max(lengths) + 64)
    state = shard.new_state(max(lengths) + 64)
    generator = torch.Generator().manual_seed(0)
    out: dict = {"preset": args.preset, "prefill_path": "fla + flash attention" if shard.prefill_kernels else "reference",
                 "by_length": {}}
    rules = ("direct", "public") if args.rule == "both" else (args.rule,)
    pieces = [int(p) for p in args.prefill_rows.split(",")]
    default_rule = prefill.fla_rule
    graphs = {}  # pieces -> its PrefillGraphs (captured once per process, as a daemon's)
    variants = [(rule, p, n) for n in lengths for p in pieces for rule in rules if not (p and rule == "public")]
    for rule, p, n in variants:
        tokens = torch.randint(0, config.vocab_size, (n,), generator=generator).tolist()
        prefill.fla_rule = lambda direct=True, rule=rule: default_rule(direct=rule == "direct")  # noqa: E731
        if p and p not in graphs:
            graphs[p] = PrefillGraphs(model, shard.layers, shard.pools, p)
        shard.prefill_rows, shard.prefill_graphs = p, graphs.get(p)

        def call():
            state.length = 0
            shard.forward(state, 0, tokens=tokens)

        call()
        torch.cuda.synchronize()
        walls, hosts = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            call()
            hosts.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        top = profile_top(torch, call, 1, top=8)
        row = {"wall_ms": round(statistics.median(walls) * 1e3, 2), "host_ms": round(statistics.median(hosts) * 1e3, 2),
               "kernel_ms": top[-1]["ms_per_call"], "launches": top[-1]["launches"],
               "tok_s": round(n / statistics.median(walls), 1), "top": top[:-1]}
        if p:
            row["graph_failures"] = {str(list(k)): v for k, v in graphs[p].failures.items()}
        name = str(n) if len(variants) == len(lengths) else f"{n}/{rule}/pieces{p}"
        out["by_length"][name] = row
        print(f"prefill {n:5d} tokens ({rule}, pieces {p or 'none'}): wall {row['wall_ms']:8.2f} ms, host "
              f"{row['host_ms']:8.2f} ms, kernels {row['kernel_ms']:8.2f} ms in {row['launches']} launches, "
              f"{row['tok_s']} tok/s", flush=True)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
