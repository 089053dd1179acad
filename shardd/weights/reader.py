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
from protocol.layout import owns_embedding, owns_head
from shardd.draft.config import DraftConfig

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


def _swiglu_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }


def _residual_shapes(config: ModelConfig | DraftConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """What every decoder layer has around its token mixer: the two norms and the SwiGLU MLP, or the sparse block
    in the hub's layout (one tensor per expert and projection, as save_pretrained writes them)."""
    h = config.hidden_size
    shapes = {f"{prefix}.input_layernorm.weight": (h,), f"{prefix}.post_attention_layernorm.weight": (h,)}
    moe = getattr(config, "moe", None)
    if moe is None:
        shapes.update(_swiglu_shapes(f"{prefix}.mlp", h, config.intermediate_size))
        return shapes
    shapes[f"{prefix}.mlp.gate.weight"] = (moe.num_experts, h)  # the router
    for expert in range(moe.num_experts):
        shapes.update(_swiglu_shapes(f"{prefix}.mlp.experts.{expert}", h, moe.moe_intermediate_size))
    shapes.update(_swiglu_shapes(f"{prefix}.mlp.shared_expert", h, moe.shared_expert_intermediate_size))
    shapes[f"{prefix}.mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


# transformers' in-memory layout of a layer's experts (`Qwen3_5MoeExperts`), which some tools save as it is: two
# tensors per layer, gate and up stacked along the rows
FUSED_GATE_UP = "mlp.experts.gate_up_proj"  # [experts, 2 * moe_intermediate_size, hidden]
FUSED_DOWN = "mlp.experts.down_proj"  # [experts, hidden, moe_intermediate_size]


def fused_expert_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The two fused expert tensors of a MoE layer, by our name, with their shapes."""
    moe, h = config.moe, config.hidden_size
    return {
        f"layers.{layer}.{FUSED_GATE_UP}": (moe.num_experts, 2 * moe.moe_intermediate_size, h),
        f"layers.{layer}.{FUSED_DOWN}": (moe.num_experts, h, moe.moe_intermediate_size),
    }


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


def _attention_shapes(config: ModelConfig | DraftConfig, prefix: str, *, gated: bool) -> dict[str, tuple[int, ...]]:
    """Qwen attention with per-head q/k norms; a gated one's q_proj also yields the output gate."""
    h = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        f"{prefix}.q_proj.weight": (2 * q if gated else q, h),
        f"{prefix}.k_proj.weight": (kv, h),
        f"{prefix}.v_proj.weight": (kv, h),
        f"{prefix}.o_proj.weight": (h, q),
        f"{prefix}.q_norm.weight": (config.head_dim,),
        f"{prefix}.k_norm.weight": (config.head_dim,),
    }


def layer_shapes(config: ModelConfig, index: int) -> dict[str, tuple[int, ...]]:
    c = config
    h = c.hidden_size
    p = f"layers.{index}"
    shapes = _residual_shapes(c, p)
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
        shapes.update(_attention_shapes(c, f"{p}.self_attn", gated=True))
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


def draft_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash drafter needs, by our (= its checkpoint's) name, with its shape."""
    h = config.hidden_size
    shapes = {"fc.weight": (h, config.feature_size), "hidden_norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        shapes.update(_residual_shapes(config, f"layers.{i}"))
        shapes.update(_attention_shapes(config, f"layers.{i}.self_attn", gated=False))
    shapes["norm.weight"] = (h,)
    return shapes


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
