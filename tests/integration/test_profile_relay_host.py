"""scripts/profile_relay_host.py (the relay's host cost without sockets or device) runs end to end on the CPU:
every step goes through both daemons' handlers, for one sequence and a batch, greedy and verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_relay_host_profile_runs_both_daemons_for_single_and_batched_steps(tmp_path):
    out = tmp_path / "relay_host.json"
    run = subprocess.run([sys.executable, "scripts/profile_relay_host.py", "--streams", "1,3", "--rows", "1,4",
                          "--steps", "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["streams"], r["rows"]) for r in results] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    for result in results:
        parts = result["parts_ms"]
        expected = {"coordinator records", "coordinator encode", "coordinator decode", "daemon 0 FORWARD",
                    "daemon 1 FORWARD"} | ({"daemon 0 ROLLBACK", "daemon 1 ROLLBACK"} if result["rows"] > 1 else set())
        assert set(parts) == expected, parts
        assert result["host_ms_per_step"] >= sum(parts.values()) * 0.5 > 0
