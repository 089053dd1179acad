"""The fast engine's step sizes, which the flags, the engine, the memory plan and `shardctl launch --dry-run` share
(torch-free)."""

# R of the fast engine's batched step (`shardd serve --step-rows`): rows shared by the sequences of a batch. 128
# rows hold the verify blocks of 16 of `--max-sequences`' default 8 streams in one step, where a GEMM of 128 rows
# still costs little more than reading its weights; a daemon of fewer sequences steps fewer (step_rows_for).
# docs/performance.md has the measurements.
DEFAULT_STEP_ROWS = 128
# P of the fast engine's GPU prefill (`shardd serve --prefill-rows`): prompts go in pieces of P rows, each whole
# piece replayed from CUDA graphs (an eager prefill call is launch-bound); the coordinator's prompt chunk is a multiple
# of it (HELLO prefill_rows).
PREFILL_ROWS = 512


def drafter_step_rows(block_size: int, max_sequences: int, step_rows: int | None) -> int:
    """R of a hosted DFlash drafter's steps (shardd/engine/fast/draft.py): the blocks of up to 8 sequences (never
    more than `max_sequences`), or the target step's R (`step_rows`) where that is more. Its bf16 weights cost about
    as much to read for 128 rows as for 16, so an FP8 daemon's target step of one sequence does not shrink it."""
    return max(step_rows or 0, block_size * min(max_sequences, 8))


def step_rows_for(engine: str, step_rows: int | None, max_verify_tokens: int, *, max_sequences: int | None = None,
                  fp8: bool = False) -> int | None:
    """The fast engine's R for `--step-rows` (None: the default); None for the reference engine, which has no
    step (and refuses an explicit --step-rows by name). R must hold one sequence's step (max_verify_tokens, or
    the fast engine's 16 rows without rollback storage).

    The default is DEFAULT_STEP_ROWS, but never more rows than `max_sequences` sequences' steps can fill (a
    daemon of one sequence steps 16 rows: unused rows still cost their GEMM), and one sequence's step with FP8
    weights: the weight-only FP8 GEMM's time grows with the rows (past bf16's at 64), so FP8 batching is an
    operator's explicit --step-rows."""
    one_sequence = max_verify_tokens or 16  # shardd.engine.fast.shard.DEFAULT_ROWS
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
