#!/usr/bin/env bash
# One device call (one H200 is enough: nvidia-h200; with two GPUs each daemon gets its own) for the seed's
# benchmark, scripts/bench_seed.py, within ~8.5 minutes: two FP8 daemons each capped at 24 GiB (both on cuda:0 with
# one GPU), the 27B-shaped DFlash drafter, a 1,024-token prompt and 256 new tokens, A/B/A checkpoint vs replay;
# FP8 against its own dequantized bf16 model through the decode step; the same pair in bf16 without the cap.
# Each part is held to its share of SEED_BUDGET and keeps what it measured if stopped. The seed's table is printed
# last. Results: $OUT/seed_bench.json, $OUT/seed_bench.log (and the daemons' memory plans in the JSON), copied to
# bench/results/h200/.
# Wheels carried in .whl/ (pyzmq: the daemons; fla-core: the prefill) installed by scripts/gpu_env.sh.
# Usage: scripts/gpu_session_seed.sh [bench_seed.py arguments, e.g. --runs 3 --parts fp8,compare]
#   SEED_BUDGET (seconds for all parts, default 450)
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env.txt"
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
budget=${SEED_BUDGET:-450}
echo "== bench_seed (at most $budget s; log: $OUT/seed_bench.log)"
timeout $((budget + 40)) python3 scripts/bench_seed.py --budget-s "$budget" --json "$OUT/seed_bench.json" "$@" \
    > "$OUT/seed_bench.log" 2>&1
status=$?
cp "$OUT"/seed_bench.json "$OUT"/seed_bench.log "$OUT"/env.txt bench/results/h200/ 2>/dev/null
sed '/^| weights |/,$d' "$OUT/seed_bench.log" | grep -E '^(== |(fp8-block|fp8-channel|bfloat16) (A1|B|A2) |(fp8|bf16|compare): )' | tail -30
[ $status -eq 0 ] || echo "bench_seed exited with $status (1: a part failed, timed out or FP8 outputs differ; 124: the outer timeout)"
if grep -q '^| weights |' "$OUT/seed_bench.log"; then
    sed -n '/^| weights |/,$p' "$OUT/seed_bench.log"  # the seed's table, last
else
    tail -25 "$OUT/seed_bench.log"
fi
exit 0
