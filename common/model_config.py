"""Qwen3.5 text-model configuration, read from a Hugging Face `config.json` (torch-free: shardctl sizes a launch
from it, the daemons build their layers from it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.quantization import QuantizationError, scheme_from_config


LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class ConfigError(ValueError):
    """A config that we cannot run; the message names the field."""


@dataclass(frozen=True)
class MoeConfig:
    """The sparse feed-forward block of `qwen3_5_moe` (transformers' Qwen3_5MoeSparseMoeBlock), in every layer:
    a softmax router over `num_experts`, the top `num_experts_per_tok` experts (SwiGLU, `moe_intermediate_size`
    wide) weighted by their probabilities (renormalised over the top k when `norm_topk_prob`), plus one shared
    expert (`shared_expert_intermediate_size` wide) scaled by a sigmoid gate."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> 'bfloat16', the name the CLI and the wire use."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoeConfig | None = None  # None: the dense SwiGLU MLP (`intermediate_size`) in every layer

    # Derived sizes, named as in the reference implementation.
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def ffn_width(self) -> int:
        """The widest feed-forward activation one token makes: the dense MLP's, or its experts' and the shared
        expert's together (what a prefill row holds at once)."""
        if self.moe is None:
            return self.intermediate_size
        return self.moe.num_experts_per_tok * self.moe.moe_intermediate_size + self.moe.shared_expert_intermediate_size

    def is_gdn(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR_ATTENTION

    def recurrent_state_bytes(self) -> int:
        """float32 bytes of one GDN layer's recurrent state."""
        return 4 * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim

    def conv_state_bytes(self) -> int:
        """float32 bytes of one GDN layer's conv window (the last kernel-1 inputs)."""
        return 4 * (self.linear_conv_kernel_dim - 1) * self.linear_conv_dim

    def to_hf_dict(self) -> dict:
        """The `qwen3_5_text` (or `qwen3_5_moe_text`) config.json this config reads back from (and transformers
        loads)."""
        moe = self.moe
        sparse = {} if moe is None else {
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
            "norm_topk_prob": moe.norm_topk_prob,
        }
        return {
            "architectures": ["Qwen3_5ForCausalLM" if moe is None else "Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_text" if moe is None else "qwen3_5_moe_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            **({"intermediate_size": self.intermediate_size} if moe is None else sparse),
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "eos_token_id": list(self.eos_token_ids) or None,
        }


_REQUIRED_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)


def _positive_int(raw: dict, name: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(f"config field {name!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
    return value


def _rope(raw: dict) -> tuple[float, float]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config field 'rope_parameters' must be a mapping, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"config field 'rope_parameters.rope_type' = {rope_type!r} is not supported (only 'default')")
    if params.get("mrope_interleaved") and params.get("mrope_section") is None:
        raise ConfigError("config field 'rope_parameters.mrope_section' is missing for interleaved M-RoPE")
    theta = params.get("rope_theta", raw.get("rope_theta", 10_000_000.0))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"config field 'rope_parameters.rope_theta' must be positive, got {theta!r}")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise ConfigError(f"config field 'rope_parameters.partial_rotary_factor' must be in (0, 1], got {factor!r}")
    return float(theta), float(factor)


def _layer_types(raw: dict, num_layers: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        interval = _positive_int(raw, "full_attention_interval", 4)
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(
            f"config field 'layer_types' must list {num_layers} entries (num_hidden_layers), "
            f"got {len(types) if isinstance(types, list) else type(types).__name__}"
        )
    for i, kind in enumerate(types):
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise ConfigError(f"config field 'layer_types[{i}]' = {kind!r} is not one of {LINEAR_ATTENTION!r}, {FULL_ATTENTION!r}")
    return tuple(types)


# model types whose sparse layers differ from Qwen3.5 MoE's (other routing, other expert layout): refused by name
_OTHER_MOE = {
    "qwen3_next": "Qwen3-Next", "qwen3_moe": "Qwen3 MoE", "qwen2_moe": "Qwen2 MoE", "qwen3_vl_moe": "Qwen3-VL MoE",
    "deepseek_v3": "DeepSeek-V3", "deepseek_v2": "DeepSeek-V2", "mixtral": "Mixtral", "gpt_oss": "gpt-oss",
}
_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def _moe(raw: dict) -> MoeConfig:
    """The sparse block of a `qwen3_5_moe_text` config, as transformers builds it; a ConfigError naming the field
    for a variant it does not build (dense layers between sparse ones, other routing)."""
    if raw.get("mlp_only_layers"):
        raise ConfigError(f"config field 'mlp_only_layers' = {raw['mlp_only_layers']!r} is not supported: Qwen3.5 MoE "
                          "has the sparse block in every layer")
    if raw.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"config field 'decoder_sparse_step' = {raw['decoder_sparse_step']!r} is not supported: "
                          "Qwen3.5 MoE has the sparse block in every layer (1)")
    scoring = raw.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ConfigError(f"config field 'scoring_func' = {scoring!r} is not supported (Qwen3.5 MoE routes by softmax)")
    grouped = [name for name in ("n_group", "topk_group") if raw.get(name) not in (None, 1)]
    grouped += [name for name in ("n_routed_experts", "first_k_dense_replace") if raw.get(name) is not None]
    if grouped:
        raise ConfigError(f"config field {grouped[0]!r} (grouped or DeepSeek-style routing) is not supported: Qwen3.5 "
                          "MoE routes by softmax over all experts, top k")
    if raw.get("routed_scaling_factor", 1) != 1:
        raise ConfigError(f"config field 'routed_scaling_factor' = {raw['routed_scaling_factor']!r} is not supported "
                          "(Qwen3.5 MoE weights the experts by their router probabilities alone)")
    norm = raw.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ConfigError(f"config field 'norm_topk_prob' must be a boolean, got {norm!r}")
    moe = MoeConfig(
        num_experts=_positive_int(raw, "num_experts"),
        num_experts_per_tok=_positive_int(raw, "num_experts_per_tok"),
        moe_intermediate_size=_positive_int(raw, "moe_intermediate_size"),
        shared_expert_intermediate_size=_positive_int(raw, "shared_expert_intermediate_size"),
        norm_topk_prob=norm,
    )
    if moe.num_experts_per_tok > moe.num_experts:
        raise ConfigError(f"config field 'num_experts_per_tok' ({moe.num_experts_per_tok}) exceeds 'num_experts' "
                          f"({moe.num_experts})")
    return moe


def config_from_dict(raw: dict) -> ModelConfig:
    """Parse `model_type: qwen3_5` / `qwen3_5_moe` (with `text_config`) or `qwen3_5_text` / `qwen3_5_moe_text`."""
    if not isinstance(raw, dict):
        raise ConfigError("config must be a JSON object")
    model_type = raw.get("model_type")
    tie = raw.get("tie_word_embeddings")
    if model_type in _TEXT_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"config field 'text_config' is missing (model_type {model_type!r})")
        if tie is None:
            tie = text.get("tie_word_embeddings")
        raw = text
        model_type = raw.get("model_type", _TEXT_TYPES[model_type])
    if model_type in _OTHER_MOE or str(model_type).removesuffix("_text") in _OTHER_MOE:
        name = _OTHER_MOE[str(model_type).removesuffix("_text")]
        raise ConfigError(f"config field 'model_type' = {model_type!r} ({name}) is a MoE variant shardd does not "
                          "implement: only Qwen3.5 MoE ('qwen3_5_moe') and dense Qwen3.5 ('qwen3_5') are supported")
    if model_type not in _TEXT_TYPES.values():
        raise ConfigError(f"config field 'model_type' = {model_type!r} is not supported (expected 'qwen3_5', "
                          "'qwen3_5_text', 'qwen3_5_moe' or 'qwen3_5_moe_text')")
    moe = _moe(raw) if model_type == "qwen3_5_moe_text" else None
    if tie is None:
        tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"config field 'tie_word_embeddings' must be a boolean, got {tie!r}")

    ints = {name: _positive_int(raw, name) for name in _REQUIRED_INTS}
    # a MoE config has no dense MLP; its width stands in where a dense width is asked (a synthetic drafter's)
    ints["intermediate_size"] = _positive_int(raw, "intermediate_size",
                                              moe.shared_expert_intermediate_size if moe else None)
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"config field 'hidden_act' = {hidden_act!r} is not supported (only 'silu')")
    if raw.get("attention_bias", False):
        raise ConfigError("config field 'attention_bias' = true is not supported by Qwen3.5 layers")
    head_dim = _positive_int(raw, "head_dim", ints["hidden_size"] // ints["num_attention_heads"])
    if ints["num_attention_heads"] % ints["num_key_value_heads"]:
        raise ConfigError(
            f"config field 'num_attention_heads' ({ints['num_attention_heads']}) must be a multiple of "
            f"'num_key_value_heads' ({ints['num_key_value_heads']})"
        )
    if ints["linear_num_value_heads"] % ints["linear_num_key_heads"]:
        raise ConfigError(
            f"config field 'linear_num_value_heads' ({ints['linear_num_value_heads']}) must be a multiple of "
            f"'linear_num_key_heads' ({ints['linear_num_key_heads']})"
        )
    theta, factor = _rope(raw)
    if int(head_dim * factor) % 2:
        raise ConfigError(f"config field 'partial_rotary_factor' gives an odd rotary dim {head_dim * factor} for head_dim {head_dim}")
    eps = raw.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ConfigError(f"config field 'rms_norm_eps' must be positive, got {eps!r}")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    return ModelConfig(
        **ints,
        head_dim=head_dim,
        layer_types=_layer_types(raw, ints["num_hidden_layers"]),
        linear_conv_kernel_dim=_positive_int(raw, "linear_conv_kernel_dim", 4),
        rope_theta=theta,
        partial_rotary_factor=factor,
        rms_norm_eps=float(eps),
        tie_word_embeddings=tie,
        max_position_embeddings=_positive_int(raw, "max_position_embeddings", 262_144),
        eos_token_ids=eos_ids,
        moe=moe,
    )


def read_config_json(model_dir: str | Path) -> dict:
    """The parsed `config.json` of a model (or draft) directory; a clear ConfigError otherwise."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json in {model_dir}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    raw = read_config_json(model_dir)
    check_quantization(raw, model_dir)
    return config_from_dict(raw)


def check_quantization(raw: dict, model_dir: str | Path):
    """The checkpoint's FP8 scheme, None when unquantized; a ConfigError naming the method for any quantization we
    cannot load exactly (GPTQ, AWQ, ...: their scales would be ignored and compute garbage)."""
    try:
        return scheme_from_config(raw, str(model_dir))
    except QuantizationError as exc:
        raise ConfigError(str(exc)) from None


def context_problem(max_context: int, max_position_embeddings: int, allow_long_context: bool) -> str | None:
    """Why `--max-context` cannot be served by a model trained on `max_position_embeddings` positions (None when
    it can): positions past those are outside what the model learned, so only an operator who asks by name
    (`--allow-long-context`, vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN) gets them."""
    if max_context <= max_position_embeddings or allow_long_context:
        return None
    return (f"{max_context} tokens is more than the model's max_position_embeddings ({max_position_embeddings}); "
            f"give at most {max_position_embeddings}, or add --allow-long-context to use positions it was not trained on")
