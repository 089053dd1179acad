#!/usr/bin/env bash
# Diagnose a hanging device-wait test (one device call): alone under a hard timeout, pytest's
# faulthandler dumping every thread after 25 s, py-spy dumping the writer children at 35 s; all under $OUT.
set -uo pipefail
OUT=${OUT:-bench/results/gpu}; mkdir -p "$OUT"
GPU_ENV_FILE=$OUT/env.txt; . scripts/gpu_env.sh > /dev/null 2>&1
for t in front-end; do
  ( sleep 35; for p in $(pgrep -f "python3 -c"); do echo "== $p"; timeout 10 py-spy dump --pid "$p" 2>&1 | head -40; done ) > "$OUT/spy_$t.txt" 2>&1 &
  spy=$!
  timeout -s KILL ${TEST_KILL_S:-45} python3 -u -m pytest -v -x -p no:cacheprovider -o faulthandler_timeout=25 \
      "tests/test_ring_wait.py::test_a_device_wait_ends_landed_poisoned_cancelled_or_timed_out" > "$OUT/t_$t.txt" 2>&1
  echo "$t rc $?"; wait $spy; pkill -9 -f "python3 -c"; sleep 1
  tail -5 "$OUT/t_$t.txt"
done
