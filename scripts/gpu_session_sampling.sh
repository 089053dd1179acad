#!/usr/bin/env bash
# One device call for the head shard's batched sampling (issue 20): scripts/bench_sampling.py (old per-row vs
# batched ms per verify of 8/16/64/128 rows at Qwen3.5's vocabulary, chunk sizes swept; batch identity, torch ops
# per call, host syncs per call), then the CUDA test of tests/test_sampling.py. Results in $OUT.
# Usage: scripts/gpu_session_sampling.sh [bench_sampling.py arguments]
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
GPU_ENV_FILE="$OUT/env.txt"
GPU_ENV_WHEELS_OPTIONAL=1
GPU_ENV_VERSIONS='import torch; print("torch", torch.__version__)'
. scripts/gpu_env.sh
echo "== bench_sampling"
timeout ${BENCH_TIMEOUT:-90} python3 scripts/bench_sampling.py --json "$OUT/sampling.json" --chunk-rows 16,8,32,64,128 \
    "$@" 2>"$OUT/sampling.log" | tee "$OUT/sampling.txt"
echo "== CUDA sampling tests"
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q tests/test_sampling.py -k "cuda or whatever_its_batch or stream or edges" \
    2>&1 | tail -5 | tee "$OUT/sampling_tests.txt"
