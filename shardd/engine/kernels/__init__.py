"""Triton kernels of the GPU step (shardd/engine/fast/), one op per module, each tested against the readable
reference in shardd/engine/reference/ (tests/test_kernels.py).

Every kernel computes a row (a token) the same way whatever the other rows of its launch hold and
however many of them are real: that is what makes a token's result independent of how many tokens
shared its step. Importing this package does not import triton; each module does, so only a GPU
shard (or a test under TRITON_INTERPRET=1) loads it.
"""


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET set and not 0: the CPU tests)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
