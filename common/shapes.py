"""Which tensors each part of a Qwen3.5 checkpoint holds, by our name, with their shapes, and the bytes they take:
a shard's layer range (dense or MoE), the embedding and head, a DFlash drafter. Torch-free, so shardctl sizes a launch
and splits the layers by bytes with the same tables the daemon loads by (shardd.weights.reader)."""

from __future__ import annotations

import math

from common.model_config import ModelConfig
from common.quantization import Fp8Scheme, scale_shape
from protocol.layout import owns_embedding, owns_head


def _swiglu_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }


def _residual_shapes(config, prefix: str) -> dict[str, tuple[int, ...]]:
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


def _attention_shapes(config, prefix: str, *, gated: bool) -> dict[str, tuple[int, ...]]:
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


def draft_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash drafter needs, by our (= its checkpoint's) name, with its shape."""
    h = config.hidden_size
    shapes = {"fc.weight": (h, config.feature_size), "hidden_norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        shapes.update(_residual_shapes(config, f"layers.{i}"))
        shapes.update(_attention_shapes(config, f"layers.{i}.self_attn", gated=False))
    shapes["norm.weight"] = (h,)
    return shapes




# The parts of a daemon's weights, as a plan prints them.
WEIGHT_PARTS = ("experts", "shared_expert", "mlp", "attention", "gdn", "embedding", "head")


def checkpoint_module(name: str) -> str:
    """The module a tensor of ours belongs to under the released checkpoints' prefix (what a quantization_config
    names): `layers.3.mlp.up_proj.weight` -> `model.language_model.layers.3.mlp.up_proj`."""
    return f"model.language_model.{name.removesuffix('.weight')}"


def fp8_tensors(shapes: dict[str, tuple[int, ...]], scheme: Fp8Scheme | None, module=checkpoint_module) -> set[str]:
    """Our names of the linears among `shapes` that a checkpoint of `scheme` stores as FP8 (`module`: a name's
    module in that checkpoint)."""
    if scheme is None:
        return set()
    return {name for name, shape in shapes.items()
            if name.endswith(".weight") and len(shape) == 2 and scheme.quantizes(module(name))}


def tensor_bytes(shape: tuple[int, ...], dtype_bytes: int, fp8_scheme: Fp8Scheme | None = None) -> int:
    """One tensor's bytes: in the weight dtype, or as FP8 (one byte an element) with its float32 scales."""
    if fp8_scheme is None:
        return math.prod(shape) * dtype_bytes
    return math.prod(shape) + 4 * math.prod(scale_shape(fp8_scheme, shape))


def weight_part(config: ModelConfig, name: str, begin: int) -> str:
    """Which of WEIGHT_PARTS the tensor `name` of a shard starting at layer `begin` is (the router goes with the
    experts, a layer's norms with its token mixer)."""
    if name == "embed_tokens.weight":
        return "embedding" if owns_embedding(begin) else "head"  # a tied head on a shard without the embedding
    if not name.startswith("layers."):
        return "head"  # the final norm and lm_head
    if ".mlp.experts." in name or ".mlp.gate." in name:
        return "experts"
    if ".mlp.shared_expert" in name:
        return "shared_expert"
    if ".mlp." in name:
        return "mlp"
    return "gdn" if config.is_gdn(int(name.split(".")[1])) else "attention"


def weight_bytes_by_part(config: ModelConfig, shapes: dict[str, tuple[int, ...]], *, begin: int, dtype_bytes: int,
                         scheme: Fp8Scheme | None = None, fp8: set[str] | None = None) -> dict[str, int]:
    """The bytes `shapes` (of a shard starting at layer `begin`) take once loaded, by WEIGHT_PARTS: `fp8` names the
    tensors kept as FP8 in `scheme` (default: every linear the scheme quantizes), the rest in the weight dtype."""
    fp8 = fp8_tensors(shapes, scheme) if fp8 is None else fp8
    parts = dict.fromkeys(WEIGHT_PARTS, 0)
    for name, shape in shapes.items():
        parts[weight_part(config, name, begin)] += tensor_bytes(shape, dtype_bytes, scheme if name in fp8 else None)
    return parts


def layer_split_costs(config: ModelConfig, *, dtype_bytes: int, scheme: Fp8Scheme | None = None) -> list[int]:
    """Each layer's weight bytes, the embedding counted with layer 0 and the final norm and head with the last
    (their shards own them): what protocol.layout.balanced_split balances."""
    return [sum(weight_bytes_by_part(config, shard_shapes(config, index, index + 1), begin=index,
                                     dtype_bytes=dtype_bytes, scheme=scheme).values())
            for index in range(config.num_layers)]
