"""The fast engine's default step sizes, which the flags, the engine and the memory plan share (torch-free)."""

# R of the fast engine's batched step (`shardd serve --step-rows`): rows shared by the sequences of a batch. 128
# rows hold the verify blocks of 16 of `--max-sequences`' default 8 streams in one step, where a GEMM of 128 rows
# still costs little more than reading its weights; a daemon of fewer sequences steps fewer (step_rows_for).
# docs/performance.md has the measurements.
DEFAULT_STEP_ROWS = 128
# P of the fast engine's GPU prefill (`shardd serve --prefill-rows`): prompts go in pieces of P rows, each whole
# piece replayed from CUDA graphs (an eager prefill call is launch-bound); the coordinator's prompt chunk is a multiple
# of it (HELLO prefill_rows).
PREFILL_ROWS = 512
# The fast engine's step has no MoE layer: a sparse model is served by the reference engine (`--engine auto` picks it).
MOE_REFUSAL = "the fast engine does not run MoE layers yet; use --engine reference"


def drafter_step_rows(block_size: int, max_sequences: int, step_rows: int | None) -> int:
    """R of a hosted DFlash drafter's steps (shardd/engine/fast/draft.py): the blocks of up to 8 sequences (never
    more than `max_sequences`), or the target step's R (`step_rows`) where that is more. Its bf16 weights cost about
    as much to read for 128 rows as for 16, so an FP8 daemon's target step of one sequence does not shrink it."""
    return max(step_rows or 0, block_size * min(max_sequences, 8))
