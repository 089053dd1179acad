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
