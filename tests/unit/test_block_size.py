"""`--block-size auto`: the block chosen from what a verify step reads against the tokens it commits (dense: always
the largest; MoE: smaller as the acceptance rate falls), and the output identical to plain greedy and to a fixed
block on a tiny MoE model, in process and through daemons."""

from __future__ import annotations

import json

import pytest

from common.presets import preset_config
from coordinator.benchstats import tokens_digest
from coordinator.decoding import greedy_decode
from coordinator.drafting.drafters import make_drafter
from coordinator.scheduler.block_size import (
    VerifyCost, acceptance_estimate, choose_block_size, expected_commit, verify_cost_of,
)
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import decode_all
from shardd.engine.reference.rollback import RollbackStorage
from shardd.local import LocalTarget
from shardd.weights.loading import ModelSource
from protocol.layout import CHECKPOINT

WORDS = list(b"the quick brown fox jumps over the lazy dog, the quick brown fox")
NEW_TOKENS = 40


def test_expected_commit_and_distinct_experts():
    assert expected_commit(0.5, 1) == 1 and expected_commit(0.5, 3) == 1.75 and expected_commit(1.0, 5) == 5
    cost = VerifyCost(dense_bytes=100, moe_layers=2, num_experts=8, experts_per_token=2, expert_bytes=10)
    assert cost.distinct_experts(1) == pytest.approx(2)  # one token reads its k experts
    assert cost.distinct_experts(1000) == pytest.approx(8)  # a long block reads them all
    assert cost.bytes_moved(1) == pytest.approx(100 + 2 * 2 * 10)
    assert acceptance_estimate(0, 0) == 0.5 and acceptance_estimate(8, 0) == 0.9


def test_a_dense_target_whose_rows_write_nothing_always_gets_the_largest_block():
    cost = VerifyCost.of_config(preset_config("qwen3.5-27b"), 2)
    assert cost.moe_layers == 0 and cost.row_bytes == 0
    assert [choose_block_size(cost, p, 16) for p in (0.01, 0.5, 0.99)] == [16, 16, 16]
    assert choose_block_size(cost, 0.5, 7) == 7


def test_a_dense_target_shrinks_the_block_when_the_drafts_are_rejected():
    """The 27B shape with checkpoint storage: each row writes a float32 checkpoint of its 48 GDN layers' state
    (~150 MB, against ~51 GB of bf16 weights a step reads): a drafter that accepts almost nothing gets one draft a
    block, one accepted about as often as not a few, one that is almost always right the largest block."""
    config = preset_config("qwen3.5-27b")
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    gdn_layers = sum(kind == "linear_attention" for kind in config.layer_types)
    cost = VerifyCost.of_config(config, 2, row_bytes=gdn_layers * state)
    chosen = [choose_block_size(cost, p, 16) for p in (0.01, 0.5, 0.9, 0.99)]
    assert chosen[0] == 2 and chosen == sorted(chosen) and chosen[-1] == 16 and 2 < chosen[1] < 16


def test_hellos_give_each_row_its_rollback_record():
    hello = lambda layers, mode, per_sequence: {  # noqa: E731
        "layers": layers, "model": {"moe": None}, "memory": {"weight_parts": {"mlp": 1000, "embedding": 50}},
        "rollback": {"mode": mode, "max_verify_tokens": 16, "checkpoint_bytes_per_sequence": per_sequence}}
    cost = VerifyCost.of_hellos([hello([0, 3], "checkpoint", 1600), hello([3, 6], "replay-ssm", 320),
                                 {"layers": None, "model": {"moe": None}}])
    assert (cost.dense_bytes, cost.row_bytes) == (2000, 100 + 20)
    assert VerifyCost.of_hellos([hello([0, 6], None, 0)]).row_bytes == 0


def test_a_moe_target_shrinks_the_block_as_acceptance_falls():
    cost = VerifyCost.of_config(preset_config("qwen3.5-35b-a3b"), 2)
    # the 35B-A3B shape: 40 MoE layers of 256 experts, 8 routed, each expert 3 x 2048 x 512 bf16 (+ its router row)
    assert (cost.moe_layers, cost.num_experts, cost.experts_per_token) == (40, 256, 8)
    assert cost.expert_bytes == 3 * 2048 * 512 * 2 + 2048 * 2
    chosen = [choose_block_size(cost, p, 16) for p in (0.2, 0.6, 0.9, 0.99)]
    assert chosen == sorted(chosen) and chosen[0] == 2 and chosen[-1] > chosen[1]
    assert all(2 <= rows <= 16 for rows in chosen)


class RecordingDrafter:
    """The oracle drafter, noting how many drafts each step asked for."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []
        self.name = inner.name

    def propose(self, history, n):
        self.asked.append(n)
        return self.inner.propose(history, n)


def decode(target, drafter, *, block_size=16, verify_cost=None):
    request = Request(WORDS, NEW_TOKENS, drafter=drafter, block_size=block_size, verify_cost=verify_cost)
    return decode_all(target, [request], rollback=CHECKPOINT)[0]


def test_auto_output_equals_greedy_and_a_fixed_block_on_a_tiny_moe_model():
    source = ModelSource(synthetic="tiny-moe")
    greedy = greedy_decode(LocalTarget(source, [(0, 3), (3, 6)], RollbackStorage(None, 0)), 1, WORDS, NEW_TOKENS).tokens
    target = LocalTarget(source, [(0, 3), (3, 6)], RollbackStorage(CHECKPOINT, 16))
    cost = verify_cost_of(target)
    assert cost.moe_layers == 6 and cost.num_experts == 8

    def oracle(mean_commit):
        return RecordingDrafter(make_drafter("oracle", prompt_len=len(WORDS), reference=greedy, block_size=16,
                                             mean_commit=mean_commit, seed=3))

    fixed = decode(target, oracle(2.0), block_size=6)
    poor, good = oracle(1.5), oracle(14.0)
    auto_poor = decode(target, poor, verify_cost=cost)
    auto_good = decode(target, good, verify_cost=cost)
    assert fixed.tokens == auto_poor.tokens == auto_good.tokens == greedy
    # the choice followed each sequence's acceptance: short blocks for the poor drafter, longer for the good one
    assert max(poor.asked) < max(good.asked)
    assert len(set(poor.asked + good.asked)) > 1


def test_generate_block_size_auto_through_moe_daemons_equals_greedy():
    """The CLI path: `--block-size auto` over two daemons of the tiny MoE preset reads the cost from their HELLOs."""
    from click.testing import CliRunner

    from coordinator.cli import cli

    text = bytes(WORDS).decode()
    greedy = greedy_decode(LocalTarget(ModelSource(synthetic="tiny-moe"), [(0, 3), (3, 6)], RollbackStorage(None, 0)),
                           1, WORDS, 16).tokens
    result = CliRunner().invoke(cli, ["generate", "--synthetic", "tiny-moe", "--split", "2", "--prompt", text,
                                      "--max-new-tokens", "16", "--drafter", "ngram", "--block-size", "auto", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sha256"] == tokens_digest(greedy)


def test_block_size_takes_a_number_or_auto():
    from click.testing import CliRunner

    from coordinator.cli import cli

    result = CliRunner().invoke(cli, ["generate", "--synthetic", "tiny", "--split", "1", "--prompt", "x",
                                      "--block-size", "1"])
    assert result.exit_code == 2 and "at least 2" in result.output
    result = CliRunner().invoke(cli, ["generate", "--synthetic", "tiny", "--split", "1", "--prompt", "x",
                                      "--block-size", "big"])
    assert result.exit_code == 2 and "or auto" in result.output
