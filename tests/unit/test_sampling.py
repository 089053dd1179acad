"""Sampling on the head shard (shardd.engine.head.sampling, shardd.engine.head.answer): the target distribution, the seeded stream,
batch invariance (a row's answer whatever else is in its batch), and losslessness of speculative rejection
sampling, by chi-square tests over thousands of samples drawn in one batched call with fixed seeds."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch

from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafting.drafters import NgramDrafter
from coordinator.sampling import Sampling
from shardd.engine.head import sampling as sm
from shardd.engine.head.answer import HeadRequest, answer_batch, answer_rows
from shardd.weights.loading import ModelSource
from shardd.local import LocalTarget
from shardd.engine.head.logprobs import row_logprobs
from shardd.engine.head.penalties import Penalties, PenaltyRows, penalise, penalise_rows
from shardd.engine.head.sampling import CHUNK_ROWS, SamplingParams, sample_rows, target_probs, uniform
from tests.support.stats import chi2_against, chi2_critical, two_sample_chi2

N = 4000


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: thread pools competing for the shared cores cost more than they gain
    yield
    torch.set_num_threads(threads)


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                       [0.0, 1.0, 0.2, 2.0, -1.0, 0.5, 0.1, -2.0],
                       [1.0, -1.0, 0.3, 0.0, 2.5, 0.5, 0.1, -2.0]])


def verifies(drafts: list[int], params_of, rows: int = 2) -> list:
    """One verify of `rows` rows (the last len(drafts) + 1 answered) per seed 0..N-1, all in one batch."""
    return answer_batch([(LOGITS[:rows], [0] * rows, 10, HeadRequest(params_of(seed), drafts=drafts))
                         for seed in range(N)])


def first_committed(draft: int, params_of, check: bool = True) -> Counter:
    """The first committed token of a 2-row verify with one draft, over N seeds."""
    counts = Counter()
    for ids, accepted, _ in verifies([draft], params_of):
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
    monkeypatch.setattr(sm, "residual", lambda probs, rows, p_draft: probs)
    params_of = lambda seed: SamplingParams(temperature=0.8, seed=seed)  # noqa: E731
    probs = target_probs(LOGITS[0], params_of(0))
    stat, df = chi2_against(first_committed(0, params_of, check=False), probs, N)
    assert stat > chi2_critical(df), (stat, df)


def test_bonus_token_after_accepted_drafts_follows_the_last_row():
    params_of = lambda seed: SamplingParams(temperature=1.0, top_p=0.95, seed=seed)  # noqa: E731
    bonus = Counter(ids[1] for ids, accepted, _ in verifies([0], params_of) if accepted == 1)
    n = sum(bonus.values())
    stat, df = chi2_against(bonus, target_probs(LOGITS[1], params_of(0)), n)
    assert n > 1000 and stat < chi2_critical(df), (n, stat, df)


def test_the_second_draft_row_follows_its_own_row():
    """Two drafts: whenever the first is accepted, the second committed token (accepted or resampled) follows
    row 1's distribution: every draft row's accept test runs at once, and the first rejection stops the rest."""
    params_of = lambda seed: SamplingParams(temperature=1.3, top_k=5, seed=seed)  # noqa: E731
    second = Counter()
    for ids, accepted, _ in verifies([0, 3], params_of, rows=3):
        assert accepted == sum(1 for _ in range(accepted)) and ids[:accepted] == [0, 3][:accepted]
        if accepted < 2:
            assert ids[accepted] != [0, 3][accepted] and ids[accepted + 1:] == [0] * (2 - accepted)
        if accepted >= 1:
            second[ids[1]] += 1
    n = sum(second.values())
    stat, df = chi2_against(second, target_probs(LOGITS[1], params_of(0)), n)
    assert n > 1000 and stat < chi2_critical(df), (n, stat, df)


def test_top_k_top_p_edges():
    row = LOGITS[0]

    def kept(**params) -> list[int]:
        return torch.nonzero(target_probs(row, SamplingParams(1.0, **params))).flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_k=1) == [0]
    assert kept(top_k=8) == kept(top_k=1000) == kept(top_k=1 << 70) == kept() == list(range(8))  # top_k >= vocab: all
    assert kept(top_p=0.5) == [0, 1]  # 0.37 alone is below 0.5, with 0.23 it is not
    assert kept(top_p=0.0) == [0]  # greedy-like, not empty
    assert kept(top_p=0.5, top_k=1) == [0]
    probs = target_probs(row, SamplingParams(0.7, top_p=0.9, top_k=5))
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)
    top5 = torch.softmax(row[:5] / 0.7, dim=-1)  # LOGITS[0] is in descending order
    keep = next(k for k in range(1, 6) if float(top5[:k].sum()) >= 0.9)
    assert keep == 3 and probs.tolist() == pytest.approx((top5[:3] / top5[:3].sum()).tolist() + [0.0] * 5, abs=1e-6)
    ties = torch.tensor([1.0, 3.0, 3.0, 0.0])  # a top-k cut through a tie keeps the tie, as a cut by value
    assert torch.nonzero(target_probs(ties, SamplingParams(1.0, top_k=1))).flatten().tolist() == [1, 2]
    for top_p in (0.0, 1e-9):  # with top_p 0 sampling always gives the most likely token
        requests = [HeadRequest(SamplingParams(2.0, top_p, seed=s)) for s in range(50)]
        ids = [ids for ids, _, _ in answer_batch([(LOGITS, [9, 9, 9], 0, request) for request in requests])]
        assert {tuple(i) for i in ids} == {(9, 9, 4)}


def splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def reference_uniform(seed: int, position: int, draw: int) -> float:
    """The documented stream, in Python integers: splitmix64 of the seed, then of (position, draw)."""
    golden = 0x9E3779B97F4A7C15
    key = splitmix64((seed + golden) & ((1 << 64) - 1))
    return (splitmix64((key + (position * 3 + draw + 1) * golden) & ((1 << 64) - 1)) >> 11) * 2.0 ** -53


def test_the_seeded_stream_is_a_pure_function_of_seed_and_position():
    rng = random.Random(5)
    seeds = [0, 1, 2 ** 63 - 1] + [rng.randrange(2 ** 63) for _ in range(40)]
    positions = [0, 7, 2 ** 31] + [rng.randrange(1 << 20) for _ in range(40)]
    for draw in (sm.SAMPLE, sm.ACCEPT, sm.RESIDUAL):
        got = [uniform(s, p, draw) for s, p in zip(seeds, positions)]
        assert got == [reference_uniform(s, p, draw) for s, p in zip(seeds, positions)]
    values = [uniform(seed, position, sm.SAMPLE) for seed in range(200) for position in range(50)]
    assert 0 <= min(values) and max(values) < 1 and len(set(values)) == 10_000
    assert uniform(-1, 3, sm.ACCEPT) == reference_uniform(2 ** 64 - 1, 3, sm.ACCEPT)  # a seed is its 64-bit pattern
    # a plain sample at position p is the inverse CDF, in vocabulary order, of that row's uniform
    params = SamplingParams(0.9, top_p=0.95, seed=77)
    for pos in range(20):
        ids, accepted = sample_rows(LOGITS, [0, 0, 0], pos, params)
        probs = target_probs(LOGITS[2], params)
        u, total = reference_uniform(77, pos + 2, sm.SAMPLE), 0.0
        cdf = [total := total + float(p) for p in probs]
        want = next(i for i, c in enumerate(cdf) if c > u * cdf[-1])
        assert (ids, accepted) == ([0, 0, want], 0), pos


@pytest.mark.gpu
def test_the_stream_and_the_answers_are_the_same_on_cuda():
    items = mixed_batch(torch.Generator().manual_seed(4))
    on_cuda = answer_batch([(logits.cuda(), ids, pos, head) for logits, ids, pos, head in items])
    assert [answer[:2] for answer in on_cuda] == [answer[:2] for answer in answer_batch(items)]



def test_a_top_k_cut_reads_the_same_kth_value_whatever_k_max():
    """The CUDA graphs of the sampler (shardd/engine/fast/sampling.py) round top_k_max up to a power of two: the k-th
    largest value, and so every answer, is the same for any k_max >= k."""
    from shardd.engine.fast.sampling import k_bucket

    assert [k_bucket(k, 100) for k in (0, 1, 2, 3, 5, 64, 65, 99)] == [0, 1, 2, 4, 8, 64, 100, 100]
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(CHUNK_ROWS, 300, generator=generator) * 4
    logits[:, 10:20] = logits[:, 10:11]  # ties at the cut
    top_k = [0, 1, 3, 5, 7, 40, 299, 300] * 2
    rng = random.Random(3)
    for top_p in ([1.0] * CHUNK_ROWS, [rng.choice([1.0, 0.9, 0.5]) for _ in range(CHUNK_ROWS)]):
        cuts = sm._cuts(300, top_p, top_k)
        rows = sm._row_settings(300, [0.7] * CHUNK_ROWS, top_p, top_k, [rng.randrange(-1, 300) for _ in top_k],
                                [5] * CHUNK_ROWS, list(range(CHUNK_ROWS)), top_k_max=cuts["top_k_max"]).on_device("cpu")
        want = sm._verify_chunk(logits, rows, **cuts)
        for k_max in (cuts["top_k_max"] + 1, k_bucket(cuts["top_k_max"], 300), 300):
            got = sm._verify_chunk(logits, rows, top_k_max=k_max, any_top_p=cuts["any_top_p"])
            assert all(torch.equal(a, b) for a, b in zip(got, want)), k_max


@pytest.mark.gpu
def test_the_chunk_graphs_answer_as_op_by_op_on_cuda(monkeypatch):
    """Each chunk replayed as a CUDA graph gives the answers of the same ops run one by one, for every kind of
    row, several top_k buckets and both top_p cases, twice (the second call replays graphs captured by the first)."""
    generator = torch.Generator().manual_seed(12)
    batches = [mixed_batch(generator) for _ in range(3)]
    batches.append([(torch.randn(8, VOCAB, generator=generator).cuda(), list(range(8)), 4,
                     HeadRequest(SamplingParams(0.9, top_k=k, seed=k), drafts=[1] * 7)) for k in (1, 2, 3, 9, 33)])
    batches = [[(logits.cuda(), ids, pos, head) for logits, ids, pos, head in items] for items in batches]
    graphed = [answer_batch(items) for items in batches] + [answer_batch(items) for items in batches]
    monkeypatch.setattr(sm, "GRAPHS", False)
    eager = [answer_batch(items) for items in batches] * 2
    assert graphed == eager
    from shardd.engine.fast.sampling import chunk_graphs

    assert any(graph is not None for graph in chunk_graphs(torch.device("cuda")).graphs.values())


VOCAB = 50


def mixed_batch(generator: torch.Generator) -> list:
    """Forwards of every kind a head shard answers: sampled (decode and verify, each its own settings),
    greedy with penalties, logprobs, plain; more rows than a chunk, so chunk edges fall inside sequences."""
    def logits(n):
        return torch.randn(n, VOCAB, generator=generator) * 3

    items = []
    for k in range(12):
        n = 1 + k % 5
        drafts = [int(t) for t in torch.randint(VOCAB, (n - 1,), generator=generator)]
        rows = logits(n)
        ids = rows.argmax(-1).tolist()
        if k % 3 == 0:  # a draft the argmax agrees with, so greedy verifies accept something
            drafts[:1] = ids[n - len(drafts) - 1:n - len(drafts)] if drafts else []
        sampling = None if k % 4 == 3 else SamplingParams(0.5 + k / 10, top_p=(1.0, 0.9, 0.3)[k % 3],
                                                           top_k=(0, 5, 100)[k % 3], seed=1000 + k)
        penalties = Penalties(0.5, 0.3, 1.2) if k % 2 else Penalties()
        head = HeadRequest(sampling, penalties, prompt=[1, 2, 3], output=[4, 4, 5], drafts=drafts,
                           logprobs=(None, 0, 3, 20)[k % 4])
        items.append((rows, ids, 3 * k, head))
    items.append((logits(2), [1, 2], 5, HeadRequest(drafts=[2])))  # plain: the argmax is the answer
    return items


def test_a_row_answers_the_same_whatever_its_batch():
    items = mixed_batch(torch.Generator().manual_seed(1))
    assert sum(len(head.drafts) + 1 for *_, head in items) > 2 * CHUNK_ROWS
    alone = [answer_rows(*item) for item in items]
    together = answer_batch(items)
    assert together == alone  # bit for bit, logprobs included
    order = list(range(len(items)))
    random.Random(2).shuffle(order)
    assert answer_batch([items[i] for i in order]) == [alone[i] for i in order]
    padded = [items[0]] * 7 + [items[5]]  # another composition: row 5 now at another offset in its chunk
    assert answer_batch(padded)[-1] == alone[5]
    assert any(answer[1] for answer in alone) and any(answer[2] for answer in alone)


def test_penalties_and_logprobs_in_a_batch():
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(6, VOCAB, generator=generator)
    groups = [PenaltyRows(Penalties(0.8, 0.6, 1.4), [1, 2, 2, 7], [7, 7, 3, 9, 3], [7, 49, 3], 3),
              PenaltyRows(Penalties(), [1], [2], [], 1),
              PenaltyRows(Penalties(repetition=0.5), [4, 60], [-1, 5], [5], 2)]  # out-of-vocab ids are ignored
    got = penalise_rows(rows, groups)
    want = [penalise(rows[0], groups[0].penalties, [1, 2, 2, 7], [7, 7, 3, 9, 3]),
            penalise(rows[1], groups[0].penalties, [1, 2, 2, 7], [7, 7, 3, 9, 3, 7]),
            penalise(rows[2], groups[0].penalties, [1, 2, 2, 7], [7, 7, 3, 9, 3, 7, 49]),
            rows[3],
            penalise(rows[4], groups[2].penalties, [4], [5]),
            penalise(rows[5], groups[2].penalties, [4], [5, 5])]
    assert torch.equal(got, torch.stack(want))
    assert float(got[0, 7]) == pytest.approx(float(rows[0, 7]) / 1.4 - 0.6 * 2 - 0.8 if rows[0, 7] > 0
                                             else float(rows[0, 7]) * 1.4 - 0.6 * 2 - 0.8, abs=1e-6)
    assert torch.equal(got[:, 10:40], rows[:, 10:40])  # untouched tokens: bit for bit
    logprobs = torch.log_softmax(rows[2], dim=-1)
    token, top = row_logprobs(rows[2], 11, 3)
    assert token == float(logprobs[11]) and [i for i, _ in top] == logprobs.topk(3).indices.tolist()
    assert [v for _, v in top] == logprobs.topk(3).values.tolist()
    assert row_logprobs(rows[2], 11, 0)[1] == []


def test_the_drafts_must_leave_a_row():
    with pytest.raises(ValueError, match="2 drafts for 2 rows"):
        answer_rows(LOGITS[:2], [0, 0], 0, HeadRequest(SamplingParams(1.0), drafts=[1, 2]))
    with pytest.raises(ValueError, match="item 1"):
        answer_batch([(LOGITS, [0, 0, 0], 0, HeadRequest(SamplingParams(1.0))),
                      (LOGITS[:1], [0], 0, HeadRequest(drafts=[3]))])


@pytest.mark.parametrize("temperature", [1e-38, 1e-20, 9.9e-6])
def test_a_temperature_below_the_epsilon_is_greedy(temperature):
    """logits / T overflows float32 for a tiny T (the last id for every seed): below SAMPLING_EPS a request is
    answered with the argmax on the head shard and is greedy on the coordinator, whatever the seed."""
    ids = LOGITS[:3].argmax(dim=-1).tolist()
    from protocol import Forward, SAMPLING_EPS
    from shardd.server.handlers.forward import head_request

    assert SAMPLING_EPS == 1e-5
    for seed in range(8):
        request = Forward(id=0, seq=1, pos=0, tokens=[1, 2, 3], temperature=temperature, seed=seed)
        head = head_request(request)
        assert head.sampling is None and not head.needed  # the shard's argmax is the answer
        logprobs = dataclasses.replace(head, logprobs=0)
        assert answer_rows(LOGITS[:3], ids, 0, logprobs)[0] == ids
        sampling = Sampling(temperature=temperature, seed=seed)
        assert sampling.greedy and sampling.plain and sampling.wire() == {}
    assert not Sampling(temperature=SAMPLING_EPS).greedy
    assert head_request(Forward(id=0, seq=1, pos=0, tokens=[1], temperature=SAMPLING_EPS)).sampling is not None
    with pytest.raises(ValueError, match="below 1e-05"):  # the sampler itself never divides by such a T
        sm.verify_rows(LOGITS[:1], [temperature], [1.0], [0], [0], [0], [-1])


# ---- end to end on a tiny model: speculation does not change the distribution -------------------

@pytest.fixture(scope="module")
def local():
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
SAMPLES = 400  # the rule itself is checked above with N draws; here the decoding loop's wiring around it


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


def test_the_batch_sampler_runs_few_device_ops_per_chunk():
    """The per-row settings (uniforms, cuts, draft columns) are worked out on the host: an 8-row top-p verify
    costs few torch ops (each a kernel launch on the GPU), and a second chunk about as many again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in VIEWS:
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    VIEWS = {"slice", "view", "detach", "unsqueeze", "select", "squeeze", "lift_fresh", "expand", "alias", "t",
             "transpose", "_unsafe_view", "unbind", "split", "as_strided", "reshape"}
    generator = torch.Generator().manual_seed(3)

    def ops(sequences: int) -> int:
        items = []
        for index in range(sequences):
            logits = torch.randn(8, 300, generator=generator)
            head = HeadRequest(SamplingParams(0.7, top_p=0.9, seed=index), drafts=[1] * 7)
            items.append((logits, logits.argmax(-1).tolist(), 10, head))
        Count.ops = 0
        with Count():
            answer_batch(items)
        return Count.ops

    one_chunk, two_chunks = ops(1), ops(4)  # 8 rows; 32 rows (two chunks of 16)
    assert one_chunk <= 80, one_chunk  # about 104 before the settings moved to the host
    assert two_chunks - ops(2) <= 45, two_chunks
