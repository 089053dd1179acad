"""The device ring's flag kernels (shardd/server/ring.py, the device wait): one program, one thread's worth each.

A slot's flag (int32, in the reader's memory) holds what the writer last published into it: the put's
generation (1, 2, ... since its RING) once its rows are in the slot, or the generation with POISON set when the
writer's own input rows never landed (its step ran on none). A wait for generation g ends once
`(int32)(flag - g) >= 0`: the GPU's front end waits for that (`cuStreamWaitValue32`, no SM taken), and a copy of
the flag taken right after it is the wait's outcome. The reader's watcher ends a wait that has not landed by
writing CANCELLED (the writer died) or TIMED_OUT (--rows-wait) with a compare-and-swap that only succeeds while the flag is still below g, and the
writer publishes with a compare-and-swap from the value it last published: whichever comes first holds, so a
late writer can never turn an ended wait into a landed one after the reader's stream went on.
"""

from __future__ import annotations

import triton
import triton.language as tl

POISON = 1 << 30  # generations stay below it
TIMED_OUT_VALUE = 0x7FFFFFFE
CANCELLED_VALUE = 0x7FFFFFFF
LANDED, TIMED_OUT, CANCELLED, POISONED = 1, 2, 3, 4  # outcomes, as the host reads them (outcome_of)


def outcome_of(seen: int, generation: int) -> int:
    """What a wait for `generation` that saw flag value `seen` means."""
    if seen == generation:
        return LANDED
    if seen == generation | POISON:
        return POISONED
    if seen == CANCELLED_VALUE:
        return CANCELLED
    return TIMED_OUT  # TIMED_OUT_VALUE, or a value no writer of this generation writes


# The kernels take the flags' base and a slot index, never a slot's own address: one specialization each
# (Triton specializes on a pointer's 16-byte alignment), compiled and loaded by the warm-ups. A compile or module
# load while a wait is queued can wait for the GPU, and so for the wait: a deadlock.
@triton.jit(do_not_specialize=["slot", "own_slot", "previous", "generation", "expected_own"])
def _publish_kernel(flags_ptr, slot, own_ptr, own_slot, previous, generation, expected_own, HAS_OWN: tl.constexpr):
    flag_ptr = flags_ptr + slot
    own_ptr = own_ptr + own_slot
    value = generation
    if HAS_OWN:  # this shard's own input rows: the next shard's wait ends poisoned when they never landed
        if tl.load(own_ptr, volatile=True) != expected_own:
            value = generation | 1073741824  # POISON
    old = tl.load(flag_ptr, volatile=True)
    if (old & 1073741823) == previous:  # the previous put's value, poisoned or not (an ended wait's is neither)
        tl.atomic_cas(flag_ptr, old, value, sem="release", scope="sys")


@triton.jit(do_not_specialize=["slot", "generation", "value"])
def _end_wait_kernel(flags_ptr, slot, generation, value):
    flag_ptr = flags_ptr + slot
    old = tl.load(flag_ptr, volatile=True)
    done = old - generation >= 0  # landed (or ended) already: nothing to end
    while not done:
        seen = tl.atomic_cas(flag_ptr, old, value, sem="acq_rel", scope="sys")
        done = (seen == old) | (seen - generation >= 0)
        old = seen


def publish(flags, slot: int, previous: int, generation: int, own=None, own_slot: int = 0,
            expected_own: int = 0) -> None:
    """Queue the writer's compare-and-swap of flags[slot] from the value of generation `previous` (poisoned or
    not) to `generation` (POISON set when own[own_slot], the seen value of this shard's own wait, is not
    `expected_own`)."""
    _publish_kernel[(1,)](flags, slot, own if own is not None else flags, own_slot, previous, generation,
                          expected_own, HAS_OWN=own is not None, num_warps=1)


def end_wait(flags, slot: int, generation: int, value: int) -> None:
    """Queue the watcher's end of a wait for `generation` that has not landed: `value` (CANCELLED_VALUE or
    TIMED_OUT_VALUE) swapped into flags[slot] while it is below it."""
    _end_wait_kernel[(1,)](flags, slot, generation, value, num_warps=1)
