"""The DFlash draft's tensors, by the reference's key names (`fc.weight`, `hidden_norm.weight`, `layers.*`,
`norm.weight`), read from the draft checkpoint's safetensors files in the style of shardd/weights.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from shardd.draft.config import DraftConfig
from shardd.weights import WeightError


def draft_layer_shapes(config: DraftConfig, index: int) -> dict[str, tuple[int, ...]]:
    c = config
    h = c.hidden_size
    q = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    p = f"layers.{index}"
    return {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (q, h),
        f"{p}.self_attn.k_proj.weight": (kv, h),
        f"{p}.self_attn.v_proj.weight": (kv, h),
        f"{p}.self_attn.o_proj.weight": (h, q),
        f"{p}.self_attn.q_norm.weight": (c.head_dim,),
        f"{p}.self_attn.k_norm.weight": (c.head_dim,),
        f"{p}.mlp.gate_proj.weight": (c.intermediate_size, h),
        f"{p}.mlp.up_proj.weight": (c.intermediate_size, h),
        f"{p}.mlp.down_proj.weight": (h, c.intermediate_size),
    }


def draft_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter needs, by its checkpoint name, with its shape."""
    h = config.hidden_size
    shapes = {"fc.weight": (h, config.feature_size), "hidden_norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        shapes.update(draft_layer_shapes(config, i))
    shapes["norm.weight"] = (h,)
    return shapes


def _key_files(draft_dir: Path) -> dict[str, Path]:
    """Key -> its file, from the index when there is one, else from the file headers."""
    index = draft_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightError(f"{index} has no 'weight_map'")
        pairs = [(key, draft_dir / filename) for key, filename in weight_map.items()]
    else:
        files = sorted(draft_dir.glob("*.safetensors"))
        if not files:
            raise WeightError(f"no *.safetensors files in {draft_dir}")
        pairs = []
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                pairs.extend((key, path) for key in f.keys())
    return dict(pairs)


def load_draft_weights(
    draft_dir: str | Path,
    config: DraftConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Load the draft's tensors; a missing or mis-shaped tensor raises WeightError naming the key."""
    draft_dir = Path(draft_dir)
    wanted = draft_shapes(config)
    files = _key_files(draft_dir)
    missing = [name for name in wanted if name not in files]
    if missing:
        raise WeightError(
            f"draft checkpoint {draft_dir} is missing tensor {missing[0]!r} (expected shape {list(wanted[missing[0]])}; "
            f"and {len(missing) - 1} more)"
        )
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in sorted(by_file.items()):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != wanted[name]:
                    raise WeightError(
                        f"draft tensor {name!r} in {path.name} has shape {list(shape)}, expected {list(wanted[name])}"
                    )
                tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return tensors
