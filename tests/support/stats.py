"""Chi-square checks that sampled tokens follow a distribution, for the sampling tests: no scipy needed."""

from __future__ import annotations

import math
from collections import Counter

import torch


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09), Wilson-Hilferty: no scipy needed."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_against(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Goodness of fit of `counts` to `probs`; cells with tiny expectation are pooled."""
    expected = {i: float(p) * n for i, p in enumerate(probs) if float(p) > 0}
    stray = sum(c for token, c in counts.items() if token not in expected)
    assert stray == 0, f"sampled tokens outside the support: {counts}"
    big = {i: e for i, e in expected.items() if e >= 5}
    stat = sum((counts.get(i, 0) - e) ** 2 / e for i, e in big.items())
    rest_e = n - sum(big.values())
    if rest_e >= 5:
        rest_o = n - sum(counts.get(i, 0) for i in big)
        stat += (rest_o - rest_e) ** 2 / rest_e
        return stat, len(big)
    return stat, len(big) - 1


def two_sample_chi2(a: Counter, b: Counter) -> tuple[float, int]:
    keys = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) >= 10]
    na, nb = sum(a.values()), sum(b.values())
    pooled_a = na - sum(a.get(k, 0) for k in keys)
    pooled_b = nb - sum(b.get(k, 0) for k in keys)
    cells = [(a.get(k, 0), b.get(k, 0)) for k in keys] + ([(pooled_a, pooled_b)] if pooled_a + pooled_b else [])
    stat = 0.0
    for oa, ob in cells:
        total = oa + ob
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return stat, len(cells) - 1
