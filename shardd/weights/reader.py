"""The one weight loader, and the tables of what it loads: a shard's layer range of a Qwen3.5 checkpoint, the
target tensors a drafter borrows, a DFlash draft checkpoint. It reads exactly the tensors asked for from Hugging Face
safetensors files; a key mapping (`target_name`, `draft_name`) turns each checkpoint key into our name."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from common.model_config import ModelConfig
from common.shapes import (  # noqa: F401 - the tables of what the loader reads, torch-free
    FUSED_DOWN, FUSED_GATE_UP, draft_shapes, embedding_and_head_shapes, fused_expert_shapes, head_name, layer_shapes,
    shard_shapes,
)

_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")
_KEY_PREFIXES = ("model.language_model.", "model.")


class WeightError(ValueError):
    """A checkpoint that does not match the config; the message names the key."""


def target_name(key: str) -> str | None:
    """Qwen3.5 checkpoint key -> our name (`layers.3.mlp.up_proj.weight`), or None for tensors we never read."""
    if key.startswith(_IGNORED_PREFIXES):
        return None
    if key == "lm_head.weight":
        return key
    for prefix in _KEY_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def draft_name(key: str) -> str:
    """A DFlash draft checkpoint's keys are our names already (`fc.weight`, `layers.0.self_attn.q_proj.weight`)."""
    return key


def split_fused_experts(config: ModelConfig, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> dict:
    """A layer's fused expert tensors as the per-expert names of layer_shapes (views: nothing is copied)."""
    width = config.moe.moe_intermediate_size
    out = {}
    for expert in range(config.moe.num_experts):
        prefix = f"layers.{layer}.mlp.experts.{expert}"
        out[f"{prefix}.gate_proj.weight"] = gate_up[expert, :width]
        out[f"{prefix}.up_proj.weight"] = gate_up[expert, width:]
        out[f"{prefix}.down_proj.weight"] = down[expert]
    return out


def _key_locations(model_dir: Path, names: Callable[[str], str | None]) -> dict[str, tuple[Path, str]]:
    """Our name -> (file, key in file), from the index when there is one, else from the file headers."""
    index = model_dir / "model.safetensors.index.json"
    locations: dict[str, tuple[Path, str]] = {}
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightError(f"{index} has no 'weight_map'")
        for key, filename in weight_map.items():
            name = names(key)
            if name is not None:
                locations[name] = (model_dir / filename, key)
        return locations
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = names(key)
                if name is not None:
                    locations[name] = (path, key)
    return locations


def checkpoint_keys(model_dir: str | Path, names: Callable[[str], str | None] = target_name) -> dict[str, str]:
    """Our name -> the checkpoint's key, for every tensor the checkpoint holds that we may read."""
    return {name: key for name, (_, key) in _key_locations(Path(model_dir), names).items()}


def stored_headers(model_dir: str | Path, wanted: list[str], names: Callable[[str], str | None] = target_name) -> dict:
    """Our name -> (dtype as safetensors names it, e.g. 'F8_E4M3', shape) of each tensor the checkpoint holds, from
    the file headers (no data read)."""
    locations = _key_locations(Path(model_dir), names)
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name in locations:
            by_file.setdefault(locations[name][0], []).append(name)
    headers = {}
    for path, in_file in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in in_file:
                tensor = f.get_slice(locations[name][1])
                headers[name] = (tensor.get_dtype(), tuple(tensor.get_shape()))
    return headers


@dataclass
class LoadedWeights:
    tensors: dict[str, torch.Tensor]
    keys_read: list[str] = field(default_factory=list)  # checkpoint keys whose data was read


def load_tensors(
    model_dir: str | Path,
    wanted: dict[str, tuple[int, ...]],
    *,
    names: Callable[[str], str | None] = target_name,
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
    progress=None,
) -> LoadedWeights:
    """Load exactly the `wanted` tensors (our names -> expected shapes), nothing else; `names` maps the checkpoint's
    keys to our names (None: never read). `dtype` None keeps each tensor's stored dtype (FP8 weights, their scales)."""
    model_dir = Path(model_dir)
    locations = _key_locations(model_dir, names)
    missing = [name for name in wanted if name not in locations]
    if missing:
        first = missing[0]
        raise WeightError(
            f"checkpoint {model_dir} is missing tensor {first!r} (expected shape {list(wanted[first])}; "
            f"and {len(missing) - 1} more)"
        )

    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(locations[name][0], []).append(name)
    loaded = LoadedWeights({})
    total, done = sum(math.prod(shape) for shape in wanted.values()) * (dtype.itemsize if dtype else 1), 0
    for path, in_file in sorted(by_file.items()):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in in_file:
                key = locations[name][1]
                shape = tuple(f.get_slice(key).get_shape())
                if shape != wanted[name]:
                    raise WeightError(f"tensor {key!r} in {path.name} has shape {list(shape)}, expected {list(wanted[name])}")
                tensor = f.get_tensor(key)
                loaded.keys_read.append(key)
                loaded.tensors[name] = tensor.to(device=device, dtype=dtype or tensor.dtype)
                done += loaded.tensors[name].nbytes
                if progress is not None:
                    progress(done, total)  # bytes
    return loaded
