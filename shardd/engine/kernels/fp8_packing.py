"""How one FP8 GEMM launch cuts K (`geometry`), and a weight laid out as that launch's contiguous byte tiles
(`PackedWeight`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from shardd.engine.kernels.fp8_tiles import TileConfig


@dataclass(frozen=True)
class Geometry:
    """How one launch cuts K: loads of `block_k` (a K tile never straddles two scale blocks), `unroll` of them an
    iteration, `tiles_per_split` iterations per split of K (the last split's tiles past K read zeros)."""

    block_k: int
    unroll: int
    k_tiles: int
    tiles_per_split: int
    split_k: int

    @property
    def padded_k_tiles(self) -> int:  # what the splits walk over: the packed layout's K tiles
        return self.tiles_per_split * self.unroll * self.split_k


def geometry(config: TileConfig, k: int, scale_block_k: int | None) -> Geometry:
    """scale_block_k: the block scale's K extent (None for a per-channel scale)."""
    block_k, unroll = config.block_k, 1
    if scale_block_k is not None:
        if scale_block_k % block_k and block_k % scale_block_k:
            raise ValueError(f"fp8_linear: tile block_k {block_k} must divide the scale block {scale_block_k} or be a multiple of it")
        if block_k > scale_block_k:  # a K tile per scale block, several loaded per iteration
            block_k, unroll = scale_block_k, block_k // scale_block_k
    k_tiles = triton.cdiv(k, block_k)
    tiles_per_split = triton.cdiv(triton.cdiv(k_tiles, unroll), config.split_k)
    return Geometry(block_k, unroll, k_tiles, tiles_per_split, config.split_k)


@dataclass(frozen=True)
class PackedWeight:
    """An FP8 weight [N, K] laid out for one TileConfig: contiguous [block_n, block_k] byte tiles, each N tile's
    K tiles in order ([n_tiles, padded_k_tiles, block_n, block_k] uint8), zero-padded at the edges, so that a
    program reads one contiguous run of memory and its loads need no mask. Same values, same arithmetic as the
    row-major weight (a zero byte is +0.0, and the padding meets zeroed x columns or is never stored)."""

    data: torch.Tensor
    shape: tuple[int, int]
    config: TileConfig
    scale_block_k: int | None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def pack_weight(weight: torch.Tensor, config: TileConfig, block) -> PackedWeight:
    """The row-major float8_e4m3fn weight [N, K] as a PackedWeight for `config` (block: the scale's block, None
    for per-channel)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"pack_weight: a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    scale_block_k = None if block is None else int(block[1])
    geo = geometry(config, k, scale_block_k)
    n_tiles = triton.cdiv(n, config.block_n)
    padded = torch.zeros(n_tiles * config.block_n, geo.padded_k_tiles * geo.block_k, dtype=torch.uint8, device=weight.device)
    padded[:n, :k] = weight.view(torch.uint8)
    data = padded.view(n_tiles, config.block_n, geo.padded_k_tiles, geo.block_k).permute(0, 2, 1, 3).contiguous()
    return PackedWeight(data, (n, k), config, scale_block_k)


def unpack_weight(packed: PackedWeight) -> torch.Tensor:
    """The row-major float8_e4m3fn weight [N, K] back (tests, the large-M path)."""
    n, k = packed.shape
    n_tiles, k_tiles, block_n, block_k = packed.data.shape
    rows = packed.data.permute(0, 2, 1, 3).reshape(n_tiles * block_n, k_tiles * block_k)
    return rows[:n, :k].contiguous().view(torch.float8_e4m3fn)
