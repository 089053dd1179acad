#!/usr/bin/env bash
# One device call (one H200) for issue 20's batched step; about 5 minutes. Results in $OUT and bench/results/h200/.
#   1. environment; 2. the batched step's GPU tests (tests/test_batch_step.py: bf16 rows bit-identical to each
#   sequence alone on the 27B layer shape, every rollback mode, a failing item, slots reused; the CPU tests' float32
#   schedules, on the GPU) and the fast path's
#   own GPU tests (tests/test_fast_path.py: the step and every rollback mode through the new control);
#   3. scripts/bench_gpu.py --parts batch-step: ms per step by R = 16 .. 256 rows (the 27B shape, bf16), the
#   table last.
# Usage: scripts/gpu_session_batch_step.sh   (STEP_ROWS, REPEATS, TESTS_TIMEOUT, FAST_TESTS_TIMEOUT, BENCH_TIMEOUT)
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env.txt"
GPU_ENV_WHEELS_OPTIONAL=1
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
echo "== batched-step GPU tests"
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -rf tests/test_batch_step.py 2>&1 | tail -20 | tee "$OUT/batch_step_tests.txt"
timeout ${FAST_TESTS_TIMEOUT:-100} python3 -m pytest -q -rf tests/test_fast_path.py -k "gpu or bf16 or graph or prefill" 2>&1 \
    | tail -12 | tee -a "$OUT/batch_step_tests.txt"
echo "== bench_gpu --parts batch-step"
timeout ${BENCH_TIMEOUT:-180} python3 scripts/bench_gpu.py --parts batch-step --repeats ${REPEATS:-10} \
    --step-rows ${STEP_ROWS:-16,32,64,128,256} --batch-step-budget-s 120 \
    --json "$OUT/gpu_bench_batch_step.json" 2>&1 | grep -v '^ \|^[{}]' | tail -40
cp "$OUT"/gpu_bench_batch_step.json "$OUT"/batch_step_tests.txt bench/results/h200/ 2>/dev/null
true
