"""Build a ShardModel, and a hosted DFlash drafter, from a checkpoint directory or a synthetic preset: the one
place a daemon gets weights."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from common import quantization
from common.shapes import checkpoint_module, fp8_tensors, weight_bytes_by_part
from common.model_config import ModelConfig, check_quantization, dtype_name, load_config, read_config_json
from common.presets import parse_synthetic, preset_config
from shardd.weights import quant
from common.draft_config import DraftConfig, draft_config_of, load_draft_config, parse_draft, synthetic_draft_config
from shardd.draft.model import DFlashDrafter
from shardd.draft.synthetic import synthetic_draft_weights
from shardd.engine.reference.rollback import RollbackStorage
from shardd.engine.reference.shard import ShardModel
from shardd.synthetic.model import synthetic_tensor, synthetic_tensors
from shardd.weights.reader import (
    FUSED_GATE_UP, WeightError, checkpoint_keys, draft_name, draft_shapes, embedding_and_head_shapes,
    fused_expert_shapes, head_name, load_tensors, shard_shapes, split_fused_experts, stored_headers,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a checkpoint directory, or `synthetic` = 'PRESET[:SEED]' (with `quantize`, its
    linears as FP8 in that layout, exactly as `shardctl make-model --quantize` writes them)."""

    model_dir: str | None = None
    synthetic: str | None = None
    quantize: str | None = None  # synthetic only: 'fp8-block' or 'fp8-channel'

    def __post_init__(self):
        if (self.model_dir is None) == (self.synthetic is None):
            raise ValueError("give exactly one of a model directory or a synthetic preset")
        if self.quantize is not None:
            if self.synthetic is None:
                raise ValueError("--quantize applies to --synthetic; a checkpoint's config.json says how it is quantized")
            if self.quantize not in quantization.LAYOUTS:
                raise ValueError(f"--quantize must be one of {', '.join(quantization.LAYOUTS)}, got {self.quantize!r}")

    def scheme(self) -> quantization.Fp8Scheme | None:
        """How the linears are stored: None for unquantized weights."""
        if self.synthetic is not None:
            return quantization.synthetic_scheme(self.quantize) if self.quantize else None
        return check_quantization(read_config_json(self.model_dir), self.model_dir)

    def config(self) -> ModelConfig:
        if self.synthetic is not None:
            return preset_config(parse_synthetic(self.synthetic)[0])
        return load_config(self.model_dir)

    @property
    def seed(self) -> int:
        """The synthetic seed (0 for a checkpoint directory)."""
        return parse_synthetic(self.synthetic)[1] if self.synthetic is not None else 0

    def fingerprint(self, device: torch.device) -> str:
        """Identifies the weights, so a coordinator can refuse shards built from different checkpoints."""
        if self.synthetic is not None:
            preset, seed = parse_synthetic(self.synthetic)
            # The generator's device type is part of the identity: CPU and CUDA generators differ.
            return f"synthetic:{preset}:{seed}:{device.type}" + (f":{self.quantize}" if self.quantize else "")
        return checkpoint_fingerprint(self.model_dir)

    def tensors(
        self, shapes: dict[str, tuple[int, ...]], *, dtype: torch.dtype, device: str = "cpu", progress=None,
        keep_fp8: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Exactly the named tensors (our names -> shapes): generated, or read from the checkpoint. FP8 linears come
        back as `quant.Fp8Linear`s with `keep_fp8`, else dequantized to `dtype` (the CPU reference path)."""
        scheme = self.scheme()
        fp8 = self.fp8_names(shapes, scheme)
        plain = {name: shape for name, shape in shapes.items() if name not in fp8}
        if self.synthetic is not None:
            tensors = synthetic_tensors(self.config(), plain, self.seed, dtype=dtype, device=device, progress=progress)
            stored = {name: quant.quantize(synthetic_tensor(self.config(), name, shapes[name], self.seed, device),
                                           self.quantize) for name in fp8}
        else:
            fused = self._fused_expert_layers(shapes, scheme)
            for layer in fused:  # read as the two fused tensors, handed out as per-expert views
                plain = {name: shape for name, shape in plain.items() if not _is_expert_of(name, layer)}
                plain.update(fused_expert_shapes(self.config(), layer))
            tensors = load_tensors(self.model_dir, plain, dtype=dtype, device=device, progress=progress).tensors
            for layer in fused:
                gate_up, down = (tensors.pop(name) for name in fused_expert_shapes(self.config(), layer))
                tensors.update(split_fused_experts(self.config(), layer, gate_up, down))
            stored = self._read_fp8(fp8, shapes, scheme, device) if fp8 else {}
        for name, (weight, scale) in stored.items():
            if keep_fp8:
                tensors[name] = quant.Fp8Linear(weight, scale, scheme.block)
            else:
                tensors[name] = quant.dequantize(weight, scale, scheme.block).to(dtype)
        return tensors

    def _fused_expert_layers(self, shapes: dict[str, tuple[int, ...]], scheme) -> list[int]:
        """The MoE layers among `shapes` whose experts the checkpoint stores fused (transformers' in-memory
        `mlp.experts.gate_up_proj` / `down_proj`) rather than one tensor per expert."""
        config = self.config()
        if config.moe is None:
            return []
        keys = checkpoint_keys(self.model_dir)
        layers = sorted({int(name.split(".")[1]) for name in shapes if name.endswith(".mlp.experts.0.gate_proj.weight")})
        fused = [layer for layer in layers if f"layers.{layer}.mlp.experts.0.gate_proj.weight" not in keys
                 and f"layers.{layer}.{FUSED_GATE_UP}" in keys]
        if fused and scheme is not None:
            raise WeightError(
                f"checkpoint {self.model_dir} stores the experts of layer {fused[0]} fused "
                f"({keys[f'layers.{fused[0]}.{FUSED_GATE_UP}']!r}) with {scheme.method} quantization: FP8 experts are "
                f"loaded one tensor per expert (mlp.experts.E.gate_proj.weight and its scale), as the official FP8 "
                f"checkpoints store them")
        return fused

    def fp8_names(self, shapes: dict[str, tuple[int, ...]], scheme: quantization.Fp8Scheme | None) -> set[str]:
        """Our names of the tensors among `shapes` that are stored as FP8."""
        if scheme is None:
            return set()
        keys = checkpoint_keys(self.model_dir) if self.model_dir is not None else {}
        module = lambda name: keys[name].removesuffix(".weight") if name in keys else checkpoint_module(name)  # noqa: E731
        return fp8_tensors(shapes, scheme, module)

    def _read_fp8(self, fp8: set[str], shapes, scheme: quantization.Fp8Scheme, device) -> dict:
        """(weight, scale) of each FP8 linear, as stored; a WeightError naming the tensor when the checkpoint's
        dtypes disagree with its quantization_config."""
        scale_name = lambda name: name.removesuffix("weight") + scheme.scale_key  # noqa: E731
        headers = stored_headers(self.model_dir, [*shapes, *(scale_name(n) for n in fp8)])
        for name in shapes:
            if name in headers and (headers[name][0] == "F8_E4M3") != (name in fp8):
                raise WeightError(
                    f"tensor {name!r} of {self.model_dir} is stored as {headers[name][0]}, but its quantization_config "
                    f"({scheme.method}) {'quantizes' if name in fp8 else 'leaves unquantized'} it")
        wanted = {}
        for name in sorted(fp8):
            wanted[name] = shapes[name]
            expected = quant.scale_shape(scheme, shapes[name])
            found = headers.get(scale_name(name), (None, expected))[1]
            if scheme.block is None and found in ((shapes[name][0],), (1,), (1, 1), ()):
                expected = found  # per-channel [N], or one scale per tensor: broadcast below
            wanted[scale_name(name)] = expected
        loaded = load_tensors(self.model_dir, wanted, dtype=None, device=device).tensors
        stored = {}
        for name in fp8:
            scale = loaded[scale_name(name)].to(torch.float32)
            if scheme.block is None:
                scale = scale.reshape(-1, 1).expand(shapes[name][0], 1).contiguous()
            stored[name] = (loaded[name], scale)
        return stored

    def weight_bytes(self, shapes: dict[str, tuple[int, ...]], *, dtype: torch.dtype, keep_fp8: bool,
                     begin: int = 0) -> dict[str, int]:
        """The bytes `tensors(shapes, ...)` (a shard's from layer `begin`) will hold, by common.shapes.WEIGHT_PARTS,
        before loading anything (the memory budget's first line)."""
        scheme = self.scheme()
        fp8 = self.fp8_names(shapes, scheme) if keep_fp8 else set()
        return weight_bytes_by_part(self.config(), shapes, begin=begin, dtype_bytes=dtype.itemsize, scheme=scheme,
                                    fp8=fp8)


def _is_expert_of(name: str, layer: int) -> bool:
    """Whether `name` is one routed expert's tensor of `layer` (`layers.3.mlp.experts.17.up_proj.weight`)."""
    return name.startswith(f"layers.{layer}.mlp.experts.")


def checkpoint_fingerprint(directory: str | Path) -> str:
    """sha256 over config.json and the safetensors headers (names, dtypes, shapes, offsets) of a directory."""
    digest = hashlib.sha256()
    root = Path(directory)
    digest.update((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(path.name.encode())
            digest.update(f.read(min(header_len, 1 << 24)))
    return "sha256:" + digest.hexdigest()[:32]


def build_shard(
    source: ModelSource,
    begin: int,
    end: int,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    storage: RollbackStorage = RollbackStorage(None, 0),
    progress=None,
    keep_fp8: bool = False,
) -> ShardModel:
    config = source.config()
    torch_dtype = DTYPES[dtype]
    if torch_dtype == torch.float32:
        # float32 means float32: TF32 matmuls and convs would break token-exact agreement with greedy decoding.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    weights = source.tensors(shard_shapes(config, begin, end), dtype=torch_dtype, device=device, progress=progress,
                             keep_fp8=keep_fp8)
    fingerprint = source.fingerprint(torch.device(device))
    return ShardModel(config, weights, begin, end, dtype=torch_dtype, device=device, storage=storage, fingerprint=fingerprint)


# ---- a hosted DFlash drafter -----------------------------------------------------------------------

def draft_feature_size(target: ModelConfig, draft: str) -> int:
    """The width of the features the drafter named by `draft` reads, from its config alone (before any weight
    loads: the daemon sizes its frame limit with it when it binds)."""
    return draft_config_of(draft, target).feature_size


@dataclass
class HostedDrafter:
    """A DFlash drafter as a daemon hosts it: the model, what it was built from, and the target it drafts for."""

    model: DFlashDrafter
    fingerprint: str  # the draft weights, as ModelSource.fingerprint identifies the target's
    target: ModelConfig
    target_fingerprint: str
    borrowed_bytes: int  # the target embedding / head loaded for the drafter alone (not shared with a shard)

    @property
    def config(self) -> DraftConfig:
        return self.model.config

    def weight_bytes(self) -> int:
        return self.model.weight_bytes() + self.borrowed_bytes

    def describe(self, max_context: int) -> dict:
        """HELLO's `drafter` field."""
        c = self.config
        return {
            "name": "dflash",
            "fingerprint": self.fingerprint,
            "target_layer_ids": list(c.target_layer_ids),
            "feature_size": c.feature_size,
            "block_size": c.block_size,
            "max_draft_tokens": self.model.max_draft_tokens,
            "mask_token_id": c.mask_token_id,
            "num_layers": c.num_hidden_layers,
            "dtype": dtype_name(self.model.dtype),
            "state_bytes_per_sequence": self.model.state_bytes_per_sequence(max_context),
            "engine": self.model.engine,
        }


def build_drafter(
    source: ModelSource,
    draft: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    shard: ShardModel | None = None,
) -> HostedDrafter:
    """The drafter named by `draft` ('DIR' or 'synthetic[:LAYERS]') for the target `source`.

    It borrows the target's embedding and lm_head: from `shard` where the shard already holds them, else read
    (only those tensors) from `source`. A synthetic drafter takes the target's synthetic seed (0 for a directory).
    """
    target = source.config()
    torch_dtype = DTYPES[dtype]
    held: dict[str, torch.Tensor] = {}
    if shard is not None:  # same daemon: same dtype and device
        if shard.owns_embedding:
            held["embed_tokens.weight"] = shard.embed_tokens
        if shard.owns_head:
            held[head_name(target)] = shard.lm_head
    wanted = {name: shape for name, shape in embedding_and_head_shapes(target).items() if name not in held}
    loaded = source.tensors(wanted, dtype=torch_dtype, device=device)
    borrowed = {**held, **loaded}

    draft_dir, layers = parse_draft(draft)
    if draft_dir is not None:
        config = load_draft_config(draft_dir)
        config.check_target(target)
        weights = load_tensors(draft_dir, draft_shapes(config), names=draft_name, dtype=torch_dtype, device=device).tensors
        fingerprint = checkpoint_fingerprint(draft_dir)
    else:
        config = synthetic_draft_config(target, num_layers=layers)
        weights = synthetic_draft_weights(config, source.seed, dtype=torch_dtype)
        fingerprint = f"synthetic-dflash:{layers}:{config.block_size}:{source.seed}"
    model = DFlashDrafter(
        config, weights, target_embed=borrowed["embed_tokens.weight"], target_lm_head=borrowed[head_name(target)],
        device=device, dtype=torch_dtype,
    )
    return HostedDrafter(
        model, fingerprint, target, source.fingerprint(torch.device(device)),
        borrowed_bytes=sum(t.nbytes for t in {id(t): t for t in loaded.values()}.values()),
    )


def daemon_memory_plan(source: ModelSource, config: ModelConfig, shard):
    """The memory a daemon of `shard` (a ShardConfig: its layers, None for only a drafter, its drafter, engine and
    limits) will allocate (common.memory), from the configs alone: nothing is loaded."""
    from common.memory import hosted_drafter, plan_memory, rollback_bytes_per_sequence

    layers, draft, storage, engine = shard.layers, shard.draft, shard.storage(), shard.engine
    torch_dtype = DTYPES[shard.dtype]
    begin, end = layers if layers is not None else (0, 0)
    drafter_bytes, drafter_state = 0, None
    if draft is not None:
        drafter_bytes, drafter_state = hosted_drafter(
            draft_config_of(draft, config), config, torch_dtype.itemsize, layers=layers, engine=engine,
            max_sequences=shard.max_sequences, max_context=shard.max_context, step_rows=shard.step_rows)
    gdn = [i for i in range(begin, end) if config.is_gdn(i)]
    weights = source.weight_bytes(shard_shapes(config, begin, end), dtype=torch_dtype, keep_fp8=shard.keeps_fp8,
                                  begin=begin) if layers is not None else {}
    return plan_memory(
        config, begin, end, weight_bytes=weights, dtype_bytes=torch_dtype.itemsize,
        engine=engine if layers is not None else "reference",
        max_sequences=shard.max_sequences if layers is not None else 0, max_context=shard.max_context,
        max_tokens_per_request=shard.max_tokens_per_request,
        checkpoint_bytes_per_sequence=rollback_bytes_per_sequence(config, len(gdn), storage.mode if storage.enabled
                                                                   else None, storage.max_verify_tokens),
        # the fast step's R (--step-rows), else one sequence's rows (FastShard's DEFAULT_ROWS without storage)
        step_rows=shard.step_rows or (storage.max_verify_tokens if storage.enabled else 16),
        drafter_bytes=drafter_bytes, drafter_state=drafter_state, cap=shard.max_gpu_memory,
        # the GPU prefill's graphs (--prefill-rows) exist on a GPU only
        prefill_rows=shard.prefill_rows if layers is not None and shard.on_gpu else 0,
        prefix_cache=shard.prefix_cache_bytes, on_gpu=shard.on_gpu,
        device_bytes=shard.device_bytes)
