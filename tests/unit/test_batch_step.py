"""The batched fixed-shape step: several sequences' rows in one step of R rows, each row's result the
same as its sequence stepped alone.

On a CUDA machine: bf16, CUDA graphs, a 27B-like layer shape, every rollback mode, bit for bit. Without one:
the same kernels under Triton's interpreter (TRITON_INTERPRET=1, conftest.py) on the CPU, float32, a
two-layer model (one GDN layer, one attention layer) and few rows, also bit for bit: the GEMMs see R rows
whoever fills them, and the attention and GDN kernels run each sequence's segment as if it were alone.
(On the CPU a GEMM's row is independent of the other rows for R a multiple of 4, the CPU BLAS's block of
rows; at R = 6 the last two rows round differently, so the CPU tests use R = 4 and 8.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton", reason="the fast path's kernels need triton")

from common.model_config import config_from_dict  # noqa: E402
from common.presets import PRESETS  # noqa: E402
from protocol.layout import CHECKPOINT, REPLAY_SSM  # noqa: E402
from shardd.engine.batch import BatchItem  # noqa: E402
from shardd.engine.fast.shard import FastShard  # noqa: E402
from shardd.engine.reference import rollback as rb  # noqa: E402
from shardd.engine.reference.errors import BadInput, ModelError, PositionMismatch  # noqa: E402
from shardd.engine.reference.shard import ShardModel  # noqa: E402
from shardd.synthetic.model import synthetic_weights  # noqa: E402
from tests.support.steps import assert_same_state, ids, item, outputs_equal, run_schedule, state_bits  # noqa: E402

CUDA = torch.cuda.is_available()


def config(preset: str):
    if preset == "duo":  # the tiny preset cut to a GDN layer and an attention layer: the interpreter is slow
        return config_from_dict({**PRESETS["tiny"], "num_hidden_layers": 2, "full_attention_interval": 2})
    if preset == "27b-like":  # the 27B shape's layers (widths, heads), eight of them (6 GDN + 2 attention)
        return config_from_dict({**PRESETS["qwen3.5-27b"], "num_hidden_layers": 8})
    return config_from_dict(PRESETS[preset])


def pair(mode, *, preset, rows, step_rows, sequences, context, dtype, device, begin=0, end=None):
    """Two FastShards over one model: `batched` (R = step_rows) and `alone`, the same R, one sequence a step."""
    c = config(preset)
    end = c.num_layers if end is None else end
    weights = synthetic_weights(c, begin, end, seed=0, dtype=dtype, device=device)
    model = ShardModel(c, weights, begin, end, dtype=dtype, device=device, storage=rb.RollbackStorage(mode, rows))
    batched = FastShard(model, max_sequences=sequences, max_context=context, step_rows=step_rows)
    batched.prefill_kernels = False  # the step alone: prompts here fit in it
    alone = batched.sharing_weights(rb.RollbackStorage(mode, rows))
    alone.prefill_kernels = False
    return batched, alone


# ---- CPU (interpreter) and GPU: exactness -----------------------------------------------------------------

def test_a_batched_step_equals_each_sequence_alone():
    """Three sequences at different positions, different lengths per step, each rolled back by its own keep (the
    next step reading the kept checkpoint slots): logits, ids, captured rows and states bit-identical to each
    sequence stepped alone. (The interpreter is slow: checkpoint mode here, every mode on the GPU.)"""
    device = "cuda" if CUDA else "cpu"
    batched, alone = pair(CHECKPOINT, preset="duo", rows=2, step_rows=8, sequences=3, context=24,
                          dtype=torch.float32, device=device)
    run_schedule(batched, alone, [(2, 1, 2), (1, 2, 2)], prompts=(1, 2, 3), keeps=[(1, 0, 2), (0, 2, 1)])


@pytest.mark.parametrize("mode", [CHECKPOINT, REPLAY_SSM])
def test_rollback_after_a_batched_step_equals_a_fresh_recompute(mode):
    """Two sequences with the same prompt in one batch: `a` verifies a checkpointed block and rolls back to one
    token, `b` forwards only that token. Their states are then bit-identical, and so are their rows of the
    next batched step."""
    device = "cuda" if CUDA else "cpu"
    batched, _ = pair(mode, preset="duo", rows=2, step_rows=4, sequences=2, context=16,
                      dtype=torch.float32, device=device)
    vocab = batched.config.vocab_size
    a, b = batched.new_state(16), batched.new_state(16)
    prompt, block = ids(1, vocab, 1), ids(2, vocab, 3)
    batched.forward_batch([BatchItem(a, 0, tokens=prompt), BatchItem(b, 0, tokens=prompt)])
    batched.forward_batch([BatchItem(a, 1, tokens=block, checkpoint=True), BatchItem(b, 1, tokens=block[:1])])
    batched.rollback(a, 1)
    out = batched.forward_batch([BatchItem(b, 2, tokens=[5, 6]), BatchItem(a, 2, tokens=[5, 6])])
    outputs_equal(out[0], out[1])
    assert_same_state(state_bits(batched, a), state_bits(batched, b))


def _two_verified_two_forwarded(*, block: int, seed: int, forwarded: tuple[int, int]):
    """A replay-ssm shard of four sequences after one batched step: `a` and `b` verified a block of `block`
    tokens (pending), `c` and `d` forwarded only its first `forwarded` tokens."""
    device = "cuda" if CUDA else "cpu"
    batched, _ = pair(REPLAY_SSM, preset="duo", rows=4, step_rows=12, sequences=4, context=8,
                      dtype=torch.float32, device=device)
    a, b, c, d = (batched.new_state(8) for _ in range(4))
    tokens = ids(block, batched.config.vocab_size, seed)
    batched.forward_batch([BatchItem(a, 0, tokens=tokens, checkpoint=True),
                            BatchItem(b, 0, tokens=tokens, checkpoint=True),
                            BatchItem(c, 0, tokens=tokens[:forwarded[0]]), BatchItem(d, 0, tokens=tokens[:forwarded[1]])])
    return batched, (a, b, c, d)


def test_replay_ssm_rollbacks_of_one_batch_back_to_back():
    """One batched replay-ssm step: `a` and `b` verify the same block, `c` and `d` forward only its first one and
    two tokens. `a` and `b` are then rolled back to one and two tokens one after the other, nothing read in between
    (as `rollback_batch` does): their states equal `c`'s and `d`'s. On the GPU the rollbacks queue behind a busy
    stream, so a rollback whose control another one rewrites before its queued copy ran is caught (each used to
    go through one shared pinned buffer: `a` was never rolled back)."""
    batched, (a, b, c, d) = _two_verified_two_forwarded(block=3, seed=7, forwarded=(1, 2))
    if CUDA:
        torch.cuda._sleep(200_000_000)  # the stream busy (~0.1 s): both rollbacks below are queued, neither has run
    batched.rollback(a, 1)
    batched.rollback(b, 2)
    assert_same_state(state_bits(batched, a), state_bits(batched, c))
    assert_same_state(state_bits(batched, b), state_bits(batched, d))


def test_replay_ssm_re_runs_ride_in_the_next_batched_step():
    """replay-ssm rollbacks leave their re-runs to the sequence's next step (each segment's kept tokens, ahead of
    each GDN layer): `a` and `b` verify a block and keep one and three tokens, `c` and `d` forward only those; in
    the next batched step, which holds all four (a re-run in the first and third segments, none in the others),
    `a`'s rows equal `c`'s and `b`'s equal `d`'s, and so do their states after it; nothing is pending after."""
    batched, (a, b, c, d) = _two_verified_two_forwarded(block=4, seed=9, forwarded=(1, 3))
    batched.rollback(a, 1)
    batched.rollback(b, 3)
    assert batched.pools.replay[a.slot] == 1 and batched.pools.replay[b.slot] == 3
    out = batched.forward_batch([BatchItem(a, 1, tokens=[5, 6], checkpoint=True), BatchItem(c, 1, tokens=[5, 6]),
                                  BatchItem(b, 3, tokens=[7]), BatchItem(d, 3, tokens=[7])])
    outputs_equal(out[0], out[1])
    outputs_equal(out[2], out[3])
    assert not any(batched.pools.replay)
    batched.rollback(a, 2)  # keeps all of its step: nothing to re-run
    assert_same_state(state_bits(batched, a), state_bits(batched, c))
    assert_same_state(state_bits(batched, b), state_bits(batched, d))


def test_the_scheduler_over_a_batched_step_speculates_each_stream_as_greedy():
    """The scheduler over one FastShard with a shared step (replay-ssm): three streams with the oracle drafter (each
    drafting its own greedy continuation, with misses so that every stream rolls back) give each stream's greedy
    output (the same streams without drafts; each equals itself alone: the bit-for-bit tests above). On the GPU
    (bf16, graphs) this failed from 4 streams on."""
    from coordinator.drafting.drafters import OracleDrafter
    from coordinator.scheduler.requests import Request
    from coordinator.scheduler.scheduler import decode_all
    from shardd.local import LocalTarget

    device = "cuda" if CUDA else "cpu"
    batched, _ = pair(REPLAY_SSM, preset="duo", rows=4, step_rows=8, sequences=3, context=16,
                      dtype=torch.float32, device=device)
    target = LocalTarget.from_shards([batched], 16)
    prompts = [ids(2, batched.config.vocab_size, 40 + i) for i in range(3)]
    greedy = [r.tokens for r in decode_all(target, [Request(p, 4) for p in prompts], rollback=REPLAY_SSM)]
    drafters = [OracleDrafter.with_mean_commit(g, len(p), block_size=4, mean_commit=2) for p, g in zip(prompts, greedy)]
    results = decode_all(target, [Request(p, 4, drafter=d, block_size=4) for p, d in zip(prompts, drafters)],
                         rollback=REPLAY_SSM)
    assert [r.tokens for r in results] == greedy
    assert all(r.rollbacks_fast > 0 for r in results)


def test_a_fast_daemon_answers_a_batch_of_a_prompt_beside_a_block(tmp_path):
    """A batched FORWARD to a fast-engine daemon that owns the embedding and not the head (replay-ssm): an item longer
    than the step (a prompt: the prefill path, its rows on the device on a GPU) beside a short one (the step's rows,
    in host memory) — both answered in one reply, each item's hidden rows those of the same request alone. (On the
    GPU the daemon joined the two items' rows across devices and failed the batch.)"""
    from protocol import Forward, ForwardBatch, MessageType, encode_request, split_batch_reply
    from tests.support.daemons import start_daemons, stop_all

    args = ["--layers", "0:2", "--engine", "fast", "--device", "cuda:0" if CUDA else "cpu",
            "--rollback", REPLAY_SSM, "--max-verify-tokens", "4", "--step-rows", "4", "--max-context", "16",
            "--max-sequences", "4"]
    daemons = start_daemons({"shard0": (f"ipc://{tmp_path}/shard0.sock", args)}, tmp_path)
    try:
        client = daemons["shard0"].client()
        for seq in (1, 2, 3, 4):
            client.call(MessageType.OPEN, seq=seq)
        prompt, block = list(range(5, 14)), [3, 4]  # 9 tokens (past the 4-row step), 2 tokens
        sent = ForwardBatch(id=client.next_id(), items=(Forward(id=0, seq=1, pos=0, tokens=prompt),
                                                        Forward(id=0, seq=2, pos=0, tokens=block)))
        reply = client.exchange(encode_request(sent, validate=False))
        assert reply.ok, (reply.error_code, reply.error_message)
        parts = split_batch_reply(reply, sent)
        for part, seq, tokens in ((parts[0], 3, prompt), (parts[1], 4, block)):
            single = client.exchange(encode_request(Forward(id=client.next_id(), seq=seq, pos=0, tokens=tokens)))
            assert part.ok and single.ok, (part.error_message, single.error_message)
            assert bytes(part.tensors["hidden"].data) == bytes(single.tensors["hidden"].data)
    finally:
        stop_all(daemons.values())


def test_a_refused_item_changes_nothing_and_the_others_run():
    """A batch with a stale position and an out-of-vocabulary token: those items get their ModelError and their
    sequences are unchanged (length, state, pending window); the others' outputs equal them alone. A second
    item of a sequence already in the batch runs after the first (a later step). A slot released and opened
    again starts empty, in a batch with others."""
    device = "cuda" if CUDA else "cpu"
    batched, alone = pair(CHECKPOINT, preset="duo", rows=2, step_rows=4, sequences=3, context=16,
                          dtype=torch.float32, device=device)
    vocab = batched.config.vocab_size
    a, b, c = (batched.new_state(16) for _ in range(3))
    fa = alone.new_state(16)
    batched.forward_batch([BatchItem(a, 0, tokens=[1, 2]), BatchItem(b, 0, tokens=[3], checkpoint=True),
                            BatchItem(c, 0, tokens=[4])])
    alone.forward(fa, 0, tokens=[1, 2])
    before, pending = state_bits(batched, b), b.pending  # b has a pending window
    results = batched.forward_batch([
        BatchItem(a, 2, tokens=[5], checkpoint=True),
        BatchItem(b, 0, tokens=[6]),                 # stale position
        BatchItem(c, 1, tokens=[vocab + 3]),         # outside the vocabulary
        BatchItem(c, 1, tokens=[7]),                 # the same sequence again, valid: it runs
        BatchItem(a, 3, tokens=[8]),                 # a's second item, after its first
    ])
    assert isinstance(results[1], PositionMismatch) and isinstance(results[2], BadInput)
    assert_same_state(state_bits(batched, b), before)
    assert b.pending == pending is not None
    assert c.length == 2 and results[3].ids.shape == (1,)
    outputs_equal(results[0], alone.forward(fa, 2, tokens=[5], checkpoint=True))
    outputs_equal(results[4], alone.forward(fa, 3, tokens=[8]))
    with pytest.raises(ModelError):
        batched.forward(b, 5, tokens=[1])  # the one-sequence forward raises the item's error
    # slot reuse: close b, open another; it gets b's slot, starts empty, and runs with the others
    slot = b.slot
    batched.release_state(b)
    d = batched.new_state(16)
    fd = alone.new_state(16)
    assert d.slot == slot and d.length == 0 and not d.gdn.recurrent.any()
    results = batched.forward_batch([BatchItem(a, 4, tokens=[2]), BatchItem(d, 0, tokens=[3, 1])])
    outputs_equal(results[1], alone.forward(fd, 0, tokens=[3, 1]))


def test_step_rows_must_hold_one_sequence():
    device = "cuda" if CUDA else "cpu"
    c = config("duo")
    model = ShardModel(c, synthetic_weights(c, 0, 2, seed=0, dtype=torch.float32, device=device), 0, 2,
                       dtype=torch.float32, device=device, storage=rb.RollbackStorage(CHECKPOINT, 4))
    with pytest.raises(ValueError, match="step_rows=2 must hold one sequence's step of 4 rows"):
        FastShard(model, max_sequences=2, max_context=16, step_rows=2)


@pytest.mark.parametrize("args, message", [
    (["--engine", "reference", "--step-rows", "8"], "--step-rows sizes the fast engine's step; the reference engine has none"),
    (["--engine", "fast", "--max-verify-tokens", "8", "--step-rows", "4"],
     "--step-rows 4 must hold one sequence's step of 8 rows"),
    (["--prefill-rows", "-1"], "Invalid value for '--prefill-rows'"),
])
def test_serve_refuses_step_or_prefill_rows_it_cannot_use(args, message):
    from click.testing import CliRunner

    from shardd.cli import main

    device = "cuda:0" if CUDA else "cpu"  # the CPU runs the fast engine only under TRITON_INTERPRET=1 (conftest.py)
    result = CliRunner().invoke(main, ["serve", "--synthetic", "tiny", "--device", device, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


# ---- GPU: bf16, CUDA graphs, the 27B-like shape -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("mode", [CHECKPOINT, REPLAY_SSM])
@pytest.mark.parametrize("shard_range", ["head", "middle"])
def test_bf16_batched_rows_are_bit_identical_on_the_gpu(mode, shard_range):
    """bf16, graphs on, the 27B shape's layers, a 64-row step holding eight sequences of blocks up to 16: every
    item's rows bit-identical to its sequence alone, every state after every rollback too. `head`: the shard
    with the embedding and the head (tokens in, logits out); `middle`: layers 2:6 (hidden in and out)."""
    c = config("27b-like")
    begin, end = (0, c.num_layers) if shard_range == "head" else (2, 6)
    batched, alone = pair(mode, preset="27b-like", rows=16, step_rows=64, sequences=8, context=1100,
                          dtype=torch.bfloat16, device="cuda", begin=begin, end=end)
    prompts = (1, 16, 5, 9, 12, 3, 7, 16)
    schedule = [(16, 1, 9, 4, 16, 2, 16, 1), (3, 16, 1, 16, 5, 16, 8, 2), (1, 1, 1, 1, 1, 1, 1, 1)]
    keeps = [(7, 0, 9, 1, 16, 2, 0, 1), (3, 15, 0, 16, 2, 8, 8, 1), (1, 0, 1, 0, 1, 0, 1, 0)]
    run_schedule(batched, alone, schedule, prompts=prompts, keeps=keeps)


@pytest.mark.gpu
def test_bf16_batched_step_past_one_attention_chunk():
    """Sequences past the attention kernel's 1024-key chunk (two splits) next to short ones: still bit-identical."""
    batched, alone = pair(CHECKPOINT, preset="27b-like", rows=16, step_rows=32, sequences=3, context=1400,
                          dtype=torch.bfloat16, device="cuda")
    vocab = batched.config.vocab_size
    states, solo = [batched.new_state(1400) for _ in range(3)], [alone.new_state(1400) for _ in range(3)]
    for i, n in enumerate((1030, 5, 1019)):  # the prompt through the prefill path, the same on both
        prompt = ids(n, vocab, i)
        batched.forward_batch([BatchItem(states[i], 0, tokens=prompt)])
        alone.forward(solo[i], 0, tokens=prompt)
    for step in range(3):
        items = [BatchItem(s, s.length, tokens=ids(16 - 5 * i, vocab, 50 + step * 3 + i), checkpoint=True)
                 for i, s in enumerate(states)]
        results = batched.forward_batch(items)
        for i, it in enumerate(items):
            outputs_equal(results[i], alone.forward(solo[i], it.pos, tokens=it.tokens, checkpoint=True))
            batched.rollback(states[i], step + i)
            alone.rollback(solo[i], step + i)
            assert_same_state(state_bits(batched, states[i]), state_bits(alone, solo[i]))


@pytest.mark.gpu
def test_bf16_failing_item_and_slot_reuse_on_the_gpu():
    """A refused item leaves the others' outputs bit-identical to them alone; sequences leave and join (a new one
    takes the freed slot) and every step stays bit-identical to each sequence alone."""
    batched, alone = pair(CHECKPOINT, preset="27b-like", rows=16, step_rows=64, sequences=4, context=256,
                          dtype=torch.bfloat16, device="cuda")
    vocab = batched.config.vocab_size
    states = [batched.new_state(256) for _ in range(4)]
    solo = [alone.new_state(256) for _ in range(4)]
    for i, s in enumerate(states):
        batched.forward_batch([BatchItem(s, 0, tokens=ids(3 + i, vocab, i))])
        alone.forward(solo[i], 0, tokens=ids(3 + i, vocab, i))
    items = [BatchItem(s, s.length, tokens=ids(4, vocab, 20 + i), checkpoint=True) for i, s in enumerate(states)]
    items[2] = BatchItem(states[2], 0, tokens=[1])  # stale position: refused
    results = batched.forward_batch(items)
    assert isinstance(results[2], PositionMismatch)
    for i in (0, 1, 3):
        outputs_equal(results[i], alone.forward(solo[i], items[i].pos, tokens=items[i].tokens, checkpoint=True))
    for round_ in range(4):  # one leaves, one joins (in the freed slot), then a batched step of all
        leaving = round_ % len(states)
        slot = states[leaving].slot
        batched.release_state(states.pop(leaving))
        alone.release_state(solo.pop(leaving))
        states.append(batched.new_state(256))
        solo.append(alone.new_state(256))
        assert states[-1].slot == slot and states[-1].length == 0
        items = [BatchItem(s, s.length, tokens=ids(1 + (i + round_) % 16, vocab, 100 * round_ + i))
                 for i, s in enumerate(states)]
        results = batched.forward_batch(items)
        for i, it in enumerate(items):
            outputs_equal(results[i], alone.forward(solo[i], it.pos, tokens=it.tokens))


def test_the_default_step_rows_are_what_a_daemon_can_fill():
    from shardd.engine.select import DEFAULT_STEP_ROWS, step_rows_for

    assert step_rows_for("fast", None, 16) == DEFAULT_STEP_ROWS
    assert step_rows_for("fast", None, 16, max_sequences=8) == DEFAULT_STEP_ROWS
    assert step_rows_for("fast", None, 16, max_sequences=1) == 16  # a second sequence's rows could never be filled
    assert step_rows_for("fast", None, 16, max_sequences=2) == 32
    assert step_rows_for("fast", None, 128, max_sequences=1) == 128
    assert step_rows_for("fast", None, 0, max_sequences=1) == 16  # no rollback storage: the fast engine's 16 rows
    # FP8 weights: one sequence's step (the FP8 GEMM's time grows with rows); an explicit R is the operator's
    assert step_rows_for("fast", None, 16, max_sequences=8, fp8=True) == 16
    assert step_rows_for("fast", 64, 16, max_sequences=1, fp8=True) == 64
    assert step_rows_for("reference", None, 16, max_sequences=1, fp8=True) is None


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 5), st.sampled_from(["next", "skip", "other", "strided"])), min_size=1,
                max_size=8))
def test_the_step_s_row_copies_join_only_rows_that_lie_end_to_end(parts):
    """FastShard's RowSpans (one copy for consecutive items whose rows are consecutive rows of one tensor, a
    batch's hidden frame) puts in the step's buffer exactly what one copy per item puts there: rows of the same
    frame that skip rows, rows of another tensor, a non-contiguous view and a different dtype break a span."""
    from shardd.engine.fast.shard import RowSpans
    from protocol.tensors import WireTensor, row_slice

    width = 6
    frame = WireTensor.from_torch(torch.randn(64, width))
    frame = WireTensor(frame.dtype, frame.shape, bytes(frame.data))  # a received frame: read-only bytes
    other = torch.randn(32, width, dtype=torch.float64)
    joined, expected = RowSpans(torch.zeros(48, width, dtype=torch.bfloat16)), []
    at = row = 0
    for n, how in parts:
        if how == "skip":
            row += 1
        if how == "other":
            rows = other[row:row + n]
        elif how == "strided":
            rows = torch.randn(width, n).t()
        else:
            rows = row_slice(frame, row, n).to_torch()
            row += n
        joined.add(at, rows)
        expected.append(rows)
        at += n
    joined.flush()
    reference = torch.zeros(48, width, dtype=torch.bfloat16)
    reference[:at] = torch.cat([rows.to(torch.bfloat16) for rows in expected])
    assert torch.equal(joined.dest, reference)


def test_row_slices_view_their_frame_s_one_tensor():
    """A row slice's tensor is a view of its frame's (made once), equal to the same bytes made alone."""
    from protocol.tensors import WireTensor, row_slice

    frame = WireTensor.from_torch(torch.arange(24, dtype=torch.float32).view(6, 4))
    part = row_slice(row_slice(frame, 1, 4), 2, 2)
    assert part == WireTensor("float32", (2, 4), torch.arange(12, 20, dtype=torch.float32).numpy().tobytes())
    assert torch.equal(part.to_torch(), torch.arange(12, 20, dtype=torch.float32).view(2, 4))
    assert part.to_torch()._base is frame.to_torch()._base
    assert torch.equal(part.to_torch("cpu"), part.to_torch())
