"""Synthetic checkpoints on disk, by preset and dtype name: what `shardd make-model` writes (shardctl make-model and
shardctl demo run that command, so shardctl never imports torch)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from common.presets import preset_config
from common.synthetic_tokenizer import write_tokenizer
from common.draft_config import DEFAULT_SYNTHETIC_DRAFT_LAYERS, synthetic_draft_config
from shardd.draft.synthetic import write_draft_checkpoint
from shardd.synthetic.model import write_checkpoint


def write_synthetic_model(preset: str, seed: int, dtype: str, out: Path, *, show_progress: bool = True,
                          quantize: str | None = None) -> Path:
    """config.json, *.safetensors and the index of the preset in the Qwen3.5 layout, with a progress bar (bytes,
    ETA) on stderr when it is a terminal, and the tokenizer with its chat template (tokenizer.json,
    tokenizer_config.json) sized to the preset's vocabulary."""
    config = preset_config(preset)
    with tqdm(desc=f"writing {preset}", unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              disable=None if show_progress else True) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        path = write_checkpoint(out, config, seed, dtype=getattr(torch, dtype), progress=progress, quantize=quantize)
    write_tokenizer(path, config.vocab_size)
    return path


def write_synthetic_drafter(model_dir: Path, preset: str, seed: int, dtype: str, layers: Optional[int]) -> Path:
    """MODEL/draft/: the drafter `--draft synthetic[:LAYERS]` builds in memory for this model, on disk."""
    config = synthetic_draft_config(preset_config(preset), num_layers=layers or DEFAULT_SYNTHETIC_DRAFT_LAYERS)
    return write_draft_checkpoint(Path(model_dir) / "draft", config, seed, dtype=getattr(torch, dtype))
