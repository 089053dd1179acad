"""scripts/ab_compare.py: a figure of several runs of one A/B stands by the median of its after/before ratios."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_run(folder: Path, before: float, after: float) -> None:
    folder.mkdir()
    (folder / "gpu_bench_local_before.json").write_text(json.dumps({"e2e_greedy_ms_per_token": before,
                                                                     "outputs_identical": True, "ignored": 1}))
    (folder / "gpu_bench_local.json").write_text(json.dumps({"e2e_greedy_ms_per_token": after, "outputs_identical": True}))


def test_several_runs_give_each_figure_its_ratios_and_their_median(tmp_path):
    for name, (before, after) in {"r1": (20.0, 21.0), "r2": (20.0, 20.2), "r3": (20.0, 19.8)}.items():
        write_run(tmp_path / name, before, after)
    table_path = tmp_path / "table.json"
    done = subprocess.run([sys.executable, "scripts/ab_compare.py", *(str(tmp_path / r) for r in ("r1", "r2", "r3")),
                           "--json", str(table_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    figure = json.loads(table_path.read_text())["gpu_bench_local.json"]["e2e_greedy_ms_per_token"]
    assert figure["ratios"] == [1.05, 1.01, 0.99]
    assert figure["median_ratio"] == 1.01
    assert "ignored" not in json.loads(table_path.read_text())["gpu_bench_local.json"]
    assert "1.050 1.010 0.990" in done.stdout


def test_one_run_prints_before_after_and_ratio(tmp_path):
    write_run(tmp_path / "r1", 20.0, 21.0)
    done = subprocess.run([sys.executable, "scripts/ab_compare.py", str(tmp_path / "r1")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("e2e_greedy_ms_per_token"))
    assert line.split()[1:] == ["20.0", "21.0", "1.050"]
