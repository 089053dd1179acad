"""Build a ShardModel from a checkpoint directory or a synthetic preset: the one place a shard gets weights."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from shardd.config import ModelConfig, load_config
from shardd.model.shard import ShardModel
from shardd.rollback import RollbackStorage
from shardd.synthetic import parse_synthetic, preset_config, synthetic_weights
from shardd.weights import load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a checkpoint directory, or `synthetic` = 'PRESET[:SEED]'."""

    model_dir: str | None = None
    synthetic: str | None = None

    def __post_init__(self):
        if (self.model_dir is None) == (self.synthetic is None):
            raise ValueError("give exactly one of a model directory or a synthetic preset")

    def config(self) -> ModelConfig:
        if self.synthetic is not None:
            return preset_config(parse_synthetic(self.synthetic)[0])
        return load_config(self.model_dir)

    def fingerprint(self, device: torch.device) -> str:
        """Identifies the weights, so a coordinator can refuse shards built from different checkpoints."""
        if self.synthetic is not None:
            preset, seed = parse_synthetic(self.synthetic)
            # The generator's device type is part of the identity: CPU and CUDA generators differ.
            return f"synthetic:{preset}:{seed}:{device.type}"
        digest = hashlib.sha256()
        root = Path(self.model_dir)
        digest.update((root / "config.json").read_bytes())
        for path in sorted(root.glob("*.safetensors")):
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                digest.update(path.name.encode())
                digest.update(f.read(min(header_len, 1 << 24)))
        return "sha256:" + digest.hexdigest()[:32]


def parse_layers(spec: str, num_layers: int) -> tuple[int, int]:
    """'BEGIN:END' -> (begin, end), checked against the model."""
    try:
        begin_text, end_text = spec.split(":")
        begin, end = int(begin_text), int(end_text)
    except ValueError:
        raise ValueError(f"layer range must look like BEGIN:END, got {spec!r}") from None
    if not 0 <= begin < end <= num_layers:
        raise ValueError(f"layer range {spec} is not inside 0:{num_layers}")
    return begin, end


def build_shard(
    source: ModelSource,
    begin: int,
    end: int,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    storage: RollbackStorage = RollbackStorage(None, 0),
    progress=None,
) -> ShardModel:
    config = source.config()
    torch_dtype = DTYPES[dtype]
    if torch_dtype == torch.float32:
        # float32 means float32: TF32 matmuls and convs would break token-exact agreement with greedy decoding.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if source.synthetic is not None:
        _, seed = parse_synthetic(source.synthetic)
        weights = synthetic_weights(config, begin, end, seed, dtype=torch_dtype, device=device, progress=progress)
    else:
        weights = load_weights(source.model_dir, config, begin, end, dtype=torch_dtype, device=device, progress=progress).tensors
    shard = ShardModel(config, weights, begin, end, dtype=torch_dtype, device=device, storage=storage)
    shard.fingerprint = source.fingerprint(torch.device(device))
    return shard


def describe_config(config: ModelConfig) -> str:
    return json.dumps(config.describe())
