#!/usr/bin/env bash
# One device call (one GPU, ~8 minutes: the after part with its timeline run alone took over 200 s at 48 tokens): the relay's shipped arm of an older tree and of this one side by side,
# so a host-path change is measured against the code before it in one run (two daemons on one GPU vary by
# ~0.5 ms a step between sessions, more than such changes are worth).
#   BEFORE_TREE   a directory holding the older code (`git archive COMMIT | tar -x -C DIR`), inside the working
#                 tree so that it travels to the device (untracked; never commit it)
#   AB_ARGS       bench_gpu.py flags for both parts (--arms-only: the shipped arm without the plain runs)
#   AFTER_ARGS    flags for the after part only (default --timeline; e.g. "--timeline --pyspy $OUT/pyspy")
# 1. BEFORE_TREE's scripts/bench_gpu.py --parts relay (the shipped arm); 2. this tree's --parts relay,local with
# the daemons' GPU timelines (--timeline). Results in $OUT: relay_before.json, relay_after.json and their logs.
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
: "${BEFORE_TREE:?set BEFORE_TREE to the older tree}"
GPU_ENV_FILE="$OUT/env_ab.txt"
GPU_ENV_NPROC=1
. scripts/gpu_env.sh
ARGS="--tokens ${BENCH_TOKENS:-64} --repeats 10 --busy-poll-ms 20 --relay-arms direct-busy"
here=$PWD
case "$OUT" in /*) out_abs=$OUT ;; *) out_abs=$here/$OUT ;; esac  # the before run works in BEFORE_TREE
echo "== before ($BEFORE_TREE)"
(cd "$BEFORE_TREE" && PYTHONPATH=/tmp/site:/tmp/fla-site:$PWD timeout ${BEFORE_TIMEOUT:-170} python3 scripts/bench_gpu.py \
    --parts relay $ARGS ${AB_ARGS:-} --json "$out_abs/relay_before.json" > "$out_abs/relay_before.log" 2>&1)
echo "before exit: $?"
echo "== after (this tree)"
timeout ${AFTER_TIMEOUT:-320} python3 scripts/bench_gpu.py --parts relay,local $ARGS ${AB_ARGS:-} ${AFTER_ARGS:---timeline} \
    --json "$OUT/relay_after.json" > "$OUT/relay_after.log" 2>&1
echo "after exit: $?"
python3 - "$OUT/relay_before.json" "$OUT/relay_after.json" <<'PY'
import json, sys
runs = {}
for name, path in zip(("before", "after"), sys.argv[1:]):
    try:
        runs[name] = json.load(open(path))
    except (OSError, ValueError) as exc:
        print(f"{name}: no JSON ({exc})")
after = runs.get("after", {})
for name, r in runs.items():
    arm = r.get("relay_direct_busy_poll", {})
    steps = {m: arm.get(f"e2e_step_ms_{m}") for m in ("checkpoint", "replay-ssm")}
    print(name, "arm step ms", steps, "greedy ms", arm.get("e2e_greedy_ms_per_token"), "plain step ms", r.get("e2e_step_ms"),
          "identical", r.get("outputs_identical"))
if "tok_s" in after:
    local = {m: round(1e3 * after["mean_commit"][m] / after["tok_s"][m], 3) for m in ("checkpoint", "replay-ssm")}
    print("one process (after's run): step ms", local, "greedy ms", after.get("greedy_ms_per_token"))
print("timeline", after.get("relay_timeline"))
PY
true
