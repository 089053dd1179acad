#!/usr/bin/env bash
# One device call (<= 10 minutes) for the rows on the device (issue 15's relay lever; shardd/ring.py):
#   1. scripts/probe_cuda_ipc.py: two processes sharing a ring of rows and interprocess events (every step's rows
#      right), and a writer killed with its rows in flight (does a wait on its event end: host poll, stream wait);
#   2. the GPU tests of the ring (tests/test_relay.py: three fast daemons, ring against host rows);
#   3. scripts/bench_gpu.py --parts relay,local: the plain runs, and daemon to daemon with polling through the ring
#      (relay_direct_busy_poll, the shipped defaults), side by side.
# Results in $OUT and bench/results/h200/ (suffix $TAG, default the commit). TIMELINE=1: the bench also runs the
# shipped arm with the daemons' GPU timelines (--timeline: relay_timeline). STEPS (default probe,tests,bench)
# picks the steps: the three take ~60 + ~270 + ~400 s, so two calls (STEPS=probe,tests then STEPS=bench).
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
TAG=${TAG:-$(git rev-parse --short HEAD 2>/dev/null || echo now)}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env_ring.txt"
GPU_ENV_NPROC=1
. scripts/gpu_env.sh
STEPS=${STEPS:-probe,tests,bench}
step() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
if step probe; then
echo "== probe_cuda_ipc"
timeout ${PROBE_TIMEOUT:-80} python3 scripts/probe_cuda_ipc.py --json "$OUT/cuda_ipc_probe_$TAG.json"
fi
if step tests; then
echo "== GPU tests (ring)"
timeout ${TESTS_TIMEOUT:-270} python3 -m pytest -q -p no:cacheprovider tests/test_ring_wait.py tests/test_relay.py tests/test_timeline.py -k "device_ring or device_wait or stamps" 2>&1 \
    | tail -${TESTS_TAIL:-4} | tee "$OUT/gpu_tests_ring_$TAG.txt"
fi
if step bench; then
echo "== bench_gpu --parts relay,local"
timeout ${BENCH_TIMEOUT:-480} python3 scripts/bench_gpu.py --parts relay,local --tokens 64 --repeats 10 --busy-poll-ms 20 \
    --relay-arms ${ARMS:-direct-busy} ${TIMELINE:+--timeline} \
    --json "$OUT/gpu_bench_relay_$TAG.json" > "$OUT/gpu_bench_relay_$TAG.log" 2>&1
echo "bench_gpu exit: $?"
python3 - "$OUT/gpu_bench_relay_$TAG.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no benchmark JSON: {exc}")
for key in ("outputs_identical", "failed_parts", "tok_s", "step_ms", "greedy_ms_per_token", "e2e_vs_local",
            "relay_ms_per_step", "rollback_ms", "relay_timeline"):
    print(f"{key}: {r.get(key)}")
for arm in ("relay_direct_busy_poll",):
    a = r.get(arm) or {}
    print(arm, {k: v for k, v in a.items() if k.startswith(("relay_ms_per_step", "e2e_vs_local", "e2e_greedy_vs"))})
PY
fi
cp "$OUT"/*_"$TAG".* "$OUT"/env_ring.txt bench/results/h200/ 2>/dev/null
true
