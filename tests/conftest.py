import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the fast path's Triton kernels run under Triton's interpreter, on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The `tiny` synthetic preset written by our own writer (real Qwen3.5 layout, several files + index)."""
    from shardd.presets import preset_config
    from shardd.synthetic import write_checkpoint

    out = tmp_path_factory.mktemp("tiny")
    return write_checkpoint(out, preset_config("tiny"), seed=0, max_file_bytes=64 << 10)
