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
echo "== GPU tests (tests/test_fp8_gemm.py)"
timeout ${TESTS_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py > "$OUT/fp8_gemm_tests_full.txt" 2>&1
tail -25 "$OUT/fp8_gemm_tests_full.txt" | tee "$OUT/fp8_gemm_tests.txt"
echo "== bench_fp8_gemm (log: $OUT/fp8_gemm_bench.log)"
timeout ${BENCH_TIMEOUT:-230} python3 scripts/bench_fp8_gemm.py --json "$OUT/fp8_gemm.json" --budget-s ${BENCH_BUDGET:-60} --sweep-s ${SWEEP_S:-130} "$@" > "$OUT/fp8_gemm_bench.log" 2>&1
status=$?
grep -v '^{' "$OUT/fp8_gemm_bench.log" | tail -45
[ $status -eq 0 ] || echo "bench_fp8_gemm exited with $status (124: timed out; partial JSON lines in the log)"
cp "$OUT"/fp8_gemm.json "$OUT"/fp8_gemm_tests.txt "$OUT"/fp8_gemm_tests_full.txt "$OUT"/fp8_gemm_bench.log bench/results/h200/ 2>/dev/null
exit 0
