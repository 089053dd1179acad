#!/usr/bin/env bash
# One device call (one GPU, <= 10 minutes) for both open issues' figures when device minutes are short:
#   1. the narrow GEMM's GPU tests and scripts/bench_gpu.py --fp8 (scripts/gpu_session_fp8.sh, issue 17);
#   2. the relay bench with the shipped arm and the daemons' GPU timelines (scripts/gpu_session_ring.sh STEPS=bench
#      TIMELINE=1 ARMS=direct-busy: relay_by_phase, relay_timeline; issue 15).
# Each part under its own timeout; results in $OUT and bench/results/h200/.
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
export OUT
mkdir -p "$OUT"
FP8_TESTS=${FP8_TESTS:-tests/test_narrow_gemm.py} TESTS_TIMEOUT=90 BENCH_TIMEOUT=150 \
    timeout 260 bash scripts/gpu_session_fp8.sh > "$OUT/fp8_session.txt" 2>&1
echo "fp8 session exit: $?"
STEPS=bench TIMELINE=1 ARMS=${ARMS:-direct-busy} BENCH_TIMEOUT=${RELAY_TIMEOUT:-300} \
    bash scripts/gpu_session_ring.sh > "$OUT/ring_session.txt" 2>&1
echo "ring session exit: $?"
