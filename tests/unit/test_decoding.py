"""The decoding loops against an in-memory target with real per-sequence state (tests/support/fake_target.py),
whose next token depends on the whole state, so a rollback that keeps one token too many or too few changes the
output."""

import random
from collections import Counter

import pytest

from coordinator.benchstats import all_identical, drift, summarize_runs, tokens_digest
from coordinator.decoding import ROLLBACK_MODES, greedy_decode, speculative_decode
from coordinator.drafting.drafters import NgramDrafter, OracleDrafter
from coordinator.relay.target import ReplayTarget, RollbackFailed, SequenceLost, Target
from coordinator.scheduler.commit import accept_length, commit_tokens
from coordinator.tokenizer import ByteTokenizer, HFTokenizer, NoTokenizer, TokenizerUnavailable, load_tokenizer
from tests.support.fake_target import FakeTarget, mixing_rule

CYCLE = [3, 14, 15, 9, 26, 5, 35]


def cycle_rule(state):
    """Walks a short cycle, knocked off it every 11 positions: prompt lookup pays off."""
    last = state[-1]
    if len(state) % 11 == 0 or last not in CYCLE:
        return CYCLE[(last * 3 + len(state)) % len(CYCLE)] if last in CYCLE else CYCLE[0]
    return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)]


class FlakyRollbackTarget(FakeTarget):
    """Every other rollback fails and leaves the rejected tokens in the state."""

    attempts = 0

    def rollback(self, seq, keep):
        self.attempts += 1
        if self.attempts % 2 == 0:
            self.pending.pop(seq, None)
            raise RollbackFailed("no checkpoint storage on shard 1")
        super().rollback(seq, keep)


class RestartingTarget(FakeTarget):
    """A shard that restarts (losing every sequence) at chosen calls, and is still coming back
    for the first open after each restart."""

    def __init__(self, crash_at: dict[str, set[int]], rule=mixing_rule):
        super().__init__(rule)
        self.crash_at = crash_at
        self.restarting = False
        self.restarts = 0

    def _maybe_crash(self, kind):
        """Before the call numbered calls[kind] + 1 runs."""
        if self.calls[kind] + 1 in self.crash_at.get(kind, ()):
            self.calls[kind] += 1
            self.states.clear()
            self.pending.clear()
            self.snapshots.clear()
            self.restarting = True
            self.restarts += 1
            raise SequenceLost(f"shard restarted during {kind}")

    def _state(self, seq):
        if seq not in self.states:
            raise SequenceLost(f"NO_SUCH_SEQUENCE {seq}")
        return self.states[seq]

    def open(self, seq):
        if self.restarting:
            self.restarting = False
            raise SequenceLost("timed out: shard still loading")
        super().open(seq)

    def close(self, seq):
        self.calls["close"] += 1
        self.states.pop(seq, None)

    def forward(self, seq, pos, tokens, *, checkpoint=False):
        self._maybe_crash("forward")
        return super().forward(seq, pos, tokens, checkpoint=checkpoint)

    def rollback(self, seq, keep):
        self._maybe_crash("rollback")
        super().rollback(seq, keep)

    def restore(self, seq):
        self._maybe_crash("restore")
        super().restore(seq)


def simulate_greedy(rule, prompt, n):
    state = list(prompt)
    out = []
    for _ in range(n):
        out.append(rule(state))
        state.append(out[-1])
    return out


PROMPT = [7, 1, 33, 2, 7, 1, 40, 12, 9]


def greedy_tokens(rule, max_new_tokens, prompt=PROMPT, eos_ids=()):
    return greedy_decode(FakeTarget(rule), 1, prompt, max_new_tokens, eos_ids).tokens


# --- acceptance arithmetic ------------------------------------------------------------


def test_no_draft_accepted_commits_the_target_token():
    assert accept_length([5, 6, 7], [1, 2, 3, 4]) == 0
    assert commit_tokens([5, 6, 7], [1, 2, 3, 4], room=10) == ([1], 1)


def test_partial_accept_commits_prefix_and_correction():
    assert accept_length([1, 2, 9], [1, 2, 3, 4]) == 2
    assert commit_tokens([1, 2, 9], [1, 2, 3, 4], room=10) == ([1, 2, 3], 3)


def test_full_accept_adds_the_bonus_token():
    assert accept_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert commit_tokens([1, 2, 3], [1, 2, 3, 4], room=10) == ([1, 2, 3, 4], 4)


def test_eos_mid_block_cuts_the_commit_after_it():
    assert commit_tokens([1, 2, 3], [1, 2, 3, 4], room=10, eos_ids=[2]) == ([1, 2], 2)
    # EOS as the correction token is committed too.
    assert commit_tokens([1, 8, 3], [1, 2, 3, 4], room=10, eos_ids=(2,)) == ([1, 2], 2)


def test_room_smaller_than_the_block():
    assert commit_tokens([1, 2, 3], [1, 2, 3, 4], room=2) == ([1, 2], 2)
    assert commit_tokens([1, 2, 3], [1, 2, 3, 4], room=1) == ([1], 1)


def test_verify_output_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError):
        accept_length([1, 2], [1, 2])
    with pytest.raises(ValueError):
        commit_tokens([1, 2], [1, 2, 3, 4], room=5)


# --- greedy ---------------------------------------------------------------------------


def test_greedy_follows_the_model():
    for rule in (mixing_rule, cycle_rule):
        target = FakeTarget(rule)
        result = greedy_decode(target, 3, PROMPT, 40)
        assert result.tokens == simulate_greedy(rule, PROMPT, 40)
        assert result.steps == 39 and result.commits == [1] * 39
        assert result.avg_commit == 1.0 and result.acceptance_rate is None
        assert target.states == {}  # closed
        assert target.closed_states[3] == PROMPT + result.tokens[:-1]


def test_greedy_stops_at_eos_inclusive():
    full = greedy_tokens(mixing_rule, 60)
    eos = full[20]
    cut = full[: full.index(eos) + 1]
    assert greedy_tokens(mixing_rule, 60, eos_ids=[eos]) == cut


def test_prompt_must_not_be_empty():
    with pytest.raises(ValueError):
        greedy_decode(FakeTarget(), 1, [], 5)
    with pytest.raises(ValueError):
        speculative_decode(FakeTarget(), 1, [], NgramDrafter(), max_new_tokens=5)


# --- speculative == greedy ------------------------------------------------------------


def make_drafter_for(kind, rule, max_new_tokens, block_size):
    if kind == "ngram":
        return NgramDrafter()
    reference = greedy_tokens(rule, max_new_tokens)
    if kind == "oracle":
        return OracleDrafter.with_mean_commit(reference, len(PROMPT), block_size=block_size,
                                              mean_commit=min(block_size, 3.5), seed=7)
    # An oracle that was handed the wrong continuation: drafts are mostly rejected.
    shuffled = list(reference)
    random.Random(0).shuffle(shuffled)
    return OracleDrafter(shuffled, len(PROMPT), lambda rng: rng.randrange(block_size), seed=1)


@pytest.mark.parametrize("rule", [mixing_rule, cycle_rule], ids=["mixing", "cycle"])
@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("kind", ["ngram", "oracle", "bad-oracle"])
@pytest.mark.parametrize("max_new_tokens", [1, 5, 77])
def test_speculative_matches_greedy(rule, block_size, mode, kind, max_new_tokens):
    expected = greedy_tokens(rule, max_new_tokens)
    target = FakeTarget(rule)
    drafter = make_drafter_for(kind, rule, max_new_tokens, block_size)
    result = speculative_decode(target, 5, PROMPT, drafter, block_size=block_size,
                                rollback=mode, max_new_tokens=max_new_tokens)
    assert result.tokens == expected
    assert target.states == {}
    # The invariant: the state held everything committed but the last token.
    assert target.closed_states[5] == PROMPT + expected[:-1]
    assert sum(result.commits) == max_new_tokens - 1
    assert result.accepted <= result.drafted


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_speculative_stops_at_eos_like_greedy(mode, block_size):
    full = greedy_tokens(mixing_rule, 80)
    for eos in (full[0], full[9], full[30]):
        expected = greedy_tokens(mixing_rule, 80, eos_ids=[eos])
        assert expected[-1] == eos and eos not in expected[:-1]
        for drafter in (NgramDrafter(), OracleDrafter.with_mean_commit(full, len(PROMPT), block_size, 2.0, seed=4)):
            target = FakeTarget()
            result = speculative_decode(target, 2, PROMPT, drafter, block_size=block_size, rollback=mode,
                                        max_new_tokens=80, eos_ids=[eos])
            assert result.tokens == expected
            assert target.closed_states[2] == PROMPT + expected[:-1]


def test_max_new_tokens_one_is_prefill_only():
    target = FakeTarget()
    result = speculative_decode(target, 1, PROMPT, NgramDrafter(), max_new_tokens=1)
    assert result.tokens == greedy_tokens(mixing_rule, 1)
    assert result.steps == 0 and result.drafted == 0
    assert target.calls["forward"] == 1


def test_zero_new_tokens_touches_nothing():
    target = FakeTarget()
    assert speculative_decode(target, 1, PROMPT, NgramDrafter(), max_new_tokens=0).tokens == []
    assert greedy_decode(target, 1, PROMPT, 0).tokens == []
    assert target.calls == Counter()


def test_verify_block_never_exceeds_the_token_budget():
    reference = greedy_tokens(mixing_rule, 3)
    drafter = OracleDrafter.with_mean_commit(reference, len(PROMPT), block_size=16, mean_commit=16.0)
    target = FakeTarget()
    result = speculative_decode(target, 1, PROMPT, drafter, block_size=16, max_new_tokens=3)
    assert result.tokens == reference
    # Prefill, then a single step verifying [t0, d1]: both drafts beyond it would be waste.
    assert target.forward_sizes == [len(PROMPT), 2]
    assert result.commits == [2]


@pytest.mark.parametrize("mode", ["checkpoint", "replay-ssm"])
def test_fast_rollback_modes_use_rollback_only(mode):
    reference = greedy_tokens(mixing_rule, 200)
    drafter = OracleDrafter.with_mean_commit(reference, len(PROMPT), block_size=8, mean_commit=4.0, seed=2)
    target = FakeTarget()
    result = speculative_decode(target, 1, PROMPT, drafter, block_size=8, rollback=mode, max_new_tokens=200)
    assert result.tokens == reference
    assert result.rollbacks_fast == target.calls["rollback"] > 0
    assert result.rollbacks_fallback == result.replays == 0
    assert target.calls["snapshot"] == target.calls["restore"] == 0
    # Full accepts need no rollback: fewer rollbacks than steps.
    assert result.rollbacks_fast < result.steps


def test_replay_mode_restores_and_reforwards():
    reference = greedy_tokens(mixing_rule, 200)
    drafter = OracleDrafter.with_mean_commit(reference, len(PROMPT), block_size=8, mean_commit=4.0, seed=2)
    target = FakeTarget()
    result = speculative_decode(target, 1, PROMPT, drafter, block_size=8, rollback="replay", max_new_tokens=200)
    assert result.tokens == reference
    assert target.calls["rollback"] == 0
    assert target.calls["snapshot"] == result.steps
    assert 0 < result.replays == target.calls["restore"] < result.steps
    # Prefill, one verify per step, one re-forward per replay.
    assert target.calls["forward"] == 1 + result.steps + result.replays


def test_replay_target_restores_the_snapshot_and_forwards_the_kept_tokens():
    plain = FakeTarget()
    plain.open(1)
    inner = FakeTarget()
    replay = ReplayTarget(inner)
    replay.open(1)
    replay.forward(1, 0, [1, 2, 3])
    assert replay.forward(1, 3, [4, 5, 6, 7], checkpoint=True) == plain.forward(1, 0, [1, 2, 3, 4, 5, 6, 7])[3:]
    replay.rollback(1, 2)
    assert inner.states[1] == [1, 2, 3, 4, 5]
    assert inner.pending == {}  # the inner target only ever saw plain forwards
    with pytest.raises(RollbackFailed):  # one rollback per checkpointed step
        replay.rollback(1, 1)
    replay.forward(1, 5, [6, 7], checkpoint=True)
    replay.rollback(1, 0)
    assert inner.states[1] == [1, 2, 3, 4, 5]
    assert (inner.calls["snapshot"], inner.calls["restore"], inner.calls["rollback"]) == (2, 2, 0)


@pytest.mark.parametrize("mode", ["checkpoint", "replay-ssm"])
def test_failed_rollback_falls_back_to_refill(mode):
    expected = greedy_tokens(mixing_rule, 150)
    drafter = OracleDrafter.with_mean_commit(expected, len(PROMPT), block_size=6, mean_commit=3.0, seed=9)
    target = FlakyRollbackTarget()
    result = speculative_decode(target, 4, PROMPT, drafter, block_size=6, rollback=mode, max_new_tokens=150)
    assert result.tokens == expected
    assert result.rollbacks_fallback > 0 and result.rollbacks_fast > 0
    assert target.calls["open"] == 1 + result.rollbacks_fallback
    assert target.closed_states[4] == PROMPT + expected[:-1]


def test_ngram_speeds_up_a_repetitive_model():
    expected = greedy_tokens(cycle_rule, 300)
    result = speculative_decode(FakeTarget(cycle_rule), 1, PROMPT, NgramDrafter(), block_size=8,
                                max_new_tokens=300)
    assert result.tokens == expected
    assert result.avg_commit > 2.5
    assert 0 < result.acceptance_rate < 1


@pytest.mark.parametrize("block_size, mean_commit", [(16, 6.0), (8, 2.5)])
def test_oracle_measured_avg_commit_is_near_the_requested_mean(block_size, mean_commit):
    n = 3000
    reference = greedy_tokens(mixing_rule, n)
    drafter = OracleDrafter.with_mean_commit(reference, len(PROMPT), block_size, mean_commit, seed=0)
    result = speculative_decode(FakeTarget(), 1, PROMPT, drafter, block_size=block_size, max_new_tokens=n)
    assert result.tokens == reference
    assert result.avg_commit == pytest.approx(mean_commit, abs=0.25)
    assert result.acceptance_rate == pytest.approx((mean_commit - 1) / (block_size - 1), abs=0.05)


def test_on_commit_streams_every_token_in_order():
    streamed = []
    result = speculative_decode(FakeTarget(cycle_rule), 1, PROMPT, NgramDrafter(), block_size=4,
                                max_new_tokens=60, on_commit=streamed.append)
    assert [t for chunk in streamed for t in chunk] == result.tokens
    assert [len(chunk) for chunk in streamed] == [1] + result.commits

    greedy_streamed = []
    greedy = greedy_decode(FakeTarget(cycle_rule), 1, PROMPT, 60, on_commit=greedy_streamed.append)
    assert [t for chunk in greedy_streamed for t in chunk] == greedy.tokens == result.tokens


def test_a_failing_drafter_still_closes_the_sequence():
    class BrokenDrafter:
        name = "broken"

        def propose(self, history, n):
            raise RuntimeError("drafter died")

    target = FakeTarget()
    with pytest.raises(RuntimeError, match="drafter died"):
        speculative_decode(target, 1, PROMPT, BrokenDrafter(), max_new_tokens=10)
    assert target.states == {}


def test_a_drafter_proposing_the_wrong_count_is_refused():
    class ShortDrafter:
        name = "short"

        def propose(self, history, n):
            return [1] * (n - 1)

    target = FakeTarget()
    with pytest.raises(ValueError, match="proposed 2 tokens, asked for 3"):
        speculative_decode(target, 1, PROMPT, ShortDrafter(), block_size=4, max_new_tokens=10)
    assert target.states == {}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        speculative_decode(FakeTarget(), 1, PROMPT, NgramDrafter(), block_size=1, max_new_tokens=5)
    with pytest.raises(ValueError, match="rollback mode"):
        speculative_decode(FakeTarget(), 1, PROMPT, NgramDrafter(), rollback="undo", max_new_tokens=5)


def test_the_fake_satisfies_the_target_protocol():
    assert isinstance(FakeTarget(), Target)


def test_result_rates_and_summary():
    result = speculative_decode(FakeTarget(cycle_rule), 1, PROMPT, NgramDrafter(), block_size=4,
                                max_new_tokens=50)
    summary = result.summary()
    assert summary["new_tokens"] == 50
    assert summary["avg_commit"] == pytest.approx(49 / result.steps)
    assert summary["acceptance_rate"] == pytest.approx(result.accepted / result.drafted)
    assert result.decode_tok_s == pytest.approx(49 / result.decode_seconds)
    assert result.prefill_tok_s == pytest.approx(len(PROMPT) / result.prefill_seconds)


# --- benchmark statistics -------------------------------------------------------------


def test_summarize_runs_takes_medians_and_keeps_missing_acceptance_missing():
    runs = [
        {"decode_tok_s": 10.0, "wall_seconds": 3.0, "prefill_tok_s": 100.0, "acceptance_rate": None, "avg_commit": 1.0},
        {"decode_tok_s": 30.0, "wall_seconds": 1.0, "prefill_tok_s": 300.0, "acceptance_rate": None, "avg_commit": 1.0},
        {"decode_tok_s": 20.0, "wall_seconds": 2.0, "prefill_tok_s": 200.0, "acceptance_rate": None, "avg_commit": 1.0},
    ]
    summary = summarize_runs(runs)
    assert summary["runs"] == 3
    assert summary["decode_tok_s"] == 20.0 and summary["wall_seconds"] == 2.0
    assert summary["prefill_tok_s"] == 200.0 and summary["avg_commit"] == 1.0
    assert summary["acceptance_rate"] is None


def test_drift_is_the_relative_gap_between_a_blocks():
    assert drift(100.0, 100.0) == 0.0
    assert drift(90.0, 110.0) == pytest.approx(0.2)
    assert drift(110.0, 90.0) == drift(90.0, 110.0)


def test_all_identical_and_digests():
    same = tokens_digest([1, 2, 3])
    assert same == tokens_digest([1, 2, 3])
    assert tokens_digest([1, 2, 3]) != tokens_digest([1, 23])
    assert all_identical([same, same, same])
    assert not all_identical([same, tokens_digest([3, 2, 1])])
    assert not all_identical([])


# --- tokenizers -----------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer(300)
    text = "layer split, état récurrent 🚀"
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids[:3] + [256, 299] + ids[3:]) == text  # ids past the bytes show nothing
    with pytest.raises(ValueError):
        ByteTokenizer(255)


def write_word_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3, "shard": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text('{"model_type": "qwen3_5", "text_config": {"eos_token_id": 1}}')


def test_hf_tokenizer_round_trip_and_eos(tmp_path):
    write_word_tokenizer(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    ids = tokenizer.encode("hello shard world")
    assert ids == [2, 4, 3]
    assert tokenizer.decode(ids) == "hello shard world"
    assert tokenizer.eos_ids == (1,)
    assert tokenizer.vocab_size == 5


def test_load_tokenizer_picks_the_model_tokenizer_and_bytes_only_by_name(tmp_path):
    for none in (load_tokenizer(None, 512), load_tokenizer(str(tmp_path), 512)):
        assert isinstance(none, NoTokenizer) and none.decode([104, 105]) == ""
        with pytest.raises(TokenizerUnavailable, match="--tokenizer bytes"):
            none.encode("hi")
    assert isinstance(load_tokenizer("bytes", 512, given=True), ByteTokenizer)
    write_word_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path), 5), HFTokenizer)


@pytest.mark.parametrize("mode", [None, "checkpoint", "replay-ssm", "replay"])
def test_a_restarted_shard_is_refilled_from_history_and_the_output_is_unchanged(mode, monkeypatch):
    monkeypatch.setattr("coordinator.scheduler.recovery.RETRY_INTERVAL_S", 0.0)
    expected = greedy_tokens(mixing_rule, 120)
    # Crash on the 5th and 9th forward, and on the 3rd rollback / restore where the mode has them.
    target = RestartingTarget({"forward": {5, 9}, "rollback": {3}, "restore": {3}})
    if mode is None:
        result = greedy_decode(target, 2, PROMPT, 120)
    else:
        drafter = OracleDrafter.with_mean_commit(expected, len(PROMPT), block_size=6, mean_commit=3.0, seed=4)
        result = speculative_decode(target, 2, PROMPT, drafter, block_size=6, rollback=mode, max_new_tokens=120)
    assert result.tokens == expected
    assert 2 <= result.recoveries <= target.restarts  # a crash during a re-fill is retried inside it


class SteppedTarget(FakeTarget):
    """A target whose shards serve the fixed-shape GPU step of `step_rows` rows, failing one rollback."""

    step_rows = 4
    failed = False

    def rollback(self, seq, keep):
        if not self.failed:
            self.failed = True
            self.pending.pop(seq, None)
            raise RollbackFailed("lost the pending step")
        super().rollback(seq, keep)


def test_a_refill_forwards_the_prompt_as_one_prefill_and_the_generated_tokens_in_steps():
    """A re-fill must build the state the way decoding did: the prompt as the same prefill, then no input
    longer than the step (a longer one would take the prefill path, which rounds differently in bf16)."""
    expected = greedy_tokens(mixing_rule, 40)
    target = SteppedTarget()
    drafter = OracleDrafter.with_mean_commit(expected, len(PROMPT), block_size=4, mean_commit=2.0, seed=1)
    target.forward_sizes.clear()
    result = speculative_decode(target, 2, PROMPT, drafter, block_size=4, max_new_tokens=40)
    assert result.tokens == expected and result.rollbacks_fallback == 1
    prompt_forwards = [i for i, size in enumerate(target.forward_sizes) if size == len(PROMPT)]
    assert len(prompt_forwards) == 2  # the prefill, and the re-fill's prefill of the same prompt
    assert max(target.forward_sizes[prompt_forwards[1] + 1 :]) <= SteppedTarget.step_rows
