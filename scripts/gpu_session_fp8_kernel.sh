#!/usr/bin/env bash
# One device call for the weight-only FP8 GEMM (shardd/kernels/fp8_gemm.py), under 6 minutes:
#   1. environment; 2. its GPU tests with the current defaults (every 27B fused shape, 1..16 rows, native and
#   asm conversions and the forced-Ampere path, row independence, 64/128-row launches whose 16-row tiles
#   equal those tiles alone, graph replay); 3. scripts/bench_fp8_gemm.py (each 27B matrix at 1/16/64 rows vs
#   the FP8 read floor, commit bef3bcc's figures, bf16 cuBLAS and torch._scaled_mm; then the tile sweep within
#   130 s). The before/after table and the TILE_TABLE lines are printed last.
# Needs only torch, triton and pytest (no carried wheels); if .whl/ has wheels they are installed as
# scripts/gpu_env.sh does for every session script, so the same machine state serves both scripts.
# Results land in $OUT and in bench/results/h200/.
# Usage: scripts/gpu_session_fp8_kernel.sh [bench_fp8_gemm.py arguments]
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env.txt"
GPU_ENV_VERSIONS='import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
GPU_ENV_WHEELS_OPTIONAL=1
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
if [ -n "${NCU:-}" ]; then  # hardware counters of the GEMM's launches (Firecracker hosts; METHOD.md: clocks left alone)
    echo "== ncu (scripts/profile_fp8_gemm.py; report: $OUT/fp8_gemm_ncu.txt)"
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none -k regex:_fp8_gemm_kernel --section SpeedOfLight \
        --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis python3 scripts/profile_fp8_gemm.py ${NCU_SHAPES:+--shapes $NCU_SHAPES} \
        > "$OUT/fp8_gemm_ncu.txt" 2>&1
    echo "ncu exited with $?"
    grep -E "launches|row-major|packed|_fp8_gemm_kernel|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Warp|No Eligible|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit" "$OUT/fp8_gemm_ncu.txt" | head -120
    cp "$OUT/fp8_gemm_ncu.txt" bench/results/h200/ 2>/dev/null
fi
[ -n "${SKIP_TESTS:-}" ] || {
echo "== GPU tests (tests/test_fp8_gemm.py)"
timeout ${TESTS_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py > "$OUT/fp8_gemm_tests_full.txt" 2>&1
tail -25 "$OUT/fp8_gemm_tests_full.txt" | tee "$OUT/fp8_gemm_tests.txt"
}
echo "== bench_fp8_gemm (log: $OUT/fp8_gemm_bench.log)"
timeout ${BENCH_TIMEOUT:-230} python3 scripts/bench_fp8_gemm.py --json "$OUT/fp8_gemm.json" --budget-s ${BENCH_BUDGET:-60} --sweep-s ${SWEEP_S:-130} "$@" > "$OUT/fp8_gemm_bench.log" 2>&1
status=$?
grep -v '^{' "$OUT/fp8_gemm_bench.log" | tail -45
[ $status -eq 0 ] || echo "bench_fp8_gemm exited with $status (124: timed out; partial JSON lines in the log)"
cp "$OUT"/fp8_gemm.json "$OUT"/fp8_gemm_tests.txt "$OUT"/fp8_gemm_tests_full.txt "$OUT"/fp8_gemm_bench.log bench/results/h200/ 2>/dev/null
if [ -n "${STEP_AB:-}" ] && [ -s "$OUT/fp8_tiles.json" ]; then  # pass --write-tiles $OUT/fp8_tiles.json above
    # the one-process FP8 step with the sweep's tiles ($SHARDD_FP8_TILES) against the built-in TILE_TABLE, one run each
    for table in tuned builtin; do
        echo "== bench_gpu --fp8 fp8-block --parts local, tiles: $table"
        if [ $table = tuned ]; then export SHARDD_FP8_TILES="$OUT/fp8_tiles.json"; else unset SHARDD_FP8_TILES; fi
        timeout ${STEP_TIMEOUT:-170} python3 scripts/bench_gpu.py --fp8 fp8-block --parts local --tokens 96 \
            --repeats ${STEP_REPEATS:-5} --json "$OUT/gpu_bench_fp8_$table.json" > "$OUT/gpu_bench_fp8_$table.log" 2>&1
        python3 - "$OUT/gpu_bench_fp8_$table.json" <<'PY' 2>/dev/null || echo "no JSON (see the log)"
import json, sys
r = json.load(open(sys.argv[1]))
print("floor %.2f ms; greedy %.2f ms/token (%.2fx); verify %s (x floor %s); identical %s" % (
    r["floor_ms"], r["greedy_ms_per_token"], r["floor_ratio_greedy"], r["step_ms"], r["floor_ratio_step"], r["outputs_identical"]))
print("top:", [(t["kernel"][:40], t["ms_per_call"], t["launches"]) for t in r.get("profile_step_top", [])[:8]])
PY
    done
    unset SHARDD_FP8_TILES
fi
exit 0
