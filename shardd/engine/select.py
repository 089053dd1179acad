"""Which implementation of the step a daemon serves a shard with.

- `reference`: the readable model code of shardd/engine/reference/ (any device; the CPU path).
- `fast`: shardd/engine/fast/, the fixed-shape T-row step with Triton kernels and CUDA graphs (a CUDA device), which
  makes a token's result independent of how many tokens shared its step: bf16 speculative output equals greedy.
- `auto` (the default): `fast` on a CUDA device where Triton is installed, else `reference`.
"""

from __future__ import annotations

import os

from common.sizes import DEFAULT_STEP_ROWS, PREFILL_ROWS, drafter_step_rows, step_rows_for  # noqa: F401 (the flags' defaults, named here too)


ENGINES = ("auto", "reference", "fast")


def _interpreted() -> bool:
    """Triton's interpreter runs the fast path's kernels on the CPU (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_engine(engine: str, device) -> str:
    """The engine `engine` stands for on `device` (either serves dense and MoE models, bf16, float32 or FP8);
    ValueError saying why when the one named cannot serve it."""
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


def serve_with(engine: str, shard, *, max_sequences: int, max_context: int, step_rows: int | None = None,
               prefill_rows: int | None = None):
    """The shard as the daemon serves it: itself, or a FastShard over it (state pools sized here; `step_rows`: the
    batched step's R, default one sequence's rows; `prefill_rows`: the GPU prefill's graphed piece, default
    PREFILL_ROWS)."""
    if engine != "fast":
        return shard
    from shardd.engine.fast.shard import FastShard

    return FastShard(shard, max_sequences=max_sequences, max_context=max_context, step_rows=step_rows,
                     prefill_rows=PREFILL_ROWS if prefill_rows is None else prefill_rows)


def draft_with(engine: str, hosted, *, max_sequences: int, max_context: int, step_rows: int | None = None):
    """The hosted drafter as the daemon serves it: its reference model, or a FastDrafter over it (shardd/engine/fast/draft.py:
    its two steps as multi-sequence CUDA graphs over fused weights, caches in slots sized here; its steps' rows
    from the target's `step_rows`: common.sizes.drafter_step_rows)."""
    if engine != "fast" or hosted is None:
        return hosted
    from shardd.engine.fast.draft import FastDrafter

    step_rows = drafter_step_rows(hosted.model.config.block_size, max_sequences, step_rows)
    hosted.model = FastDrafter(hosted.model, max_sequences=max_sequences, max_context=max_context, step_rows=step_rows)
    return hosted


def numerics(shard, max_context: int, quantization: dict | None) -> dict | None:
    """What decides a token's bits beyond the weights and the dtype (HELLO's `numerics`): the engine, the fixed
    step's T and R, the GPU prefill's piece, the attention launch of the cache length, the FP8 scheme and tile table.
    A coordinator re-fills a restarted shard only when this is unchanged (coordinator/relay/shards.py)."""
    if shard is None:
        return None
    out = {"engine": shard.engine, "step_rows": shard.step_rows, "batch_rows": shard.batch_rows,
           "prefill_rows": shard.prefill_rows, "quantization": quantization}
    if shard.engine == "fast":
        from shardd.engine.kernels.attention import launch

        out["attention_launch"] = launch(max_context)
        if quantization:
            from shardd.engine.kernels.fp8_gemm import tiles_identity

            out["fp8_tiles"] = tiles_identity()
    return out
