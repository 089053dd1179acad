"""The GPU step (shardd/engine/fast, shardd/engine/kernels) against the reference model code.

On a CUDA machine this runs the real Triton kernels and CUDA graphs, in float32 and bf16. Without
one it runs the same kernels under Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) on
the CPU, in float32, on the tiny preset cut to 3 layers: slow, so the schedules are short.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the fast path's kernels need triton")

from common.model_config import config_from_dict  # noqa: E402
from common.presets import PRESETS, preset_config  # noqa: E402
from coordinator.decoding import greedy_decode, speculative_decode  # noqa: E402
from coordinator.drafting.drafters import OracleDrafter  # noqa: E402
from shardd.local import LocalTarget  # noqa: E402
from protocol.layout import CHECKPOINT, REPLAY_SSM  # noqa: E402
from shardd.engine.fast.shard import FastShard  # noqa: E402
from shardd.engine.reference import rollback as rb  # noqa: E402
from shardd.engine.reference.shard import ShardModel  # noqa: E402
from shardd.synthetic.model import synthetic_weights  # noqa: E402
from tests.support.steps import reference_chunk_rule  # noqa: E402

CUDA = torch.cuda.is_available()
if CUDA:  # float32 means float32 on both paths (as build_shard sets for a float32 shard)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
DEVICE = "cuda" if CUDA else "cpu"
ROWS = 4
CONTEXT = 96


def model_config(preset: str):
    """`micro` is the tiny preset cut to 3 layers (GDN, GDN, attention): the interpreter runs each op in Python."""
    if preset == "micro":
        return config_from_dict({**PRESETS["tiny"], "num_hidden_layers": 3})
    return preset_config(preset)


def shard(mode: str | None, *, preset="micro", dtype=torch.float32, begin=0, end=None, rows=ROWS) -> ShardModel:
    config = model_config(preset)
    end = config.num_layers if end is None else end
    weights = synthetic_weights(config, begin, end, seed=0, dtype=dtype, device=DEVICE)
    storage = rb.RollbackStorage(mode, rows) if mode else rb.RollbackStorage(None, 0)
    return ShardModel(config, weights, begin, end, dtype=dtype, device=DEVICE, storage=storage)


def fast(mode: str | None, **kwargs) -> FastShard:
    return FastShard(shard(mode, **kwargs), max_sequences=2, max_context=CONTEXT)


def ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mode", [CHECKPOINT, REPLAY_SSM])
def test_step_and_rollback_match_the_reference(mode):
    """float32: logits of every step, and the GDN state after every rollback, agree with the reference model
    code within rounding; the prefill (longer than T) is the reference path itself."""
    reference, step = shard(mode), fast(mode)
    step.prefill_kernels = False  # the step alone: the GPU prefill has a test of its own
    vocab = reference.config.vocab_size
    ref_state, fast_state = reference.new_state(CONTEXT), step.new_state(CONTEXT)
    prompt = ids(9, vocab, 0)
    a = reference.forward(ref_state, 0, tokens=prompt)
    b = step.forward(fast_state, 0, tokens=prompt)
    assert torch.equal(a.logits.cpu(), b.logits.cpu())
    pos = len(prompt)
    for keep in (1, ROWS - 1, 0):
        block = ids(ROWS, vocab, pos)
        a = reference.forward(ref_state, pos, tokens=block, checkpoint=True)
        b = step.forward(fast_state, pos, tokens=block, checkpoint=True)
        torch.testing.assert_close(b.logits.cpu(), a.logits.cpu(), rtol=1e-4, atol=1e-4)
        assert b.ids.tolist() == a.ids.tolist()
        reference.rollback(ref_state, keep)
        step.rollback(fast_state, keep)
        assert fast_state.length == ref_state.length == pos + keep
        step.settle(fast_state)  # a checkpoint rollback only points the next step at the kept slot
        torch.testing.assert_close(fast_state.gdn.recurrent, ref_state.gdn.recurrent, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast_state.gdn.conv, ref_state.gdn.conv, rtol=1e-4, atol=1e-5)
        pos += keep
        a = reference.forward(ref_state, pos, tokens=[7])
        b = step.forward(fast_state, pos, tokens=[7])
        torch.testing.assert_close(b.logits.cpu(), a.logits.cpu(), rtol=1e-4, atol=1e-4)
        pos += 1


@pytest.mark.parametrize("launch", ["short", "long"])
def test_attention_over_several_key_chunks_and_the_long_launch_match_the_reference(monkeypatch, launch):
    """float32, key chunks of 64 positions (the shipped CHUNK is longer than any CPU test's context): steps crossing
    a chunk's end and steps over two chunks agree with the reference; "long" forces the long-context launch
    (LONG_LAUNCH, taken from --max-context 8192 on) at this context."""
    from shardd.engine.kernels import attention

    monkeypatch.setattr(attention, "CHUNK", 64)  # a multiple of both launches' key blocks
    if launch == "long":
        monkeypatch.setattr(attention, "LONG_CONTEXT", CONTEXT)
    assert attention.launch(CONTEXT) == launch
    reference, step = shard(None), fast(None)  # the split sizes are fixed when the step's buffers are made
    step.prefill_kernels = False
    vocab = reference.config.vocab_size
    ref_state, fast_state = reference.new_state(CONTEXT), step.new_state(CONTEXT)
    prompt = ids(57, vocab, 1)
    reference.forward(ref_state, 0, tokens=prompt)
    step.forward(fast_state, 0, tokens=prompt)
    pos = len(prompt)
    for _ in range(3):  # 57 .. 69: across the first chunk's end
        block = ids(ROWS, vocab, pos)
        a = reference.forward(ref_state, pos, tokens=block)
        b = step.forward(fast_state, pos, tokens=block)
        torch.testing.assert_close(b.logits.cpu(), a.logits.cpu(), rtol=1e-4, atol=1e-4)
        assert b.ids.tolist() == a.ids.tolist()
        pos += ROWS
    prompt = ids(80, vocab, 2)  # a second sequence, wholly in two chunks
    reference.release_state(ref_state)
    step.release_state(fast_state)
    ref_state, fast_state = reference.new_state(CONTEXT), step.new_state(CONTEXT)
    reference.forward(ref_state, 0, tokens=prompt)
    step.forward(fast_state, 0, tokens=prompt)
    block = ids(ROWS, vocab, 3)
    a, b = reference.forward(ref_state, 80, tokens=block), step.forward(fast_state, 80, tokens=block)
    torch.testing.assert_close(b.logits.cpu(), a.logits.cpu(), rtol=1e-4, atol=1e-4)


def test_checkpoint_and_replay_ssm_states_are_bit_identical():
    """replay-ssm re-runs the step's own recurrence kernel over the kept tokens: the state it leaves is
    bit for bit the checkpoint mode's saved slot."""
    shards = {mode: fast(mode) for mode in (CHECKPOINT, REPLAY_SSM)}
    vocab = shards[CHECKPOINT].config.vocab_size
    states = {mode: s.new_state(CONTEXT) for mode, s in shards.items()}
    pos = 0
    for keep in (2, 0, 3, 1, ROWS):  # either side of the conv window (3 rows) and at it
        block = ids(ROWS, vocab, 100 + pos)
        for mode, s in shards.items():
            s.forward(states[mode], pos, tokens=block, checkpoint=True)
            s.rollback(states[mode], keep)
            s.settle(states[mode])
        a, b = states[CHECKPOINT], states[REPLAY_SSM]
        assert torch.equal(a.gdn.recurrent, b.gdn.recurrent)
        assert torch.equal(a.gdn.conv, b.gdn.conv)
        pos += keep


def _rollback_against_the_copy(mode: str, *, preset: str, rows: int, dtype) -> None:
    """Steps of `rows` checkpointed tokens, each rolled back to keep 0 .. rows in turn. Shard `copied` rolls back
    by copying the kept token's checkpoint slot (the rollback as it was: settled at once); shard `served` as the
    daemon does: in checkpoint mode the next step reads the kept slot in place (and overwrites it with its own
    checkpoints), in replay-ssm mode the next step re-runs the kept tokens ahead of each GDN layer (on a side
    stream on the GPU). Every step's logits and the state after it are bit-identical."""
    context = 2 * rows + rows * (rows + 1) // 2 + 8  # every step's kept tokens stay
    copied = FastShard(shard(CHECKPOINT, preset=preset, rows=rows, dtype=dtype), max_sequences=1, max_context=context)
    served = copied.sharing_weights(rb.RollbackStorage(mode, rows))
    vocab = copied.config.vocab_size
    a, b = copied.new_state(context), served.new_state(context)
    prompt = ids(rows + 3, vocab, 1)
    copied.forward(a, 0, tokens=prompt)
    served.forward(b, 0, tokens=prompt)
    pos = len(prompt)
    for keep in [*range(rows + 1), 0]:
        block = ids(rows, vocab, 1000 + keep)
        out_a = copied.forward(a, pos, tokens=block, checkpoint=True)
        out_b = served.forward(b, pos, tokens=block, checkpoint=True)
        assert torch.equal(out_a.logits.cpu(), out_b.logits.cpu()), f"step after keep {keep - 1}"
        assert torch.equal(a.gdn.recurrent, b.gdn.recurrent) and torch.equal(a.gdn.conv, b.gdn.conv)
        copied.rollback(a, keep)
        copied.settle(a)
        served.rollback(b, keep)
        pos += keep
    last = served.forward(b, pos, tokens=[3])  # a plain step after a rollback reads the kept slot too
    assert torch.equal(copied.forward(a, pos, tokens=[3]).logits.cpu(), last.logits.cpu())
    served.settle(b)
    assert torch.equal(a.gdn.recurrent, b.gdn.recurrent) and torch.equal(a.gdn.conv, b.gdn.conv)


@pytest.mark.parametrize("mode", [CHECKPOINT, REPLAY_SSM])
def test_rollback_off_the_critical_path_is_bit_identical_to_the_copy(mode):
    # checkpoint: the next step reads the kept slot; replay-ssm: the next step re-runs the kept tokens ahead of
    # each GDN layer (the same kernel and launch shape as the re-run at once)
    _rollback_against_the_copy(mode, preset="micro", rows=ROWS, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [CHECKPOINT, REPLAY_SSM])
def test_rollback_off_the_critical_path_is_bit_identical_on_the_gpu(mode):
    """The real kernels in CUDA graphs, bf16, a 16-row step: after every keep from 0 to 16."""
    _rollback_against_the_copy(mode, preset="tiny", rows=16, dtype=torch.bfloat16)


def test_padding_rows_change_nothing():
    """A step of n < T real rows leaves exactly the state of the same n rows in a step of their own."""
    one, other = fast(CHECKPOINT), fast(CHECKPOINT)
    vocab = one.config.vocab_size
    a, b = one.new_state(CONTEXT), other.new_state(CONTEXT)
    block = ids(ROWS, vocab, 5)
    out_a = one.forward(a, 0, tokens=block[:2])
    out_b = [other.forward(b, 0, tokens=block[:1]), other.forward(b, 1, tokens=block[1:2])]
    assert out_a.ids.tolist() == [out_b[0].ids.item(), out_b[1].ids.item()]
    assert torch.equal(a.gdn.recurrent, b.gdn.recurrent) and torch.equal(a.gdn.conv, b.gdn.conv)
    layer = one.attention_layers[0]
    assert torch.equal(a.kv[layer].key[:, :2], b.kv[layer].key[:, :2])


def test_a_slot_is_reused_after_release_and_starts_empty():
    step = fast(CHECKPOINT)
    state = step.new_state(CONTEXT)
    step.forward(state, 0, tokens=[1, 2, 3])
    slot = state.slot
    step.release_state(state)
    again = step.new_state(CONTEXT)
    assert again.slot == slot and again.length == 0
    assert not again.gdn.recurrent.any()


def _speculative_outputs(dtype, preset, rows, prompt_len, new_tokens, split=None, context=CONTEXT,
                         modes=(CHECKPOINT, REPLAY_SSM, "replay")):
    config = model_config(preset)
    shards = {}
    for mode in (CHECKPOINT, REPLAY_SSM):
        ranges = [(0, config.num_layers)] if split is None else [(0, split), (split, config.num_layers)]
        shards[mode] = [FastShard(shard(mode, preset=preset, dtype=dtype, begin=b, end=e, rows=rows),
                                  max_sequences=2, max_context=context) for b, e in ranges]
    prompt = ids(prompt_len, config.vocab_size, 1)
    greedy = greedy_decode(LocalTarget.from_shards(shards[CHECKPOINT], context), 1, prompt, new_tokens).tokens
    outputs = {"greedy": greedy}
    for mode in modes:
        target = LocalTarget.from_shards(shards[CHECKPOINT if mode == "replay" else mode], context)
        drafter = OracleDrafter.with_mean_commit(greedy, len(prompt), block_size=rows, mean_commit=rows / 2)
        result = speculative_decode(target, 2, prompt, drafter, block_size=rows, rollback=mode, max_new_tokens=new_tokens)
        outputs[mode] = result.tokens
    return outputs


def test_speculative_output_equals_greedy_through_the_step():
    # the interpreter is slow: two modes (replay re-forwards through the same step), a short schedule
    outputs = _speculative_outputs(torch.float32, "micro", ROWS, 6, 6, modes=(CHECKPOINT, REPLAY_SSM))
    assert all(tokens == outputs["greedy"] for tokens in outputs.values()), outputs


@pytest.mark.gpu
@pytest.mark.parametrize("split", [None, 4])
def test_bf16_speculative_output_is_byte_identical_to_greedy(split):
    """bf16 on the GPU, graphs on: every mode gives exactly the greedy tokens (one shard and two)."""
    outputs = _speculative_outputs(torch.bfloat16, "small", 16, 40, 64, split=split, context=256)
    assert all(tokens == outputs["greedy"] for tokens in outputs.values()), outputs


@pytest.mark.gpu
def test_graph_replay_equals_the_eager_step():
    graphs, eager = fast(CHECKPOINT, preset="small", dtype=torch.bfloat16), fast(CHECKPOINT, preset="small", dtype=torch.bfloat16)
    eager.runner.use_graphs = False
    vocab = graphs.config.vocab_size
    a, b = graphs.new_state(CONTEXT), eager.new_state(CONTEXT)
    for pos in range(0, 3 * ROWS, ROWS):
        block = ids(ROWS, vocab, pos)
        out_a = graphs.forward(a, pos, tokens=block)
        out_b = eager.forward(b, pos, tokens=block)
        assert torch.equal(out_a.logits, out_b.logits), pos  # the same kernels replayed: the same bits


@pytest.mark.gpu
def test_gpu_prefill_matches_the_reference():
    """Inputs longer than T take the fla + flash-attention prefill; state and logits agree with the reference."""
    reference, step = shard(CHECKPOINT, preset="small"), fast(CHECKPOINT, preset="small")
    assert step.prefill_kernels
    vocab = reference.config.vocab_size
    a_state, b_state = reference.new_state(CONTEXT), step.new_state(CONTEXT)
    relative = lambda x, ref: ((x.float() - ref.float()).norm() / ref.float().norm()).item()  # noqa: E731
    for pos, n in ((0, 40), (40, 9)):
        block = ids(n, vocab, pos)
        a = reference.forward(a_state, pos, tokens=block)
        b = step.forward(b_state, pos, tokens=block)
        assert relative(b.logits, a.logits) < 1e-2  # fla's chunk kernel multiplies in tf32
        assert b.ids.tolist() == a.ids.tolist()
    assert relative(b_state.gdn.recurrent, a_state.gdn.recurrent) < 1e-2
    assert relative(b_state.gdn.conv, a_state.gdn.conv) < 1e-2  # later layers' inputs carry the tf32 rounding


@pytest.mark.gpu
def test_the_prefill_calls_fla_s_forward_with_the_public_function_s_bits():
    """`prefill.fla_rule()` (fla's forward functions without the public wrapper's layers) gives the public
    `chunk_gated_delta_rule`'s bits: a prefill in two calls through each, logits and every layer's state equal."""
    from shardd.engine.fast import prefill
    from shardd.engine.fast.graph import PrefillGraphs

    step = fast(CHECKPOINT, preset="small")
    states = [step.new_state(CONTEXT), step.new_state(CONTEXT)]
    vocab = step.model.config.vocab_size
    for pos, n in ((0, 70), (70, 26)):  # within CONTEXT (96)
        block = ids(n, vocab, pos)
        x = torch.nn.functional.embedding(torch.tensor(block, device=DEVICE), step.model.embed_tokens)
        outs = []
        for state, rule in zip(states, (prefill.fla_rule(), prefill.fla_rule(direct=False))):
            step.settle(state)
            outs.append(prefill.prefill(step.model, step.layers, state, pos, x, (), chunk_rule=rule))
            state.length = pos + n
        assert torch.equal(outs[0].logits, outs[1].logits)
    for layer in step.model.gdn_layers:
        assert torch.equal(states[0].gdn[layer].recurrent, states[1].gdn[layer].recurrent)
        assert torch.equal(states[0].gdn[layer].conv, states[1].gdn[layer].conv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_prefill_graphs_replay_the_eager_prefill_s_bits(dtype):
    """PrefillGraphs on the GPU (fla's rule, real CUDA graphs): a prompt in pieces of 32 rows gives the eager
    pieces' bits (logits, captures, every layer's state, the KV rows), the first call's check keeps the graphs,
    and a second sequence in another slot at another position replays them with the same bits."""
    from shardd.engine.fast import prefill
    from shardd.engine.fast.graph import PrefillGraphs

    model = shard(CHECKPOINT, preset="small", dtype=dtype)
    step = FastShard(model, max_sequences=2, max_context=CONTEXT, prefill_rows=32)
    eager = FastShard(model, max_sequences=2, max_context=CONTEXT, prefill_rows=0, layers=step.layers)
    assert step.prefill_graphs is not None and step.prefill_graphs.use_graphs
    vocab, capture = model.config.vocab_size, (1, 3)
    for seq, (pos, n) in enumerate(((0, 70), (ROWS, 64))):
        a, b = step.new_state(CONTEXT), eager.new_state(CONTEXT)
        if pos:  # a first block through the step, then the prompt's rest from `pos`
            block = ids(pos, vocab, 50 + seq)
            step.forward(a, 0, tokens=block), eager.forward(b, 0, tokens=block)
        tokens = ids(n, vocab, seq)
        out = step.forward(a, pos, tokens=tokens, capture_layers=capture)
        x = torch.nn.functional.embedding(torch.tensor(tokens, device=DEVICE), model.embed_tokens)
        eager.settle(b)
        pieces = [prefill.prefill(model, eager.layers, b, pos + first, x[first:first + 32], capture)
                  for first in range(0, n, 32)]
        assert torch.equal(out.logits, torch.cat([piece.logits for piece in pieces]))
        for layer in capture:
            assert torch.equal(out.captured[layer], torch.cat([piece.captured[layer] for piece in pieces]))
        assert torch.equal(a.gdn.conv, b.gdn.conv) and torch.equal(a.gdn.recurrent, b.gdn.recurrent)
        for layer, cache in a.kv.items():
            assert torch.equal(cache.key[:, :pos + n], b.kv[layer].key[:, :pos + n])
            assert torch.equal(cache.value[:, :pos + n], b.kv[layer].value[:, :pos + n])
        assert step.prefill_graphs.failures == {}, step.prefill_graphs.failures
        assert step.describe()["prefill_graphs"]["eager"] == []
        assert isinstance(step.prefill_graphs.sets[capture][2][0], torch.cuda.CUDAGraph)


@pytest.mark.parametrize("layers", [None, (0, 4)], ids=["whole", "first-half"])  # 0:4 ends on attention
def test_the_gpu_prefill_path_matches_the_reference_with_the_reference_recurrence(layers):
    """shardd.engine.fast.prefill (the fused norms and residual adds, the SwiGLU kernel, flash attention's SDPA call)
    with fla's chunked rule swapped for the reference's own recurrence: on the CPU (the kernels under Triton's
    interpreter) it agrees with the reference model, logits or hidden rows, captures and state, over two calls."""
    from shardd.engine.fast import prefill
    from shardd.engine.fast.graph import PrefillGraphs

    begin, end = layers or (0, None)
    reference = shard(CHECKPOINT, preset="small", begin=begin, end=end)
    step = fast(CHECKPOINT, preset="small", begin=begin, end=end)
    vocab, capture = reference.config.vocab_size, (1,)
    a_state, b_state = reference.new_state(CONTEXT), step.new_state(CONTEXT)
    relative = lambda x, ref: ((x.float() - ref.float()).norm() / ref.float().norm()).item()  # noqa: E731
    generator = torch.Generator().manual_seed(3)
    for pos, n in ((0, 40), (40, 9)):
        if reference.owns_embedding:
            block = ids(n, vocab, pos)
            a = reference.forward(a_state, pos, tokens=block, capture_layers=capture)
            x = torch.nn.functional.embedding(torch.tensor(block, device=DEVICE), step.model.embed_tokens)
        else:
            x = torch.randn(n, reference.config.hidden_size, generator=generator).to(DEVICE)
            a = reference.forward(a_state, pos, hidden=x, capture_layers=capture)
        step.settle(b_state)
        b = prefill.prefill(step.model, step.layers, b_state, pos, x, capture, chunk_rule=reference_chunk_rule)
        b_state.length = pos + n
        if reference.owns_head:
            assert relative(b.logits, a.logits) < 1e-5 and b.ids.tolist() == a.ids.tolist()
        else:
            assert relative(b.hidden, a.hidden) < 1e-5
        assert relative(b.captured[1], a.captured[1]) < 1e-5
    for layer in reference.gdn_layers:
        assert relative(b_state.gdn[layer].recurrent, a_state.gdn[layer].recurrent) < 1e-5
    assert relative(b_state.gdn.conv, a_state.gdn.conv) < 1e-5


@pytest.mark.parametrize("layers", [None, (0, 2)], ids=["whole", "first-two"])  # 0:2 ends on GDN: hidden out
def test_the_prefill_in_pieces_replays_its_stages_with_the_eager_path_s_bits(layers, monkeypatch):
    """A FastShard's GPU prefill in pieces of `prefill_rows`, each whole piece through PrefillGraphs (here its
    stages replayed by running their ops, the reference recurrence for fla's: everything but the capture, which
    the GPU test and the first-call check cover): bit-identical to the eager prefill of the same pieces, from
    the first call (the check) and after it (the replay through the staged GDN state), on two sequences whose
    slots differ; captures too; and within rounding of the reference model, which prefills in one call."""
    from shardd.engine.fast import prefill
    from shardd.engine.fast.graph import PrefillGraphs

    monkeypatch.setattr(prefill, "fla_rule", lambda direct=True: reference_chunk_rule)
    begin, end = layers or (0, None)
    reference = shard(CHECKPOINT, begin=begin, end=end)
    step = fast(CHECKPOINT, begin=begin, end=end)
    step.prefill_kernels, step.prefill_rows = True, 8
    step.prefill_graphs = PrefillGraphs(step.model, step.layers, step.pools, 8, use_graphs=False)
    eager = FastShard(step.model, max_sequences=2, max_context=CONTEXT, layers=step.layers)
    capture = (1,)
    generator = torch.Generator().manual_seed(5)
    relative = lambda x, ref: ((x.float() - ref.float()).norm() / ref.float().norm()).item()  # noqa: E731
    for prompt in range(2):
        n = 21 if prompt == 0 else 16  # pieces 8 + 8 + 5, then 8 + 8
        states = [step.new_state(CONTEXT), eager.new_state(CONTEXT), reference.new_state(CONTEXT)]
        if reference.owns_embedding:
            tokens = ids(n, reference.config.vocab_size, 10 + prompt)
            inputs = dict(tokens=tokens)
            x = torch.nn.functional.embedding(torch.tensor(tokens, device=DEVICE), step.model.embed_tokens)
        else:
            x = torch.randn(n, reference.config.hidden_size, generator=generator).to(DEVICE)
            inputs = dict(hidden=x)
        out = step.forward(states[0], 0, capture_layers=capture, **inputs)
        pieces = [prefill.prefill(step.model, step.layers, states[1], first, x[first:first + 8], capture,
                                  chunk_rule=reference_chunk_rule) for first in range(0, n, 8)]
        a = reference.forward(states[2], 0, capture_layers=capture, **inputs)
        key = "logits" if reference.owns_head else "hidden"
        assert torch.equal(getattr(out, key), torch.cat([getattr(piece, key) for piece in pieces]))
        assert torch.equal(out.captured[1], torch.cat([piece.captured[1] for piece in pieces]))
        assert relative(getattr(out, key), getattr(a, key)) < 1e-5
        assert torch.equal(states[0].gdn.conv, states[1].gdn.conv)
        assert torch.equal(states[0].gdn.recurrent, states[1].gdn.recurrent)
        for layer, cache in states[0].kv.items():
            assert torch.equal(cache.key[:, :n], states[1].kv[layer].key[:, :n])
        assert states[0].length == n
        assert step.prefill_graphs.failures == {} and step.prefill_graphs.sets[capture] is not None
        assert step.describe() == {"prefill_graphs": {"rows": 8, "replayed": [[1]], "eager": []}}
        for state, owner in zip(states, (step, eager, reference)):
            owner.release_state(state)


def test_daemons_serve_the_fast_engine(tmp_path):
    """`shardd serve --engine fast` over real sockets (two daemons, tcp and ipc): HELLO names the engine and its T,
    and speculative decoding through them gives exactly their greedy output (on the CPU under Triton's
    interpreter: one short schedule)."""
    from coordinator.relay.pipeline import Pipeline
    from tests.support.daemons import free_tcp_endpoint, start_daemons, stop_all

    device = "cuda:0" if CUDA else "cpu"
    common = ["--engine", "fast", "--device", device, "--max-verify-tokens", str(ROWS), "--step-rows", str(ROWS),
              "--max-context", "64", "--max-sequences", "2"]
    specs = {
        "first": (free_tcp_endpoint(), ["--layers", "0:3", *common]),
        "second": (f"ipc://{tmp_path}/second.sock", ["--layers", "3:6", *common]),
    }
    daemons = start_daemons(specs, tmp_path)
    try:
        assert {d.hello["engine"] for d in daemons.values()} == {"fast"}
        assert {d.hello["step_rows"] for d in daemons.values()} == {ROWS}
        # no graphed prefill pieces: --prefill-rows 512 (the default) exceeds --max-context 64, and off a GPU none
        assert {d.hello["prefill_rows"] for d in daemons.values()} == {0}
        with Pipeline.connect([bind for bind, _ in specs.values()], timeout_s=600) as pipeline:
            assert pipeline.prefill_rows is None
            prompt = ids(6, preset_config("tiny").vocab_size, 3)
            greedy = greedy_decode(pipeline, 1, prompt, 6).tokens
            drafter = OracleDrafter.with_mean_commit(greedy, len(prompt), block_size=ROWS, mean_commit=2)
            result = speculative_decode(pipeline, 2, prompt, drafter, block_size=ROWS, rollback=CHECKPOINT,
                                        max_new_tokens=6)
            assert result.tokens == greedy
            assert result.rollbacks_fast > 0, result
            assert result.rollbacks_fallback == 0 and result.recoveries == 0, result
    finally:
        stop_all(daemons.values())


def test_engine_choice_is_checked_before_loading():
    from shardd.engine.select import resolve_engine

    assert resolve_engine("reference", "cpu") == "reference"
    assert resolve_engine("auto", "cpu") == "reference"
    if not CUDA:
        import os

        interpreted = os.environ.pop("TRITON_INTERPRET", None)
        try:
            with pytest.raises(ValueError, match="needs a CUDA device"):
                resolve_engine("fast", "cpu")
        finally:
            if interpreted is not None:
                os.environ["TRITON_INTERPRET"] = interpreted


@pytest.mark.parametrize("n", [1, 2, 3, 37])
def test_the_prefill_s_conv_kernel_is_the_window_concatenation_conv1d_and_silu_it_replaces(n):
    """shardd.engine.kernels.gdn.prefill_conv and the window's advance: the prefill's old PyTorch expression (the window
    and the rows concatenated, a depthwise conv1d, its silu; the window's last rows kept), for prompts shorter
    than the window and longer, rows that are a strided view (the conv part of the in_proj output); float32
    to the last few ulps (the taps' sum order), bf16 within its rounding (the interpreter truncates where the
    GPU rounds to nearest)."""
    from shardd.engine.fast.prefill import advance_window
    from shardd.engine.kernels.gdn import prefill_conv

    rng = torch.Generator().manual_seed(n)
    C, W = 200, 3
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        proj = torch.randn(n, C + 40, generator=rng).to(DEVICE, dtype)
        rows = proj[:, 7:7 + C]
        window = torch.randn(W, C, generator=rng).to(dtype).float().to(DEVICE)
        weight = torch.randn(C, W + 1, generator=rng).to(DEVICE, dtype)
        joined = torch.cat([window.to(dtype), rows])
        expected = torch.nn.functional.silu(torch.nn.functional.conv1d(joined.t()[None], weight[:, None, :],
                                                                       groups=C)[0].t())
        got = prefill_conv(rows, window, weight)
        assert got.dtype == dtype and got.shape == (n, C)
        assert torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
        advance_window(window, rows)
        assert torch.equal(window, joined[n:].float())
