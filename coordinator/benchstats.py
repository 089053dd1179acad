"""Statistics for the A/B/A benchmark method.

Runs are taken in blocks A1, B, A2 on the same machine. B is compared with the A
medians; the drift between A1 and A2 says how much the machine itself moved meanwhile,
and a comparison smaller than that drift means nothing. Every run's output hash must be
the same across modes: speed that changes the tokens is a bug, not a speed-up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from statistics import median

SUMMARY_KEYS = ("decode_tok_s", "wall_seconds", "prefill_tok_s", "acceptance_rate", "avg_commit")


def summarize_runs(runs: Sequence[dict]) -> dict:
    """Medians of `SUMMARY_KEYS` over runs (dicts like `DecodeResult.summary()`).

    A key that is None in every run (acceptance of plain greedy) stays None."""
    if not runs:
        raise ValueError("no runs to summarize")
    summary: dict = {"runs": len(runs)}
    for key in SUMMARY_KEYS:
        values = [run[key] for run in runs if run.get(key) is not None]
        summary[key] = median(values) if values else None
    return summary


def drift(a1: float, a2: float) -> float:
    """Relative difference of the A1 and A2 block medians, against their mean."""
    mean = (a1 + a2) / 2
    if mean == 0:
        return 0.0 if a1 == a2 else float("inf")
    return abs(a1 - a2) / abs(mean)


def all_identical(hashes: Iterable[str]) -> bool:
    """True when there is at least one hash and all are equal."""
    distinct = set(hashes)
    return len(distinct) == 1


def tokens_digest(tokens: Iterable[int]) -> str:
    """sha256 (hex) of the token ids written as comma-joined decimals: "12,7,301". Tables show its first 16 digits."""
    data = ",".join(str(int(token)) for token in tokens).encode()
    return hashlib.sha256(data).hexdigest()
