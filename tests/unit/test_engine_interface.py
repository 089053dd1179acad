"""Both shard engines through `ShardEngine` alone: each satisfies the protocol, and the same calls (open,
forward_batch, rollback, snapshot, restore, close) give the same tokens and states on a tiny synthetic model.

The fast engine runs its kernels under Triton's interpreter on the CPU (TRITON_INTERPRET=1, conftest.py), so
the schedule is short; float32 on both, compared within rounding as tests/test_fast_path.py does.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the fast engine's kernels need triton")

from protocol.layout import CHECKPOINT, REPLAY_SSM  # noqa: E402
from shardd.engine.batch import BatchItem  # noqa: E402
from common.model_config import config_from_dict  # noqa: E402
from shardd.engine.fast.shard import FastShard  # noqa: E402
from shardd.engine.interface import ShardEngine  # noqa: E402
from shardd.engine.reference.errors import ModelError, NoPendingStep, NoSnapshot, PositionMismatch  # noqa: E402
from shardd.engine.reference.rollback import RollbackStorage  # noqa: E402
from shardd.engine.reference.shard import ShardModel  # noqa: E402
from common.presets import PRESETS  # noqa: E402
from shardd.synthetic.model import synthetic_weights  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = 4
CONTEXT = 32
TOL = dict(rtol=1e-4, atol=1e-5)


def engines(mode: str, begin: int = 0, end: int | None = None) -> tuple[ShardModel, FastShard]:
    """The reference engine and the fast one over weights of the same seed (the tiny preset cut to a GDN
    layer and an attention layer: the interpreter is slow)."""
    config = config_from_dict({**PRESETS["tiny"], "num_hidden_layers": 2, "full_attention_interval": 2})
    end = config.num_layers if end is None else end

    def model():
        weights = synthetic_weights(config, begin, end, seed=0, dtype=torch.float32, device=DEVICE)
        return ShardModel(config, weights, begin, end, dtype=torch.float32, device=DEVICE,
                          storage=RollbackStorage(mode, ROWS))

    fast = FastShard(model(), max_sequences=2, max_context=CONTEXT)
    fast.prefill_kernels = False  # inputs longer than a step take the reference path: the step is what is tested
    return model(), fast


def state_of(engine: ShardEngine, state) -> tuple:
    engine.settle(state)
    kv = [(c.key[:, : state.length].clone(), c.value[:, : state.length].clone()) for c in state.kv.values()]
    return state.length, state.gdn.recurrent.clone(), state.gdn.conv.clone(), kv


def assert_same_state(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1], **TOL)
    torch.testing.assert_close(a[2], b[2], **TOL)
    for (ka, va), (kb, vb) in zip(a[3], b[3]):
        torch.testing.assert_close(ka, kb, **TOL)
        torch.testing.assert_close(va, vb, **TOL)


def test_both_engines_are_shard_engines_without_posing():
    """isinstance through the runtime-checkable protocol, every member the engine's own (no `__getattr__`
    forwarding to a wrapped model), and the read-only facts a daemon reads agree between the two."""
    reference, fast = engines(CHECKPOINT)
    for engine in (reference, fast):
        assert isinstance(engine, ShardEngine)
        assert not hasattr(type(engine), "__getattr__")
    assert (reference.engine, fast.engine) == ("reference", "fast")
    for fact in ("config", "fingerprint", "begin", "end", "dtype", "device", "owns_embedding", "owns_head",
                 "gdn_layers", "attention_layers"):
        assert getattr(fast, fact) == getattr(reference, fact), fact
    assert fast.storage == reference.storage
    assert fast.weight_bytes() == reference.weight_bytes()
    assert fast.state_bytes_per_sequence(CONTEXT) == reference.state_bytes_per_sequence(CONTEXT)
    assert fast.checkpoint_bytes_per_sequence() == reference.checkpoint_bytes_per_sequence()
    assert (reference.step_rows, reference.batch_rows, reference.prefill_rows) == (None, None, None)
    assert fast.step_rows == ROWS and fast.batch_rows == ROWS
    assert (reference.supports_device_rows, fast.supports_device_rows) == (False, True)


@pytest.mark.parametrize("mode", [CHECKPOINT, REPLAY_SSM])
def test_the_same_calls_give_the_same_tokens_and_states(mode):
    """open, a prompt longer than a step and a checkpointed block through forward_batch, rollback to a keep, a
    snapshot, a step, a restore, a step after it, close: ids, logits and states agree at every point."""
    reference, fast = engines(mode)
    vocab = reference.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
    block = torch.randint(0, vocab, (ROWS,), generator=g).tolist()
    states = {}
    for engine in (reference, fast):
        s = engine.new_state(CONTEXT)
        [out] = engine.forward_batch([BatchItem(s, 0, tokens=prompt)])
        [verify] = engine.forward_batch([BatchItem(s, len(prompt), tokens=block, checkpoint=True)])
        engine.rollback(s, 2)
        states[engine.engine] = (s, out, verify)
    (a, out_a, verify_a), (b, out_b, verify_b) = states["reference"], states["fast"]
    torch.testing.assert_close(out_b.logits.cpu(), out_a.logits.cpu(), **TOL)
    assert verify_b.ids.tolist() == verify_a.ids.tolist()
    torch.testing.assert_close(verify_b.logits.cpu(), verify_a.logits.cpu(), rtol=1e-4, atol=1e-4)
    assert a.length == b.length == len(prompt) + 2 and a.pending is None and b.pending is None
    assert_same_state(state_of(fast, b), state_of(reference, a))

    pos = a.length
    reference.snapshot(a), fast.snapshot(b)
    step_a = reference.forward(a, pos, tokens=block[:3])
    step_b = fast.forward(b, pos, tokens=block[:3])
    assert step_b.ids.tolist() == step_a.ids.tolist()
    reference.restore(a), fast.restore(b)
    assert a.length == b.length == pos
    assert_same_state(state_of(fast, b), state_of(reference, a))
    again_a = reference.forward(a, pos, tokens=block[:3])
    again_b = fast.forward(b, pos, tokens=block[:3])
    assert again_b.ids.tolist() == again_a.ids.tolist() == step_a.ids.tolist()

    reference.release_state(a), fast.release_state(b)
    fresh = fast.new_state(CONTEXT)  # a closed sequence's slot comes back as a fresh state
    assert fresh.length == 0 and not fresh.gdn.recurrent.any()
    fast.release_state(fresh)


def test_refusals_are_the_same_through_the_protocol():
    """A refused item of a batch gets its ModelError and changes nothing, the others run; a rollback with
    nothing pending and a restore without a snapshot are refused alike by both engines."""
    reference, fast = engines(CHECKPOINT)
    for engine in (reference, fast):
        s, t = engine.new_state(CONTEXT), engine.new_state(CONTEXT)
        results = engine.forward_batch([BatchItem(s, 3, tokens=[1, 2]), BatchItem(t, 0, tokens=[1, 2])])
        assert isinstance(results[0], PositionMismatch) and not isinstance(results[1], ModelError)
        assert (s.length, t.length) == (0, 2)
        with pytest.raises(NoPendingStep):
            engine.rollback(t, 0)
        with pytest.raises(NoSnapshot):
            engine.restore(t)
        assert t.length == 2
        engine.release_state(s), engine.release_state(t)


def test_an_item_that_wants_ids_only_gets_no_logits():
    reference, fast = engines(CHECKPOINT)
    for engine in (reference, fast):
        s = engine.new_state(CONTEXT)
        [out] = engine.forward_batch([BatchItem(s, 0, tokens=[1, 2, 3], logits=False)])
        assert out.logits is None and len(out.ids) == 3
        engine.release_state(s)
