#!/usr/bin/env bash
# One device call (< 6 minutes) that measures where a two-daemon verify step's time goes on the GPU host:
# two `shardd serve` daemons of the 27B shape (layers 0:32 and 32:64; both on cuda:0 when one GPU is there),
# greedy and each shard rollback mode with the oracle drafter, the daemons' STATS phases and the coordinator's
# client phases per step (`relay_by_phase`), STATS round trips, and a short extra run with the daemons under
# cProfile (SHARDD_PROFILE). Prints the per-phase table last; JSON and cProfile dumps land in $OUT.
# Usage: scripts/gpu_relay_profile.sh [bench_gpu.py arguments]
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
GPU_ENV_FILE="$OUT/env.txt"
GPU_ENV_VERSIONS='import torch, triton, zmq, sys; print("torch", torch.__version__, "triton", triton.__version__, "zmq", zmq.__version__, "libzmq", zmq.zmq_version(), "switchinterval", sys.getswitchinterval())'
GPU_ENV_NPROC=1
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
timeout ${RELAY_TIMEOUT:-320} python3 scripts/bench_gpu.py --parts relay --tokens 64 --prompt-len 512 \
    --daemon-profile "$OUT/daemon-prof" --json "$OUT/relay_profile.json" "$@" > "$OUT/relay_profile.txt" 2>&1
echo "bench_gpu exit: $? (full output: $OUT/relay_profile.txt)"
grep -E '^(relay|built|Traceback|RuntimeError|[A-Za-z]*Error)' "$OUT/relay_profile.txt" | tail -12
python3 - "$OUT/relay_profile.json" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from bench_gpu import phase_table
result = json.load(open(sys.argv[1]))
for name, top in result.get("daemon_profile_top", {}).items():
    print(f"== cProfile of {name} (tottime)\n" + "\n".join(top[:14]))
print("devices", result.get("relay_devices"), "STATS round trip ms", result.get("relay_round_trip_ms"),
      "outputs_identical", result.get("outputs_identical"), "failed", result.get("failed_parts"))
print("== relay by phase (ms per step)\n" + phase_table(result.get("relay_by_phase", {})))
PY
