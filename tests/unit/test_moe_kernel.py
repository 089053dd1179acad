"""The routing (shardd/engine/kernels/moe_route.py) and routed experts (shardd/engine/kernels/moe.py) of the fast step,
and its sparse block (shardd/engine/fast/moe.py): against the reference's routing, the readable loop beside the
kernel and the reference MoE block, and row-independent bit for bit (a row's output is the same whichever rows share
its step and its experts); FP8 experts (128x128 blocks, partial at the edges and wider than an expert, or per output
channel) against the same loop over their dequantized weights. Under Triton's interpreter on the CPU (conftest
sets it), in float32; on a GPU in bf16 too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton")

from common.model_config import config_from_dict  # noqa: E402
from common.presets import PRESETS  # noqa: E402
from common.quantization import FP8_BLOCK, FP8_CHANNEL  # noqa: E402
from shardd.engine.fast import moe as fast_moe  # noqa: E402
from shardd.engine.kernels import moe as moe_kernels  # noqa: E402
from shardd.engine.kernels import moe_route  # noqa: E402
from shardd.engine.reference.moe import SparseMoeBlock  # noqa: E402
from shardd.synthetic.model import synthetic_weights  # noqa: E402
from shardd.weights import quant  # noqa: E402
from tests.support.fp8 import fp8_experts  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
EXPERTS, TOP_K, HIDDEN, WIDTH = 6, 3, 80, 40  # widths not a multiple of the kernel's tiles
FP8_HIDDEN = 200  # FP8: 128-blocks of H whole and partial; an expert (40 rows, 40 columns) within one partial block
LAYOUTS = [FP8_BLOCK, FP8_CHANNEL]


class Layer:
    """Random expert weights of one layer (`layout`: FP8 bytes and scales, else x's dtype), and rows to route
    through them."""

    def __init__(self, dtype, seed: int = 0, layout: str | None = None):
        g = torch.Generator().manual_seed(seed)
        self.dtype, self.layout = dtype, layout
        self.hidden = HIDDEN if layout is None else FP8_HIDDEN
        self.gate_up = self.rand(g, EXPERTS, 2 * WIDTH, self.hidden) * self.hidden**-0.5  # activations of order one
        self.down = self.rand(g, EXPERTS, self.hidden, WIDTH) * WIDTH**-0.5
        self.scales = None
        if layout is not None:  # magnitudes that change along rows and columns: each block's scale its own
            self.gate_up *= torch.logspace(-0.5, 0.5, self.hidden) * torch.logspace(0.5, -0.5, 2 * WIDTH)[:, None]
            self.down *= torch.logspace(-0.5, 0.5, WIDTH) * torch.logspace(0.5, -0.5, self.hidden)[:, None]
            self.gate_up, self.down, self.scales, self.dequantized = stacked_fp8(self.gate_up, self.down, layout)

    @staticmethod
    def rand(g, *shape):
        return torch.randn(*shape, generator=g)

    def rows(self, n: int, seed: int):
        """x [n, H], each row's distinct experts [n, k] in ascending order, weights [n, k], the shared gate and output."""
        g = torch.Generator().manual_seed(seed)
        x = self.rand(g, n, self.hidden)
        experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K].sort().values for _ in range(n)])
        weights = torch.rand(n, TOP_K, generator=g)
        return x, experts, weights, self.rand(g, n, 1), self.rand(g, n, self.hidden)

    def run(self, x, experts, weights, shared_gate, shared, reference=False, scratch=None):
        d = dict(device=DEVICE, dtype=self.dtype)
        weight = dict(device=DEVICE) if self.layout else d  # FP8 bytes stay FP8
        args = (x.to(**d), experts.to(DEVICE, torch.int32), weights.to(**d), self.gate_up.to(**weight),
                self.down.to(**weight), shared_gate.to(**d), shared.to(**d))
        scales = self.scales and moe_kernels.ExpertScales(self.scales.gate_up.to(DEVICE), self.scales.down.to(DEVICE),
                                                          self.scales.block)
        if reference:
            return moe_kernels.routed_experts_reference(*args, scales).cpu()
        scratch = scratch or moe_kernels.ExpertScratch(x.shape[0], TOP_K, self.hidden, WIDTH, self.dtype, DEVICE)
        out = torch.empty(x.shape[0], self.hidden, **d)
        return moe_kernels.routed_experts(*args, scratch, out, scales).cpu()


def stacked_fp8(gate_up, down, layout: str):
    """Stacked float weights as FP8 experts: each expert's gate, up and down quantized on their own (as a checkpoint
    stores them), their bytes and scales stacked as shardd/engine/fast/moe.py stacks them; and each matrix
    dequantized on its own (shardd.weights.quant.dequantize), stacked the same way."""
    block = (128, 128) if layout == FP8_BLOCK else None
    width = down.shape[2]
    parts = [[quant.quantize(matrix, layout) for matrix in (gate_up[e, :width], gate_up[e, width:], down[e])]
             for e in range(gate_up.shape[0])]
    gate_up_bytes = torch.stack([torch.cat([gate[0].view(torch.uint8), up[0].view(torch.uint8)])
                                 for gate, up, _ in parts]).view(torch.float8_e4m3fn)
    down_bytes = torch.stack([d[0] for _, _, d in parts])
    scales = moe_kernels.ExpertScales(torch.stack([torch.cat([gate[1], up[1]]) for gate, up, _ in parts]),
                                      torch.stack([d[1] for _, _, d in parts]), block)
    dequantized = [[quant.dequantize(weight, scale, block) for weight, scale in expert] for expert in parts]
    return gate_up_bytes, down_bytes, scales, (torch.stack([torch.cat([gate, up]) for gate, up, _ in dequantized]),
                                               torch.stack([d for _, _, d in dequantized]))


def _close(out, expected, dtype):
    """Within the rounding of another order of the same sums (a bf16 ulp, or float32's, scaled to the output)."""
    tolerance = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("rows, top_k", [(1, 3), (7, 3), (75, 4)])  # 300 pairs: two column blocks of the sort
def test_the_pairs_sort_by_expert_stably(rows, top_k):
    """expert_order against torch's stable sort: every pair's place, its expert and where its expert's run starts,
    with padding rows (expert E) sorted last."""
    g = torch.Generator().manual_seed(rows)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:top_k].sort().values for _ in range(rows)])
    experts[::3] = EXPERTS  # padding rows
    experts = experts.to(DEVICE, torch.int32)
    scratch = moe_kernels.ExpertScratch(rows, top_k, HIDDEN, WIDTH, torch.float32, DEVICE)
    moe_kernels.expert_order(experts, EXPERTS, scratch)
    expected = moe_kernels.expert_order_reference(experts)
    for got, want in zip((scratch.sorted_expert, scratch.pair, scratch.run_start), expected):
        assert torch.equal(got.long(), want.long())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 7])  # pairs 3, 15 and 21: runs shorter and longer than a block of 16
def test_routed_experts_match_the_loop_over_rows_and_slots(dtype, rows):
    layer = Layer(dtype)
    batch = layer.rows(rows, seed=rows)
    _close(layer.run(*batch), layer.run(*batch, reference=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 7])
def test_fp8_experts_match_the_loop_over_their_dequantized_weights(dtype, layout, rows):
    """The kernels on FP8 bytes and scales against the loop on each expert's dequantized matrices: 128x128 blocks
    partial at H's edge (200 = 128 + 72) and taller and wider than an expert (gate and up each in a block of their
    own), or one scale per output channel. A scale applied to the wrong block or channel is far outside rounding:
    the weights' magnitudes span 100x across rows and columns."""
    layer = Layer(dtype, layout=layout)
    batch = layer.rows(rows, seed=rows)
    expected = layer.run(*batch, reference=True)
    _close(layer.run(*batch), expected, dtype)
    dequantized = Layer(dtype)  # the loop over each expert's matrices as dequantized one by one, in x's dtype
    dequantized.hidden, (dequantized.gate_up, dequantized.down) = FP8_HIDDEN, layer.dequantized
    assert torch.equal(dequantized.run(*batch, reference=True), expected)
    swapped = Layer(dtype, layout=layout)  # the gate's and up's scales exchanged: far outside rounding
    swapped.scales = moe_kernels.ExpertScales(layer.scales.gate_up.flip(1), layer.scales.down, layer.scales.block)
    assert not torch.allclose(swapped.run(*batch), expected, rtol=0.05, atol=0.05 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_on_one_expert_and_padding_rows(dtype):
    """20 rows all choosing expert 2 (a run of 20 pairs: two blocks), then the same with every third row padding:
    real rows unchanged bit for bit, padding rows' pairs run no expert (their scratch rows stay untouched)."""
    layer = Layer(dtype)
    x, experts, weights, shared_gate, shared = layer.rows(20, seed=3)
    experts[:, 0] = 2
    experts = torch.stack([torch.cat([row[:1], torch.tensor([e for e in range(EXPERTS) if e != 2][:TOP_K - 1])])
                           for row in experts]).sort(dim=-1).values
    assert (experts == 2).sum() == 20
    full = layer.run(x, experts, weights, shared_gate, shared)
    _close(full, layer.run(x, experts, weights, shared_gate, shared, reference=True), dtype)
    valid = torch.arange(20) % 3 != 0
    scratch = moe_kernels.ExpertScratch(20, TOP_K, HIDDEN, WIDTH, dtype, DEVICE)
    padding = torch.where(valid[:, None], experts, EXPERTS)  # as the routing marks a padding row
    padded = layer.run(x, padding, weights, shared_gate, shared, scratch=scratch)
    assert torch.equal(padded[valid], full[valid])
    pair_valid = valid.repeat_interleave(TOP_K).to(DEVICE)
    assert (scratch.act[~pair_valid] == 0).all() and (scratch.pair_out[~pair_valid] == 0).all()
    assert (scratch.pair_out[pair_valid] != 0).any(dim=1).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [None, *LAYOUTS], ids=["unquantized", *LAYOUTS])
def test_a_rows_bits_do_not_depend_on_its_neighbours(dtype, layout):
    """The same row in steps of different sizes, at different places, beside rows choosing the same or other experts
    (so it lands at another place in its experts' blocks): bit-identical outputs, FP8 experts too."""
    layer = Layer(dtype, layout=layout)
    x, experts, weights, shared_gate, shared = layer.rows(1, seed=9)
    alone = layer.run(x, experts, weights, shared_gate, shared)[0]
    for n, place, seed in ((4, 0, 1), (9, 5, 2), (17, 16, 3), (17, 7, 4)):
        batch = list(layer.rows(n, seed=seed))
        if seed % 2:  # every other row shares the row's experts
            batch[1][::2] = experts[0]
        for part, value in zip(batch, (x, experts, weights, shared_gate, shared)):
            part[place] = value[0]
        assert torch.equal(layer.run(*batch)[place], alone), (n, place)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_matches_the_reference_s(dtype, norm_topk_prob):
    """Each row's top k experts (ascending) and weights as the reference routes them, from a column slice of a wider
    projection (as the step's fused router); padding rows get no expert (E) in every slot."""
    experts = 60  # not a power of two
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, experts + 7, generator=g).to(DEVICE, dtype)[:, 3:3 + experts]
    row_segment = torch.tensor([0, 0, 1, -1, 1, 2, -1, 2, 2], dtype=torch.int32, device=DEVICE)
    chosen = torch.full((9, 5), -7, dtype=torch.int32, device=DEVICE)
    weights = torch.zeros(9, 5, dtype=dtype, device=DEVICE)
    moe_route.route_rows(logits, 5, norm_topk_prob, row_segment, chosen, weights)
    expected_experts, expected_weights = moe_route.route_rows_reference(logits, 5, norm_topk_prob, row_segment)
    assert torch.equal(chosen, expected_experts)
    assert (chosen[row_segment < 0] == experts).all()
    tolerance = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(weights, expected_weights, rtol=tolerance, atol=tolerance)
    moe_route.route_rows(logits, 5, norm_topk_prob, None, chosen, weights)  # no padding: every row routed
    assert torch.equal(chosen, moe_route.route_rows_reference(logits, 5, norm_topk_prob, None)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [None, *LAYOUTS], ids=["unquantized", *LAYOUTS])
def test_the_fast_sparse_block_matches_the_reference_block(dtype, layout):
    """shardd/engine/fast/moe.py's block (fused router and shared expert, device routing, the kernel) against
    shardd/engine/reference/moe.py on the tiny MoE preset's layer: the same experts chosen, outputs within rounding.
    With FP8 experts (routed and shared, 32 and 48 rows: partial blocks) the fast block holds their bytes, the
    reference block their dequantized matrices."""
    config = config_from_dict(PRESETS["tiny-moe"])
    weights = synthetic_weights(config, 0, 1, seed=0, dtype=dtype, device=DEVICE)
    reference = SparseMoeBlock(
        config.moe, weights if layout is None else fp8_experts(weights, layout, dequantized=True), "layers.0.mlp")
    x = torch.randn(12, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    expected = reference(x)
    experts, _ = reference.route(x)
    block = SparseMoeBlock(config.moe, weights if layout is None else fp8_experts(weights, layout), "layers.0.mlp")
    fused = fast_moe.fuse_moe(block, 0)
    if layout is not None:
        assert fused.experts_gate_up.dtype == fused.experts_down.dtype == torch.float8_e4m3fn
        assert isinstance(fused.router_and_shared, quant.StackedLinear)
        assert isinstance(fused.shared_down, quant.Fp8Linear)
        up, scales = block.experts[3].up_proj, fused.experts_scales  # the reference block's matrices view the stacks
        assert up.weight.data_ptr() == fused.experts_gate_up[3, config.moe.moe_intermediate_size:].data_ptr()
        assert up.scale.data_ptr() == scales.gate_up[3, scales.gate_up.shape[1] // 2:].data_ptr()
    buffers = fast_moe.MoeBuffers(config, 12, dtype, DEVICE)
    _close(fast_moe.sparse_mlp(fused, x, None, buffers).cpu(), expected.cpu(), dtype)
    assert torch.equal(buffers.experts_chosen.cpu(), experts.sort(dim=-1).values.int().cpu())
    assert len(torch.unique(buffers.experts_chosen)) > 2  # the rows spread over the experts
    _close(block(x).cpu(), expected.cpu(), dtype)  # the fused block's reference attributes view the same weights


def test_experts_a_checkpoint_stored_fused_are_used_in_place():
    """The loader hands out fused experts (transformers' gate_up_proj [E, 2I, H], down_proj [E, H, I]) as per-expert
    views: the fast block runs on those very tensors, no copy; per-expert tensors are stacked into one."""
    from shardd.weights.reader import split_fused_experts

    config = config_from_dict(PRESETS["tiny-moe"])
    weights = synthetic_weights(config, 0, 1, seed=0)
    moe = config.moe
    gate_up = torch.stack([torch.cat([weights[f"layers.0.mlp.experts.{e}.{name}_proj.weight"] for name in ("gate", "up")])
                           for e in range(moe.num_experts)])
    down = torch.stack([weights[f"layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(moe.num_experts)])
    fused = fast_moe.fuse_moe(SparseMoeBlock(moe, {**weights, **split_fused_experts(config, 0, gate_up, down)},
                                             "layers.0.mlp"), 0)
    assert fused.experts_gate_up is gate_up and fused.experts_down is down
    copied = fast_moe.fuse_moe(SparseMoeBlock(moe, weights, "layers.0.mlp"), 0)
    assert torch.equal(copied.experts_gate_up, gate_up) and torch.equal(copied.experts_down, down)
