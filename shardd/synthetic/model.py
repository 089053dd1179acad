"""Synthetic Qwen3.5 models: deterministic weights from (seed, tensor name), for any shape.

The same generator writes a checkpoint directory in the real layout (`shardctl make-model`) and builds
the weights in memory (so the 27B shape can be benchmarked without writing 54 GB). Initialisation keeps
activations finite through 64 layers in bf16: residual-branch outputs are scaled by 1/sqrt(2 * layers).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import quantization
from common.model_config import ModelConfig
from shardd.weights.reader import shard_shapes


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


LARGE_TENSOR_BYTES = 1 << 30  # float32 tensors from this size are narrowed on the host (synthetic_tensors)


def synthetic_tensor(config: ModelConfig, name: str, shape: tuple[int, ...], seed: int, device="cpu") -> torch.Tensor:
    """float32 values for tensor `name`, a pure function of (seed, name, shape, generator device type)."""
    device = torch.device(device)
    gen = _generator(seed, name, device)
    # in place: no second float32 copy (the 27B's vocab matrices are 4.7 GiB each in float32)
    normal = lambda std: torch.randn(shape, generator=gen, device=device).mul_(std)  # noqa: E731
    residual_scale = 1.0 / math.sqrt(2 * config.num_layers)
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if name == "embed_tokens.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(2.0 / math.sqrt(config.hidden_size))
    if leaf in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm") or name == "norm.weight":
        return normal(0.1)  # zero-centred: the scale is 1 + w
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + normal(0.1)
    if leaf == "A_log":
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
    if leaf == "dt_bias":
        return 1.0 + normal(0.1)
    if leaf == "conv1d":
        return normal(1.0 / math.sqrt(shape[-1]))
    fan_in = shape[-1]
    std = 1.0 / math.sqrt(fan_in)
    if leaf in ("o_proj", "out_proj", "down_proj"):
        std *= residual_scale
    return normal(std)


def synthetic_weights(
    config: ModelConfig, begin: int, end: int, seed: int, *, dtype=torch.float32, device="cpu", progress=None
) -> dict[str, torch.Tensor]:
    """The tensors of a shard, built in memory (on `device`, so a 27B shard never touches host memory)."""
    return synthetic_tensors(config, shard_shapes(config, begin, end), seed, dtype=dtype, device=device, progress=progress)


def synthetic_tensors(
    config: ModelConfig, shapes: dict[str, tuple[int, ...]], seed: int, *, dtype=torch.float32, device="cpu", progress=None
) -> dict[str, torch.Tensor]:
    """The named tensors (our names -> shapes), each the same as in the whole synthetic model."""
    weights = {}
    total, done = sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize, 0
    for name, shape in shapes.items():
        values = synthetic_tensor(config, name, shape, seed, device)
        if values.device.type == "cuda" and dtype != values.dtype and values.nbytes >= LARGE_TENSOR_BYTES:
            # narrowed on the host (the same numbers), so the device never holds the float32 tensor and its narrowed
            # copy at once: a daemon under --max-gpu-memory loads within its cap (the 27B's lm_head is 4.7 GiB in
            # float32 beside 2.4 GiB in bf16)
            values = values.cpu()
            torch.cuda.empty_cache()
        weights[name] = values.to(dtype=dtype, device=device)
        del values
        done += weights[name].nbytes
        if progress is not None:
            progress(done, total)  # bytes
    return weights


def write_checkpoint(
    out_dir: str | Path, config: ModelConfig, seed: int, *, max_file_bytes: int = 2 << 30, dtype=torch.float32,
    progress=None, quantize: str | None = None,
) -> Path:
    """Write config.json, sharded *.safetensors and the index, in the real Qwen3.5 layout.

    Keys carry the `model.language_model.` prefix and the config is `model_type: qwen3_5` with a
    `text_config`, as in released checkpoints; one small `mtp.*` tensor is included (readers must skip it).
    Files are written one at a time as their tensors are made (at most one file's tensors in memory: the
    27B preset is 54 GB in bf16). `progress(done_bytes, total_bytes)` after each file.
    `quantize` ('fp8-block' or 'fp8-channel', shardd.weights.quant) writes the linears as FP8 with their scales and the
    method's `quantization_config`, as the tools that make released FP8 checkpoints do.
    """
    from shardd.weights import quant

    scheme = quantization.synthetic_scheme(quantize) if quantize else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = config.to_hf_dict()
    full = {
        "architectures": ["Qwen3_5ForConditionalGeneration" if config.moe is None else "Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5" if config.moe is None else "qwen3_5_moe",
        "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": text,
        "shardd_synthetic": {"seed": seed, "quantize": quantize},
    }
    if scheme is not None:
        full["quantization_config"] = quantization.quantization_config(quantize, quantization.SYNTHETIC_IGNORE[quantize])
    (out / "config.json").write_text(json.dumps(full, indent=2) + "\n")

    # Plan the files from the shapes first, so each can be named (-of-N) and written as soon as it is full.
    files: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]  # (checkpoint key, our name, shape) per file
    size = 0
    for name, shape in shard_shapes(config, 0, config.num_layers).items():
        key = name if name == "lm_head.weight" else f"model.language_model.{name}"
        nbytes = math.prod(shape) * dtype.itemsize
        if size and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append((key, name, shape))
        size += nbytes
    total = sum(math.prod(shape) for file in files for _, _, shape in file) * dtype.itemsize

    weight_map, done = {}, 0
    for i, file in enumerate(files):
        filename = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for key, name, shape in file:
            value = synthetic_tensor(config, name, shape, seed)
            if scheme is not None and len(shape) == 2 and key.endswith(".weight") and scheme.quantizes(key[: -len(".weight")]):
                tensors[key], tensors[key.removesuffix("weight") + scheme.scale_key] = quant.quantize(value, quantize)
            else:
                tensors[key] = value.to(dtype).contiguous()
        if i == len(files) - 1:
            tensors["mtp.fc.weight"] = torch.zeros(2, 2, dtype=dtype)
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        weight_map.update({key: filename for key in tensors})
        done += sum(math.prod(shape) for _, _, shape in file) * dtype.itemsize
        del tensors
        if progress is not None:
            progress(done, total)
    index = {"metadata": {"total_size": total + 4 * dtype.itemsize}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
