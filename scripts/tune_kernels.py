#!/usr/bin/env python3
"""Time the launch shapes of the step's two latency-bound kernels on the GPU, on the 27B shape: the GDN
recurrence (16 tokens, 48 value heads, checkpoint writes on) and the split-KV attention at a short and a
32k-token context. Prints one JSON line per variant; the module constants in shardd/engine/kernels/ are set from it.

    python3 scripts/tune_kernels.py --json bench/results/h200/tune_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from shardd.engine.kernels import attention as attention_kernels  # noqa: E402
from shardd.engine.kernels import gdn as gdn_kernels  # noqa: E402
from shardd.engine.kernels import segments  # noqa: E402


def recurrence(rows=16, k_heads=16, v_heads=48, k=128, v=128, slots=2, layers=1):
    dev = "cuda"
    f32 = dict(dtype=torch.float32, device=dev)
    rin = (torch.randn(slots, layers, rows, k_heads, k, **f32) * 0.1, torch.nn.functional.normalize(torch.randn(slots, layers, rows, k_heads, k, **f32), dim=-1),
           torch.randn(slots, layers, rows, v_heads, v, **f32), -torch.rand(slots, layers, rows, v_heads, **f32), torch.rand(slots, layers, rows, v_heads, **f32))
    state = torch.randn(slots, layers, v_heads, k, v, **f32)
    saved = torch.zeros(slots, layers, rows + 1, v_heads, k, v, **f32)
    out = torch.zeros(1, rows, v_heads, v, **f32)
    control = torch.tensor(segments.table([segments.segment(0, rows, 0, save=1, n_save=rows + 1)], 1, 1, rows),
                           dtype=torch.int32, device=dev)
    results = []
    for block_v, warps in ((16, 2), (16, 4), (32, 4)):
        gdn_kernels.RECURRENCE_BLOCK_V, gdn_kernels.RECURRENCE_WARPS = block_v, warps
        fn = lambda: gdn_kernels.gdn_recurrence(rin, state, saved, out, control, layer0=0, layers=1, rows=rows, num_k_heads=k_heads)  # noqa: E731
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        results.append({"kernel": "gdn_recurrence", "block_v": block_v, "warps": warps, "us": round(ms * 1e3, 2)})
        print(json.dumps(results[-1]), flush=True)
    return results


def attention(context, rows=16, heads=24, kv_heads=4, dim=256, rot=64):
    dev = "cuda"
    bf = dict(dtype=torch.bfloat16, device=dev)
    qkv = torch.randn(rows, 2 * heads * dim + 2 * kv_heads * dim, **bf)
    cache_k = torch.randn(2, kv_heads, context + 64, dim, **bf)
    cache_v = torch.randn(2, kv_heads, context + 64, dim, **bf)
    norm = torch.zeros(dim, **bf)
    cos = torch.ones(context + 64, rot, **bf)
    sin = torch.zeros(context + 64, rot, **bf)
    query = torch.zeros(rows, heads, dim, **bf)
    splits = attention_kernels.num_splits(context + 64)
    partials = (torch.zeros(rows, heads, splits, device=dev), torch.zeros(rows, heads, splits, device=dev),
                torch.zeros(rows, heads, splits, dim, device=dev))
    out = torch.zeros(rows, heads * dim, **bf)
    control = torch.tensor(segments.table([segments.segment(0, rows, context - rows)], 1, 1, rows),
                           dtype=torch.int32, device=dev)
    results = []
    for heads_per_program, block_n, warps in ((1, 64, 4), (1, 32, 4), (2, 64, 4), (2, 32, 4), (3, 32, 4), (3, 32, 8), (6, 16, 8)):
        attention_kernels.SHORT_LAUNCH = attention_kernels.LONG_LAUNCH = (heads_per_program, block_n, warps)
        fn = lambda: attention_kernels.attention_step(qkv, norm, norm, cos, sin, cache_k, cache_v, query, partials, out, control,  # noqa: E731
                                                    num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, rotary_dim=rot, eps=1e-6, rows=rows)
        variant = {"kernel": "attention", "context": context, "heads_per_program": heads_per_program, "block_n": block_n, "warps": warps}
        try:
            variant["us"] = round(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, 2)
        except Exception as error:  # a shape that does not compile (registers, shared memory)
            variant["error"] = str(error)[:200]
        results.append(variant)
        print(json.dumps(variant), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    results = recurrence() + attention(32768) + attention(600)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
