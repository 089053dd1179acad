"""DFlash drafter configuration, read from the draft checkpoint's `config.json` (a Qwen3 config plus DFlash fields).

The draft is `model_type: qwen3` with `num_target_layers` and a `dflash_config` map holding `target_layer_ids`,
`mask_token_id` and (in newer checkpoints) `block_size`; older checkpoints keep `block_size` at the top level.
Sliding windows follow transformers' Qwen3Config: the window exists only with `use_sliding_window: true`, and
applies to the layers whose `layer_types` entry is `sliding_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardd.config import ConfigError, ModelConfig, read_config_json

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
DRAFT_ARCHITECTURE = "DFlashDraftModel"

# Qwen3Config defaults for the fields a draft config may leave out.
_QWEN3_HEAD_DIM = 128
_QWEN3_SLIDING_WINDOW = 4096
_QWEN3_MAX_WINDOW_LAYERS = 28
_QWEN3_ROPE_THETA = 10_000.0


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default choice of target layers: the middle one, or spread evenly over [1, L - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    # Target layers whose outputs (the residual stream after the layer: HF `hidden_states[id + 1]`) are
    # concatenated, in this order, into one context feature row.
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    num_target_layers: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_theta: float = _QWEN3_ROPE_THETA
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32_768

    @property
    def feature_size(self) -> int:
        """Width of one context feature row: the captured target layers side by side."""
        return len(self.target_layer_ids) * self.hidden_size

    def layer_window(self, layer: int) -> int | None:
        """The attention window of draft layer `layer`, or None for full attention."""
        if self.sliding_window is not None and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    def check_target(self, target: ModelConfig) -> None:
        """Raise ConfigError when this draft cannot run on `target` (it uses the target's embedding and head)."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"draft config field 'hidden_size' ({self.hidden_size}) must equal the target's ({target.hidden_size})"
            )
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            raise ConfigError(
                f"draft config field 'num_target_layers' ({self.num_target_layers}) does not match the target's "
                f"{target.num_layers} layers"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConfigError(
                f"draft config field 'dflash_config.target_layer_ids' names layer {bad[0]}, "
                f"outside the target's 0..{target.num_layers - 1}"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(
                f"draft config field 'dflash_config.mask_token_id' ({self.mask_token_id}) is outside the target "
                f"vocabulary 0..{target.vocab_size - 1}"
            )

    def to_hf_dict(self) -> dict:
        """The draft `config.json` this config reads back from (the `dflash_config` form)."""
        return {
            "architectures": [DRAFT_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }


def _int(raw: dict, name: str, *, default: int | None = None, minimum: int = 1, where: str = "") -> int:
    value = raw.get(name, default)
    field = f"{where}{name}"
    if value is None:
        raise ConfigError(f"draft config field {field!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"draft config field {field!r} must be {kind}, got {value!r}")
    return value


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"draft config field 'rope_parameters' must be a mapping, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"draft config field 'rope_parameters.rope_type' = {rope_type!r} is not supported (only 'default')")
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        # The reference rotates q and k whole (Qwen3 apply_rotary_pos_emb); a partial rotary draft does not exist.
        raise ConfigError(f"draft config field 'partial_rotary_factor' = {factor!r} is not supported (only 1.0)")
    theta = params.get("rope_theta", raw.get("rope_theta", _QWEN3_ROPE_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"draft config field 'rope_parameters.rope_theta' must be positive, got {theta!r}")
    return float(theta)


def _sliding(raw: dict, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, window) as transformers' Qwen3Config derives them."""
    use_window = raw.get("use_sliding_window", False)
    if not isinstance(use_window, bool):
        raise ConfigError(f"draft config field 'use_sliding_window' must be a boolean, got {use_window!r}")
    window = _int(raw, "sliding_window", default=_QWEN3_SLIDING_WINDOW) if use_window else None
    types = raw.get("layer_types")
    if types is None:
        first_window_layer = _int(raw, "max_window_layers", default=_QWEN3_MAX_WINDOW_LAYERS, minimum=0)
        return tuple(
            SLIDING_ATTENTION if window is not None and i >= first_window_layer else FULL_ATTENTION
            for i in range(num_layers)
        ), window
    if not isinstance(types, list) or len(types) != num_layers:
        count = len(types) if isinstance(types, list) else type(types).__name__
        raise ConfigError(f"draft config field 'layer_types' must list {num_layers} entries (num_hidden_layers), got {count}")
    for i, kind in enumerate(types):
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ConfigError(
                f"draft config field 'layer_types[{i}]' = {kind!r} is not one of {FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}"
            )
    return tuple(types), window


def _block_size(raw: dict, dflash: dict) -> int:
    inner = dflash.get("block_size")
    outer = raw.get("block_size")
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(
            f"draft config fields 'dflash_config.block_size' ({inner!r}) and 'block_size' ({outer!r}) disagree"
        )
    if inner is not None:
        return _int(dflash, "block_size", where="dflash_config.")
    if outer is not None:
        return _int(raw, "block_size")
    raise ConfigError("draft config field 'dflash_config.block_size' is missing (nor is there a top-level 'block_size')")


def _target_layer_ids(dflash: dict, num_target_layers: int | None, num_layers: int) -> tuple[int, ...]:
    ids = dflash.get("target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ConfigError(
                "draft config field 'num_target_layers' is missing (needed for the default "
                "'dflash_config.target_layer_ids')"
            )
        return tuple(build_target_layer_ids(num_target_layers, num_layers))
    if not isinstance(ids, list) or not ids:
        raise ConfigError(f"draft config field 'dflash_config.target_layer_ids' must be a non-empty list, got {ids!r}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConfigError(f"draft config field 'dflash_config.target_layer_ids' holds {i!r}, not a layer index")
        if num_target_layers is not None and i >= num_target_layers:
            raise ConfigError(
                f"draft config field 'dflash_config.target_layer_ids' names layer {i}, but "
                f"'num_target_layers' is {num_target_layers}"
            )
    return tuple(ids)


def draft_config_from_dict(raw: dict) -> DraftConfig:
    if not isinstance(raw, dict):
        raise ConfigError("draft config must be a JSON object")
    architectures = raw.get("architectures")
    if architectures is not None and (not isinstance(architectures, list) or DRAFT_ARCHITECTURE not in architectures):
        raise ConfigError(f"draft config field 'architectures' = {architectures!r} does not name {DRAFT_ARCHITECTURE!r}")
    dflash = raw.get("dflash_config", {})
    if not isinstance(dflash, dict):
        raise ConfigError(f"draft config field 'dflash_config' must be a mapping, got {dflash!r}")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"draft config field 'hidden_act' = {hidden_act!r} is not supported (only 'silu')")
    if raw.get("attention_bias", False):
        raise ConfigError("draft config field 'attention_bias' = true is not supported")

    num_layers = _int(raw, "num_hidden_layers")
    heads = _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ConfigError(
            f"draft config field 'num_attention_heads' ({heads}) must be a multiple of 'num_key_value_heads' ({kv_heads})"
        )
    head_dim = _int(raw, "head_dim", default=_QWEN3_HEAD_DIM)
    if head_dim % 2:
        raise ConfigError(f"draft config field 'head_dim' must be even for rotary embedding, got {head_dim}")
    num_target_layers = raw.get("num_target_layers")
    if num_target_layers is not None:
        num_target_layers = _int(raw, "num_target_layers")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ConfigError(f"draft config field 'rms_norm_eps' must be positive, got {eps!r}")
    layer_types, window = _sliding(raw, num_layers)
    return DraftConfig(
        hidden_size=_int(raw, "hidden_size"),
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(raw, "vocab_size"),
        target_layer_ids=_target_layer_ids(dflash, num_target_layers, num_layers),
        mask_token_id=_int(dflash, "mask_token_id", minimum=0, where="dflash_config."),
        block_size=_block_size(raw, dflash),
        num_target_layers=num_target_layers,
        layer_types=layer_types,
        sliding_window=window,
        rope_theta=_rope_theta(raw),
        rms_norm_eps=float(eps),
        max_position_embeddings=_int(raw, "max_position_embeddings", default=32_768),
    )


def load_draft_config(draft_dir: str | Path) -> DraftConfig:
    return draft_config_from_dict(read_config_json(draft_dir))
