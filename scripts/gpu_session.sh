#!/usr/bin/env bash
# One device call that checks and times the GPU path; results land in $OUT (the device tool brings them back).
#   1. environment; 2. cuda vs cpu parity and rollback exactness (scripts/check_cuda.py);
#   3. rollback cost side by side on the 27B shape, bf16, one GPU (scripts/bench_rollback.py);
#   4. end to end over two daemons on two GPUs: shardctl bench, A/B/A, for each pair given as arguments.
# Usage: scripts/gpu_session.sh [--skip-checks] [AB ...]   (default AB: replay,checkpoint)
#   E2E_DTYPE (default bfloat16), E2E_TOKENS (default 128), E2E_RUNS (default 2) tune step 4.
set -uo pipefail
skip_checks=0
if [ "${1:-}" = "--skip-checks" ]; then skip_checks=1; shift; fi
pairs=("$@"); [ ${#pairs[@]} -eq 0 ] && pairs=(replay,checkpoint)
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c 'import torch, zmq; print("torch", torch.__version__, "zmq", zmq.__version__)'; } | tee "$OUT/env.txt"

if [ $skip_checks -eq 0 ]; then
echo "== check_cuda"
timeout 120 python3 scripts/check_cuda.py cuda:0 | tee "$OUT/check_cuda.json"

echo "== bench_rollback 27B bf16"
timeout 200 python3 scripts/bench_rollback.py --synthetic qwen3.5-27b --device cuda:0 --dtype bfloat16 \
    --prompt-len 512 --steps 24 --rounds 2 --json "$OUT/rollback_27b_h200.json" 2>&1 | tail -8
fi

if [ "$ngpu" -ge 2 ]; then devices=cuda:0,cuda:1; else devices=cuda:0; fi
for ab in "${pairs[@]}"; do
    echo "== shardctl bench $ab on $devices"
    timeout ${E2E_TIMEOUT:-330} python3 -m coordinator.cli bench --synthetic qwen3.5-27b --split 2 --devices "$devices" --dtype "${E2E_DTYPE:-bfloat16}" \
        --ab "$ab" --runs "${E2E_RUNS:-2}" --drafter oracle --mean-commit 6 --max-new-tokens "${E2E_TOKENS:-128}" --timeout 600 \
        --json "$OUT/e2e_${E2E_DTYPE:-bfloat16}_${ab/,/_vs_}.json" 2>"$OUT/e2e_${E2E_DTYPE:-bfloat16}_${ab/,/_vs_}.log" | tail -12
done
