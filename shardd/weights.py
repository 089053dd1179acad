"""The one weight loader: reads only the tensors of a layer range from Hugging Face safetensors files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from protocol.layout import owns_embedding, owns_head
from shardd.config import ModelConfig

_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")
_KEY_PREFIXES = ("model.language_model.", "model.")


class WeightError(ValueError):
    """A checkpoint that does not match the config; the message names the key."""


def canonical_key(key: str) -> str | None:
    """Checkpoint key -> our name (`layers.3.mlp.up_proj.weight`), or None for tensors we never read."""
    if key.startswith(_IGNORED_PREFIXES):
        return None
    if key == "lm_head.weight":
        return key
    for prefix in _KEY_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def layer_shapes(config: ModelConfig, index: int) -> dict[str, tuple[int, ...]]:
    c = config
    h = c.hidden_size
    p = f"layers.{index}"
    shapes = {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.mlp.gate_proj.weight": (c.intermediate_size, h),
        f"{p}.mlp.up_proj.weight": (c.intermediate_size, h),
        f"{p}.mlp.down_proj.weight": (h, c.intermediate_size),
    }
    if c.is_gdn(index):
        a = f"{p}.linear_attn"
        shapes.update(
            {
                f"{a}.in_proj_qkv.weight": (c.linear_conv_dim, h),
                f"{a}.in_proj_z.weight": (c.linear_value_dim, h),
                f"{a}.in_proj_b.weight": (c.linear_num_value_heads, h),
                f"{a}.in_proj_a.weight": (c.linear_num_value_heads, h),
                f"{a}.conv1d.weight": (c.linear_conv_dim, 1, c.linear_conv_kernel_dim),
                f"{a}.dt_bias": (c.linear_num_value_heads,),
                f"{a}.A_log": (c.linear_num_value_heads,),
                f"{a}.norm.weight": (c.linear_value_head_dim,),
                f"{a}.out_proj.weight": (h, c.linear_value_dim),
            }
        )
    else:
        a = f"{p}.self_attn"
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        shapes.update(
            {
                f"{a}.q_proj.weight": (2 * q, h),
                f"{a}.k_proj.weight": (kv, h),
                f"{a}.v_proj.weight": (kv, h),
                f"{a}.o_proj.weight": (h, q),
                f"{a}.q_norm.weight": (c.head_dim,),
                f"{a}.k_norm.weight": (c.head_dim,),
            }
        )
    return shapes


def head_name(config: ModelConfig) -> str:
    """The tensor the lm_head reads: the embedding itself when the checkpoint ties them."""
    return "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def shard_shapes(config: ModelConfig, begin: int, end: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the shard owning layers [begin, end) needs, by our name, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    embedding = (config.vocab_size, config.hidden_size)
    if owns_embedding(begin):
        shapes["embed_tokens.weight"] = embedding
    for i in range(begin, end):
        shapes.update(layer_shapes(config, i))
    if owns_head(end, config.num_layers):
        shapes["norm.weight"] = (config.hidden_size,)
        shapes[head_name(config)] = embedding
    return shapes


def embedding_and_head_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The target tensors a DFlash drafter borrows: the token embedding and the lm_head (not the final norm)."""
    embedding = (config.vocab_size, config.hidden_size)
    return {"embed_tokens.weight": embedding, head_name(config): embedding}


def _key_locations(model_dir: Path) -> dict[str, tuple[Path, str]]:
    """Our name -> (file, key in file), from the index when there is one, else from the file headers."""
    index = model_dir / "model.safetensors.index.json"
    locations: dict[str, tuple[Path, str]] = {}
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightError(f"{index} has no 'weight_map'")
        for key, filename in weight_map.items():
            name = canonical_key(key)
            if name is not None:
                locations[name] = (model_dir / filename, key)
        return locations
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = canonical_key(key)
                if name is not None:
                    locations[name] = (path, key)
    return locations


@dataclass
class LoadedWeights:
    tensors: dict[str, torch.Tensor]
    keys_read: list[str] = field(default_factory=list)  # checkpoint keys whose data was read


def load_weights(
    model_dir: str | Path,
    config: ModelConfig,
    begin: int,
    end: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress=None,
) -> LoadedWeights:
    """Load only the tensors of layers [begin, end) (plus embedding / head where this shard owns them)."""
    return load_tensors(model_dir, shard_shapes(config, begin, end), dtype=dtype, device=device, progress=progress)


def load_tensors(
    model_dir: str | Path,
    wanted: dict[str, tuple[int, ...]],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress=None,
) -> LoadedWeights:
    """Load exactly the `wanted` tensors (our names -> expected shapes), nothing else."""
    model_dir = Path(model_dir)
    locations = _key_locations(model_dir)
    missing = [name for name in wanted if name not in locations]
    if missing:
        raise WeightError(f"checkpoint {model_dir} is missing tensor {missing[0]!r} (and {len(missing) - 1} more)")

    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(locations[name][0], []).append(name)
    loaded = LoadedWeights({})
    for path, names in sorted(by_file.items()):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                key = locations[name][1]
                shape = tuple(f.get_slice(key).get_shape())
                if shape != wanted[name]:
                    raise WeightError(f"tensor {key!r} in {path.name} has shape {list(shape)}, expected {list(wanted[name])}")
                tensor = f.get_tensor(key)
                loaded.keys_read.append(key)
                loaded.tensors[name] = tensor.to(device=device, dtype=dtype)
                if progress is not None:
                    progress(len(loaded.keys_read), len(wanted))
    return loaded
