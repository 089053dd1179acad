#!/usr/bin/env python3
"""Time the weight-only FP8 GEMM (shardd/engine/kernels/fp8_gemm.py) on every matrix shape of the 27B step.

For each shape and row count (1, 16, 64): our kernel as fp8_linear runs it (its TILE_TABLE config and
conversion), the same tiles with Triton's native FP8 conversion, bf16 cuBLAS on the same matrix in bf16,
and torch._scaled_mm (FP8 activations, row-wise scales, fast accumulation: the library FP8 GEMM), each as
one CUDA graph replayed over enough distinct copies of the matrix (1 GiB of FP8) that L2 holds none of
them; "before" is a reference run's time (`BEFORE`: the first asm conversion). Against the floor: the FP8
bytes and their scales at the copy bandwidth measured in the same run. The step's sum weighs
each shape by its count in the 64 layers (the bf16 head, 248320 x 5120, timed with cuBLAS and added apart).

Then a sweep at 16 rows, within --budget-s: per shape a coordinate descent from the TILE_TABLE config over
block_n 16/32/64/128, block_k 128/256/512, split_k 1/2/4/8, warps 2/4/8, stages 3/4/6, the conversion
(asm, native, asm_v1) and the orientation, plus a few joint moves; the best few are timed at 64 rows too.
It prints the fastest per shape as the line to put in fp8_tiles.TILE_TABLE, and a before/after table last.

    python3 scripts/bench_fp8_gemm.py --json bench/results/h200/fp8_gemm.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_measure import copy_bandwidth  # noqa: E402
from shardd.engine.kernels import fp8_gemm as fp8  # noqa: E402

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
COPY_BYTES = 1 << 30  # FP8 bytes of distinct copies per shape: about 20x an H100's or H200's L2
# The sweep's axes (coordinate descent: one axis moved at a time from the best so far; the likeliest first, in
# case the budget ends a round: the native conversion is in the main table already)
# An earlier sweep found asm fastest on every shape, 3 stages ahead of 4 and 6 on most, 2 warps ahead of 4 on
# several: this one tries 2 stages and 1 warp, and spends its budget on the tile axes (the conversion column of the
# table still times native).
AXES = {"block_n": [16, 32, 64, 128], "split_k": [1, 2, 4, 8], "warps": [1, 2, 4, 8], "block_k": [128, 256, 512],
        "stages": [2, 3, 4], "swap": [False, True], "convert": ["asm"], "pdl": [False, True], "prefetch": [0, 1, 2, 4]}
# joint moves tried in each round (fewer warps with wider tiles: fewer x reloads per weight byte;
# and more programs for them through a split of K)
JOINT = [{"pdl": True, "prefetch": 2}, {"pdl": True, "prefetch": 4},
         {"block_n": 32, "warps": 2}, {"block_n": 64, "warps": 2}, {"block_n": 128, "warps": 4},
         {"block_n": 128, "warps": 8}, {"block_n": 32, "warps": 2, "block_k": 256}, {"block_n": 64, "block_k": 256, "stages": 3},
         {"block_n": 32, "warps": 2, "split_k": 2}, {"block_n": 64, "warps": 2, "split_k": 2}, {"block_n": 32, "split_k": 2},
         {"block_n": 128, "warps": 8, "split_k": 2}, {"warps": 2, "stages": 2}, {"block_k": 256, "stages": 2},
         {"swap": True, "split_k": 8}, {"swap": True, "warps": 2}]
# The table's "before": a reference run on an H200 (us per matrix; fp8_ampere, the first asm conversion, its faster path)
PACKED_MODE = False  # --packed: the weights also as fp8.PackedWeight (timed beside, read-only baselines, the sweep)
BEFORE = {16: {"gdn_in_proj": 30.19, "out_proj": 17.28, "attn_qkv": 29.63, "gate_up": 62.34, "down": 36.92},
          64: {"gdn_in_proj": 91.66, "out_proj": 41.01, "attn_qkv": 85.6, "gate_up": 188.68, "down": 102.77},
          1: {"gdn_in_proj": 29.95, "out_proj": 16.7, "attn_qkv": 29.44, "gate_up": 61.65, "down": 36.54}}


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


@triton.jit
def _read_kernel(w_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
                 SPLIT_K: tl.constexpr, PACKED: tl.constexpr):
    """The GEMM's weight reads alone (same grid, same tiles, a sum instead of the conversion and the MMA): what
    the memory gives this access pattern."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int32)
    for i in range(TILES_PER_SPLIT):
        tile = pid_k * TILES_PER_SPLIT + i
        if PACKED:
            ptrs = (w_ptr + pid_n.to(tl.int64) * (TILES_PER_SPLIT * SPLIT_K * BLOCK_N * BLOCK_K) + tile * (BLOCK_N * BLOCK_K)
                    + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :])
        else:
            ptrs = (w_ptr + (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None] * K + tile * BLOCK_K
                    + tl.arange(0, BLOCK_K)[None, :])
        acc += tl.load(ptrs).to(tl.int32)
    tl.store(out_ptr + pid_n * SPLIT_K + pid_k, tl.sum(acc))


def read_only(w, config: fp8.TileConfig, n: int, k: int, packed: bool, sink: torch.Tensor):
    """One launch of _read_kernel over w (row-major, or a PackedWeight's data) with config's grid (K tiles of
    block_k; N and K must be multiples of the tile for the row-major case)."""
    block_k = config.block_k
    tiles_per_split = triton.cdiv(triton.cdiv(k, block_k), config.split_k)
    _read_kernel[(triton.cdiv(n, config.block_n), config.split_k)](
        w.view(torch.uint8), sink, k, BLOCK_N=config.block_n, BLOCK_K=block_k, TILES_PER_SPLIT=tiles_per_split,
        SPLIT_K=config.split_k, PACKED=packed, num_warps=config.warps, num_stages=config.stages)


def packed_copies(weights, config: fp8.TileConfig):
    return [fp8.pack_weight(w, config, BLOCK) for w in weights]


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
        timed(results, "fp8", lambda: [fp8.fp8_linear(x, w, s, BLOCK, out=o) for w, s, o in zip(weights, scales, outs)], copies)
        config = fp8.tile_config(n, k, True)
        timed(results, "fp8_native", lambda: [fp8.fp8_gemm(x, w, s, BLOCK, config, convert="native", out=o)
                                              for w, s, o in zip(weights, scales, outs)], copies)
        x_fp8 = x.to(torch.float8_e4m3fn)
        scale_a = torch.ones(rows, 1, device="cuda")
        scale_b = torch.ones(1, n, device="cuda")
        if PACKED_MODE:
            packs = packed_copies(weights, config)
            timed(results, "fp8_packed", lambda: [fp8.fp8_gemm(x, p, s, BLOCK, config, convert=fp8.HOPPER_CONVERT, out=o)
                                                  for p, s, o in zip(packs, scales, outs)], copies)
            # the reads alone, in 128-wide K tiles (the packed layout of a 128-wide tile)
            read_config = dataclasses.replace(config, block_k=128) if config.block_k != 128 else config
            read_packs = packed_copies(weights, read_config) if read_config != config else packs
            sink = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
            if n % read_config.block_n == 0 and k % 128 == 0:
                timed(results, "read_row_major", lambda: [read_only(w, read_config, n, k, False, sink) for w in weights], copies)
            timed(results, "read_packed", lambda: [read_only(p.data, read_config, n, k, True, sink) for p in read_packs], copies)
            del packs, read_packs
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


def _config(point: dict) -> fp8.TileConfig:
    return fp8.TileConfig(**{key: value for key, value in point.items() if key != "convert"})


def sweep_shape(name, n, k, deadline: float, rows=16):
    """Coordinate descent at `rows` rows from the shape's TILE_TABLE config (asm conversion), until no axis
    move helps or the deadline; then the best three at 64 rows."""
    weights, scales = shape_copies(n, k)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, n, device="cuda", dtype=torch.bfloat16)
    seen: dict[tuple, dict] = {}

    def measure(point: dict, m: int = rows) -> float | None:
        key = (m, *sorted(point.items()))
        if key not in seen:
            config, times = _config(point), {}
            try:
                mats = packed_copies(weights, config) if PACKED_MODE else weights
            except Exception as error:
                mats, times["us"], times["errors"] = None, None, {"us": f"{type(error).__name__}: {str(error)[:160]}"}
            if mats is not None:
                timed(times, "us", lambda: [fp8.fp8_gemm(x[:m], w, s, BLOCK, config, convert=point["convert"], out=out[:m])
                                            for w, s in zip(mats, scales)], len(weights))
            del mats
            seen[key] = {"config": dict(point), "rows": m, "us": times["us"],
                         **({"error": times["errors"]["us"]} if "errors" in times else {})}
        return seen[key]["us"]

    start = {**fp8.tile_config(n, k, True).__dict__, "convert": fp8.HOPPER_CONVERT}
    best, best_us = start, measure(start)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        moves = JOINT + [{axis: value} for axis, values in AXES.items() for value in values if best[axis] != value]
        for move in moves:
            if time.perf_counter() > deadline:
                break
            point = {**best, **move}
            if not point.get("pdl"):  # a prefetch is issued only before the PDL wait
                point["prefetch"] = 0
            us = measure(point)
            if us is not None and (best_us is None or us < best_us):
                best, best_us, improved = point, us, True
    ranked = sorted((r for r in seen.values() if r["us"] is not None), key=lambda r: r["us"])[:3]
    at64 = []
    for r in ranked:
        at64.append({"config": r["config"], "us16": r["us"], "us64": measure(r["config"], 64)})
    del weights, scales
    torch.cuda.empty_cache()
    return {"name": name, "n": n, "k": k, "tried": len(seen), "configs": list(seen.values()),
            "best": {"config": best, "us": best_us}, "top_at_64": at64}


def _cell(us, floor) -> str:
    return f"{'-':>14}" if us is None else f"{us:>8.1f} {us / floor:4.2f}x"


def table(out) -> str:
    keys = ("before", "fp8", "fp8_native", "bf16_cublas", "scaled_mm")
    if any("fp8_packed" in shape["rows"][rows] for shape in out["shapes"] for rows in shape["rows"]):
        keys += ("fp8_packed", "read_row_major", "read_packed")
    lines = []
    for rows in out["rows"]:
        lines.append(f"-- {rows} rows: us per matrix (x its FP8 floor); before = commit bef3bcc's faster path")
        lines.append(f"{'shape':12} {'N x K':>12} {'floor':>7} {'before':>14} {'fp8 now':>14} {'native conv':>14} "
                     f"{'bf16 cuBLAS':>14} {'_scaled_mm':>14}"
                     + ("".join(f" {name:>14}" for name in ("packed", "read rows", "read packed")) if len(keys) > 5 else ""))
        for shape in out["shapes"]:
            r = {**shape["rows"][rows], "before": BEFORE.get(rows, {}).get(shape["name"])}
            lines.append(f"{shape['name']:12} {shape['n']:>6}x{shape['k']:<5} {shape['floor_us']:>7.1f} "
                         + " ".join(_cell(r.get(key), shape["floor_us"]) for key in keys))
        step = out["step_ms"][rows]
        lines.append(f"{'64 layers ms':12} {'':>12} {step['floor']:>7.2f} " + " ".join(_cell(step.get(key), step["floor"]) for key in keys)
                     + f"   (+ bf16 head {step['head_bf16']:.2f} ms)")
    if out.get("sweep"):
        lines.append("-- sweep at 16 rows: best per shape -> fp8_tiles.TILE_TABLE (and its convert); 64-row us of the top 3")
        total = {"floor": 0.0, "before": 0.0, "now": 0.0, "best": 0.0}
        for s in out["sweep"]:
            best = s["best"]
            if not best or best["us"] is None:
                continue
            c = best["config"]
            shape = next(sh for sh in out["shapes"] if sh["name"] == s["name"])
            now = shape["rows"].get(16, {}).get("fp8")
            lines.append(f"    ({s['n']}, {s['k']}, True): TileConfig(block_n={c['block_n']}, block_k={c['block_k']}, "
                         f"split_k={c['split_k']}, warps={c['warps']}, stages={c['stages']}, swap={c['swap']}"
                         f"{', pdl=True' if c.get('pdl') else ''}"
                         f"{', prefetch=%d' % c['prefetch'] if c.get('prefetch') else ''}),  "
                         f"# {s['name']} {best['us']} us {best['us'] / shape['floor_us']:.2f}x, convert {c['convert']}, "
                         f"{s['tried']} tried")
            lines.append("        64 rows: " + "; ".join(
                f"{t['config']['block_n']}/{t['config']['block_k']}/s{t['config']['split_k']}/w{t['config']['warps']}/"
                f"st{t['config']['stages']}/{t['config']['convert']}{'/swap' if t['config']['swap'] else ''}"
                f"{'/pdl' if t['config'].get('pdl') else ''}{'/pf%d' % t['config']['prefetch'] if t['config'].get('prefetch') else ''}: "
                f"{t['us16']} -> {t['us64']} us" for t in s["top_at_64"]))
            total["floor"] += shape["count"] * shape["floor_us"] / 1e3
            total["before"] += shape["count"] * BEFORE[16][s["name"]] / 1e3
            total["now"] += shape["count"] * (now or float("nan")) / 1e3
            total["best"] += shape["count"] * best["us"] / 1e3
        ratio = {key: value / total["floor"] for key, value in total.items()}
        lines.append(f"-- 64 layers at 16 rows: floor {total['floor']:.2f} ms; before {total['before']:.2f} ({ratio['before']:.2f}x); "
                     f"now {total['now']:.2f} ({ratio['now']:.2f}x); "
                     f"with the sweep's best {total['best']:.2f} ({ratio['best']:.2f}x) (shapes swept: {len(out['sweep'])})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--packed", action="store_true", help="time packed weights too, and sweep their configs")
    parser.add_argument("--write-tiles", help="write the sweep's best configs here (the form of $SHARDD_FP8_TILES)")
    parser.add_argument("--budget-s", type=float, default=120, help="stop starting new shapes in the timing part after this")
    parser.add_argument("--sweep-s", type=float, default=130, help="seconds for the whole sweep (shared by the shapes)")
    args = parser.parse_args()
    global PACKED_MODE
    PACKED_MODE = args.packed
    t0 = time.perf_counter()
    rows_list = [int(r) for r in args.rows.split(",")]
    bandwidth = copy_bandwidth(torch, torch.device("cuda"))
    out = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "rows": rows_list, "shapes": [], "step_ms": {},
           "table": {f"{n}x{k}": fp8.tile_config(n, k, True).__dict__ for _, n, k, _ in SHAPES},
           "hopper_convert": fp8.HOPPER_CONVERT}
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
        for s in out["shapes"]:
            s["rows"][rows]["before"] = BEFORE.get(rows, {}).get(s["name"])
        for key in ("before", "fp8", "fp8_native", "bf16_cublas", "scaled_mm", "fp8_packed", "read_row_major", "read_packed"):
            values = [s["rows"][rows].get(key) for s in out["shapes"]]
            step[key] = None if None in values else sum(s["count"] * v for s, v in zip(out["shapes"], values)) / 1e3
        out["step_ms"][rows] = {key: None if v is None else round(v, 3) for key, v in step.items()}
    del head
    torch.cuda.empty_cache()
    out["sweep"] = []
    if not args.no_sweep:
        sweep_start = time.perf_counter()
        sweep_end = sweep_start + args.sweep_s
        for index, (name, n, k, _) in enumerate(SHAPES):
            now = time.perf_counter()
            if now > sweep_end - 5:
                print(f"sweep budget spent: {name} not swept", flush=True)
                break
            deadline = now + (sweep_end - now) / (len(SHAPES) - index)  # an equal share of what is left
            out["sweep"].append(sweep_shape(name, n, k, deadline))
            print(json.dumps(out["sweep"][-1]), flush=True)
    if args.write_tiles and out["sweep"] and not PACKED_MODE:
        tiles = {f"{s['n']}x{s['k']}": {key: value for key, value in s["best"]["config"].items() if key != "convert"}
                 for s in out["sweep"] if s["best"]["us"] is not None}
        Path(args.write_tiles).write_text(json.dumps(tiles, indent=1) + "\n")
        print(f"tiles for {fp8.TILES_ENV}: {args.write_tiles}")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
