"""Which `quantization_config`s a checkpoint may carry and how its FP8 linears are stored: parsed from config.json,
torch-free, so shardctl refuses an unloadable checkpoint before it launches a daemon.

Loaded (weights only; activations stay in the model's dtype):
- `quant_method: "fp8"` (transformers' FineGrainedFP8, DeepSeek/Qwen `-FP8` releases): `fmt: "e4m3"`,
  `weight_block_size: [128, 128]`, each linear `weight` float8_e4m3fn with a float32 `weight_scale_inv`
  [ceil(N/128), ceil(K/128)] (partial blocks at the edges); `modules_to_not_convert` stay unquantized;
  `activation_scheme: "dynamic"` only.
- `quant_method: "compressed-tensors"` FP8 (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK): float 8-bit weights with
  a `weight_scale` per output channel [N, 1], per tensor [1] or per 128x128 block; input activations dynamic or
  none; an `ignore` list (names, or `re:` patterns).
Everything else (GPTQ, AWQ, bitsandbytes, NVFP4/modelopt, GGUF, int4/int8 compressed-tensors, static activation
scales, FP8 KV caches) is refused by name: loading it with its scales ignored would compute garbage.
The weights themselves (dequantizing, the FP8 linear) are shardd.weights.quant's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

FP8_BLOCK = "fp8-block"      # quant_method "fp8", weight_scale_inv per [128, 128] block
FP8_CHANNEL = "fp8-channel"  # compressed-tensors FP8, weight_scale per output channel
LAYOUTS = (FP8_BLOCK, FP8_CHANNEL)

# the linear layers of a Qwen3.5 decoder layer: the only modules a quantization_config can quantize here
LINEAR_LEAVES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj",
                 "o_proj", "gate_proj", "up_proj", "down_proj")

_KNOWN_REFUSED = {  # quant_method -> what it is, for the refusal message
    "gptq": "GPTQ int4/int8", "awq": "AWQ int4", "bitsandbytes": "bitsandbytes int8/nf4", "modelopt": "NVIDIA modelopt",
    "gguf": "GGUF", "hqq": "HQQ", "eetq": "EETQ int8", "aqlm": "AQLM", "quanto": "optimum-quanto",
    "torchao": "torchao", "fbgemm_fp8": "FBGEMM FP8 (per-row activations)", "mxfp4": "MXFP4", "bitnet": "BitNet",
    "higgs": "HIGGS", "vptq": "VPTQ", "spqr": "SpQR", "auto-round": "AutoRound", "compressed_tensors": "compressed-tensors",
}


class QuantizationError(ValueError):
    """A quantization_config we cannot load exactly; the message names the method and the field."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linears are stored: the method, the scale key and granularity, what stays unquantized."""

    method: str                          # "fp8" or "compressed-tensors"
    scale_key: str                       # "weight_scale_inv" (fp8) or "weight_scale" (compressed-tensors)
    block: tuple[int, int] | None        # (128, 128), or None: one scale per output channel (or per tensor)
    not_converted: tuple[str, ...] = ()  # fp8: modules_to_not_convert (substrings of the module name)
    ignore: tuple[str, ...] = ()         # compressed-tensors: module names, or `re:` patterns

    @property
    def layout(self) -> str:
        return FP8_BLOCK if self.block is not None else FP8_CHANNEL

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (the checkpoint's name, `model.language_model.layers.0.mlp.up_proj`) is FP8."""
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in LINEAR_LEAVES or ".layers." not in f".{module}":
            return False  # embeddings, norms, conv1d, lm_head: never quantized (transformers keeps lm_head out too)
        if any(entry in module for entry in self.not_converted):
            return False
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif entry == module or module.endswith("." + entry):
                return False
        return True

    def describe(self) -> dict:
        """HELLO's `quantization` field."""
        return {"method": self.method, "layout": self.layout, "weight_dtype": "float8_e4m3fn",
                "block": list(self.block) if self.block else None, "activations": "unquantized (weight-only)"}


def scheme_from_config(raw: dict, where: str = "checkpoint") -> Fp8Scheme | None:
    """The FP8 scheme of a config.json (its `quantization_config`, top level or in `text_config`), None if it has
    none; QuantizationError naming the method otherwise."""
    quant = None
    for section in (raw, raw.get("text_config") or {}):
        if isinstance(section, dict) and section.get("quantization_config") is not None:
            quant = section["quantization_config"]
            break
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise QuantizationError(f"{where}: quantization_config must be a mapping, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8_method(quant, where)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    what = _KNOWN_REFUSED.get(str(method).lower(), "not a method shardd knows")
    raise QuantizationError(
        f"{where} is quantized with quant_method {method!r} ({what}), which shardd does not load: only FP8 "
        f"checkpoints (quant_method 'fp8' with 128x128 blocks, or compressed-tensors FP8) are supported; use the "
        f"unquantized or an FP8 checkpoint"
    )


def _fp8_method(quant: dict, where: str) -> Fp8Scheme:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"{where}: quant_method 'fp8' with fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(
            f"{where}: quant_method 'fp8' with activation_scheme {scheme!r} (static input_scale) is not supported: "
            f"shardd runs FP8 weights with unquantized activations, which a static-activation checkpoint was not "
            f"calibrated for (only 'dynamic')"
        )
    block = quant.get("weight_block_size")
    if block is None:
        raise QuantizationError(
            f"{where}: quant_method 'fp8' without weight_block_size (one scale per tensor) is not supported "
            f"(only weight_block_size [128, 128])")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"{where}: weight_block_size must be two positive integers, got {block!r}")
    if tuple(block) != (128, 128):
        raise QuantizationError(f"{where}: weight_block_size {block} is not supported (only [128, 128])")
    skip = quant.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise QuantizationError(f"{where}: modules_to_not_convert must be a list of module names, got {skip!r}")
    return Fp8Scheme("fp8", "weight_scale_inv", (128, 128), not_converted=tuple(skip))


def _compressed_tensors(quant: dict, where: str) -> Fp8Scheme:
    name = f"{where}: compressed-tensors"
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(
            f"{name} format {fmt!r} is not supported (only FP8 weights, format 'float-quantized'; int4/int8 "
            f"'pack-quantized'/'int-quantized', NVFP4 and sparse formats are refused)")
    if quant.get("kv_cache_scheme") is not None:
        raise QuantizationError(f"{name} with a kv_cache_scheme (quantized KV cache) is not supported")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{name} has no config_groups")
    blocks = set()
    for group_name, group in groups.items():
        where_group = f"{name} config_groups.{group_name}"
        if not isinstance(group, dict):
            raise QuantizationError(f"{where_group} must be a mapping")
        targets = group.get("targets")
        if targets != ["Linear"]:
            raise QuantizationError(f"{where_group}.targets {targets!r} is not supported (only ['Linear'])")
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise QuantizationError(
                f"{where_group}.weights is {weights.get('type')!r} with {weights.get('num_bits')!r} bits: only FP8 "
                f"weights (type 'float', num_bits 8) are supported (int4/int8/NVFP4 are refused)")
        if weights.get("dynamic") or not weights.get("symmetric", True):
            raise QuantizationError(f"{where_group}.weights must be static and symmetric")
        strategy = weights.get("strategy")
        if strategy in ("channel", "tensor"):
            blocks.add(None)
        elif strategy == "block" and weights.get("block_structure") == [128, 128]:
            blocks.add((128, 128))
        else:
            raise QuantizationError(
                f"{where_group}.weights.strategy {strategy!r} is not supported (only 'channel', 'tensor' or "
                f"'block' with block_structure [128, 128])")
        acts = group.get("input_activations")
        if acts is not None and not (acts.get("dynamic") is True and acts.get("type") == "float"):
            raise QuantizationError(
                f"{where_group}.input_activations are static (input_scale): not supported (only dynamic or none; "
                f"shardd keeps activations unquantized)")
        if group.get("output_activations") is not None:
            raise QuantizationError(f"{where_group}.output_activations are not supported")
    if len(blocks) != 1:
        raise QuantizationError(f"{name}: config_groups mix scale layouts {sorted(map(str, blocks))}")
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(s, str) for s in ignore):
        raise QuantizationError(f"{name} ignore must be a list of module names, got {ignore!r}")
    return Fp8Scheme("compressed-tensors", "weight_scale", blocks.pop(), ignore=tuple(ignore))


def quantization_config(layout: str, ignore: list[str]) -> dict:
    """The config.json `quantization_config` of `layout`, as the tools that write real checkpoints write it."""
    if layout == FP8_BLOCK:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ignore}
    if layout == FP8_CHANNEL:
        return {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True},
                "output_activations": None,
            }},
            "ignore": ignore, "kv_cache_scheme": None,
        }
    raise ValueError(f"unknown FP8 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


# What synthetic FP8 models leave unquantized, in each method's own syntax: the head (as every FP8 release does) and
# the GDN `a` projection (so a fused in_proj mixes FP8 and bf16 parts, as checkpoints that skip small layers do).
SYNTHETIC_IGNORE = {FP8_BLOCK: ["lm_head", "linear_attn.in_proj_a"],
                    FP8_CHANNEL: ["lm_head", r"re:.*linear_attn\.in_proj_a$"]}


def synthetic_scheme(layout: str) -> Fp8Scheme:
    return scheme_from_config({"quantization_config": quantization_config(layout, SYNTHETIC_IGNORE[layout])})


def scale_shape(scheme: Fp8Scheme, shape: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a [N, K] weight."""
    n, k = shape
    if scheme.block is not None:
        return (math.ceil(n / scheme.block[0]), math.ceil(k / scheme.block[1]))
    return (n, 1)
