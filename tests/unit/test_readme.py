"""The README's "Measured" table is what the committed benchmark JSON says (scripts/measured_table.py), so no figure
there is typed by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_measured_table_is_written_from_the_benchmark_json():
    check = subprocess.run([sys.executable, "scripts/measured_table.py", "--check"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr
