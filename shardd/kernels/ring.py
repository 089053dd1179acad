"""The device ring's two flag kernels (shardd/ring.py, `--ring-wait device`): one program, one thread's worth.

The writer publishes each put into a slot by storing the put's generation in the slot's flag after its rows (on
its stream, so after their copy), or minus the generation when its own input rows never landed (`poisoned`: its
step ran on no rows). The reader's stream runs `await_rows` before it copies the rows out of the slot: it spins on
the flag until it holds the generation awaited and then ends, so the reader's launch is queued before the rows
land without the unbounded wait of a stream waiting on another process's event. It also ends when the flag is
poisoned, when the reader's host sets `cancel` (the writer died) or after `timeout_ns`; it stores why in
`outcome` (LANDED, TIMED_OUT, CANCELLED, POISONED), which the host reads after the step and the reader's own
publish to the shard after it reads on the device.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

PENDING, LANDED, TIMED_OUT, CANCELLED, POISONED = 0, 1, 2, 3, 4


@triton.jit(do_not_specialize=["expected"])
def _await_rows_kernel(flag_ptr, cancel_ptr, outcome_ptr, expected, timeout_ns):
    start = globaltimer()
    outcome = 0
    while outcome == 0:
        flag = tl.load(flag_ptr, volatile=True)
        if flag == expected:
            outcome = 1
        elif flag == -expected:
            outcome = 4
        elif tl.load(cancel_ptr, volatile=True) != 0:
            outcome = 3
        elif globaltimer() - start > timeout_ns:
            outcome = 2
    tl.store(outcome_ptr, outcome)


@triton.jit(do_not_specialize=["generation"])
def _publish_kernel(flag_ptr, outcome_ptr, generation, HAS_OUTCOME: tl.constexpr):
    value = generation
    if HAS_OUTCOME:  # this shard's own input rows: the next shard's wait ends poisoned when they never landed
        if tl.load(outcome_ptr, volatile=True) != 1:
            value = -generation
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


def await_rows(flag, cancel, outcome, expected: int, timeout_s: float) -> None:
    """Queue the wait on the current stream: flag int64 [1] (the ring's, in this device's memory), cancel int32
    [1], outcome int32 [1], all on the stream's device."""
    _await_rows_kernel[(1,)](flag, cancel, outcome, expected, int(timeout_s * 1e9), num_warps=1)


def publish(flag, generation: int, outcome=None) -> None:
    """Queue the store of `generation` (minus it when `outcome`, this shard's own await, is not LANDED)."""
    _publish_kernel[(1,)](flag, outcome if outcome is not None else flag, generation,
                          HAS_OUTCOME=outcome is not None, num_warps=1)
