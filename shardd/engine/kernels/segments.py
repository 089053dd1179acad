"""The step's control: a device int32 table of segments, one per sequence sharing the step, then
the segment of each of the step's rows.

A step of R rows holds several sequences, each in contiguous rows: a segment. Its 8 fields are the
sequence's slot, its number of rows n, its first position pos, what to save for a rollback (SAVE_*, as in
gdn.py) and how many states (n_save), the checkpoint slot its GDN state starts from after a checkpoint
rollback (start, -1: its own state), and the step's row it starts at (first). A segment of no sequence has
n = 0 and points at the scratch slot. After the table, R entries give each row's segment (-1: a padding row):
a kernel over the step's rows reads its row's (`segment_of`); a kernel over sequences runs one program per
segment. The table's size is fixed per shard, so the launches, and a token's bits, never depend on how many
sequences share a step.
"""

from __future__ import annotations

import triton
import triton.language as tl

FIELDS = 8
SLOT, ROWS, POS, SAVE, N_SAVE, START, FIRST = range(7)


def segment(slot: int, n: int, pos: int, *, save: int = 0, n_save: int = 0, start: int = -1, first: int = 0) -> list[int]:
    """One segment's fields, in the table's order."""
    return [slot, n, pos, save, n_save, start, first, 0]


def table(segments: list[list[int]], size: int, scratch_slot: int, rows: int) -> list[int]:
    """`segments` padded to `size` with empty ones on the scratch slot, flattened as the kernels read it, then
    the segment of each of the step's `rows` rows."""
    flat = padded(segments, size, scratch_slot)
    row_segment = [-1] * rows
    for index, s in enumerate(segments):
        row_segment[s[FIRST] : s[FIRST] + s[ROWS]] = [index] * s[ROWS]
    if len(row_segment) != rows:
        raise ValueError(f"segments reach past the step's {rows} rows")
    return flat + row_segment


def padded(segments: list[list[int]], size: int, scratch_slot: int) -> list[int]:
    """`segments` padded to `size` with empty ones on the scratch slot, flattened: a table without its rows'
    map (the replay-ssm re-runs a step carries, read by a kernel over sequences only)."""
    if len(segments) > size:
        raise ValueError(f"{len(segments)} segments in a step of at most {size}")
    empty = segment(scratch_slot, 0, 0)
    return [field for s in [*segments, *[empty] * (size - len(segments))] for field in s]


def size(segments: int, rows: int) -> int:
    """The control's length for a table of `segments` and a step of `rows` rows."""
    return segments * FIELDS + rows


@triton.jit
def segment_of(control_ptr, row, SEGMENTS: tl.constexpr):
    """The index of the segment holding the step's `row`, or -1 (a padding row), after a table of SEGMENTS."""
    return tl.load(control_ptr + SEGMENTS * 8 + row)
