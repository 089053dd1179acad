"""What every test shares: traffic kept on loopback (tests/support/loopback.py), the CPU fallbacks set before
anything imports the kernels, the `gpu` marker's skip, and the `tiny` checkpoint. Helpers that tests import live
in tests/support/."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.loopback import offline_environment, refuse_outside_connections  # noqa: E402

# Before transformers, datasets or huggingface_hub read their settings at import: no downloads, no telemetry.
offline_environment(os.environ)
refuse_outside_connections()

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the fast path's Triton kernels run under Triton's interpreter, on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's test command runs two workers) each worker gets its share of the cores for
# the torch work it does in-process, rather than every worker spinning a thread per core against the others.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

def pytest_collection_modifyitems(config, items):
    """A test marked `gpu` (pyproject.toml's markers) needs CUDA: without it, it is skipped with one reason."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The `tiny` synthetic preset written by our own writer (real Qwen3.5 layout, several files + index)."""
    from common.presets import preset_config
    from shardd.synthetic.model import write_checkpoint

    out = tmp_path_factory.mktemp("tiny")
    return write_checkpoint(out, preset_config("tiny"), seed=0, max_file_bytes=64 << 10)
