"""The synthetic model shapes as plain data (dense: `tiny`, `small`, `qwen3.5-27b`; MoE: `tiny-moe`,
`qwen3.5-35b-a3b`, `qwen3.5-122b-a10b`, `qwen3.5-397b-a17b`), and `PRESET[:SEED]` parsing.

Torch-free, so the coordinator can size a launch (`shardctl generate --synthetic small --split 2`)
without importing torch; `shardd.synthetic.model` builds the weights.
"""

from __future__ import annotations

from common.model_config import ModelConfig, config_from_dict


_COMMON = {"model_type": "qwen3_5_text", "hidden_act": "silu", "rms_norm_eps": 1e-6, "eos_token_id": None}


def _qwen35_moe(layers: int, hidden: int, heads: int, value_heads: int, experts: int, routed: int, expert: int) -> dict:
    """A released Qwen3.5 MoE text shape (Qwen/Qwen3.5-*-A*B config.json): 3 GDN : 1 attention, 2 KV heads of 256,
    GDN heads of 128 (16 key heads), 8 or 10 routed experts plus one shared expert as wide as a routed one."""
    return {
        **_COMMON,
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "full_attention_interval": 4,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": experts,
        "num_experts_per_tok": routed,
        "moe_intermediate_size": expert,
        "shared_expert_intermediate_size": expert,
        "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
    }


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
        "max_position_embeddings": 262144,  # the family's: synthetic stand-ins take any context
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
        "max_position_embeddings": 262144,  # the family's: synthetic stand-ins take any context
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
    # Fast MoE tests: the tiny shape with 8 experts of 32, 2 routed per token, a shared expert of 48.
    "tiny-moe": {
        **_COMMON,
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 320,
        "hidden_size": 64,
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
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,  # the family's: synthetic stand-ins take any context
    },
    # The released MoE shapes: (layers, hidden, attention heads, GDN value heads, experts, routed, expert width).
    "qwen3.5-35b-a3b": _qwen35_moe(40, 2048, 16, 32, 256, 8, 512),
    "qwen3.5-122b-a10b": _qwen35_moe(48, 3072, 32, 64, 256, 8, 1024),
    "qwen3.5-397b-a17b": _qwen35_moe(60, 4096, 32, 64, 512, 10, 1024),
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
