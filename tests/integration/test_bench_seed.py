"""scripts/bench_seed.py (the seed's benchmark) as a CPU dry run on the tiny preset: its parts run end to end and
report what the GPU run reports; a part that overruns its share of --budget-s is stopped with its daemons and
keeps what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRY_RUN = ["--preset", "tiny", "--devices", "cpu", "--prompt-len", "24", "--tokens", "6", "--compare-tokens", "6",
           "--context", "64", "--draft-layers", "1", "--cap", "1GiB"]


def bench_seed(tmp_path, *args, timeout=150):
    out = tmp_path / "seed.json"
    run = subprocess.run([sys.executable, "scripts/bench_seed.py", *DRY_RUN, *args, "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    return run, json.loads(out.read_text())


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_dry_run_reports_the_seed_table_and_fp8_against_its_dequantized_model(tmp_path):
    run, result = bench_seed(tmp_path, "--parts", "fp8,compare", "--runs", "1", "--budget-s", "120")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    fp8 = result["fp8"]
    assert fp8["complete"] and fp8["weights"] == "fp8-block" and fp8["cap"] == "1GiB"
    assert [fp8["blocks"][name]["runs"] for name in ("A1", "B", "A2")] == [1, 1, 1]
    assert fp8["outputs_identical"] and set(fp8["hashes"]) == {"greedy", "warm-up", "A1/0", "B/0", "A2/0"}
    assert all(plan["cap_bytes"] == 1 << 30 for plan in fp8["memory_plan"])
    compare = result["compare"]
    # on the CPU the FP8 matrices are dequantized per call: the same numbers as the dequantized model
    assert compare["complete"] and compare["max_abs_delta_logit"] == 0 and compare["top1_agreement"] == 1
    assert compare["fp8_greedy_tokens"] == fp8["greedy_tokens"]
    assert result["fp8_outputs_identical"] is True and result["fp8_one_process_greedy_matches"] is True
    table = run.stdout[run.stdout.index("| weights |"):]  # the table comes last
    assert "| fp8-block | 1GiB | B replay | 1 |" in table and "outputs identical: True" in table
    assert "top-1 agreement 100.00%" in table.splitlines()[-2] and "same tokens: True" in table.splitlines()[-1]


def test_a_part_over_its_limit_is_stopped_with_its_daemons_and_keeps_what_it_measured(tmp_path):
    run, result = bench_seed(tmp_path, "--parts", "fp8", "--budget-s", "25", "--stall-s", "120")
    assert run.returncode == 1
    fp8 = result["fp8"]
    assert fp8["timed_out"] and not fp8["complete"] and fp8["weights"] == "fp8-block"  # what it wrote before
    if "load_seconds" in fp8:  # the daemons came up in time (on a loaded machine they may not): greedy ran
        assert len(fp8["greedy_tokens"]) == 6
    assert not any(alive(pid) for pid in fp8["daemon_pids"])
    assert "fp8: timed out" in run.stdout
