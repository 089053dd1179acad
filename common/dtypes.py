"""Weight dtype names as both commands take them (`--dtype`), vLLM's spellings included, and what `auto` means."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
# Every accepted spelling -> its dtype; `auto` is decided per daemon (`resolve_dtype`).
DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "float": "float32",
               "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
DTYPE_CHOICES = tuple(DTYPE_NAMES)


def dtype_name(text: str) -> str:
    """The canonical name of a --dtype spelling (bf16 -> bfloat16); ValueError for one we do not know."""
    name = DTYPE_NAMES.get(str(text).strip().lower())
    if name is None:
        raise ValueError(f"unknown dtype {text!r}: one of {', '.join(DTYPE_CHOICES)}")
    return name


def checkpoint_dtype(model_dir: Optional[str]) -> Optional[str]:
    """The dtype config.json declares (`torch_dtype`, or `dtype`, at the top or in text_config), None when it
    declares none we load."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config.get("text_config") or {}, config):
        for key in ("torch_dtype", "dtype"):
            declared = DTYPE_NAMES.get(str(section.get(key) or "").removeprefix("torch."))
            if declared not in (None, "auto"):
                return declared
    return None


def resolve_dtype(dtype: str, device: str, model_dir: Optional[str]) -> str:
    """`auto` as vLLM decides it on a GPU: the checkpoint's dtype, bfloat16 for a float32 or synthetic model.
    On the CPU `auto` is float32, the reference's dtype. Other names are only spelled canonically."""
    name = dtype_name(dtype)
    if name != "auto":
        return name
    if not device.startswith("cuda"):
        return "float32"
    declared = checkpoint_dtype(model_dir)
    return declared if declared in ("bfloat16", "float16") else "bfloat16"
