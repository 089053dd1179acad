#!/usr/bin/env bash
# One device call (<= 9 minutes) for issue 15: the GPU tests of the rollback that copies nothing, the relay's host
# cost on the GPU host's CPU (scripts/profile_relay_host.py), then the
# benchmark parts that measure the split: relay (two daemons, relay_by_phase and the e2e keys), local (one
# process: the reference the e2e ratios divide by), delay (relay_vs_delay through scripts/delay_proxy.py) and
# dflash (three daemons, e2e_dflash_step_ms). Both daemons share cuda:0 when one GPU is there. Results land in
# $OUT and bench/results/h200/ (gpu_bench_relay.json); a short table is printed last.
# Usage: scripts/gpu_session_relay.sh [bench_gpu.py arguments], e.g. --busy-poll-ms 20 --direct-rows (the arms side
# by side with the plain runs: relay_busy_poll, relay_direct, relay_direct_busy_poll)
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" bench/results/h200
GPU_ENV_FILE="$OUT/env.txt"
GPU_ENV_NPROC=1
. scripts/gpu_env.sh  # wheels from .whl/, PYTHONPATH, PYTHONUNBUFFERED, the environment line
echo "== GPU tests (rollback off the critical path, bit-identical; bf16 speculative = greedy)"
timeout ${TESTS_TIMEOUT:-110} python3 -m pytest -q tests/test_fast_path.py \
    -k "critical_path or bit_identical or bf16 or graph_replay" 2>&1 | tail -6 | tee "$OUT/gpu_tests_relay.txt"
echo "== the relay's host cost on this host's CPU (scripts/profile_relay_host.py: no sockets, no device)"
timeout 90 python3 scripts/profile_relay_host.py --json "$OUT/relay_host_profile.json" 2>&1 | cut -c1-200 | tail -6
cp "$OUT"/relay_host_profile.json bench/results/h200/ 2>/dev/null
echo "== bench_gpu --parts ${PARTS:-relay,local,delay,relay-dflash}"
timeout ${BENCH_TIMEOUT:-400} python3 scripts/bench_gpu.py --parts "${PARTS:-relay,local,delay,relay-dflash}" --tokens 64 \
    --repeats 10 --json "$OUT/gpu_bench_relay.json" "$@" > "$OUT/gpu_bench_relay.txt" 2>&1
echo "bench_gpu exit: $? (full output: $OUT/gpu_bench_relay.txt)"
grep -E '^(==|relay|delay|dflash|greedy|built|checkpoint|replay|Traceback|RuntimeError|[A-Za-z]*Error)' "$OUT/gpu_bench_relay.txt" | tail -24
cp "$OUT"/gpu_bench_relay.json "$OUT"/gpu_tests_relay.txt bench/results/h200/ 2>/dev/null
python3 - "$OUT/gpu_bench_relay.json" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from bench_gpu import phase_table
r = json.load(open(sys.argv[1]))
for key in ("outputs_identical", "failed_parts", "tok_s", "e2e_tok_s", "e2e_vs_local", "relay_ms_per_step", "step_ms",
            "e2e_step_ms", "greedy_ms_per_token", "e2e_greedy_ms_per_token", "e2e_greedy_vs_local", "rollback_ms",
            "rollback_share_of_step", "e2e_dflash_step_ms", "relay_round_trip_ms", "relay_busy_poll", "relay_direct",
            "relay_direct_busy_poll", "relay_plain", "relay_shipped"):
    print(f"{key}: {r.get(key)}")
delay = r.get("relay_vs_delay")
if delay:
    print("relay_vs_delay: one-way ms", delay["delays_ms_one_way"], "greedy ms/token", delay["greedy_ms_per_token"])
    for block in delay["blocks"]:
        print(f"  block {block}: tok/s {delay['tok_s'][str(block)]}, step ms {delay['step_ms'][str(block)]}")
    print("  round trips per step (fit):", delay["round_trips_per_step"])
if r.get("dflash_relay_by_phase"):
    print("== dflash relay by phase (ms per step; last shard = the drafter daemon)\n" + phase_table(r["dflash_relay_by_phase"]))
print("== relay by phase (ms per step)\n" + phase_table(r.get("relay_by_phase", {})))
PY
