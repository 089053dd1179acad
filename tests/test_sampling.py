"""Sampling on the head shard (shardd.sampling): the target distribution, seeds, and losslessness of
speculative rejection sampling, by chi-square tests over thousands of samples with fixed seeds."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafters import NgramDrafter
from coordinator.sampling import Sampling
from shardd import sampling as sm
from shardd.loading import ModelSource
from shardd.sampling import SamplingParams, sample_rows, target_probs
from tests.local import LocalTarget

N = 4000


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


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                       [0.0, 1.0, 0.2, 2.0, -1.0, 0.5, 0.1, -2.0]])


def first_committed(draft: int, params_of, check: bool = True) -> Counter:
    """The first committed token of a 2-row verify with one draft, over N seeds."""
    counts = Counter()
    for seed in range(N):
        ids, accepted = sample_rows(LOGITS, [0, 0], 10, params_of(seed), [draft])
        counts[ids[0]] += 1
        assert not check or (ids[0] == draft) == (accepted == 1)  # a residual sample never equals its draft
    return counts


@pytest.mark.parametrize("draft", [0, 3, 7])
def test_verified_token_follows_the_target_distribution(draft):
    params_of = lambda seed: SamplingParams(temperature=0.8, seed=seed)  # noqa: E731
    probs = target_probs(LOGITS[0], params_of(0))
    stat, df = chi2_against(first_committed(draft, params_of), probs, N)
    assert stat < chi2_critical(df), (stat, df)


def test_a_broken_rejection_rule_fails_the_test(monkeypatch):
    """Resampling from p itself (not the residual without the draft) over-weights the draft: detected."""
    monkeypatch.setattr(sm, "residual", lambda probs, draft: probs.clone())
    params_of = lambda seed: SamplingParams(temperature=0.8, seed=seed)  # noqa: E731
    probs = target_probs(LOGITS[0], params_of(0))
    stat, df = chi2_against(first_committed(0, params_of, check=False), probs, N)
    assert stat > chi2_critical(df), (stat, df)


def test_bonus_token_after_accepted_drafts_follows_the_last_row():
    params = lambda seed: SamplingParams(temperature=1.0, seed=seed)  # noqa: E731
    bonus = Counter()
    for seed in range(N):
        ids, accepted = sample_rows(LOGITS, [0, 0], 0, params(seed), [0])
        if accepted == 1:
            bonus[ids[1]] += 1
    n = sum(bonus.values())
    stat, df = chi2_against(bonus, target_probs(LOGITS[1], params(0)), n)
    assert n > 1000 and stat < chi2_critical(df), (n, stat, df)


def test_top_k_top_p_and_seeds():
    row = LOGITS[0]
    assert set(torch.nonzero(target_probs(row, SamplingParams(1.0, top_k=2))).flatten().tolist()) == {0, 1}
    kept = torch.nonzero(target_probs(row, SamplingParams(1.0, top_p=0.5))).flatten().tolist()
    assert kept == [0, 1]  # 0.37 alone is below 0.5, with 0.23 it is not
    assert torch.nonzero(target_probs(row, SamplingParams(1.0, top_p=0.0))).flatten().tolist() == [0]
    one = [sample_rows(LOGITS, [0, 0], 5, SamplingParams(1.0, seed=s))[0] for s in range(50)]
    assert one == [sample_rows(LOGITS, [0, 0], 5, SamplingParams(1.0, seed=s))[0] for s in range(50)]
    assert len({tuple(ids) for ids in one}) > 1


# ---- end to end on a tiny model: speculation does not change the distribution -------------------

@pytest.fixture(scope="module")
def local():
    torch.set_num_threads(1)  # a tiny model: thread pools competing for the shared cores cost more than they gain
    return LocalTarget(ModelSource(synthetic="tiny"), max_context=64)


class LikelyDrafter:
    """Deterministic, like every drafter here: proposes the continuation plain sampling gave most often, so
    drafts are often accepted (accepted, rejected and bonus paths all run)."""

    name = "likely"

    def __init__(self, likely: tuple[int, ...]):
        self.likely = list(likely) * 2

    def propose(self, history, n):
        done = len(history) - len(PROMPT)
        return self.likely[done:done + n] + [0] * max(0, n - len(self.likely[done:done + n]))


PROMPT = [5, 9, 5, 9, 5, 9, 5]  # repeats: the ngram drafter proposes something
NEW = 3
SAMPLES = 1000


ACCEPTED = Counter()  # drafts accepted per drafter over a test's samples


def sampled_prefixes(local, drafter_of, rollback="checkpoint") -> Counter:
    counts = Counter()
    for seed in range(SAMPLES):
        sampling = Sampling(temperature=1.0, top_k=2, seed=seed)
        if drafter_of is None:
            result = greedy_decode(local, 1, PROMPT, NEW, sampling=sampling)
        else:
            result = speculative_decode(local, 1, PROMPT, drafter_of(local), block_size=4, rollback=rollback,
                                        max_new_tokens=NEW, sampling=sampling)
            ACCEPTED[drafter_of] += result.accepted
        counts[tuple(result.tokens)] += 1
    return counts


@pytest.fixture(scope="module")
def plain(local):
    return sampled_prefixes(local, None)


@pytest.mark.parametrize("drafter", ["ngram", "likely"])
def test_speculative_sampling_is_lossless(local, plain, drafter):
    likely = plain.most_common(1)[0][0]
    make = (lambda target: NgramDrafter()) if drafter == "ngram" else (lambda target: LikelyDrafter(likely))
    speculated = sampled_prefixes(local, make)
    if drafter == "likely":
        assert ACCEPTED[make] > SAMPLES // 4  # the accepted path and the bonus token really ran
    assert len(plain) > 3  # the test sees a real distribution, not one sequence
    stat, df = two_sample_chi2(plain, speculated)
    assert stat < chi2_critical(df), (stat, df, plain.most_common(8), speculated.most_common(8))


def test_a_seed_reproduces_across_rollback_modes(local):
    sampling = Sampling(temperature=0.9, top_p=0.9, seed=1234)
    outputs = {mode: speculative_decode(local, 1, PROMPT, NgramDrafter(), block_size=4, rollback=mode,
                                        max_new_tokens=12, sampling=sampling).tokens
               for mode in ("checkpoint", "replay")}
    assert outputs["checkpoint"] == outputs["replay"]
    again = speculative_decode(local, 1, PROMPT, NgramDrafter(), block_size=4, max_new_tokens=12, sampling=sampling)
    assert again.tokens == outputs["checkpoint"]
