"""Synthetic DFlash drafters shaped to a synthetic target: deterministic weights from (seed, tensor name)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.draft_config import DraftConfig
from shardd.synthetic.model import _generator
from shardd.weights.reader import draft_shapes

_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "hidden_norm", "norm")


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
