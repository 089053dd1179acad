#!/usr/bin/env bash
# Every GPU run by name, in one device call:
#
#     scripts/gpu_run.sh RUN [RUN...] [-- ARGS]      # ARGS go to each named run's benchmark (name one run with them)
#
# | run           | builds / installs  | GPU tests                                           | measures (under $OUT) |
# |---------------|--------------------|-----------------------------------------------------|-----------------------|
# | check         | wheels             | prefill against the reference, rollbacks bit-exact  | prefill host vs kernel time (prefill_profile.json) |
# | local         | wheels             | tests/unit/test_fast_path.py, all of it             | one process + transformers baseline (gpu_bench_local.json) |
# | relay         | wheels             | rollback off the critical path, bf16 = greedy       | relay host cost (relay_host_profile.json); one process and two daemons, GPU timeline (gpu_bench_relay.json) |
# | relay-profile | wheels             | -                                                   | two daemons under cProfile (relay_profile.json) |
# | ring          | wheels             | the device ring and its waits                       | CUDA IPC across processes (cuda_ipc_probe.json) |
# | batch         | wheels, HTTP stack | -                                                   | many streams, one process / two daemons / HTTP (gpu_bench_batch.json) |
# | batch-step    | wheels             | tests/unit/test_batch_step.py, fast-path step tests | ms per batched step by R rows (gpu_bench_batch_step.json) |
# | dflash        | wheels             | the drafter's graphs, the kernels it shares         | PROPOSE, drafter placements vs oracle (gpu_bench_dflash.json) |
# | dflash-batch  | wheels, HTTP stack | rows and features through the device ring           | DFlash vs oracle at 1/8/32 streams, serve --drafter dflash vs none at 1/8 HTTP streams (gpu_bench_dflash_batch.json) |
# | fp8           | wheels             | FP8 loading, fast step, narrow GEMM, FP8 kernel     | one process with FP8 weights (gpu_bench_fp8.json) |
# | fp8-gemm      | -                  | tests/unit/test_fp8_gemm.py                         | each 27B FP8 matrix vs its floor, tile sweep (fp8_gemm.json); NCU=1: Nsight Compute (fp8_gemm_ncu.txt) |
# | seed          | wheels             | -                                                   | the seed's benchmark, within SEED_BUDGET s (seed_bench.json) |
# | sampling      | -                  | the head shard's sampler on CUDA                    | per-row vs batched sampling (gpu_bench_sampling.json) |
# | prefix        | wheels             | prefix entries on the fast engine, prompt logprobs  | prefix caching: second turn, shared system prompt, flood (gpu_bench_prefix.json) |
# | moe           | wheels             | MoE kernels, fast MoE step: bf16 and FP8, graphs    | 35B-A3B step vs its floor, its heaviest kernels (gpu_bench_moe.json; `-- --fp8 fp8-block`: FP8 linears and experts) |
# | guided        | wheels             | -                                                   | constrained vs plain batched step, 8 streams (gpu_bench_guided.json) |
# | groups        | wheels             | -                                                   | greedy with vs without micro-batches in flight, 1/8/32 streams (gpu_bench_groups.json) |
# | tune          | wheels             | -                                                   | kernels' launch shapes: GDN recurrence, attention (launch, key chunk), MoE experts, MoE router GEMM (tune_kernels.json; `-- --parts moe,router`) |
# | gpu-tests     | wheels             | every test marked gpu (`pytest -m gpu tests`)       | - |
#
# Each run also writes RUN.log (its tests' tail and the benchmark's output); a short summary of every run is printed
# last, since the device tool's reply carries the end of the output. The device tool brings back at most 8 files
# from $OUT: PACK=1 packs them into one runs.tar.gz. Copy what replaces a figure into bench/results/h200/
# (docs/performance.md says how).
# A change is judged against the code before it in the same call (the same code measures differently on another
# host): BEFORE_TREE=DIR (an older tree inside the working tree, untracked, e.g. `git archive COMMIT | tar -x -C old`)
# runs each benchmark of the named runs from that tree first, its JSON as NAME_before.json, and the summary prints
# both (`python3 scripts/ab_compare.py $OUT` lists every figure of each pair with its ratio). Each call has 10 minutes: the timeouts below fit one run each; TESTS_TIMEOUT / BENCH_TIMEOUT override them.
# AB_SIDE=before / AB_SIDE=after runs one side of such a pair, for a benchmark whose two sides do not fit one call
# (seed: 450 s a side; two calls back to back on the warm machine, each with BEFORE_TREE, the same OUT left to the
# caller to join). dflash-batch's tests and its benchmark at 1, 8 and 32 streams with HTTP fit one call (140 + ~300
# s on an H100); `-- --streams 1,8` takes ~150 s. dflash and dflash-batch take two calls.
#
# batch's one-process part plans ~97 GB: on an 80 GB H100 its last arm (a second state pool with checkpoint storage,
# ~27 GiB) does not fit and is skipped (`batch_checkpoint_skipped`), the rest measured; an H200 runs it all. local
# fits an H100; an older tree's local (BEFORE_TREE) needs
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True there for its 32k-context shard (dflash-batch sets it itself).
# Wheels: the device machine has no package index, so what it lacks travels in .whl/ (not in git; carry it:
# `run(carry=[".whl"], command="bash scripts/gpu_run.sh relay fp8")`). Fill it where pip works (Python 3.12 there):
#   P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
#   pip download --no-deps $P -d .whl pyzmq fla-core py-spy xgrammar apache-tvm-ffi
#   pip download $P -d .whl/serve fastapi uvicorn prometheus_client
# Other knobs: SKIP_TESTS=1 (benchmarks only), PARTS (relay: bench_gpu parts, default relay,local; add
# delay,relay-dflash when the call has room), SEED_BUDGET (seed, default 450), BENCH_HTTP_PYSPY=FILE (batch: the HTTP part again under py-spy),
# SHARDD_FP8_TILES (fp8: a tile sweep's table instead of the built-in one), NCU=1 (fp8-gemm).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}

runs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do runs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
ARGS=("$@")
known=" check local relay relay-profile ring batch batch-step dflash dflash-batch fp8 fp8-gemm seed sampling prefix guided groups moe tune gpu-tests "
if [ ${#runs[@]} -eq 0 ]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
for run in "${runs[@]}"; do
    case "$known" in *" $run "*) ;; *) echo "gpu_run: unknown run '$run' (known:$known)" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"

# Install the carried wheels apart from the host's packages: fla-core into its own site, so the transformers
# baseline runs as a plain install would (without fla); the HTTP stack last on the path, only where the host lacks it.
setup() {
    export PYTHONUNBUFFERED=1
    for wheel in .whl/*.whl; do
        [ -e "$wheel" ] || { echo "gpu_run: no wheels in .whl/: the host's packages only"; break; }
        case "$wheel" in *fla_core*) target=/tmp/fla-site ;; *) target=/tmp/site ;; esac
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$wheel" \
            || { echo "gpu_run: $wheel did not install" >&2; exit 1; }
    done
    export PYTHONPATH=/tmp/site:/tmp/fla-site:$PWD
    export PATH=/tmp/site/bin:$PATH  # the carried wheels' programs (py-spy)
    if ls .whl/serve/*.whl > /dev/null 2>&1 && ! python3 -c "import fastapi, uvicorn, prometheus_client" 2> /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serve-site \
            .whl/serve/*.whl || { echo "gpu_run: the HTTP wheels did not install" >&2; exit 1; }
        export PYTHONPATH=$PYTHONPATH:/tmp/serve-site
    fi
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        nproc
        python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
        python3 -c 'import zmq; print("zmq", zmq.__version__, "libzmq", zmq.zmq_version())' 2>&1
    } | tee "$OUT/env.txt"
}

# gpu_tests RUN SECONDS PYTEST-ARGS...: the GPU tests of a run, their tail into RUN.log (SKIP_TESTS=1: none)
gpu_tests() {
    local run=$1 seconds=${TESTS_TIMEOUT:-$2}; shift 2
    [ -z "${SKIP_TESTS:-}" ] || return 0
    echo "== $run: GPU tests (pytest $*)" | tee -a "$OUT/$run.log"
    timeout "$seconds" python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -8 | tee -a "$OUT/$run.log"
    # the tests' own exit, in the summary; a timeout leaves no pytest summary line to read, so it says so
    local status=${PIPESTATUS[0]}
    if [ "$status" -eq 124 ]; then
        echo "$run: exit 124 (GPU tests: out of their $seconds s; TESTS_TIMEOUT raises it)" | tee -a "$OUT/$run.log"
    else
        echo "$run: exit $status (GPU tests)" | tee -a "$OUT/$run.log"
    fi
}

# bench RUN SECONDS COMMAND...: a benchmark under its timeout, its whole output into RUN.log; with BEFORE_TREE, the
# same command from that tree first, writing NAME_before.json where this one writes $OUT/NAME.json
bench() {
    local run=$1 seconds=${BENCH_TIMEOUT:-$2}; shift 2
    [ -z "${BEFORE_TREE:-}" ] || bench_before "$run" "$seconds" "$@"
    [ "${AB_SIDE:-}" != before ] || return 0
    echo "== $run: $*" | tee -a "$OUT/$run.log"
    timeout "$seconds" "$@" >> "$OUT/$run.log" 2>&1
    local status=$?
    echo "$run: exit $status$([ $status -eq 124 ] && echo ' (timed out)')" | tee -a "$OUT/$run.log"
}
bench_before() {
    local run=$1 seconds=$2 out_abs tree arg; shift 2
    [ "${AB_SIDE:-}" != after ] || return 0
    out_abs=$(cd "$OUT" && pwd); tree=$(cd "$BEFORE_TREE" && pwd)
    local args=()
    for arg in "$@"; do
        case "$arg" in "$OUT"/*.json) arg="$out_abs/$(basename "$arg" .json)_before.json" ;; esac
        args+=("$arg")
    done
    echo "== $run before ($BEFORE_TREE): ${args[*]}" | tee -a "$OUT/$run.log"
    (cd "$tree" && PYTHONPATH=${PYTHONPATH//$PWD/$tree} timeout "$seconds" "${args[@]}") >> "$OUT/$run.log" 2>&1
    echo "$run before: exit $?" | tee -a "$OUT/$run.log"
}

run_check() {
    gpu_tests check 150 tests/unit/test_fast_path.py tests/unit/test_batch_step.py -k "prefill or bit_identical or replay"
    bench check 90 python3 scripts/profile_prefill.py --lengths 256,512,1024 --rule both \
        --json "$OUT/prefill_profile.json" "${ARGS[@]}"
}
run_local() {
    gpu_tests local 170 tests/unit/test_fast_path.py
    bench local 400 python3 scripts/bench_gpu.py --parts local,transformers --json "$OUT/gpu_bench_local.json" "${ARGS[@]}"
}
run_relay() {
    gpu_tests relay 150 tests/unit/test_fast_path.py -k "critical_path or bit_identical or bf16 or graph_replay"
    bench relay 60 python3 scripts/profile_relay_host.py --json "$OUT/relay_host_profile.json"
    bench relay 380 python3 scripts/bench_gpu.py --parts "${PARTS:-relay,local}" --tokens 64 --repeats 10 --timeline \
        --json "$OUT/gpu_bench_relay.json" "${ARGS[@]}"
}
run_prefix() {
    gpu_tests prefix 200 tests/integration/test_prefix_cache.py tests/integration/test_prompt_logprobs.py -k fast_engine
    bench prefix 420 python3 scripts/bench_gpu.py --parts prefix --json "$OUT/gpu_bench_prefix.json" "${ARGS[@]}"
}
run_moe() {
    gpu_tests moe 200 tests/unit/test_moe_kernel.py tests/unit/test_fast_moe.py
    bench moe 300 python3 scripts/bench_gpu.py --parts moe --json "$OUT/gpu_bench_moe.json" "${ARGS[@]}"
}
run_tune() {
    bench tune 240 python3 scripts/tune_kernels.py --json "$OUT/tune_kernels.json" "${ARGS[@]}"
}
run_groups() {
    bench groups 300 python3 scripts/bench_gpu.py --parts groups --json "$OUT/gpu_bench_groups.json" "${ARGS[@]}"
}
run_guided() {
    bench guided 300 python3 scripts/bench_gpu.py --parts guided --json "$OUT/gpu_bench_guided.json" "${ARGS[@]}"
}
run_relay-profile() {
    bench relay-profile 320 python3 scripts/bench_gpu.py --parts relay --tokens 64 --daemon-profile /tmp/daemon-prof \
        --json "$OUT/relay_profile.json" "${ARGS[@]}"
}
run_ring() {
    bench ring 80 python3 scripts/probe_cuda_ipc.py --json "$OUT/cuda_ipc_probe.json"
    gpu_tests ring 270 tests/gpu/test_ring_wait.py tests/integration/test_relay.py tests/integration/test_timeline.py -k "device_ring or device_wait or stamps"
}
run_batch() {
    bench batch 450 python3 scripts/bench_gpu.py --parts batch --tokens 64 --prompt-len 512 \
        --json "$OUT/gpu_bench_batch.json" "${ARGS[@]}"
}
run_batch-step() {
    gpu_tests batch-step 150 tests/unit/test_batch_step.py
    gpu_tests batch-step 100 tests/unit/test_fast_path.py -k "gpu or bf16 or graph or prefill"
    bench batch-step 180 python3 scripts/bench_gpu.py --parts batch-step --repeats 10 --batch-step-budget-s 120 \
        --json "$OUT/gpu_bench_batch_step.json" "${ARGS[@]}"
}
run_dflash() {
    bench dflash 330 python3 scripts/bench_gpu.py --parts dflash --json "$OUT/gpu_bench_dflash.json" "${ARGS[@]}"
    gpu_tests dflash 170 tests/unit/test_fast_draft.py tests/unit/test_fast_path.py \
        -k "fast_drafter or verify_reply or step_and_rollback or bf16 or graph_replay"
}
run_dflash-batch() {
    gpu_tests dflash-batch 200 tests/integration/test_dflash.py tests/integration/test_relay.py -k "ride or device_ring"
    # two 27B daemons, the drafter and 33 sequences' state on one card: unsegmented, an 80 GB card runs out loading
    # the drafter with GiBs cached in pieces
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} bench dflash-batch 380 python3 scripts/bench_gpu.py --parts dflash-batch --json "$OUT/gpu_bench_dflash_batch.json" "${ARGS[@]}"
}
run_fp8() {
    gpu_tests fp8 180 -x tests/unit/test_quant.py tests/unit/test_narrow_gemm.py tests/unit/test_fp8_gemm.py
    bench fp8 150 python3 scripts/bench_gpu.py --fp8 fp8-block --parts local --tokens 96 --repeats 10 \
        --json "$OUT/gpu_bench_fp8.json" "${ARGS[@]}"
}
run_fp8-gemm() {
    if [ -n "${NCU:-}" ]; then  # hardware counters of the GEMM's launches; clocks left as they are (METHOD.md)
        bench fp8-gemm 150 ncu --clock-control none -k regex:_fp8_gemm_kernel --section SpeedOfLight \
            --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
            --section MemoryWorkloadAnalysis python3 scripts/profile_fp8_gemm.py
        grep -E "_fp8_gemm_kernel|Duration|DRAM Throughput|No Eligible|Achieved Occupancy" "$OUT/fp8-gemm.log" \
            > "$OUT/fp8_gemm_ncu.txt"
    fi
    gpu_tests fp8-gemm 110 tests/unit/test_fp8_gemm.py
    bench fp8-gemm 230 python3 scripts/bench_fp8_gemm.py --json "$OUT/fp8_gemm.json" --budget-s 60 --sweep-s 130 "${ARGS[@]}"
}
run_seed() {
    local budget=${SEED_BUDGET:-450}
    bench seed $((budget + 40)) python3 scripts/bench_seed.py --budget-s "$budget" --json "$OUT/seed_bench.json" "${ARGS[@]}"
}
run_sampling() {
    bench sampling 90 python3 scripts/bench_sampling.py --json "$OUT/gpu_bench_sampling.json" --chunk-rows 16,8,32,64,128 "${ARGS[@]}"
    gpu_tests sampling 150 tests/unit/test_sampling.py -k "cuda or whatever_its_batch or stream or edges"
}
run_gpu-tests() {
    gpu_tests gpu-tests 540 -m gpu tests
}

# The figures that matter of each run's JSON, and its tables, printed after all runs.
summary() {
    python3 - "$OUT" "$@" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
out, runs = Path(sys.argv[1]), sys.argv[2:]
KEYS = ("outputs_identical", "failed_parts", "floor_ms", "greedy_ms_per_token", "floor_ratio_greedy", "step_ms",
        "floor_ratio_step", "tok_s", "rollback_ms", "prefill_tok_s", "e2e_tok_s", "e2e_vs_local", "relay_ms_per_step",
        "e2e_greedy_vs_local", "relay_timeline", "draft_propose_ms_fast", "draft_floor_ratio", "dflash_vs_oracle",
        "batch_identical", "batch_http", "relay_vs_delay", "e2e_dflash_step_ms", "dflash_batch_vs_oracle",
        "dflash_batch_identical", "prefix_turn", "prefix_shared", "prefix_flood", "prefix_outputs_identical", "guided_step_ms", "plain_step_ms",
        "guided_step_ratio", "guided_identical", "groups_vs_none", "groups_identical", "moe_greedy_floor_ratio", "moe_verify_floor_ratio",
        "moe_distinct_experts")
FILES = {"check": "prefill_profile.json", "local": "gpu_bench_local.json", "relay": "gpu_bench_relay.json",
         "relay-profile": "relay_profile.json", "ring": "cuda_ipc_probe.json",
         "batch": "gpu_bench_batch.json", "batch-step": "gpu_bench_batch_step.json", "dflash": "gpu_bench_dflash.json",
         "dflash-batch": "gpu_bench_dflash_batch.json",
         "fp8": "gpu_bench_fp8.json", "fp8-gemm": "fp8_gemm.json", "seed": "seed_bench.json",
         "sampling": "gpu_bench_sampling.json", "prefix": "gpu_bench_prefix.json", "guided": "gpu_bench_guided.json",
         "groups": "gpu_bench_groups.json", "moe": "gpu_bench_moe.json"}
for run in runs:
    print(f"==== {run}")
    log = out / f"{run}.log"
    if log.exists():  # the tests' last lines and each command's exit
        print("\n".join(l for l in log.read_text().splitlines() if l.startswith(f"{run}: exit") or " passed" in l or " failed" in l))
    if run == "seed":  # the seed's own table is the last thing bench_seed.py prints
        text = log.read_text() if log.exists() else ""
        print(text[text.find("| weights |"):] if "| weights |" in text else "no seed table (see seed.log)")
        continue
    if run not in FILES:  # tests only
        continue
    try:
        result = json.loads((out / FILES[run]).read_text())
    except (OSError, ValueError) as exc:
        print(f"no JSON: {exc}")
        continue
    if run == "batch":
        from bench_batch import batch_table
        print(batch_table(result))
    if run == "dflash":
        from bench_dflash import dflash_table
        print(dflash_table(result))
    if run == "dflash-batch":
        from bench_dflash import dflash_batch_table
        print(dflash_batch_table(result))
    if run == "batch-step":
        from bench_batch_step import batch_step_table
        print(batch_step_table(result))
    for key in KEYS:
        if key in result:
            print(f"{key}: {json.dumps(result[key])[:300]}")
    if run in ("relay", "relay-profile") and result.get("relay_by_phase"):
        from bench_relay import phase_table
        print("relay by phase (ms per step)\n" + phase_table(result["relay_by_phase"]))
    before = out / FILES[run].replace(".json", "_before.json")
    if before.exists():  # BEFORE_TREE: the same keys of the older tree's run
        before = json.loads(before.read_text())
        for key in KEYS:
            if key in before:
                print(f"before {key}: {json.dumps(before[key])[:300]}")
    for name, top in result.get("daemon_profile_top", {}).items():  # relay-profile
        print(f"cProfile of {name} (tottime)\n" + "\n".join(top[:14]))
PY
}

setup
for run in "${runs[@]}"; do
    : > "$OUT/$run.log"
    "run_$run"
done
summary "${runs[@]}"
if [ -n "${PACK:-}" ]; then
    (cd "$OUT" && tar -czf /tmp/runs.tar.gz . && find . -mindepth 1 -delete && mv /tmp/runs.tar.gz .)
fi
exit 0
