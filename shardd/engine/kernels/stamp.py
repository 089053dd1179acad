"""The timeline's stamp (shardd/obs/timeline.py): one thread writes the GPU's global timer (%globaltimer, nanoseconds,
one clock for every process on the GPU) into `stamps[index]` when the stream reaches it. GPU-only (inline PTX):
the interpreter has no timer to read."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["index"])
def _stamp_kernel(stamps_ptr, index):
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(stamps_ptr + index, now)


def stamp(stamps, index: int) -> None:
    """Queue the stamp on the current stream: stamps (int64, on the GPU)[index] = the GPU's time then."""
    _stamp_kernel[(1,)](stamps, index, num_warps=1)
