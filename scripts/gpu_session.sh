#!/usr/bin/env bash
# One device call that checks and times the GPU fast path; results land in $OUT (the device tool brings them
# back) and in bench/results/h200/.
#   1. environment; 2. scripts/bench_gpu.py (one process, transformers baseline, and two daemons when two GPUs
#   are there); 3. the GPU tests (kernels and graph step against the reference, bf16 greedy vs every mode).
# Wheels carried in .whl/: pyzmq (the daemons), fla-core (the GPU prefill), installed apart (scripts/gpu_env.sh) so the
# transformers baseline runs as a plain install would (without fla).
# Usage: scripts/gpu_session.sh [bench_gpu.py arguments]
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env.txt"
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
echo "== bench_gpu"
timeout ${BENCH_TIMEOUT:-400} python3 scripts/bench_gpu.py --json "$OUT/gpu_bench.json" "$@" 2>&1 | grep -v '^ ' | tail -30
echo "== GPU tests"
timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q tests/test_fast_path.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
cp "$OUT"/gpu_bench.json "$OUT"/gpu_tests.txt "$OUT"/env.txt bench/results/h200/ 2>/dev/null
