"""DFlash drafter configuration, read from the draft checkpoint's `config.json` (a Qwen3 config plus DFlash fields).

The draft is `model_type: qwen3` with `num_target_layers`, `rope_theta` and a `dflash_config` map holding
`target_layer_ids` and `mask_token_id`. z-lab's published configs keep `block_size` at the top level (their loaders
read `config.block_size`), newer ones also inside `dflash_config`; SGLang reads `dflash_config` first and the top
level second, and so do we for `block_size`, `num_target_layers`, `mask_token_id` and `target_layer_ids`, refusing a
config where the two places disagree.
Sliding windows follow transformers' Qwen3Config: the window exists only with `use_sliding_window: true`, and
applies to the layers whose `layer_types` entry is `sliding_attention`.
Fields other implementations read for computations we do not implement (`_UNIMPLEMENTED`: logit and embedding
scales, soft-capping, attention sinks, causality and window switches, ...) are refused by name unless they hold a
value that changes nothing, and so is any `dflash_config` key we do not know.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.model_config import ConfigError, ModelConfig, read_config_json


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
DRAFT_ARCHITECTURE = "DFlashDraftModel"

# Qwen3Config defaults for the fields a draft config may leave out.
_QWEN3_HEAD_DIM = 128
_QWEN3_SLIDING_WINDOW = 4096
_QWEN3_MAX_WINDOW_LAYERS = 28


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
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32_768

    @property
    def feature_size(self) -> int:
        """Width of one context feature row: the captured target layers side by side."""
        return len(self.target_layer_ids) * self.hidden_size

    def context_bytes(self, positions: int, itemsize: int) -> int:
        """One sequence's context K/V over `positions` positions, every draft layer (the drafter's state)."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * positions * self.head_dim * itemsize

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
        """The draft `config.json` this config reads back from, in the shape z-lab publishes: `block_size` and
        `rope_theta` at the top level, where z-lab's loaders read them, and `block_size` in `dflash_config` as well."""
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
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }


# ---- fields we do not implement ---------------------------------------------------------------------------------
# Each changes what a drafter computes in the implementation that reads it, so a config that needs one is refused by
# name rather than drafted from wrongly. Each is accepted at the values that change nothing (absent always is);
# `neutral` gives them for the config at hand.


@dataclass(frozen=True)
class _Unimplemented:
    field: str  # "dflash_config.<key>" or a top-level key
    effect: str  # what it does, and where
    neutral: Callable[[DraftConfig], tuple]


def _agreeing_causality(config: DraftConfig) -> tuple:
    """The forced causality (vLLM's `is_causal` / `dflash_config.causal`) that matches ours on every layer."""
    sliding = [config.layer_window(i) is not None for i in range(config.num_hidden_layers)]
    return (None,) + ((True,) if all(sliding) else ()) + ((False,) if not any(sliding) else ())


def _window_in_effect(config: DraftConfig) -> tuple:
    slides = any(config.layer_window(i) is not None for i in range(config.num_hidden_layers))
    return (None, config.sliding_window) if slides else (None,)


_UNIMPLEMENTED = (
    _Unimplemented("dflash_config.input_embedding_scale", "scales the block's embeddings (vLLM DFlash2)",
                   lambda c: (1.0,)),
    _Unimplemented("dflash_config.output_multiplier", "scales the draft logits (SGLang)", lambda c: (1.0,)),
    # SGLang reads 0 as no cap; vLLM divides by the top-level value whenever it is not null.
    _Unimplemented("dflash_config.final_logit_softcapping", "tanh-caps the draft logits (SGLang)",
                   lambda c: (None, 0)),
    _Unimplemented("final_logit_softcapping", "tanh-caps the draft logits (vLLM)", lambda c: (None,)),
    _Unimplemented("logit_scale", "scales the draft logits (vLLM)", lambda c: (1.0,)),
    _Unimplemented("dflash_config.attention_sink_bias", "adds a learned per-head sink logit to attention "
                   "(vLLM, SGLang)", lambda c: (None, False)),
    _Unimplemented("add_swa_attention_sink_bias", "adds a learned per-head sink logit to attention (vLLM)",
                   lambda c: (None, False)),
    _Unimplemented("dflash_config.attention_value_scale", "scales V before attention (SGLang)",
                   lambda c: (None, 1.0)),
    _Unimplemented("dflash_config.causal", "forces every layer causal or non-causal (vLLM)", _agreeing_causality),
    _Unimplemented("is_causal", "forces every layer causal or non-causal (vLLM)", _agreeing_causality),
    _Unimplemented("dflash_config.use_swa", "puts a sliding window on every layer (vLLM)", lambda c: (None, False)),
    _Unimplemented("dflash_config.swa_window_size", "replaces 'sliding_window' for the sliding layers (vLLM)",
                   _window_in_effect),
    _Unimplemented("dflash_config.conv_kernel_size", "adds a grouped convolution (SGLang DFlash2)", lambda c: (None, 0)),
    _Unimplemented("dflash_config.conv_group_size", "adds a grouped convolution (SGLang DFlash2)", lambda c: (None, 0)),
    _Unimplemented("dflash_config.selector_rank", "adds a candidate selector (SGLang DFlash2)", lambda c: (None, 0)),
    _Unimplemented("dflash_config.selector_top_k", "adds a candidate selector (SGLang DFlash2)", lambda c: (None, 0)),
    _Unimplemented("dflash_config.projector_type", "swaps the feature projector (SGLang Domino)", lambda c: (None,)),
    _Unimplemented("dflash_config.sample_from_anchor", "changes which block rows are drafted (SGLang)",
                   lambda c: (True,)),
    _Unimplemented("dflash_config.use_aux_hidden_state", "drops fc and the target features when false (vLLM)",
                   lambda c: (True,)),
    _Unimplemented("use_aux_hidden_state", "drops fc and the target features when false (vLLM)", lambda c: (True,)),
    _Unimplemented("target_hidden_size", "takes target features of another width (vLLM)",
                   lambda c: (None, c.hidden_size)),
    _Unimplemented("draft_vocab_size", "drafts over a reduced vocabulary mapped by d2t (vLLM)",
                   lambda c: (None, c.vocab_size)),
    _Unimplemented("is_neox_style", "rotates interleaved pairs when false (vLLM)", lambda c: (True,)),
    _Unimplemented("rope_is_neox_style", "rotates interleaved pairs when false (SGLang)", lambda c: (True,)),
    _Unimplemented("has_embed_tokens", "gives the draft its own token embedding (SGLang)", lambda c: (None, False)),
    _Unimplemented("has_lm_head", "gives the draft its own head (SGLang)", lambda c: (None, False)),
)
# The dflash_config keys we read ('mask_token' names the mask for a tokenizer; 'mask_token_id' is what we use).
_DFLASH_KEYS = {"block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "mask_token"}
_DFLASH_KEYS |= {f.field.removeprefix("dflash_config.") for f in _UNIMPLEMENTED if f.field.startswith("dflash_config.")}


def _equal(value, neutral) -> bool:
    """value == neutral, without Python's True == 1 == 1.0."""
    if isinstance(value, bool) or isinstance(neutral, bool) or value is None or neutral is None:
        return value is neutral
    return value == neutral


def _refuse_unimplemented(raw: dict, dflash: dict, config: DraftConfig) -> None:
    unknown = sorted(set(dflash) - _DFLASH_KEYS)
    if unknown:  # every dflash_config key is DFlash behaviour: one we do not know, we do not implement either
        key = unknown[0]
        raise ConfigError(
            f"draft config field 'dflash_config.{key}' = {json.dumps(dflash[key])} is not supported: shardd does "
            f"not know what it changes"
        )
    for entry in _UNIMPLEMENTED:
        key = entry.field.removeprefix("dflash_config.")
        where = dflash if entry.field.startswith("dflash_config.") else raw
        if key not in where:
            continue
        value, neutral = where[key], entry.neutral(config)
        if not any(_equal(value, n) for n in neutral):
            accepted = " or ".join(json.dumps(n) for n in neutral)
            raise ConfigError(
                f"draft config field {entry.field!r} = {json.dumps(value)} is not supported: it {entry.effect}; "
                f"shardd accepts only {accepted}"
            )


def _checked_int(value, field: str, minimum: int = 1) -> int:
    if value is None:
        raise ConfigError(f"draft config field {field!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"draft config field {field!r} must be {kind}, got {value!r}")
    return value


def _int(raw: dict, name: str, *, default: int | None = None, minimum: int = 1, where: str = "") -> int:
    return _checked_int(raw.get(name, default), f"{where}{name}", minimum)


def _dflash_field(raw: dict, dflash: dict, name: str) -> tuple[object, str]:
    """(value, field name) of a DFlash field kept in `dflash_config` or at the top level; None when in neither."""
    inner, outer = dflash.get(name), raw.get(name)
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(f"draft config fields 'dflash_config.{name}' ({inner!r}) and '{name}' ({outer!r}) disagree")
    if inner is None and outer is not None:
        return outer, name
    return inner, f"dflash_config.{name}"


def _dflash_int(raw: dict, dflash: dict, name: str, *, minimum: int = 1) -> int:
    value, field = _dflash_field(raw, dflash, name)
    if value is None:
        raise ConfigError(f"draft config field 'dflash_config.{name}' is missing (nor is there a top-level {name!r})")
    return _checked_int(value, field, minimum)


def _rope_theta(raw: dict) -> float:
    where = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"  # transformers 5 / 4 spelling
    params = raw.get(where) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"draft config field {where!r} must be a mapping, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"draft config field '{where}.rope_type' = {rope_type!r} is not supported (only 'default')")
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        # The reference rotates q and k whole (Qwen3 apply_rotary_pos_emb); a partial rotary draft does not exist.
        raise ConfigError(f"draft config field 'partial_rotary_factor' = {factor!r} is not supported (only 1.0)")
    inner, outer = params.get("rope_theta"), raw.get("rope_theta")
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(f"draft config fields '{where}.rope_theta' ({inner!r}) and 'rope_theta' ({outer!r}) disagree")
    theta, field = (outer, "rope_theta") if inner is None else (inner, f"{where}.rope_theta")
    if theta is None:
        # No default: transformers' Qwen3Config assumes 10000, vLLM's DFlash loader 1000000.
        raise ConfigError("draft config field 'rope_theta' is missing (nor is there a 'rope_parameters.rope_theta')")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"draft config field {field!r} must be positive, got {theta!r}")
    return float(theta)


def _sliding(raw: dict, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, window) as transformers' Qwen3Config derives them."""
    use_window = raw.get("use_sliding_window", False)
    if not isinstance(use_window, bool):
        raise ConfigError(f"draft config field 'use_sliding_window' must be a boolean, got {use_window!r}")
    window = raw.get("sliding_window", _QWEN3_SLIDING_WINDOW) if use_window else None
    if window is not None:
        window = _checked_int(window, "sliding_window")
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
    sliding = [i for i, kind in enumerate(types) if kind == SLIDING_ATTENTION]
    if sliding and window is None:
        # Qwen3Config drops the window here; vLLM and SGLang then refuse the drafter rather than run those layers
        # unwindowed, and so do we.
        reason = "'sliding_window' is null" if use_window else "'use_sliding_window' is not true"
        raise ConfigError(
            f"draft config field 'layer_types' makes layers {sliding} sliding_attention, but {reason}, so there is "
            f"no window for them"
        )
    return tuple(types), window


def _target_layer_ids(raw: dict, dflash: dict, num_target_layers: int | None, num_layers: int) -> tuple[int, ...]:
    ids, field = _dflash_field(raw, dflash, "target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ConfigError(
                "draft config field 'num_target_layers' is missing (needed for the default "
                "'dflash_config.target_layer_ids')"
            )
        return tuple(build_target_layer_ids(num_target_layers, num_layers))
    if not isinstance(ids, list) or not ids:
        raise ConfigError(f"draft config field {field!r} must be a non-empty list, got {ids!r}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConfigError(f"draft config field {field!r} holds {i!r}, not a layer index")
        if num_target_layers is not None and i >= num_target_layers:
            raise ConfigError(
                f"draft config field {field!r} names layer {i}, but 'num_target_layers' is {num_target_layers}"
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
    num_target_layers, field = _dflash_field(raw, dflash, "num_target_layers")
    if num_target_layers is not None:
        num_target_layers = _checked_int(num_target_layers, field)
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ConfigError(f"draft config field 'rms_norm_eps' must be positive, got {eps!r}")
    layer_types, window = _sliding(raw, num_layers)
    config = DraftConfig(
        hidden_size=_int(raw, "hidden_size"),
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(raw, "vocab_size"),
        target_layer_ids=_target_layer_ids(raw, dflash, num_target_layers, num_layers),
        mask_token_id=_dflash_int(raw, dflash, "mask_token_id", minimum=0),
        block_size=_dflash_int(raw, dflash, "block_size"),
        num_target_layers=num_target_layers,
        layer_types=layer_types,
        sliding_window=window,
        rope_theta=_rope_theta(raw),
        rms_norm_eps=float(eps),
        max_position_embeddings=_int(raw, "max_position_embeddings", default=32_768),
    )
    _refuse_unimplemented(raw, dflash, config)
    return config


def load_draft_config(draft_dir: str | Path) -> DraftConfig:
    raw = read_config_json(draft_dir)
    if isinstance(raw, dict) and raw.get("quantization_config") is not None:  # its scales would be ignored
        method = (raw["quantization_config"] or {}).get("quant_method") if isinstance(raw["quantization_config"], dict) else None
        raise ConfigError(f"{draft_dir}: a quantized drafter (quant_method {method!r}) is not supported; only the "
                          f"target's layers load FP8: use the drafter's unquantized checkpoint")
    return draft_config_from_dict(raw)


# ---- the drafter a daemon hosts (--draft DIR|synthetic[:LAYERS]) ------------------------------------

SYNTHETIC_DRAFT = "synthetic"
DEFAULT_SYNTHETIC_DRAFT_LAYERS = 2


def parse_draft(spec: str) -> tuple[str | None, int | None]:
    """'DIR' -> (DIR, None); 'synthetic' or 'synthetic:N' -> (None, N draft layers)."""
    name, _, layers = spec.partition(":")
    if name != SYNTHETIC_DRAFT:
        return spec, None
    try:
        count = int(layers) if layers else DEFAULT_SYNTHETIC_DRAFT_LAYERS
    except ValueError:
        raise ValueError(f"--draft synthetic:N takes a number of draft layers, got {layers!r}") from None
    if count < 1:
        raise ValueError(f"--draft synthetic:N needs at least one draft layer, got {count}")
    return None, count


def draft_config_of(spec: str, target: ModelConfig) -> DraftConfig:
    """The config of the drafter `spec` (--draft) names: its checkpoint's config.json, or the synthetic drafter's
    shape for `target`."""
    draft_dir, layers = parse_draft(spec)
    return load_draft_config(draft_dir) if draft_dir is not None else synthetic_draft_config(target, num_layers=layers)


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
