"""Synthetic Qwen3.5 models: deterministic weights from (seed, tensor name), for any shape.

The same generator writes a checkpoint directory in the real layout (`shardctl make-model`) and builds
the weights in memory (so the 27B shape can be benchmarked without writing 54 GB). Initialisation keeps
activations finite through 64 layers in bf16: residual-branch outputs are scaled by 1/sqrt(2 * layers).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardd.config import ModelConfig, config_from_dict
from shardd.weights import shard_shapes

_COMMON = {"model_type": "qwen3_5_text", "hidden_act": "silu", "rms_norm_eps": 1e-6, "eos_token_id": None}

PRESETS: dict[str, dict] = {
    # Fast tests: 6 layers (GDN, GDN, attention) x 2, vocab covers the byte tokenizer.
    "tiny": {
        **_COMMON,
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "full_attention_interval": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    },
    # The demo: 8 layers (3 GDN + 1 attention) x 2, quick on two CPU cores.
    "small": {
        **_COMMON,
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 640,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    },
    # The real Qwen3.5-27B text shape: 64 layers, 48 GDN + 16 attention.
    "qwen3.5-27b": {
        **_COMMON,
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "full_attention_interval": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
    },
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown synthetic preset {name!r}; choose one of {', '.join(PRESETS)}")
    return config_from_dict(PRESETS[name])


def parse_synthetic(spec: str) -> tuple[str, int]:
    """'tiny' or 'tiny:7' -> (preset, seed)."""
    name, _, seed = spec.partition(":")
    preset_config(name)
    try:
        return name, int(seed) if seed else 0
    except ValueError:
        raise ValueError(f"synthetic seed must be an integer, got {seed!r}") from None


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def synthetic_tensor(config: ModelConfig, name: str, shape: tuple[int, ...], seed: int, device="cpu") -> torch.Tensor:
    """float32 values for tensor `name`, a pure function of (seed, name, shape, generator device type)."""
    device = torch.device(device)
    gen = _generator(seed, name, device)
    normal = lambda std: torch.randn(shape, generator=gen, device=device) * std  # noqa: E731
    residual_scale = 1.0 / math.sqrt(2 * config.num_layers)
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if name == "embed_tokens.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(2.0 / math.sqrt(config.hidden_size))
    if leaf in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm") or name == "norm.weight":
        return normal(0.1)  # zero-centred: the scale is 1 + w
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + normal(0.1)
    if leaf == "A_log":
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
    if leaf == "dt_bias":
        return 1.0 + normal(0.1)
    if leaf == "conv1d":
        return normal(1.0 / math.sqrt(shape[-1]))
    fan_in = shape[-1]
    std = 1.0 / math.sqrt(fan_in)
    if leaf in ("o_proj", "out_proj", "down_proj"):
        std *= residual_scale
    return normal(std)


def synthetic_weights(
    config: ModelConfig, begin: int, end: int, seed: int, *, dtype=torch.float32, device="cpu", progress=None
) -> dict[str, torch.Tensor]:
    """The tensors of a shard, built in memory (on `device`, so a 27B shard never touches host memory)."""
    return synthetic_tensors(config, shard_shapes(config, begin, end), seed, dtype=dtype, device=device, progress=progress)


def synthetic_tensors(
    config: ModelConfig, shapes: dict[str, tuple[int, ...]], seed: int, *, dtype=torch.float32, device="cpu", progress=None
) -> dict[str, torch.Tensor]:
    """The named tensors (our names -> shapes), each the same as in the whole synthetic model."""
    weights = {}
    for i, (name, shape) in enumerate(shapes.items()):
        weights[name] = synthetic_tensor(config, name, shape, seed, device).to(dtype)
        if progress is not None:
            progress(i + 1, len(shapes))
    return weights


def write_checkpoint(
    out_dir: str | Path, config: ModelConfig, seed: int, *, max_file_bytes: int = 2 << 30, dtype=torch.float32
) -> Path:
    """Write config.json, sharded *.safetensors and the index, in the real Qwen3.5 layout.

    Keys carry the `model.language_model.` prefix and the config is `model_type: qwen3_5` with a
    `text_config`, as in released checkpoints; one small `mtp.*` tensor is included (readers must skip it).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = config.to_hf_dict()
    full = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": text,
        "shardd_synthetic": {"seed": seed},
    }
    (out / "config.json").write_text(json.dumps(full, indent=2) + "\n")

    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shard_shapes(config, 0, config.num_layers).items():
        key = name if name == "lm_head.weight" else f"model.language_model.{name}"
        tensor = synthetic_tensor(config, name, shape, seed).to(dtype).contiguous()
        if size and size + tensor.nbytes > max_file_bytes:
            files.append({})
            size = 0
        files[-1][key] = tensor
        size += tensor.nbytes
    files[-1]["mtp.fc.weight"] = torch.zeros(2, 2, dtype=dtype)

    weight_map = {}
    for i, tensors in enumerate(files):
        filename = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        weight_map.update({key: filename for key in tensors})
    index = {"metadata": {"total_size": sum(t.nbytes for f in files for t in f.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
