#!/usr/bin/env bash
# One device call for DFlash at full speed (issue 16), on ONE GPU (the daemons share it); ~6-8 minutes.
#   1. environment; 2. scripts/bench_gpu.py --parts dflash: the drafter's PROPOSE in process (fast path vs
#   reference vs its weight-read floor), then two 27B-shape target daemons plus the drafter (--draft synthetic:5)
#   in its own daemon, beside the first shard and beside the last: tok/s at mean commits 3, 5, 7 with the real
#   PROPOSE every step against the oracle on the same daemons, the per-step breakdown, the real drafter's own
#   decode (identical to greedy); 3. the GPU tests of the drafter step (tests/test_fast_draft.py) and of the
#   target step whose kernels it shares (tests/test_fast_path.py, its kernel tests); 4. the short table, last.
# JSON and logs land in $OUT and bench/results/h200/. Wheels in .whl/ are installed by scripts/gpu_env.sh.
# Usage: scripts/gpu_session_dflash.sh [bench_gpu.py arguments]
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env_dflash.txt"
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
echo "== bench_gpu --parts dflash"
timeout ${BENCH_TIMEOUT:-330} python3 scripts/bench_gpu.py --parts dflash --json "$OUT/gpu_bench_dflash.json" "$@" 2>&1 \
    | grep -v '^ \|^{\|^}' | tail -25
echo "== GPU tests"
# the drafter's tests, and the target step's tests that run the attention kernels the drafter now shares
timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q tests/test_fast_draft.py tests/test_fast_path.py \
    -k "fast_drafter or verify_reply or step_and_rollback or bf16 or graph_replay" 2>&1 | tail -12 \
    | tee "$OUT/gpu_tests_dflash.txt"
cp "$OUT"/gpu_bench_dflash.json "$OUT"/gpu_tests_dflash.txt "$OUT"/env_dflash.txt bench/results/h200/ 2>/dev/null
echo "== DFlash (one H200, two target daemons + drafter)"
python3 - "$OUT/gpu_bench_dflash.json" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from bench_gpu import dflash_table
try:
    print(dflash_table(json.load(open(sys.argv[1]))))
except (OSError, ValueError) as exc:
    print(f"no benchmark JSON: {exc}")
PY
