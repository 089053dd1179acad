#!/usr/bin/env bash
# One short device call (<= 8 minutes) after changes to the prefill and the rollback's host path:
#   1. GPU tests: the fla prefill (eager and graphed pieces) against the reference, the rollbacks bit-identical to
#      the copy (both modes; replay-ssm's re-run inside the next step, batched too);
#   2. scripts/profile_prefill.py (host vs kernel time of a prefill call by length);
#   3. scripts/bench_gpu.py --parts relay,local (two daemons at `shardd serve`'s defaults, --busy-poll-ms auto).
# Results land in $OUT and bench/results/h200/ (suffix $TAG, default the commit).
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || echo now)}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env.txt"
GPU_ENV_NPROC=1
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
echo "== GPU tests"
timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_fast_path.py tests/test_batch_step.py \
    -k "prefill or bit_identical or replay" 2>&1 | tail -4 | tee "$OUT/gpu_tests_check_$TAG.txt"
echo "== profile_prefill"
timeout ${PROFILE_TIMEOUT:-70} python3 scripts/profile_prefill.py --lengths ${PROFILE_LENGTHS:-256,512,1024} --rule ${PROFILE_RULE:-both} \
    --json "$OUT/prefill_profile_$TAG.json" 2>&1 | grep '^prefill'
echo "== bench_gpu --parts relay,local"
timeout ${BENCH_TIMEOUT:-240} python3 scripts/bench_gpu.py --parts relay,local --tokens 64 --repeats 10 \
    --json "$OUT/gpu_bench_relay_$TAG.json" > "$OUT/gpu_bench_relay_$TAG.log" 2>&1
echo "bench_gpu exit: $?"
python3 - "$OUT/gpu_bench_relay_$TAG.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for key in ("outputs_identical", "failed_parts", "relay_shipped", "tok_s", "e2e_tok_s", "e2e_vs_local",
            "relay_ms_per_step", "step_ms", "e2e_step_ms", "greedy_ms_per_token", "e2e_greedy_ms_per_token",
            "e2e_greedy_vs_local", "rollback_ms", "rollback_wall_ms", "rollback_share_of_step", "prefill_tok_s"):
    print(f"{key}: {r.get(key)}")
PY
cp "$OUT"/*_"$TAG".* bench/results/h200/ 2>/dev/null
true
