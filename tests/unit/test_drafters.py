"""Drafters on their own: what they propose for a given history."""

import random

import pytest

from coordinator.drafting.drafters import NgramDrafter, OracleDrafter, make_drafter
from coordinator.scheduler.commit import accept_length


def test_ngram_continues_a_repeating_sequence():
    drafter = NgramDrafter()
    assert drafter.propose([1, 2, 3, 4] * 3, 6) == [1, 2, 3, 4, 1, 2]


def test_ngram_copy_runs_through_its_own_output():
    # The only earlier match of the suffix [5, 6] is two tokens back: the copy overlaps.
    assert NgramDrafter().propose([9, 5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]


def test_ngram_prefers_the_longest_suffix():
    # [5] alone last followed by 6; the 2-gram [7, 5] was followed by 8.
    history = [7, 5, 8, 9, 5, 6, 7, 5]
    assert NgramDrafter().propose(history, 1) == [8]
    assert NgramDrafter(max_ngram=1).propose(history, 1) == [6]


def test_ngram_takes_the_most_recent_occurrence():
    assert NgramDrafter().propose([1, 9, 1, 8, 1], 4) == [8, 1, 8, 1]


def test_ngram_without_a_match_repeats_the_last_token():
    assert NgramDrafter().propose([1, 2, 3], 3) == [3, 3, 3]
    assert NgramDrafter(min_ngram=2).propose([1, 2, 1], 2) == [1, 1]


def test_ngram_returns_exactly_n():
    drafter = NgramDrafter()
    for n in (0, 1, 7, 40):
        assert len(drafter.propose([4, 4, 2, 4], n)) == n


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        NgramDrafter(min_ngram=0)


def fixed_profile(correct):
    return lambda rng: correct


def test_oracle_proposes_the_reference_then_one_wrong_token():
    prompt = [1, 2, 3]
    reference = [10, 11, 12, 13, 14, 15, 16]
    drafter = OracleDrafter(reference, len(prompt), fixed_profile(2))
    history = prompt + reference[:1]  # one token generated so far
    proposal = drafter.propose(history, 5)
    assert len(proposal) == 5
    assert proposal[:2] == [11, 12]
    assert proposal[2] != 13
    assert accept_length(proposal, reference[1:7]) == 2


def test_oracle_all_correct_when_the_profile_exceeds_the_block():
    reference = list(range(20, 40))
    drafter = OracleDrafter(reference, 2, fixed_profile(99))
    assert drafter.propose([0, 1] + reference[:3], 4) == reference[3:7]


def test_oracle_wrong_token_differs_even_from_zero():
    reference = [0, 0, 0, 0]
    drafter = OracleDrafter(reference, 1, fixed_profile(0))
    assert drafter.propose([5], 3)[0] != 0


def test_oracle_pads_past_the_end_of_the_reference():
    reference = [7, 8]
    drafter = OracleDrafter(reference, 1, fixed_profile(99))
    assert drafter.propose([5, 7], 3) == [8, 8, 8]


def test_oracle_is_deterministic_per_seed_and_history_length():
    reference = [random.Random(1).randrange(50) for _ in range(400)]
    prompt = [1, 2]

    def schedule(seed):
        drafter = OracleDrafter.with_mean_commit(reference, len(prompt), block_size=16, mean_commit=6.0, seed=seed)
        return [
            accept_length(drafter.propose(prompt + reference[:g], 15), reference[g:g + 16])
            for g in range(0, 300, 7)
        ]

    assert schedule(0) == schedule(0)
    assert schedule(0) != schedule(1)


@pytest.mark.parametrize("block_size, mean_commit", [(16, 6.0), (16, 1.0), (16, 16.0), (4, 2.5), (8, 7.3)])
def test_oracle_accepted_drafts_average_mean_commit_minus_one(block_size, mean_commit):
    reference = [random.Random(2).randrange(50) for _ in range(5000)]
    drafter = OracleDrafter.with_mean_commit(reference, 1, block_size=block_size, mean_commit=mean_commit, seed=3)
    counts = []
    for g in range(0, 4000, 2):
        proposal = drafter.propose([0] + reference[:g], block_size - 1)
        counts.append(accept_length(proposal, reference[g:g + block_size]))
    assert min(counts) >= 0 and max(counts) <= block_size - 1
    assert sum(counts) / len(counts) == pytest.approx(mean_commit - 1, abs=0.15)


def test_oracle_rejects_an_impossible_mean():
    with pytest.raises(ValueError):
        OracleDrafter.with_mean_commit([1], 1, block_size=4, mean_commit=5.0)
    with pytest.raises(ValueError):
        OracleDrafter.with_mean_commit([1], 1, block_size=4, mean_commit=0.5)


def test_oracle_names_itself_a_benchmark_drafter():
    drafter = OracleDrafter.with_mean_commit([1], 1)
    assert "benchmark" in drafter.name


def test_make_drafter_by_name():
    assert isinstance(make_drafter("ngram"), NgramDrafter)
    oracle = make_drafter("oracle", reference=[1, 2], prompt_len=1, mean_commit=3.0)
    assert isinstance(oracle, OracleDrafter)
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("eagle")


def _scan_propose(history, n, max_ngram=4, min_ngram=1):
    """The reference prompt lookup: scan the whole history for the most recent earlier occurrence of the
    longest suffix n-gram (what NgramDrafter's index must find)."""
    length, source = len(history), None
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - size:]
        source = next((start + size for start in range(length - size - 1, -1, -1)
                       if history[start:start + size] == suffix), None)
        if source is not None:
            break
    if source is None:
        return [history[-1]] * n
    extended = list(history)
    for index in range(source, source + n):
        extended.append(extended[index])
    return extended[len(history):]


def test_the_ngram_index_proposes_what_a_scan_of_the_history_finds():
    """NgramDrafter's n-gram index, extended as one history grows (and built again for another list, one
    shortened or one changed in place), proposes exactly what scanning the whole history proposes."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=6),
                              st.sampled_from(["grow", "grow", "grow", "new list", "shorten", "change"])),
                    min_size=1, max_size=20),
           st.integers(1, 4), st.integers(1, 4), st.integers(0, 16))
    def check(steps, a, b, n):
        low, high = min(a, b), max(a, b)
        drafter, history = NgramDrafter(max_ngram=high, min_ngram=low), []
        for tokens, how in steps:
            if how == "new list":
                history = list(history)
            elif how == "shorten" and len(history) > 2:
                del history[len(history) // 2:]
            elif how == "change" and history:
                history[len(history) // 2] = (history[len(history) // 2] + 1) % 6
            history.extend(tokens)
            assert drafter.propose(history, n) == _scan_propose(history, n, high, low)

    check()
