"""The DFlash drafter's fast path (shardd/engine/fast/draft.py) against the reference drafter (shardd/draft/model.py).

On the CPU its Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, conftest.py), float32, tiny
drafters; on a CUDA machine the same checks run with CUDA graphs, in float32 and bf16 (the interpreter's bf16 is
not the GPU's, so bf16 is GPU-only, as in test_fast_path.py).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the fast path's kernels need triton")

from common.presets import preset_config  # noqa: E402
from shardd.draft.model import DFlashDrafter  # noqa: E402
from common.draft_config import synthetic_draft_config  # noqa: E402
from shardd.draft.synthetic import synthetic_draft_weights  # noqa: E402
from shardd.engine.fast.draft import FastDrafter  # noqa: E402
from shardd.synthetic.model import synthetic_weights  # noqa: E402

CUDA = torch.cuda.is_available()
if CUDA:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
DEVICE = "cuda" if CUDA else "cpu"
CONTEXT = 48

# windows shorter than the context the tests add; "windowed" also shorter than its block
DRAFTS = {
    "full": dict(num_layers=2, block_size=8),
    "windowed": dict(num_layers=2, block_size=8, target_layer_ids=[0, 2, 4], sliding_window=5, sliding_layers=(0,)),
    "sliding-then-full": dict(num_layers=3, block_size=6, sliding_window=11, sliding_layers=(0, 1)),
}


def drafter(name: str, dtype=torch.float32, preset: str = "tiny") -> DFlashDrafter:
    target = preset_config(preset)
    weights = synthetic_weights(target, 0, target.num_layers, seed=0, device=DEVICE)
    config = synthetic_draft_config(target, **DRAFTS[name])
    head = weights["embed_tokens.weight"] if target.tie_word_embeddings else weights["lm_head.weight"]
    return DFlashDrafter(config, synthetic_draft_weights(config, 1), target_embed=weights["embed_tokens.weight"],
                         target_lm_head=head, device=DEVICE, dtype=dtype)


def features(model: DFlashDrafter, n: int, seed: int) -> torch.Tensor:
    rows = torch.randn(n, model.config.feature_size, generator=torch.Generator().manual_seed(seed))
    return rows.to(model.dtype)


def schedule(reference: DFlashDrafter, fast: FastDrafter, blocks=None):
    """The same PROPOSE sequence on both: a context longer than one context step, every block size (or `blocks`),
    crops of rolled-back rows with new rows after them. Yields (what, reference (ids, logits), fast (ids, logits))."""
    a, b = reference.new_state(CONTEXT), fast.new_state(CONTEXT)
    for model, state in ((reference, a), (fast, b)):
        model.add_context(state, features(reference, 13, 0))  # two context steps of C = block_size rows
    for block in blocks or range(2, reference.config.block_size + 1):
        yield f"block {block}", reference.propose(a, 40 + block, block), fast.propose(b, 40 + block, block)
    for length, added in ((9, 3), (12, 1)):  # rollback: the rows past `length` belonged to rejected tokens
        for model, state in ((reference, a), (fast, b)):
            model.crop(state, length)
            model.add_context(state, features(reference, added, length))
        block = reference.config.block_size
        yield f"crop to {length} + {added}", reference.propose(a, 7, block), fast.propose(b, 7, block)
    assert a.length == b.length == 13
    fast.release_state(b)


@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_fast_drafter_matches_the_reference(name):
    """float32: every block size the daemon accepts (the windowed drafters: the shortest and the longest) and the
    proposals after crops give the reference's tokens and logits."""
    reference = drafter(name)
    fast = FastDrafter(reference, max_sequences=2, max_context=CONTEXT)
    blocks = None if name == "full" else (2, reference.config.block_size)
    for what, (ref_ids, ref_logits), (ids, logits) in schedule(reference, fast, blocks):
        torch.testing.assert_close(logits.cpu(), ref_logits.cpu(), rtol=1e-4, atol=1e-4, msg=what)
        assert ids.tolist() == ref_ids.tolist(), what


def test_fast_drafter_slots_are_separate_and_reused():
    """Two sequences in two slots draft as they would alone; a released slot serves the next sequence."""
    reference = drafter("full")
    fast = FastDrafter(reference, max_sequences=2, max_context=CONTEXT)
    first, second = fast.new_state(CONTEXT), fast.new_state(CONTEXT)
    with pytest.raises(MemoryError):
        fast.new_state(CONTEXT)
    fast.add_context(first, features(reference, 5, 1))
    fast.add_context(second, features(reference, 6, 2))
    alone = reference.new_state(CONTEXT)
    reference.add_context(alone, features(reference, 5, 1))
    assert fast.propose(first, 3, 8)[0].tolist() == reference.propose(alone, 3, 8)[0].tolist()
    fast.release_state(first)
    third = fast.new_state(CONTEXT)
    assert third.slot == first.slot and third.length == 0
    with pytest.raises(ValueError, match="hold 48 rows"):
        fast.new_state(CONTEXT + 1)


@pytest.mark.parametrize("name", ["full", "windowed"])
def test_batched_steps_draft_each_sequence_as_alone(name):
    """Five sequences' contexts and blocks in shared steps (R = 2 blocks: three steps of blocks, a prompt longer
    than a step split over context steps beside the others' rows, different block sizes) give each sequence the
    bits of its proposal alone and the reference's tokens; a sequence twice in one call takes two steps."""
    reference = drafter(name)
    t = reference.config.block_size
    batched = FastDrafter(reference, max_sequences=5, max_context=CONTEXT, step_rows=2 * t)
    alone = FastDrafter(reference, max_sequences=5, max_context=CONTEXT, step_rows=2 * t)
    sizes = [(3, t), (2 * t + 5, 2), (1, t - 1), (t, 4), (7, t)]  # (context rows, block size)
    states = [batched.new_state(CONTEXT) for _ in sizes]
    batched.add_context_batch([(state, features(reference, n, i)) for i, (state, (n, _)) in enumerate(zip(states, sizes))])
    proposals = batched.propose_batch([(state, 10 + i, block) for i, (state, (_, block)) in enumerate(zip(states, sizes))])
    for i, ((n, block), (ids, logits)) in enumerate(zip(sizes, proposals)):
        state = alone.new_state(CONTEXT)
        alone.add_context(state, features(reference, n, i))
        want_ids, want_logits = alone.propose(state, 10 + i, block)
        assert states[i].length == n and ids.shape == (block - 1,)
        assert torch.equal(logits, want_logits) and torch.equal(ids, want_ids), i
        ref = reference.new_state(CONTEXT)
        reference.add_context(ref, features(reference, n, i))
        ref_ids, ref_logits = reference.propose(ref, 10 + i, block)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert ids.tolist() == ref_ids.tolist()
    twice = batched.propose_batch([(states[0], 10, t), (states[0], 10, t)])
    assert torch.equal(twice[0][0], twice[1][0]) and torch.equal(twice[0][0], proposals[0][0])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_bf16_fast_drafter_matches_the_reference_on_the_gpu(name):
    """bf16 with CUDA graphs: logits within bf16 rounding of the reference and of the eager step, mostly the same
    argmax (the reference's SDPA and the split-KV kernel round differently; random weights leave close margins)."""
    reference = drafter(name, torch.bfloat16, preset="small")
    fast = FastDrafter(reference, max_sequences=2, max_context=CONTEXT)
    eager = FastDrafter(reference, max_sequences=2, max_context=CONTEXT, use_graphs=False)
    agree = same = total = 0
    for (what, (ref_ids, ref_logits), (ids, logits)), (_, _, (eager_ids, eager_logits)) in zip(
        schedule(reference, fast), schedule(reference, eager)
    ):
        error = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        assert error < 3e-2, (what, error)
        torch.testing.assert_close(logits, eager_logits, rtol=2e-2, atol=2e-2, msg=what)
        agree += sum(x == y for x, y in zip(ids.tolist(), ref_ids.tolist()))
        same += sum(x == y for x, y in zip(ids.tolist(), eager_ids.tolist()))
        total += len(ids)
    assert agree >= 0.75 * total and same >= 0.9 * total, (agree, same, total)


@pytest.mark.gpu
def test_float32_fast_drafter_with_graphs_matches_the_reference_on_the_gpu():
    reference = drafter("sliding-then-full", preset="small")
    fast = FastDrafter(reference, max_sequences=2, max_context=CONTEXT)
    assert fast.block_step.use_graphs
    for what, (ref_ids, ref_logits), (ids, logits) in schedule(reference, fast):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-3, atol=1e-3, msg=what)
        assert ids.tolist() == ref_ids.tolist(), what


def test_daemons_serve_the_fast_drafter(tmp_path):
    """`shardd serve --layers none --draft synthetic:2 --engine fast` over a real socket: HELLO says the drafter's
    engine, and PROPOSE (a context in two context steps, then a crop after a rollback) answers the same tokens
    as the reference engine's daemon; a closed sequence's slot serves the next one."""
    from coordinator.relay.client import ShardClient
    from protocol import WireTensor
    from tests.support.daemons import free_tcp_endpoint, start_daemons, stop_all

    device = "cuda:0" if CUDA else "cpu"
    # float32 on every device (auto is bf16 on a GPU): the two engines' tokens are compared exactly
    common = ["--layers", "none", "--draft", "synthetic:2", "--device", device, "--dtype", "float32", "--max-context", "64",
              "--max-sequences", "1"]
    specs = {engine: (free_tcp_endpoint(), [*common, "--engine", engine]) for engine in ("fast", "reference")}
    daemons = start_daemons(specs, tmp_path)
    try:
        answers = {}
        for engine, (endpoint, _) in specs.items():
            with ShardClient(endpoint, timeout_s=600) as client:
                info = client.hello()["drafter"]
                assert info["engine"] == engine
                rows = torch.randn(10, info["feature_size"], generator=torch.Generator().manual_seed(5))
                client.open(1)
                tokens = [client.propose(1, 10, 9, 15, WireTensor.from_torch(rows))["tokens"]]
                reply = client.propose(1, 8, 4, 6, WireTensor.from_torch(rows[5:8]))  # rolled back to 5
                assert reply["context_length"] == 8
                tokens.append(reply["tokens"])
                client.close(1)
                client.open(2)  # max-sequences 1: the freed slot, empty again
                tokens.append(client.propose(2, 10, 9, 15, WireTensor.from_torch(rows))["tokens"])
                client.close(2)
                answers[engine] = tokens
        assert answers["fast"] == answers["reference"]
        assert answers["fast"][0] == answers["fast"][2]
    finally:
        stop_all(daemons.values())


@pytest.mark.parametrize("engine", ["reference", pytest.param("fast", marks=pytest.mark.gpu)])
def test_the_head_shard_proposes_in_the_verify_reply(tmp_path, engine):
    """With the drafter beside the last shard's layers, each verify's CAPTURE reply carries the next block (the
    first shard's captured layers ride along as `carried`), and so does the prompt's: no PROPOSE round trip for the
    whole decode, the same proposals as a drafter in its own daemon, the greedy output. A `propose` the shard
    cannot honour is refused before anything changes. On the GPU, the fast bf16 engine: the prompt's captures
    (from the prefill, on the device) and the carried rows (host) join the head's drafter context as the features
    PROPOSE brings join the drafter daemon's."""
    from coordinator.relay.client import ShardClient, ShardError
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.relay.pipeline import Pipeline
    from protocol import Capture, ErrorCode
    from tests.support.daemons import free_tcp_endpoint, start_daemons, stop_all

    common = ["--max-verify-tokens", "8", "--max-context", "96", "--max-sequences", "2", "--engine", engine,
              *(["--device", "cuda:0", "--dtype", "bfloat16"] if engine == "fast" else [])]
    specs = {"first": (free_tcp_endpoint(), ["--layers", "0:3", *common]),  # synthetic: target layers 1 and 3
             "last": (free_tcp_endpoint(), ["--layers", "3:6", "--draft", "synthetic:2", *common]),
             "own": (free_tcp_endpoint(), ["--layers", "none", "--draft", "synthetic:2", *common])}
    daemons = start_daemons(specs, tmp_path)
    endpoints = {name: endpoint for name, (endpoint, _) in specs.items()}
    try:
        prompt = list(range(5, 25))
        with Pipeline.connect([endpoints["first"], endpoints["last"]]) as pipeline:
            greedy = greedy_decode(pipeline, 1, prompt, 16).tokens
            proposals, in_reply = {}, None
            for placement in ("own", "last"):
                with ShardClient(endpoints[placement]) as client:
                    dflash = DFlashDrafterClient(client, pipeline)
                    asked = []
                    propose = dflash.propose
                    dflash.propose = lambda history, n: asked.append((len(history), n, propose(history, n))) or asked[-1][2]
                    result = speculative_decode(dflash.target, 2, prompt, dflash, block_size=8, max_new_tokens=16)
                    assert result.tokens == greedy
                    proposals[placement] = [(at, tokens) for at, n, tokens in asked if n == 7]
                    if placement == "last":
                        assert dflash.proposes_in_reply  # every block came in a reply: the prompt's, then the verifies'
                        assert dflash.proposals_in_reply == sum(1 for _, n, _ in asked if n > 0)
                        in_reply = client.stats()["drafter"]
                    else:
                        assert not dflash.proposes_in_reply
            assert proposals["last"] == proposals["own"] and proposals["own"]
            assert in_reply["proposals"] == in_reply["proposals_in_reply"]  # no PROPOSE

            with ShardClient(endpoints["first"]) as first:
                first.open(7)
                first.forward(7, 0, [1, 2, 3])
                verify = dict(id=0, seq=7, pos=3, tokens=[4, 5], checkpoint=True, parents=[-1, 0], layers=[1])
                with pytest.raises(ShardError) as refused:  # no drafter here (nor the head): nothing changes
                    first.request(Capture(**verify, drafts=[5], propose=1))
                assert refused.value.code is ErrorCode.NO_DRAFTER
                assert first.request(Capture(**verify)).result["length"] == 5  # still at 3 before it
    finally:
        stop_all(daemons.values())


def test_a_prefix_entry_carries_a_fast_drafter_context_between_slots():
    """The fast drafter's state views its slot's keys and values as the reference's holds them: a prefix entry's
    drafter rows (shardd/server/prefix.py), copied out of one slot in two chained pieces and resumed into another,
    give that slot the context's bits: the same proposal as the sequence it came from."""
    from shardd.server.prefix import draft_rows

    reference = drafter("full")
    fast = FastDrafter(reference, max_sequences=2, max_context=CONTEXT)
    source, resumed = fast.new_state(CONTEXT), fast.new_state(CONTEXT)
    fast.add_context(source, features(reference, 11, 3))
    pieces = [(0, 8, draft_rows(source, 0, 8)), (8, 11, draft_rows(source, 8, 11))]
    fast.crop(source, 11)
    for start, end, rows in pieces:
        for cache, (key, value) in zip(resumed.kv, rows):
            cache.key[:, start:end].copy_(key)
            cache.value[:, start:end].copy_(value)
    resumed.length = 11
    want_ids, want_logits = fast.propose(source, 5, 8)
    ids, logits = fast.propose(resumed, 5, 8)
    assert torch.equal(ids, want_ids) and torch.equal(logits, want_logits)
