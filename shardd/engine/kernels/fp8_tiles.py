"""The FP8 GEMM's launch shapes (shardd/engine/kernels/fp8_gemm.py): TileConfig, the built-in table of the 27B
shapes, the rule for any other shape and a GPU's own tiles file ($SHARDD_FP8_TILES), among which
fp8_gemm.tile_config picks."""

from __future__ import annotations

from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one matrix; chosen from (N, K) and the scale layout only."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 4
    swap: bool = False  # acc[BLOCK_N, BLOCK_M] = w @ x.T (the weight tile as the MMA's M side)
    # Programmatic dependent launch (sm_90+; ignored below): the programs are scheduled while the previous kernel
    # drains and wait for it (griddepcontrol.wait) before their first memory access, hiding the launch gap. The
    # arithmetic is the same; the sweep measures whether it pays (it also needs the launch kept in the CUDA graph).
    pdl: bool = False
    # With pdl: the first `prefetch` K tiles of each program's weights are prefetched into L2 before the wait (the
    # weights do not depend on the kernel before; only x does), so the early programs read them during its tail.
    prefetch: int = 0


# Fixed per 27B shape (N, K, blockwise): the configs scripts/bench_fp8_gemm.py's sweep finds fastest at 16 rows
# (with HOPPER_CONVERT "asm"); out_proj takes the sweep's second, split 4, about as fast at 16 rows and faster at
# 64. A shape not listed takes `_rule`. The shapes: GDN in_proj qkv|z|b|a 16480x5120 and
# its FP8 part when the checkpoint keeps in_proj_a (qkv|z|b, 16432) or in_proj_b and in_proj_a (qkv|z, 16384) in
# bf16 (shardd.weights.quant.fuse_rows runs those as a second GEMM), out_proj and o_proj 5120x6144, attention q|k|v
# 14336x5120, MLP gate|up 34816x5120, down 5120x17408.
_GDN_IN_PROJ = TileConfig(block_n=32, block_k=256, split_k=1, warps=2, stages=3)
TILE_TABLE: dict[tuple[int, int, bool], TileConfig] = {
    (16480, 5120, True): _GDN_IN_PROJ,
    (16432, 5120, True): _GDN_IN_PROJ,
    (16384, 5120, True): _GDN_IN_PROJ,
    (5120, 6144, True): TileConfig(block_n=32, block_k=128, split_k=4, warps=2, stages=3, swap=True),
    (14336, 5120, True): TileConfig(block_n=64, block_k=128, split_k=2, warps=4, stages=3),
    (34816, 5120, True): TileConfig(block_n=32, block_k=128, split_k=2, warps=2, stages=4, swap=True),
    (5120, 17408, True): TileConfig(block_n=32, block_k=256, split_k=4, warps=4, stages=3),
}


def _rule(n: int, k: int, blockwise: bool) -> TileConfig:
    """Enough programs to fill a GPU (132 SMs on an H100 or H200) ~3 deep: 32-wide N tiles, and a split of K when N
    alone is short (each split keeps at least 8 K tiles)."""
    block_k = 128 if blockwise else 256
    block_n = 32
    n_tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split_k = 1
    while n_tiles * split_k < 400 and k_tiles // (split_k * 2) >= 8:
        split_k *= 2
    return TileConfig(block_n=block_n, block_k=block_k, split_k=split_k)


TILES_ENV = "SHARDD_FP8_TILES"  # a JSON file of tuned configs that replace TILE_TABLE's (one GPU's own sweep)


def load_tiles(path: str) -> dict[tuple[int, int, bool], TileConfig]:
    """A tiles file: {"16480x5120": {"block_n": 32, ...}, ...} (blockwise scales), the form scripts/bench_fp8_gemm.py
    --write-tiles writes from its sweep. Unknown fields or bad values are refused by name."""
    import json

    with open(path) as f:
        data = json.load(f)
    fields = set(TileConfig.__dataclass_fields__)
    table = {}
    for key, entry in data.items():
        try:
            n, k = (int(v) for v in key.split("x"))
        except ValueError:
            raise ValueError(f"{path}: key {key!r} is not NxK") from None
        unknown = set(entry) - fields
        if unknown:
            raise ValueError(f"{path}: {key}: unknown TileConfig fields {sorted(unknown)}")
        table[(n, k, True)] = TileConfig(**entry)
    return table


def tiles_identity() -> str:
    """Which tile table the launches read: "built-in", or the sha256 (first 16 hex) of $SHARDD_FP8_TILES's file. A
    tile changes how a dot product is split, so a token's bits (HELLO's `numerics`)."""
    import hashlib
    import os

    path = os.environ.get(TILES_ENV)
    if not path:
        return "built-in"
    with open(path, "rb") as tiles:
        return hashlib.sha256(tiles.read()).hexdigest()[:16]
