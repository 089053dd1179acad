#!/usr/bin/env python3
"""Time the launch shapes of the step's latency-bound kernels on the GPU. `--parts` (default all):
- `recurrence`: the GDN recurrence, 27B shape (16 tokens, 48 value heads, checkpoint writes on);
- `attention`: split-KV attention, 27B shape, at a 32k-token and a short context, by launch shape;
- `chunks`: split-KV attention at short contexts by key chunk (`attention.CHUNK`; a chunk is one program's serial
  loop, so at a short context a smaller one spreads the keys over more programs);
- `moe`: the routed experts of one 35B-A3B layer (256 experts, 8 a token, width 512) at 1 and 16 real rows of a
  16-row step, by tile and warps, with the bandwidth over the distinct experts' bytes;
- `router`: the 35B-A3B router + shared-expert GEMM (16 rows, 1,281 outputs) against padded and split shapes
  (cuBLAS picks its kernel by the shape).
Prints one JSON line per variant; the module constants in shardd/engine/kernels/ are set from it.

    python3 scripts/tune_kernels.py --json bench/results/h200/tune_kernels.json [--parts moe,router]
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


def attention_call(context, real_rows, rows=16, heads=24, kv_heads=4, dim=256, rot=64):
    """One attention step of the 27B shape over `context` keys, `real_rows` of its `rows` real, as a call of no
    arguments (its partials sized for the current attention.CHUNK; the launch shape is read at each call)."""
    dev = "cuda"
    bf = dict(dtype=torch.bfloat16, device=dev)
    qkv = torch.randn(rows, 2 * heads * dim + 2 * kv_heads * dim, **bf)
    cache_k, cache_v = (torch.randn(2, kv_heads, context + 64, dim, **bf) for _ in range(2))
    norm = torch.zeros(dim, **bf)
    cos, sin = torch.ones(context + 64, rot, **bf), torch.zeros(context + 64, rot, **bf)
    query = torch.zeros(rows, heads, dim, **bf)
    splits = attention_kernels.num_splits(context + 64)
    partials = (torch.zeros(rows, heads, splits, device=dev), torch.zeros(rows, heads, splits, device=dev),
                torch.zeros(rows, heads, splits, dim, device=dev))
    out = torch.zeros(rows, heads * dim, **bf)
    control = torch.tensor(segments.table([segments.segment(0, real_rows, context - real_rows)], 1, 1, rows),
                           dtype=torch.int32, device=dev)
    return lambda: attention_kernels.attention_step(
        qkv, norm, norm, cos, sin, cache_k, cache_v, query, partials, out, control, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=dim, rotary_dim=rot, eps=1e-6, rows=rows)


def attention(context, rows=16):
    fn = attention_call(context, rows, rows)
    results = []
    launches = attention_kernels.SHORT_LAUNCH, attention_kernels.LONG_LAUNCH
    try:
        for heads_per_program, block_n, warps in ((1, 64, 4), (1, 32, 4), (2, 64, 4), (2, 32, 4), (3, 32, 4), (3, 32, 8),
                                                  (6, 16, 8)):
            attention_kernels.SHORT_LAUNCH = attention_kernels.LONG_LAUNCH = (heads_per_program, block_n, warps)
            results.append(timed({"kernel": "attention", "context": context, "heads_per_program": heads_per_program,
                                  "block_n": block_n, "warps": warps}, fn))
    finally:
        attention_kernels.SHORT_LAUNCH, attention_kernels.LONG_LAUNCH = launches
    return results


def timed(variant: dict, fn) -> dict:
    """`variant` with the median µs of fn() (or the error that kept it from compiling), printed."""
    try:
        variant["us"] = round(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, 2)
    except Exception as error:  # a shape that does not compile (registers, shared memory)
        variant["error"] = str(error)[:200]
    print(json.dumps(variant), flush=True)
    return variant


def attention_chunks(context, rows=16):
    results = []
    default = attention_kernels.CHUNK
    try:
        for real_rows in (1, rows):
            for chunk in (1024, 512, 256, 128):
                attention_kernels.CHUNK = chunk
                results.append(timed({"kernel": "attention", "context": context, "rows": real_rows, "chunk": chunk},
                                     attention_call(context, real_rows, rows)))
    finally:
        attention_kernels.CHUNK = default
    return results


def moe_experts(rows=16, experts=256, top_k=8, hidden=2048, width=512):
    from shardd.engine.kernels import moe as moe_kernels

    dev = "cuda"
    bf = dict(dtype=torch.bfloat16, device=dev)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, **bf)
    gate_up = torch.randn(experts, 2 * width, hidden, **bf) * 0.02
    down = torch.randn(experts, hidden, width, **bf) * 0.02
    routing = torch.rand(rows, top_k, **bf)
    shared_gate, shared = torch.randn(rows, 1, **bf), torch.randn(rows, hidden, **bf)
    scratch = moe_kernels.ExpertScratch(rows, top_k, hidden, width, torch.bfloat16, dev)
    out = torch.zeros(rows, hidden, **bf)
    names = ("GATE_UP_BLOCK_N", "BLOCK_N", "BLOCK_K", "GATE_UP_WARPS", "DOWN_WARPS")
    default = {name: getattr(moe_kernels, name) for name in names}
    shapes = [tuple(default.values()), (16, 64, 64, 4, 4), (64, 64, 64, 4, 4), (32, 64, 128, 4, 4),
              (16, 32, 128, 4, 4), (32, 32, 64, 4, 4), (32, 128, 64, 4, 4), (16, 64, 64, 2, 4), (32, 64, 64, 8, 8),
              (16, 32, 64, 2, 2), (16, 16, 128, 2, 2)]
    results = []
    try:
        for real_rows in (1, rows):
            chosen = torch.stack([torch.randperm(experts, generator=generator)[:top_k].sort().values
                                  for _ in range(rows)]).to(device=dev, dtype=torch.int32)
            chosen[real_rows:] = experts  # padding rows route nowhere
            distinct = len(torch.unique(chosen[:real_rows]))
            read = distinct * 3 * width * hidden * 2  # each selected expert's gate, up and down, bf16, once
            for shape in shapes:
                for name, value in zip(names, shape):
                    setattr(moe_kernels, name, value)
                fn = lambda: moe_kernels.routed_experts(x, chosen, routing, gate_up, down, shared_gate, shared,  # noqa: E731
                                                        scratch, out)
                variant = timed({"kernel": "moe_experts", "rows": real_rows, "distinct_experts": distinct,
                                 **dict(zip(names, shape))}, fn)
                if "us" in variant:
                    variant["tb_s"] = round(read / (variant["us"] * 1e-6) / 1e12, 3)
                results.append(variant)
    finally:
        for name, value in default.items():
            setattr(moe_kernels, name, value)
    return results


def router(rows=16, hidden=2048):
    import torch.nn.functional as F

    dev = "cuda"
    bf = dict(dtype=torch.bfloat16, device=dev)
    x = torch.randn(rows, hidden, **bf)
    results = []
    # 256 experts + the shared expert's gate + its gate|up (2 x 512): as fused today, padded, and in two parts
    for what, widths in (("fused", [1281]), ("padded to 64", [1344]), ("padded to 128", [1408]),
                         ("padded to 512", [1536]), ("router | shared", [257, 1024]), ("router padded | shared", [320, 1024])):
        weights = [torch.randn(n, hidden, **bf) for n in widths]
        fn = lambda: [F.linear(x, w) for w in weights]  # noqa: E731
        results.append(timed({"kernel": "router_gemm", "rows": rows, "shape": what, "out_rows": widths}, fn))
    return results


PARTS = {"recurrence": lambda: recurrence(), "attention": lambda: attention(32768) + attention(600),
         "chunks": lambda: attention_chunks(512) + attention_chunks(2048), "moe": moe_experts, "router": router}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args()
    unknown = [part for part in args.parts.split(",") if part not in PARTS]
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    results = [row for part in args.parts.split(",") for row in PARTS[part]()]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
