"""Which implementation of the step a daemon serves a shard with.

- `reference`: the readable model code of shardd/model/ (any device; the CPU path).
- `fast`: shardd/fast/, the fixed-shape T-row step with Triton kernels and CUDA graphs (a CUDA device), which
  makes a token's result independent of how many tokens shared its step: bf16 speculative output equals greedy.
- `auto` (the default): `fast` on a CUDA device where Triton is installed, else `reference`.
"""

from __future__ import annotations

import os

from common.busy_poll import AUTO_BUSY_POLL_CPUS, AUTO_BUSY_POLL_MS, usable_cpus


ENGINES = ("auto", "reference", "fast")
# R of the fast engine's batched step (`shardd serve --step-rows`): rows shared by the sequences of a batch. On an
# H200 every 27B-shape weight GEMM costs 1.12x / 1.18x / 1.34x the weight-read floor at 16 / 64 / 128 rows (issue
# 20; scripts/bench_gpu.py --parts batch-step). 128 rows hold the verify blocks of 16 of `--max-sequences`' default
# 8 streams in one step: measured side by side (bench/results/h200/gpu_bench_batch_r64.json against
# gpu_bench_batch.json), 8 speculative streams decode at 2,525 tok/s with R = 128 against 1,608 with 64 (two steps
# a verify), for 4-8% of greedy at 1 to 32 streams (56.1 -> 51.7 tok/s at one). `shardctl serve` speculates by
# default (the n-gram drafter, blocks of 16), so R = 128; a daemon of fewer sequences steps fewer (step_rows_for).
DEFAULT_STEP_ROWS = 128
# P of the fast engine's GPU prefill (`shardd serve --prefill-rows`): prompts go in pieces of P rows, each whole
# piece replayed from CUDA graphs. The coordinator's prompt chunk (coordinator/scheduler/scheduler.py: half its default 1,024
# rows a step), where an eager 27B-shape prefill call on an H200 host took ~114 ms of launches for ~63 ms of
# kernels (bench/results/h200/prefill_profile_538a901.json).
PREFILL_ROWS = 512


def _interpreted() -> bool:
    """Triton's interpreter runs the fast path's kernels on the CPU (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_engine(engine: str, device) -> str:
    import torch

    device = torch.device(device)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    try:
        import triton  # noqa: F401
        has_triton = True
    except ImportError:
        has_triton = False
    if engine == "auto":
        return "fast" if device.type == "cuda" and has_triton else "reference"
    if engine == "fast":
        if not has_triton:
            raise ValueError("--engine fast needs triton (installed with torch on CUDA machines)")
        if device.type != "cuda" and not _interpreted():
            raise ValueError(f"--engine fast needs a CUDA device, got {device} (use --engine reference)")
    return engine


def step_rows_for(engine: str, step_rows: int | None, max_verify_tokens: int, *, max_sequences: int | None = None,
                  fp8: bool = False) -> int | None:
    """The fast engine's R for `--step-rows` (None: the default); None for the reference engine, which has no
    step (and refuses an explicit --step-rows by name). R must hold one sequence's step (max_verify_tokens, or
    the fast engine's 16 rows without rollback storage).

    The default is DEFAULT_STEP_ROWS, but never more rows than `max_sequences` sequences' steps can fill (a
    daemon of one sequence steps 16 rows: unused rows still cost their GEMM), and one sequence's step with FP8
    weights: the weight-only FP8 GEMM's time grows with the rows (the 27B shape on an H200: 8.5 ms at 16 rows,
    20.3 at 64, where bf16 cuBLAS takes 13.5; bench/results/h200/fp8_gemm_95f786d.json), so FP8 batching is
    an operator's explicit --step-rows."""
    one_sequence = max_verify_tokens or 16  # shardd.fast.shard.DEFAULT_ROWS
    if engine != "fast":
        if step_rows is not None:
            raise ValueError(f"--step-rows sizes the fast engine's step; the {engine} engine has none")
        return None
    if step_rows is None:
        if fp8:
            return one_sequence
        rows = DEFAULT_STEP_ROWS if max_sequences is None else min(DEFAULT_STEP_ROWS, max_sequences * one_sequence)
        return max(rows, one_sequence)
    if step_rows < one_sequence:
        raise ValueError(f"--step-rows {step_rows} must hold one sequence's step of {one_sequence} rows "
                         "(--max-verify-tokens)")
    return step_rows


def serve_with(engine: str, shard, *, max_sequences: int, max_context: int, step_rows: int | None = None,
               prefill_rows: int | None = None):
    """The shard as the daemon serves it: itself, or a FastShard over it (state pools sized here; `step_rows`: the
    batched step's R, default one sequence's rows; `prefill_rows`: the GPU prefill's graphed piece, default
    PREFILL_ROWS)."""
    if engine != "fast":
        return shard
    from shardd.fast.shard import FastShard

    return FastShard(shard, max_sequences=max_sequences, max_context=max_context, step_rows=step_rows,
                     prefill_rows=PREFILL_ROWS if prefill_rows is None else prefill_rows)


def draft_with(engine: str, hosted, *, max_sequences: int, max_context: int):
    """The hosted drafter as the daemon serves it: its reference model, or a FastDrafter over it (shardd/fast/draft.py:
    the layers as CUDA graphs over fused weights, caches in slots sized here)."""
    if engine != "fast" or hosted is None:
        return hosted
    from shardd.fast.draft import FastDrafter

    hosted.model = FastDrafter(hosted.model, max_sequences=max_sequences, max_context=max_context)
    return hosted


def busy_poll_seconds(value: str | float, device) -> float:
    """--busy-poll-ms as seconds: a number of milliseconds in [0, 1000], or `auto` (AUTO_BUSY_POLL_MS on a CUDA
    device with at least AUTO_BUSY_POLL_CPUS usable CPUs, else 0)."""
    if str(value).strip().lower() == "auto":
        import torch

        dedicated = torch.device(device).type == "cuda" and usable_cpus() >= AUTO_BUSY_POLL_CPUS
        return AUTO_BUSY_POLL_MS / 1000 if dedicated else 0.0
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"--busy-poll-ms must be a number of milliseconds or auto, got {value!r}") from None
    if not 0 <= ms <= 1000:  # also refuses nan
        raise ValueError(f"--busy-poll-ms must be within [0, 1000], got {value!r}")
    return ms / 1000
