"""Synthetic DFlash drafters shaped to a synthetic target: deterministic weights from (seed, tensor name)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.model_config import ModelConfig
from shardd.draft.config import FULL_ATTENTION, SLIDING_ATTENTION, DraftConfig, build_target_layer_ids
from shardd.synthetic.model import _generator
from shardd.weights.reader import draft_shapes

_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "hidden_norm", "norm")


def synthetic_draft_config(
    target: ModelConfig,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    *,
    sliding_window: int | None = None,
    sliding_layers: tuple[int, ...] = (),
) -> DraftConfig:
    """A drafter for `target`: its hidden size, heads and vocabulary; the mask token is the last vocabulary id.

    Without `target_layer_ids` the reference's default layer choice is used; `sliding_layers` get the window.
    """
    if sliding_layers and sliding_window is None:
        raise ValueError("sliding_layers need a sliding_window")
    ids = target_layer_ids if target_layer_ids is not None else build_target_layer_ids(target.num_layers, num_layers)
    return DraftConfig(
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        vocab_size=target.vocab_size,
        target_layer_ids=tuple(ids),
        mask_token_id=target.vocab_size - 1,
        block_size=block_size,
        num_target_layers=target.num_layers,
        layer_types=tuple(SLIDING_ATTENTION if i in sliding_layers else FULL_ATTENTION for i in range(num_layers)),
        sliding_window=sliding_window,
        rope_theta=target.rope_theta,
        rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=target.max_position_embeddings,
    )


def synthetic_draft_tensor(config: DraftConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 values for draft tensor `name`, a pure function of (seed, name, shape)."""
    gen = _generator(seed, f"dflash/{name}", torch.device("cpu"))
    normal = torch.randn(shape, generator=gen)
    leaf = name.rsplit(".", 2)[-2]  # "layers.0.self_attn.q_norm.weight" -> "q_norm"
    if leaf in _NORMS:
        return 1.0 + 0.1 * normal  # plain Qwen3 norm: the scale is w itself
    std = 1.0 / math.sqrt(shape[-1])
    if leaf in ("o_proj", "down_proj"):
        std /= math.sqrt(2 * config.num_hidden_layers)
    return normal * std


def synthetic_draft_weights(config: DraftConfig, seed: int, *, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {
        name: synthetic_draft_tensor(config, name, shape, seed).to(dtype) for name, shape in draft_shapes(config).items()
    }


def write_draft_checkpoint(out_dir: str | Path, config: DraftConfig, seed: int, *, dtype=torch.float32) -> Path:
    """config.json and one model.safetensors with the reference's key names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config.to_hf_dict(), "shardd_synthetic": {"seed": seed}}, indent=2) + "\n")
    tensors = {name: t.contiguous() for name, t in synthetic_draft_weights(config, seed, dtype=dtype).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
