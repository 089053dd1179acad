#!/usr/bin/env bash
# One device call (one GPU: nvidia-h200) for issue 17, FP8 weights; at most ~6.5 minutes. Results in $OUT and in
# bench/results/h200/.
#   1. environment; 2. the FP8 GPU tests (loading and the fast step with FP8 bytes: tests/test_quant.py; the kernel:
#   tests/test_fp8*.py); 3. scripts/bench_gpu.py --fp8 (one process: greedy and verify step against the FP8 floor).
# The seed's benchmark (scripts/bench_seed.py) has its own call: scripts/gpu_session_seed.sh.
# Wheels carried in .whl/ (pyzmq, fla-core) installed by scripts/gpu_env.sh.
# Usage: scripts/gpu_session_fp8.sh   (BENCH_TOKENS, TESTS_TIMEOUT, BENCH_TIMEOUT override the sizes; FP8_TESTS the tests)
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env.txt"
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
echo "== FP8 GPU tests"
timeout ${TESTS_TIMEOUT:-180} python3 -m pytest -q -x ${FP8_TESTS:-tests/test_quant.py tests/test_narrow_gemm.py $(ls tests/test_fp8*.py 2>/dev/null)} 2>&1 | tail -15 | tee "$OUT/fp8_tests.txt"
echo "== bench_gpu --fp8 fp8-block (one process)"
timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench_gpu.py --fp8 fp8-block --parts local --tokens ${BENCH_TOKENS:-96} \
    --repeats 10 --json "$OUT/gpu_bench_fp8.json" 2>&1 | grep -v '^ ' | tail -12
python3 - "$OUT/gpu_bench_fp8.json" <<'PY' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
print("FP8 floor %.2f ms; greedy %.2f ms/token (%.2fx); verify step %s (x floor %s); outputs identical %s" % (
    r["floor_ms"], r["greedy_ms_per_token"], r["floor_ratio_greedy"], r["step_ms"], r["floor_ratio_step"], r["outputs_identical"]))
PY
cp "$OUT"/gpu_bench_fp8.json "$OUT"/fp8_tests.txt "$OUT"/env.txt bench/results/h200/ 2>/dev/null
true
