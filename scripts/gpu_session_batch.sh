#!/usr/bin/env bash
# One device call for issue 20's batch benchmark (the scheduler), on ONE GPU or more; ~8 minutes.
#   1. environment; 2. scripts/bench_gpu.py --parts batch: one process (the 27B shape, bf16, one FastShard,
#   33 sequences) then two daemons (layers 0:32, 32:64; both on cuda:0 when there is one GPU,
#   --max-sequences 33): aggregate tok/s at 1/4/8/16/32 streams, greedy and the oracle drafter (mean commit ~7),
#   512-token prompts, 64 new tokens; shardctl serve over HTTP at 8 streams against the same 8 without HTTP;
#   batch_identical (each stream equal to the same request alone, greedy, oracle, seeded sampling, checkpoint
#   and replay-ssm); the two-daemon decode steps by phase at 1/8/32 streams (batch_relay_by_phase); 3. the short
#   table, last.
# BENCH_HTTP_PYSPY=FILE: the HTTP part runs a second time under py-spy (its stacks in FILE, `profile_top` in the JSON).
# JSON and logs land in $OUT and bench/results/h200/. Wheels in .whl/ are installed by scripts/gpu_env.sh.
# Usage: scripts/gpu_session_batch.sh [bench_gpu.py arguments, e.g. --daemon-step-rows 128 --batch-rows 256]
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env_batch.txt"
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
echo "== bench_gpu --parts batch"
timeout ${BENCH_TIMEOUT:-450} python3 scripts/bench_gpu.py --parts batch --tokens 64 --prompt-len 512 \
    --json "$OUT/gpu_bench_batch.json" "$@" 2>&1 | grep -v '^ \|^{\|^}' | tail -40 | tee "$OUT/gpu_bench_batch.log"
cp "$OUT"/gpu_bench_batch.json "$OUT"/gpu_bench_batch.log "$OUT"/env_batch.txt bench/results/h200/ 2>/dev/null
echo "== batch (aggregate tok/s by concurrent streams)"
python3 - "$OUT/gpu_bench_batch.json" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from bench_batch import batch_table
from bench_gpu import phase_table
try:
    r = json.load(open(sys.argv[1]))
    print(batch_table(r))
    if r.get("batch_relay_by_phase"):
        print("== two daemons, greedy decode steps by phase (ms per step)\n" + phase_table(r["batch_relay_by_phase"]))
    if r.get("batch_prefill_by_phase"):
        print("== prefill ms, one process", r.get("batch_prefill_ms_local"), "two daemons", r.get("batch_prefill_ms_daemons"))
        print("== two daemons, prefill steps by phase (ms per step)\n" + phase_table(r["batch_prefill_by_phase"]))
except (OSError, ValueError, KeyError) as exc:
    print(f"no benchmark JSON: {exc}")
PY
