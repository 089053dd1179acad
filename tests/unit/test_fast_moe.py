"""The fast engine on a Qwen3.5 MoE model: the fixed-shape step with the sparse block (shardd/engine/fast/moe.py)
gives the reference engine's greedy tokens, speculative output equals greedy in every rollback mode, and a
sequence's rows in a batched step are bit-identical to the same sequence alone; with FP8 experts (routed and
shared, block-scaled or per output channel) too, against the reference engine on their dequantized weights.

Without a GPU the kernels run under Triton's interpreter (conftest.py), in float32, on the tiny MoE preset cut to
three layers (GDN, GDN, attention); on a GPU the same in bf16 with CUDA graphs."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the fast path's kernels need triton")

from common.model_config import config_from_dict  # noqa: E402
from common.presets import PRESETS  # noqa: E402
from common.quantization import FP8_BLOCK, FP8_CHANNEL  # noqa: E402
from coordinator.decoding import greedy_decode, speculative_decode  # noqa: E402
from coordinator.drafting.drafters import OracleDrafter  # noqa: E402
from protocol.layout import CHECKPOINT, REPLAY, REPLAY_SSM  # noqa: E402
from shardd.engine.fast.shard import FastShard  # noqa: E402
from shardd.engine.reference import rollback as rb  # noqa: E402
from shardd.engine.reference.shard import ShardModel  # noqa: E402
from shardd.local import LocalTarget  # noqa: E402
from shardd.synthetic.model import synthetic_weights  # noqa: E402
from tests.support.fp8 import fp8_experts  # noqa: E402
from tests.support.steps import reference_chunk_rule, run_schedule  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
ROWS = 4
CONTEXT = 48
CONFIG = config_from_dict({**PRESETS["tiny-moe"], "num_hidden_layers": 3})  # GDN, GDN, attention


def model(mode: str | None, *, rows: int = ROWS, dtype=DTYPE, begin: int = 0, end: int | None = None,
          fp8: str | None = None, dequantized: bool = False) -> ShardModel:
    """The shard's model; `fp8`: its experts FP8 in that layout (`dequantized`: the weights they stand for)."""
    end = CONFIG.num_layers if end is None else end
    weights = synthetic_weights(CONFIG, begin, end, seed=0, dtype=dtype, device=DEVICE)
    if fp8 is not None:
        weights = fp8_experts(weights, fp8, dequantized=dequantized)
    storage = rb.RollbackStorage(mode, rows) if mode else rb.RollbackStorage(None, 0)
    return ShardModel(CONFIG, weights, begin, end, dtype=dtype, device=DEVICE, storage=storage)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fp8", [None, FP8_BLOCK, FP8_CHANNEL], ids=["unquantized", FP8_BLOCK, FP8_CHANNEL])
def test_greedy_tokens_equal_the_reference_engine(fp8):
    """float32 on the CPU: a prompt, then greedy decoding one token a step (every row but one padding) and a
    block of ROWS through the step: the same tokens as the reference engine, logits within rounding. FP8 experts:
    the fast step reads their bytes, the reference engine their dequantized weights."""
    reference = model(CHECKPOINT, dtype=torch.float32, fp8=fp8, dequantized=True)
    step = FastShard(model(CHECKPOINT, dtype=torch.float32, fp8=fp8), max_sequences=2, max_context=CONTEXT)
    if fp8 is not None:
        assert step.layers[0].moe.experts_gate_up.dtype == torch.float8_e4m3fn
    step.prefill_kernels = False  # the step itself; the GPU prefill has tests of its own
    a, b = reference.new_state(CONTEXT), step.new_state(CONTEXT)
    prompt = ids(7, 0)
    token = reference.forward(a, 0, tokens=prompt).ids[-1].item()
    assert step.forward(b, 0, tokens=prompt).ids[-1].item() == token
    tokens, pos = [], len(prompt)
    for _ in range(6):
        out_a, out_b = reference.forward(a, pos, tokens=[token]), step.forward(b, pos, tokens=[token])
        torch.testing.assert_close(out_b.logits.cpu(), out_a.logits.cpu(), rtol=1e-4, atol=1e-4)
        assert out_b.ids.tolist() == out_a.ids.tolist()
        token, pos = out_a.ids[-1].item(), pos + 1
        tokens.append(token)
    assert len(set(tokens)) > 1
    block = ids(ROWS, 5)
    out_a, out_b = reference.forward(a, pos, tokens=block), step.forward(b, pos, tokens=block)
    assert out_b.ids.tolist() == out_a.ids.tolist()


@pytest.mark.parametrize("split, fp8", [(None, None), (2, None), (None, FP8_BLOCK)],
                         ids=["one-shard", "two-shards", "one-shard-fp8-block"])
def test_speculative_output_equals_greedy_in_every_rollback_mode(split, fp8):
    """Greedy through the fast MoE step, then speculation with an oracle that errs, in checkpoint, replay-ssm and
    replay: exactly the greedy tokens (float32 on the CPU, bf16 with graphs on a GPU); greedy itself equals the
    reference engine's in float32 (with FP8 experts: on their dequantized weights)."""
    ranges = [(0, CONFIG.num_layers)] if split is None else [(0, split), (split, CONFIG.num_layers)]
    shards = {mode: [FastShard(model(mode, begin=b, end=e, fp8=fp8), max_sequences=2, max_context=CONTEXT)
                     for b, e in ranges] for mode in (CHECKPOINT, REPLAY_SSM)}
    prompt = ids(5, 1)
    greedy = greedy_decode(LocalTarget.from_shards(shards[CHECKPOINT], CONTEXT), 1, prompt, 8).tokens
    if DTYPE == torch.float32:
        reference = [model(None, begin=b, end=e, fp8=fp8, dequantized=True) for b, e in ranges]
        assert greedy_decode(LocalTarget.from_shards(reference, CONTEXT), 1, prompt, 8).tokens == greedy
    for mode in (CHECKPOINT, REPLAY_SSM, REPLAY):
        target = LocalTarget.from_shards(shards[CHECKPOINT if mode == REPLAY else mode], CONTEXT)
        drafter = OracleDrafter.with_mean_commit(greedy, len(prompt), block_size=ROWS, mean_commit=ROWS / 2)
        result = speculative_decode(target, 2, prompt, drafter, block_size=ROWS, rollback=mode, max_new_tokens=8)
        assert result.tokens == greedy, mode
        assert result.rollbacks_fast + result.replays > 0  # the oracle erred: a partial accept was rolled back


@pytest.mark.parametrize("fp8", [None, FP8_BLOCK], ids=["unquantized", FP8_BLOCK])
def test_a_batched_moe_step_equals_each_sequence_alone(fp8):
    """Three sequences in steps of R = 8 rows (CPU: a multiple of the BLAS's row block), different lengths, each
    rolled back by its own keep: outputs and states bit-identical to each sequence stepped alone, whose steps are
    mostly padding rows (and whose rows meet other rows in their experts' blocks); FP8 experts too."""
    shard_model = model(CHECKPOINT, rows=2, fp8=fp8)
    batched = FastShard(shard_model, max_sequences=3, max_context=24, step_rows=8)
    batched.prefill_kernels = False
    alone = batched.sharing_weights(rb.RollbackStorage(CHECKPOINT, 2))
    alone.prefill_kernels = False
    run_schedule(batched, alone, [(2, 1, 2), (1, 2, 2)], prompts=(1, 2, 3), keeps=[(1, 0, 2), (0, 2, 1)])


def test_experts_of_mixed_layouts_or_per_tensor_scales_are_refused_by_name():
    """A layer's experts share one layout (stacked for the kernels): one FP8 matrix among float ones is refused
    naming the layer and its mix; so is an FP8 expert with one scale for the whole tensor (neither block nor
    per-channel)."""
    from shardd.weights import quant

    shard_model = model(None, dtype=torch.float32)
    expert = shard_model.layers[0].mlp.experts[1]
    expert.up_proj = quant.Fp8Linear(*quant.quantize(expert.up_proj, FP8_BLOCK), (128, 128))
    with pytest.raises(ValueError, match=r"layer 0's routed experts mix layouts \(23 float32, 1 FP8 128x128-block "
                                         r"matrices\)"):
        FastShard(shard_model, max_sequences=1, max_context=16)

    shard_model = model(None, dtype=torch.float32, fp8=FP8_CHANNEL)
    for expert in shard_model.layers[1].mlp.experts:
        for name in ("gate_proj", "up_proj", "down_proj"):
            matrix = getattr(expert, name)
            setattr(expert, name, quant.Fp8Linear(matrix.weight, matrix.scale.amax().reshape(1), None))
    with pytest.raises(ValueError, match=r"layer 1 experts.0.gate_proj: an FP8 scale of shape \[1\] is not one per "
                                         r"output channel"):
        FastShard(shard_model, max_sequences=1, max_context=16)


@pytest.mark.parametrize("fp8", [None, FP8_BLOCK], ids=["unquantized", FP8_BLOCK])
def test_the_gpu_prefill_path_runs_the_sparse_block(monkeypatch, fp8):
    """shardd.engine.fast.prefill over the MoE model (every row of a chunk routed, the experts grouped over the
    chunk), fla's rule swapped for the reference recurrence: within rounding of the reference engine with the same
    ids; and a FastShard's prefill in pieces of 8 through PrefillGraphs (their stages replayed by running their ops)
    bit-identical to the eager pieces. FP8 experts: against the reference engine on their dequantized weights."""
    from shardd.engine.fast import prefill
    from shardd.engine.fast.graph import PrefillGraphs

    monkeypatch.setattr(prefill, "fla_rule", lambda direct=True: reference_chunk_rule)
    reference = model(CHECKPOINT, dtype=torch.float32, fp8=fp8, dequantized=True)
    step = FastShard(model(CHECKPOINT, dtype=torch.float32, fp8=fp8), max_sequences=2, max_context=CONTEXT)
    a, b = reference.new_state(CONTEXT), step.new_state(CONTEXT)
    relative = lambda x, ref: ((x.float() - ref.float()).norm() / ref.float().norm()).item()  # noqa: E731
    for pos, n in ((0, 12), (12, 9)):
        tokens = ids(n, 20 + pos)
        expected = reference.forward(a, pos, tokens=tokens)
        x = torch.nn.functional.embedding(torch.tensor(tokens, device=DEVICE), step.model.embed_tokens)
        out = prefill.prefill(step.model, step.layers, b, pos, x, ())
        b.length = pos + n
        assert relative(out.logits, expected.logits) < 1e-5 and out.ids.tolist() == expected.ids.tolist()

    step.prefill_kernels, step.prefill_rows = True, 8
    step.prefill_graphs = PrefillGraphs(step.model, step.layers, step.pools, 8, use_graphs=False)
    eager = step.sharing_weights(rb.RollbackStorage(CHECKPOINT, ROWS))
    pieced, alone = step.new_state(CONTEXT), eager.new_state(CONTEXT)
    tokens = ids(21, 7)  # pieces 8 + 8 + 5
    out = step.forward(pieced, 0, tokens=tokens)
    x = torch.nn.functional.embedding(torch.tensor(tokens, device=DEVICE), step.model.embed_tokens)
    pieces = [prefill.prefill(step.model, step.layers, alone, first, x[first:first + 8], ()) for first in range(0, 21, 8)]
    assert torch.equal(out.logits, torch.cat([piece.logits for piece in pieces]))
    assert torch.equal(pieced.gdn.recurrent, alone.gdn.recurrent) and torch.equal(pieced.gdn.conv, alone.gdn.conv)


def test_the_memory_plan_counts_the_sparse_block_s_step_buffers():
    """common.memory's per-row share of the feed-forward block holds at least the sparse block's static buffers
    (and the MoE shape's is its own, not the dense MLP's `intermediate_size`)."""
    from common.memory import feed_forward_row_bytes
    from shardd.engine.fast.moe import MoeBuffers

    rows = 16
    buffers = MoeBuffers(CONFIG, rows, torch.bfloat16, "cpu")
    scratch = buffers.experts
    held = sum(t.nbytes for t in (buffers.experts_chosen, buffers.routing, buffers.shared_act, scratch.sorted_expert,
                                  scratch.pair, scratch.run_start, scratch.act, scratch.pair_out, buffers.out))
    assert held <= rows * feed_forward_row_bytes(CONFIG, 2)
    assert feed_forward_row_bytes(CONFIG, 2) != CONFIG.intermediate_size * 3 * 2


@pytest.mark.parametrize("fp8", [FP8_BLOCK, FP8_CHANNEL])
def test_the_memory_plan_counts_fp8_experts_at_their_bytes_and_scales(fp8):
    """The weight parts the memory plan adds up (common.shapes, as the daemon and `shardctl launch --dry-run` count
    them) are what the fast engine holds of each sparse block once fused: the FP8 experts' bytes and float32
    scales, stacked without padding, beside the unquantized router and shared-expert gate."""
    from common.quantization import synthetic_scheme
    from common.shapes import shard_shapes, weight_bytes_by_part
    from shardd.engine.fast.weights import fuse_layers
    from tests.support.fp8 import is_expert_matrix

    shapes = shard_shapes(CONFIG, 0, CONFIG.num_layers)
    parts = weight_bytes_by_part(CONFIG, shapes, begin=0, dtype_bytes=DTYPE.itemsize, scheme=synthetic_scheme(fp8),
                                 fp8={name for name in shapes if is_expert_matrix(name)})
    held = 0
    for layer in fuse_layers(model(None, fp8=fp8)):
        moe = layer.moe
        held += sum(t.nbytes for t in (moe.router_and_shared, moe.shared_down, moe.experts_gate_up, moe.experts_down,
                                       moe.experts_scales.gate_up, moe.experts_scales.down))
    assert held == parts["experts"] + parts["shared_expert"]
    assert parts["experts"] < 0.3 * weight_bytes_by_part(CONFIG, shapes, begin=0, dtype_bytes=4)["experts"]

