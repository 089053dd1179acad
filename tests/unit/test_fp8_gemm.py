"""The weight-only FP8 GEMM (shardd/engine/kernels/fp8_gemm.py) against dequantize-then-matmul in float32.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) on small
shapes with partial blocks, in float32; on a GPU, every fused matrix shape of the 27B model in bf16, on the
native (sm_89+) path and the Ampere path forced on this GPU. Both check that a row's bits depend on nothing
but that row: not on the other rows' values, nor on how many rows the launch has.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="the FP8 kernel needs triton")

from shardd.engine.kernels import fp8_gemm as fp8  # noqa: E402

CUDA = torch.cuda.is_available()
BLOCK = (128, 128)


def quantized(n: int, k: int, blockwise: bool, *, seed: int, device="cpu"):
    """A float8_e4m3fn weight with values over the whole range (subnormals, negatives, zeros) and its scale."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    if blockwise:
        shape = (math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1]))
    else:
        shape = (n, 1)
    scale = torch.rand(shape, generator=generator, device=device) * 1e-3 + 1e-4
    return weight, scale, BLOCK if blockwise else None


def assert_matches_reference(y: torch.Tensor, x: torch.Tensor, dequantized: torch.Tensor):
    """|y - x @ w.T| within y's own rounding (bf16: 2^-8 relative) plus float32 summation-order noise (the MMA's
    accumulator on a GPU), relative to sum |x| |w|."""
    reference = x.float() @ dequantized.t()
    magnitude = x.float().abs() @ dequantized.abs().t()
    bf16 = y.dtype == torch.bfloat16
    bound = (2.0**-8 if bf16 else 0.0) * reference.abs() + (1e-4 if bf16 else 1e-5) * magnitude + 1e-30
    excess = ((y.float() - reference).abs() - bound).max().item()
    assert excess <= 0, f"exceeds the bound by {excess}"


def assert_rows_independent(run, x: torch.Tensor, full: torch.Tensor):
    """Bits of row r are the same for every M, and with the other rows zeroed or replaced."""
    rows = x.shape[0]
    for m in range(1, rows):
        assert torch.equal(run(x[:m]), full[:m]), f"rows change with M={m}"
    other = torch.randn_like(x)
    for r in (0, rows // 2, rows - 1):
        for fill in (torch.zeros_like(x), other):
            alone = fill.clone()
            alone[r] = x[r]
            assert torch.equal(run(alone)[r], full[r]), f"row {r} changes with the other rows"


# ---- the interpreter (or the GPU): small shapes, partial blocks, float32 ------------------------------------

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
SMALL = (136, 300)  # 2 x 3 scale blocks, both partial; 5 N tiles of 32, the last partial (interpreter time ~ tiles)


@pytest.mark.parametrize("blockwise", [True, False], ids=["block", "channel"])
@pytest.mark.parametrize("ampere", [False, True], ids=["native", "ampere"])
def test_matches_dequantize_then_matmul_and_rows_are_independent(blockwise, ampere):
    weight, scale, block = quantized(*SMALL, blockwise, seed=1)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    dequantized = fp8.dequantize_fp8(weight, scale, block)
    x = torch.randn(16, SMALL[1], generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    run = lambda rows: fp8.fp8_linear(rows, weight, scale, block, ampere=ampere)  # noqa: E731
    full = run(x)
    assert full.dtype == x.dtype and full.shape == (16, SMALL[0])
    assert_matches_reference(full, x, dequantized)
    assert_rows_independent(run, x, full)


@pytest.mark.parametrize("config", [
    fp8.TileConfig(block_n=32, block_k=64, split_k=2, swap=True),
    fp8.TileConfig(block_n=16, block_k=128, split_k=3),
], ids=["swap-split2", "split3"])
def test_split_k_and_swapped_tiles(config):
    """A split of K adds its partial sums in a fixed order: the same bits for every M and every launch (the
    counters it leaves are zero for the next one)."""
    weight, scale, block = quantized(136, 260, True, seed=3)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(16, 260, generator=torch.Generator().manual_seed(4)).to(DEVICE, DTYPE)
    convert = "native"
    run = lambda rows: fp8.fp8_gemm(rows, weight, scale, block, config, convert=convert)  # noqa: E731
    full = run(x)
    assert_matches_reference(full, x, fp8.dequantize_fp8(weight, scale, block))
    assert torch.equal(run(x), full)
    for m in (1, 7):
        assert torch.equal(run(x[:m]), full[:m])


@pytest.mark.parametrize("blockwise", [True, False], ids=["block", "channel"])
@pytest.mark.parametrize("config", [
    fp8.TileConfig(block_n=32, block_k=128),
    fp8.TileConfig(block_n=32, block_k=64, split_k=2, swap=True),
    fp8.TileConfig(block_n=16, block_k=256, split_k=2),  # two K tiles a load for a 128-wide scale block
], ids=["plain", "swap-split2", "unroll-split2"])
def test_a_packed_weight_gives_the_row_major_weight_s_bits(config, blockwise):
    """The tiles-contiguous layout (partial tiles at both edges zero-padded, a split's last tiles past K) reads
    the same bytes into the same arithmetic: every row's bits equal the row-major launch's, for every M; and it
    unpacks back to the very weight."""
    n, k = 136, 300
    weight, scale, block = quantized(n, k, blockwise, seed=21)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    packed = fp8.pack_weight(weight, config, block)
    assert torch.equal(fp8.unpack_weight(packed).view(torch.uint8), weight.view(torch.uint8))
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(22)).to(DEVICE, DTYPE)
    convert = "asm" if CUDA else "bits"
    row_major = fp8.fp8_gemm(x, weight, scale, block, config, convert=convert)
    assert torch.equal(fp8.fp8_gemm(x, packed, scale, block, config, convert=convert), row_major)
    for m in (1, 5):
        assert torch.equal(fp8.fp8_gemm(x[:m], packed, scale, block, config, convert=convert), row_major[:m])
    with pytest.raises(ValueError, match="packed for"):
        fp8.fp8_gemm(x, packed, scale, block, fp8.TileConfig(block_n=64), convert=convert)


def test_a_tiles_file_replaces_the_table_s_configs_and_bad_entries_are_refused_by_name(tmp_path, monkeypatch):
    import json

    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"136x300": {"block_n": 16, "split_k": 3, "warps": 2, "pdl": True, "prefetch": 1}}))
    monkeypatch.setattr(fp8, "_TUNED", None)
    monkeypatch.setenv(fp8.TILES_ENV, str(path))
    assert fp8.tile_config(136, 300, True) == fp8.TileConfig(block_n=16, split_k=3, warps=2, pdl=True, prefetch=1)
    assert fp8.tile_config(5120, 6144, True) == fp8.TILE_TABLE[(5120, 6144, True)]  # not in the file: the table's
    weight, scale, block = quantized(136, 300, True, seed=31)
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(32)).to(DEVICE, DTYPE)
    assert_matches_reference(fp8.fp8_linear(x, weight.to(DEVICE), scale.to(DEVICE), block), x,
                             fp8.dequantize_fp8(weight, scale, block).to(DEVICE))
    for bad, message in (({"136x300": {"blocks": 16}}, "unknown TileConfig fields"), ({"136": {}}, "is not NxK")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            fp8.load_tiles(str(path))
    monkeypatch.setattr(fp8, "_TUNED", None)


def test_other_block_shapes():
    """Scales per (1 row x 128) block (a fused matrix whose parts' rows are not multiples of 128 can carry its
    parts' scales that way) and per 64 x 64 block (K tiles shrink to fit)."""
    n, k = 72, 200
    weight = quantized(n, k, True, seed=11)[0].to(DEVICE)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(12)).to(DEVICE, DTYPE)
    for block in ((1, 128), (64, 64)):
        shape = (math.ceil(n / block[0]), math.ceil(k / block[1]))
        scale = (torch.rand(shape, generator=torch.Generator().manual_seed(13)) * 1e-3).to(DEVICE)
        assert_matches_reference(fp8.fp8_linear(x, weight, scale, block), x, fp8.dequantize_fp8(weight, scale, block))


def test_every_fp8_byte_converts_exactly_without_fp8_instructions():
    """The Ampere path's bit manipulation gives each of the 256 e4m3fn bytes its exact value (NaN aside)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[[0x7F, 0xFF]] = 0  # the NaNs: one would poison its whole output row
    weight = codes.view(torch.float8_e4m3fn).reshape(16, 16).to(DEVICE)
    eye = torch.eye(16, dtype=DTYPE, device=DEVICE)
    ones = torch.ones(16, dtype=torch.float32, device=DEVICE)
    for convert in ["bits", "native"] + (["asm", "asm_v1"] if CUDA else []):  # a 16 x 32 tile: 4 bytes a thread for the asm
        y = fp8.fp8_gemm(eye, weight, ones, None, fp8.TileConfig(block_n=16, block_k=32), convert=convert)
        assert torch.equal(y.t().float(), weight.float()), convert


@pytest.mark.parametrize("config", [
    fp8.TileConfig(block_n=64, block_k=128),
    fp8.TileConfig(block_n=32, block_k=256, split_k=2, swap=True),
], ids=["plain", "wide-k-split2-swap"])
def test_row_tiles_of_one_launch_are_each_the_16_row_result(config, monkeypatch):
    """Up to LARGE_M rows run in one launch that reads each weight tile once for all its 16-row tiles: each
    tile's rows are the bits that tile gets alone (same K order, same tile shapes), and a K tile loaded 256
    wide (two scale blocks, one dot each) gives the bits of 128-wide ones."""
    weight, scale, block = quantized(*SMALL, True, seed=14)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(40, SMALL[1], generator=torch.Generator().manual_seed(15)).to(DEVICE, DTYPE)
    run = lambda rows, c=config: fp8.fp8_gemm(rows, weight, scale, block, c, convert="bits")  # noqa: E731
    full = run(x)
    assert_matches_reference(full, x, fp8.dequantize_fp8(weight, scale, block))
    for start, stop in ((0, 16), (16, 32), (32, 40)):
        assert torch.equal(run(x[start:stop]), full[start:stop]), f"rows {start}:{stop}"
    if config.block_k > BLOCK[1]:
        narrow = fp8.TileConfig(block_n=config.block_n, block_k=BLOCK[1], split_k=config.split_k, swap=config.swap)
        assert torch.equal(run(x[:16], narrow), full[:16])
    monkeypatch.setattr(fp8, "MAX_ROW_TILES", 2)  # more row tiles than one program takes: groups of programs
    assert torch.equal(run(x), full)


def test_large_m_dequantizes_in_chunks(monkeypatch):
    """More than LARGE_M rows (a prefill) take dequantize-then-matmul, a chunk of whole row blocks at a time."""
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 128 * 300)  # chunks of 128 rows: the last one partial
    for blockwise in (True, False):
        weight, scale, block = quantized(*SMALL, blockwise, seed=5)
        x = torch.randn(fp8.LARGE_M + 3, SMALL[1], generator=torch.Generator().manual_seed(6))
        y = fp8.fp8_linear(x, weight, scale, block)
        assert_matches_reference(y, x, fp8.dequantize_fp8(weight, scale, block))


@pytest.mark.parametrize("blockwise", [True, False])
def test_the_prefill_s_dequantization_kernel_gives_the_pytorch_expression_s_bits(blockwise):
    """The large-M path's one-pass dequantization equals `dequantize_fp8(...).to(dtype)` bit for bit: every FP8
    byte but the two NaNs (subnormals, both zeros, the largest), partial scale blocks at both edges, a row slice
    of a weight (a chunk), bf16 and float32 out."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel on a GPU, else in the interpreter
    n, k = 200, 300  # 128x128 blocks: a partial last block in both directions
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    pick = torch.randint(0, codes.numel(), (n, k), generator=torch.Generator().manual_seed(11))
    weight = codes[pick].view(torch.float8_e4m3fn).to(device)
    rng = torch.Generator().manual_seed(12)
    if blockwise:
        block = (128, 128)
        scale = torch.rand(math.ceil(n / 128), math.ceil(k / 128), generator=rng) * 0.01 + 1e-4
    else:
        block = None
        scale = (torch.rand(n, generator=rng) * 0.01 + 1e-4).reshape(n, 1)
    scale = scale.to(device)
    for dtype in (torch.bfloat16, torch.float32):
        got = fp8.dequantized(weight, scale, block, dtype)
        assert torch.equal(got, fp8.dequantize_fp8(weight, scale, block).to(dtype))
    part = weight[128:200]  # a chunk of the large-M path: whole row blocks from a block boundary
    part_scale = scale[1:2] if blockwise else scale[128:200]
    assert torch.equal(fp8.dequantized(part, part_scale, block, torch.bfloat16),
                       fp8.dequantize_fp8(part, part_scale, block).to(torch.bfloat16))


def test_bad_operands_are_refused_by_name():
    weight, scale, block = quantized(*SMALL, True, seed=7)
    x = torch.randn(2, SMALL[1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.fp8_linear(x, weight.float(), scale, block)
    with pytest.raises(ValueError, match=r"block scale of a 136x300 weight is \[2, 3\]"):
        fp8.fp8_linear(x, weight, scale[:1], block)
    with pytest.raises(ValueError, match="per-channel scale"):
        fp8.fp8_linear(x, weight, scale, None)
    with pytest.raises(ValueError, match="does not match weight"):
        fp8.fp8_linear(x[:, :10], weight, scale, block)
    with pytest.raises(ValueError, match="must be float32"):
        fp8.fp8_linear(x, weight, scale.double(), block)


def test_dequantize_applies_each_blocks_scale():
    weight = torch.ones(130, 129).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = fp8.dequantize_fp8(weight, scale, BLOCK)
    assert w[0, 0] == 1 and w[0, 128] == 2 and w[128, 0] == 3 and w[129, 128] == 4
    assert torch.equal(fp8.dequantize_fp8(weight, torch.full((130,), 0.5), None), torch.full((130, 129), 0.5))


# ---- the GPU: the 27B shapes ----------------------------------------------------------------------------

# The fused matrices of Qwen3.5-27B (shardd/engine/fast/weights.py): GDN in_proj qkv|z|b|a, out_proj (and attention
# o_proj), attention q|k|v, MLP gate|up, down.
SHAPES_27B = {"gdn_in_proj": (16480, 5120), "out_proj": (5120, 6144), "attn_qkv": (14336, 5120),
              "gate_up": (34816, 5120), "down": (5120, 17408)}


@pytest.mark.gpu
@pytest.mark.parametrize("convert", ["native", "asm"])
@pytest.mark.parametrize("name", list(SHAPES_27B))
def test_27b_shapes_block_scales(name, convert, monkeypatch):
    monkeypatch.setattr(fp8, "HOPPER_CONVERT", convert)
    ampere = False
    n, k = SHAPES_27B[name]
    weight, scale, block = quantized(n, k, True, seed=8, device="cuda")
    x = torch.randn(128, k, device="cuda", dtype=torch.bfloat16)
    run = lambda rows: fp8.fp8_linear(rows, weight, scale, block, ampere=ampere)  # noqa: E731
    full = run(x[:16])
    assert_matches_reference(full, x[:16], fp8.dequantize_fp8(weight, scale, block))
    assert_rows_independent(run, x[:16], full)
    for m in (64, 128):  # one launch for all row tiles: each tile's rows are the bits it gets alone
        rows = run(x[:m])
        assert torch.equal(rows[:16], full)
        assert torch.equal(rows[16:32], run(x[16:32]))
        last = (m - 1) // 16 * 16
        assert torch.equal(rows[last:], run(x[last:m]))
    ampere_rows = fp8.fp8_linear(x[:16], weight, scale, block, ampere=True)
    assert_matches_reference(ampere_rows, x[:16], fp8.dequantize_fp8(weight, scale, block))


@pytest.mark.gpu
@pytest.mark.parametrize("ampere", [False, True], ids=["native", "ampere"])
@pytest.mark.parametrize("name", ["gdn_in_proj", "down"])
def test_27b_shapes_channel_scales(name, ampere):
    n, k = SHAPES_27B[name]
    weight, scale, block = quantized(n, k, False, seed=9, device="cuda")
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    run = lambda rows: fp8.fp8_linear(rows, weight, scale, block, ampere=ampere)  # noqa: E731
    full = run(x)
    assert_matches_reference(full, x, fp8.dequantize_fp8(weight, scale, block))
    assert_rows_independent(run, x, full)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_programmatic_dependent_launch_keeps_the_bits_of_a_chain(split_k):
    """pdl=True (sm_90): each GEMM reads what the kernel before it wrote (another GEMM, an elementwise op); eager and
    replayed in a CUDA graph, the bits are pdl=False's."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    weight, scale, block = quantized(5120, 5120, True, seed=11, device="cuda")
    x = torch.randn(16, 5120, device="cuda", dtype=torch.bfloat16)

    def chain(pdl: bool, out: torch.Tensor) -> torch.Tensor:
        config = fp8.TileConfig(block_n=32, block_k=128, split_k=split_k, warps=2, stages=3, pdl=pdl)
        y = x
        for _ in range(4):
            y = fp8.fp8_gemm(y, weight, scale, block, config, convert="asm") * 0.16  # about 1 a pair
            y = fp8.fp8_gemm(y, weight, scale, block, config, convert="asm")
        return out.copy_(y)

    expected = chain(False, torch.empty_like(x)).clone()
    assert torch.equal(chain(True, torch.empty_like(x)), expected)
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain(True, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(True, out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_graph_replay_equals_eager(split_k):
    """Captured in a CUDA graph and replayed (split-K counters reset by each launch): the eager bits."""
    n, k = SHAPES_27B["down"]
    weight, scale, block = quantized(n, k, True, seed=10, device="cuda")
    config = fp8.TileConfig(block_n=64, block_k=128, split_k=split_k)
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(16, n, device="cuda", dtype=torch.bfloat16)
    eager = fp8.fp8_gemm(x, weight, scale, block, config, convert="native").clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fp8.fp8_gemm(x, weight, scale, block, config, convert="native", out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8.fp8_gemm(x, weight, scale, block, config, convert="native", out=out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
