#!/usr/bin/env python3
"""Time the weight-only FP8 GEMM (shardd/kernels/fp8_gemm.py) on every matrix shape of the 27B step.

For each shape and row count (1, 16, 64): our kernel on its native path and on the forced Ampere path,
bf16 cuBLAS on the same matrix in bf16, and torch._scaled_mm (FP8 activations, row-wise scales, fast
accumulation: the library FP8 GEMM), each as one CUDA graph replayed over enough distinct copies of the
matrix (1 GiB of FP8) that L2 holds none of them. Against the floor: the FP8 bytes and their scales at the
copy bandwidth measured in the same run. The step's sum weighs each shape by its count in the 64 layers
(the bf16 head, 248320 x 5120, timed with cuBLAS and added apart).

Then a sweep of tile configs at 16 rows prints the fastest per shape, as the line to put in
fp8_gemm.TILE_TABLE. The table of figures is printed last.

    python3 scripts/bench_fp8_gemm.py --json bench/results/h200/fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_gpu import copy_bandwidth  # noqa: E402
from shardd.kernels import fp8_gemm as fp8  # noqa: E402

# (name, N, K, matrices of this shape in the 64 layers: 48 GDN + 16 attention)
SHAPES = [
    ("gdn_in_proj", 16480, 5120, 48),   # qkv | z | b | a
    ("out_proj", 5120, 6144, 64),       # GDN out_proj (48) and attention o_proj (16)
    ("attn_qkv", 14336, 5120, 16),      # q (query | gate) | k | v
    ("gate_up", 34816, 5120, 64),
    ("down", 5120, 17408, 64),
]
HEAD = (248320, 5120)
BLOCK = (128, 128)
COPY_BYTES = 1 << 30  # FP8 bytes of distinct copies per shape: 20x the H200's L2
SWEEP = [
    fp8.TileConfig(block_n=32, block_k=128),
    fp8.TileConfig(block_n=64, block_k=128),
    fp8.TileConfig(block_n=128, block_k=128),
    fp8.TileConfig(block_n=128, block_k=128, warps=8),
    fp8.TileConfig(block_n=64, block_k=128, swap=True),
    fp8.TileConfig(block_n=128, block_k=128, swap=True),
    fp8.TileConfig(block_n=64, block_k=128, split_k=2),
    fp8.TileConfig(block_n=128, block_k=128, split_k=4),
    fp8.TileConfig(block_n=64, block_k=128, stages=6),
]


def graph_us(fn, calls: int, replays: int = 20) -> float:
    """Microseconds per call of fn (which makes `calls` calls), captured once as a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles, allocates split-K counters
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def timed(results: dict, key: str, fn, calls: int):
    try:
        results[key] = round(graph_us(fn, calls), 2)
    except Exception as error:  # e.g. _scaled_mm refusing a row count, a config that does not compile
        results[key] = None
        results.setdefault("errors", {})[key] = f"{type(error).__name__}: {str(error)[:160]}"


def shape_copies(n: int, k: int):
    count = max(2, math.ceil(COPY_BYTES / (n * k)))
    weights, scales = [], []
    for _ in range(count):
        weights.append((torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn))
        scales.append(torch.rand(math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1]), device="cuda") * 1e-3)
    return weights, scales


def bench_shape(name, n, k, rows_list, bandwidth):
    weights, scales = shape_copies(n, k)
    copies = len(weights)
    scale_bytes = scales[0].numel() * 4
    entry = {"name": name, "n": n, "k": k, "copies": copies,
             "floor_us": round((n * k + scale_bytes) / bandwidth * 1e6, 2), "rows": {}}
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        results = {}
        for label, ampere in (("fp8_native", False), ("fp8_ampere", True)):
            timed(results, label, lambda: [fp8.fp8_linear(x, w, s, BLOCK, ampere=ampere, out=o)
                                           for w, s, o in zip(weights, scales, outs)], copies)
        x_fp8 = x.to(torch.float8_e4m3fn)
        scale_a = torch.ones(rows, 1, device="cuda")
        scale_b = torch.ones(1, n, device="cuda")
        timed(results, "scaled_mm", lambda: [torch._scaled_mm(x_fp8, w.t(), scale_a, scale_b, out_dtype=torch.bfloat16,
                                                              use_fast_accum=True) for w in weights], copies)
        entry["rows"][rows] = results
    del outs
    bf16 = [w.to(torch.bfloat16) for w in weights[: max(2, copies // 2)]]  # 1 GiB of bf16 too
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        timed(entry["rows"][rows], "bf16_cublas", lambda: [x @ w.t() for w in bf16], len(bf16))
    del bf16, weights, scales
    torch.cuda.empty_cache()
    return entry


def sweep_shape(name, n, k, rows=16):
    weights, scales = shape_copies(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    results = []
    current = fp8.tile_config(n, k, True)
    for config in SWEEP + ([current] if current not in SWEEP else []):
        times = {}
        timed(times, "us", lambda: [fp8.fp8_gemm(x, w, s, BLOCK, config, convert="native", out=out)
                                    for w, s in zip(weights, scales)], len(weights))
        results.append({"config": config.__dict__, "us": times["us"], **({"error": times["errors"]["us"]} if "errors" in times else {})})
    del weights, scales
    torch.cuda.empty_cache()
    ok = [r for r in results if r["us"] is not None]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return {"name": name, "n": n, "k": k, "configs": results, "best": best}


def table(out) -> str:
    lines = []
    for rows in out["rows"]:
        lines.append(f"-- {rows} rows: us per matrix (x its FP8 floor)")
        lines.append(f"{'shape':12} {'N x K':>12} {'floor':>7} {'fp8':>14} {'fp8 ampere':>14} {'bf16 cuBLAS':>14} {'_scaled_mm':>14}")
        for shape in out["shapes"]:
            r = shape["rows"][rows]
            cells = []
            for key in ("fp8_native", "fp8_ampere", "bf16_cublas", "scaled_mm"):
                us = r.get(key)
                cells.append(f"{'-':>14}" if us is None else f"{us:>8.1f} {us / shape['floor_us']:4.2f}x")
            lines.append(f"{shape['name']:12} {shape['n']:>6}x{shape['k']:<5} {shape['floor_us']:>7.1f} " + " ".join(cells))
        step = out["step_ms"][rows]
        cells = [f"{'-':>14}" if step.get(key) is None else f"{step[key]:>8.2f} {step[key] / step['floor']:4.2f}x"
                 for key in ("fp8_native", "fp8_ampere", "bf16_cublas", "scaled_mm")]
        lines.append(f"{'64 layers ms':12} {'':>12} {step['floor']:>7.2f} " + " ".join(cells)
                     + f"   (+ bf16 head {step['head_bf16']:.2f} ms)")
    if out.get("sweep"):
        lines.append("-- sweep at 16 rows (native): best per shape -> fp8_gemm.TILE_TABLE")
        for s in out["sweep"]:
            if s["best"]:
                c = s["best"]["config"]
                lines.append(f"    ({s['n']}, {s['k']}, True): TileConfig(block_n={c['block_n']}, block_k={c['block_k']}, "
                             f"split_k={c['split_k']}, warps={c['warps']}, stages={c['stages']}, swap={c['swap']}),  # {s['name']} {s['best']['us']} us")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--budget-s", type=float, default=240, help="stop starting new shapes (and sweeps) after this")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows_list = [int(r) for r in args.rows.split(",")]
    bandwidth = copy_bandwidth(torch, torch.device("cuda"))
    out = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "rows": rows_list, "shapes": [], "step_ms": {},
           "table": {f"{n}x{k}": fp8.tile_config(n, k, True).__dict__ for _, n, k, _ in SHAPES}}
    print(f"{out['device']}: copy bandwidth {out['copy_bandwidth_tb_s']} TB/s", flush=True)
    for name, n, k, count in SHAPES:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget spent: {name} not timed", flush=True)
            break
        entry = bench_shape(name, n, k, rows_list, bandwidth)
        entry["count"] = count
        out["shapes"].append(entry)
        print(json.dumps(entry), flush=True)
    head = torch.randn(*HEAD, device="cuda", dtype=torch.bfloat16)
    for rows in rows_list:
        x = torch.randn(rows, HEAD[1], device="cuda", dtype=torch.bfloat16)
        step = {"floor": sum(s["count"] * s["floor_us"] for s in out["shapes"]) / 1e3,
                "head_bf16": graph_us(lambda: x @ head.t(), 1) / 1e3}
        for key in ("fp8_native", "fp8_ampere", "bf16_cublas", "scaled_mm"):
            values = [s["rows"][rows].get(key) for s in out["shapes"]]
            step[key] = None if None in values else sum(s["count"] * v for s, v in zip(out["shapes"], values)) / 1e3
        out["step_ms"][rows] = {key: None if v is None else round(v, 3) for key, v in step.items()}
    del head
    torch.cuda.empty_cache()
    out["sweep"] = []
    if not args.no_sweep:
        for name, n, k, _ in SHAPES:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget spent: sweep of {name} skipped", flush=True)
                break
            out["sweep"].append(sweep_shape(name, n, k))
            print(json.dumps(out["sweep"][-1]), flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
