"""Every rollback mode, every keep: the state equals a fresh forward of only the kept tokens."""

from __future__ import annotations

import pytest
import torch

from shardd.weights.loading import ModelSource, build_shard
from shardd.engine.reference.errors import BadInput, NoPendingStep, NoSnapshot, PositionMismatch, RollbackUnavailable
from shardd.engine.reference.rollback import RollbackStorage

PREFIX = 20
STEP = 6
TOL = 1e-5


def tokens(n, seed):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def shards(tiny_dir):
    source = ModelSource(model_dir=str(tiny_dir))
    return {
        mode: build_shard(source, 0, 6, storage=RollbackStorage(mode, 8)) for mode in ("checkpoint", "replay-ssm")
    } | {"none": build_shard(source, 0, 6)}


def assert_same_state(state, fresh):
    assert state.length == fresh.length
    for layer in fresh.gdn:
        assert (state.gdn[layer].recurrent - fresh.gdn[layer].recurrent).abs().max().item() <= TOL
        assert (state.gdn[layer].conv - fresh.gdn[layer].conv).abs().max().item() <= TOL
    for layer in fresh.kv:  # rows below the committed length are what attention reads
        rows = slice(0, fresh.length)
        assert (state.kv[layer].key[:, rows] - fresh.kv[layer].key[:, rows]).abs().max().item() <= TOL


def fresh_state(shard, prefix, kept):
    state = shard.new_state(64)
    shard.forward(state, 0, tokens=prefix)
    if kept:
        shard.forward(state, len(prefix), tokens=kept)
    return state


@pytest.mark.parametrize("mode", ["checkpoint", "replay-ssm", "snapshot"])
@pytest.mark.parametrize("keep", range(STEP + 1))
def test_rollback_equals_fresh_forward(shards, mode, keep):
    prefix, step, after = tokens(PREFIX, 1), tokens(STEP, 2), tokens(3, 3)
    shard = shards["checkpoint" if mode == "snapshot" else mode]
    state = shard.new_state(64)
    shard.forward(state, 0, tokens=prefix)
    if mode == "snapshot":
        shard.snapshot(state)
        shard.forward(state, PREFIX, tokens=step)
        shard.restore(state)
        if keep:
            shard.forward(state, PREFIX, tokens=step[:keep])
    else:
        shard.forward(state, PREFIX, tokens=step, checkpoint=True)
        assert state.pending is not None and state.length == PREFIX + STEP
        shard.rollback(state, keep)
        assert state.pending is None
    reference = shards["none"]
    fresh = fresh_state(reference, prefix, step[:keep])
    assert_same_state(state, fresh)
    # The next forward sees exactly the kept history.
    next_logits = shard.forward(state, PREFIX + keep, tokens=after).logits
    fresh_logits = reference.forward(fresh, PREFIX + keep, tokens=after).logits
    assert (next_logits - fresh_logits).abs().max().item() <= 1e-4


def test_rollback_on_a_middle_shard(tiny_dir):
    """A shard that takes hidden states in (no embedding, no head) rolls back the same way."""
    source = ModelSource(model_dir=str(tiny_dir))
    first = build_shard(source, 0, 3)
    middle = build_shard(source, 3, 5, storage=RollbackStorage("replay-ssm", 8))
    plain = build_shard(source, 3, 5)
    h = first.forward(first.new_state(64), 0, tokens=tokens(PREFIX + STEP, 4)).hidden
    state = middle.new_state(64)
    middle.forward(state, 0, hidden=h[:PREFIX])
    middle.forward(state, PREFIX, hidden=h[PREFIX:], checkpoint=True)
    middle.rollback(state, 2)
    fresh = plain.new_state(64)
    plain.forward(fresh, 0, hidden=h[: PREFIX + 2])
    assert_same_state(state, fresh)


def test_pending_window_rules(shards):
    shard = shards["checkpoint"]
    state = shard.new_state(64)
    shard.forward(state, 0, tokens=tokens(5, 1))
    with pytest.raises(NoPendingStep):
        shard.rollback(state, 0)
    shard.forward(state, 5, tokens=tokens(4, 2), checkpoint=True)
    with pytest.raises(BadInput):
        shard.rollback(state, 5)
    assert state.length == 9 and state.pending is not None
    shard.forward(state, 9, tokens=[7])  # ends the pending window: all 4 kept
    assert state.pending is None and state.length == 10
    with pytest.raises(NoPendingStep):
        shard.rollback(state, 1)


def test_checkpoint_refused_without_storage_and_over_limit(shards):
    plain = shards["none"]
    state = plain.new_state(64)
    with pytest.raises(RollbackUnavailable):
        plain.forward(state, 0, tokens=[1, 2], checkpoint=True)
    assert state.length == 0
    plain.forward(state, 0, tokens=[1, 2], capture_layers=[1])  # capture never needs rollback storage
    shard = shards["checkpoint"]
    state = shard.new_state(64)
    with pytest.raises(RollbackUnavailable):
        shard.forward(state, 0, tokens=tokens(9, 1), checkpoint=True)
    assert state.length == 0
    with pytest.raises(PositionMismatch):
        shard.forward(state, 3, tokens=[1])


def test_snapshot_ends_the_pending_step_and_restores(shards):
    shard = shards["checkpoint"]
    state = shard.new_state(64)
    with pytest.raises(NoSnapshot):
        shard.restore(state)
    shard.forward(state, 0, tokens=tokens(3, 1))
    shard.snapshot(state)
    shard.forward(state, 3, tokens=tokens(6, 1), checkpoint=True)
    shard.rollback(state, 2)
    shard.restore(state)
    assert state.length == 3
    shard.forward(state, 3, tokens=tokens(6, 1), checkpoint=True)
    shard.snapshot(state)  # ends the pending step, all 6 kept: nothing left to roll back
    assert state.length == 9
    with pytest.raises(NoPendingStep):
        shard.rollback(state, 0)


def test_checkpoint_bytes_reported(shards, tiny_dir):
    from common.model_config import load_config

    config = load_config(tiny_dir)
    gdn_layers = 4
    per_token = config.recurrent_state_bytes() + config.conv_state_bytes()
    shard = shards["checkpoint"]
    assert shard.checkpoint_bytes_per_sequence() == gdn_layers * 9 * per_token  # slots 0..8
    assert shard.new_state(64).rollback_bytes() == shard.checkpoint_bytes_per_sequence()
    replay = shards["replay-ssm"]
    assert 0 < replay.checkpoint_bytes_per_sequence() < shard.checkpoint_bytes_per_sequence()
    assert shards["none"].checkpoint_bytes_per_sequence() == 0


def test_every_model_refusal_has_a_wire_code():
    from shardd.server.errors import MODEL_ERROR_CODES
    from shardd.engine.reference.errors import ModelError

    assert set(MODEL_ERROR_CODES) == set(ModelError.__subclasses__())
