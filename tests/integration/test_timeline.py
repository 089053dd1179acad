"""The relay's GPU timeline (shardd/obs/timeline.py, SHARDD_TIMELINE): refused where it cannot stamp, before any weight
loads; its stamps in order on a GPU; and the benchmark's pairing of two daemons' stamps into a step's intervals."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def serve(env_value: str, monkeypatch) -> subprocess.CompletedProcess:
    monkeypatch.setenv("SHARDD_TIMELINE", env_value)
    return subprocess.run([sys.executable, "-m", "shardd", "serve", "--synthetic", "small", "--bind", "tcp://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value, message", [
    ("4096", "SHARDD_TIMELINE stamps a GPU's clock; this shard runs on cpu (unset it)"),
    ("many", "SHARDD_TIMELINE='many': give the number of stamps to keep (a positive whole number)"),
    ("0", "SHARDD_TIMELINE='0': give the number of stamps to keep"),
])
def test_a_timeline_that_cannot_stamp_is_refused_before_any_weight_loads(value, message, monkeypatch):
    result = serve(value, monkeypatch)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "loading weights" not in result.stderr


@pytest.mark.gpu
def test_stamps_follow_the_stream_in_order_on_the_gpu_clock():
    from shardd.obs.timeline import Timeline

    device = torch.device("cuda", 0)
    timeline = Timeline(device, capacity=8)
    x = torch.randn(2048, 2048, device=device)
    for index in range(10):  # past the capacity: the last 8 kept, oldest first
        timeline.gpu(f"mark {index}")
        x = x @ x.T / 2048
    report = timeline.report()
    assert [label for label, _ in report["gpu"]] == [f"mark {index}" for index in range(2, 10)]
    stamps = [ns for _, ns in report["gpu"]]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)  # a matmul apart: strictly later
    host_now = time.time_ns()
    assert abs(stamps[-1] - report["offset_ns"] - host_now) < 5e9  # the offset puts them on the host's clock


def bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_daemons_stamps_pair_into_a_steps_intervals():
    """Two steps of a relay on one GPU clock (us): the first shard's step, its put, the second shard's wait (queued
    in time in the first step, late in the second), its step, the reply and the next FORWARD's arrival."""
    us = 1000
    offset = 5_000_000 * us  # GPU clock ahead of the host's: a stamp at GPU time t is a host event at t - offset
    first_gpu, second_gpu, first_host, second_host = [], [], [], []
    for step, start in enumerate((offset + 100 * us, offset + 10_100 * us)):
        first_gpu += [["step start", start], ["step end", start + 4000 * us], ["published", start + 4010 * us]]
        queued = start + (-50 if step == 0 else 4030) * us  # before the first shard's step even started, or late
        second_gpu += [["wait queued", queued], ["wait done", max(queued, start + 4010 * us) + 20 * us],
                       ["step start", start + 4100 * us], ["step end", start + 8100 * us]]
        second_host += [["sent FORWARD", start + 8300 * us - offset]]
        first_host += [["receive", start + 8900 * us - offset], ["receive", start + 9500 * us - offset]]
    first_gpu.append(["step start", offset + 20_100 * us])  # the third step's start closes the second cycle
    reports = [{"gpu": first_gpu, "host": first_host, "offset_ns": offset},
               {"gpu": second_gpu, "host": second_host, "offset_ns": offset}]
    intervals = bench_gpu().relay_step_intervals(reports, 0, 30_000 * us)
    assert intervals["steps"] == 2
    assert intervals["first_step"] == 4000 and intervals["put"] == 10 and intervals["noticed"] == 20
    assert intervals["wait_queued_late"] == (-4060 + 20) / 2  # the median of in time and 20 us late
    assert intervals["to_step"] == (70 + 50) / 2 and intervals["second_step"] == 4000
    assert intervals["reply"] == 200 and intervals["coordinator"] == 1200  # to the last receive (the FORWARD)
    assert intervals["launch"] == 500 and intervals["cycle"] == 10_000

    # outside the window nothing pairs
    assert bench_gpu().relay_step_intervals(reports, 40_000 * us, 50_000 * us) == {"steps": 0}


@pytest.mark.gpu
def test_two_daemons_on_a_gpu_report_timelines_that_pair_into_steps(tmp_path):
    """Two fast daemons, the rows through the second one's device ring, with SHARDD_TIMELINE: every greedy step
    pairs (a put, a wait, both steps, the reply) and the same tokens come as without the timeline."""
    from coordinator.decoding import greedy_decode
    from coordinator.relay.pipeline import Pipeline
    from tests.support.daemons import start_daemons, stop_all

    prompt = list(b"The quick brown fox jumps over the lazy dog")
    tokens = {}
    for name, env in (("plain", {}), ("timeline", {"SHARDD_TIMELINE": "4096"})):
        workdir = tmp_path / name
        workdir.mkdir()
        binds = [f"ipc://{workdir}/s{k}.sock" for k in range(2)]
        specs = {f"{name}{k}": (bind, ["--layers", ("0:3", "3:6")[k], "--engine", "fast", "--device", "cuda:0",
                                       "--dtype", "bfloat16", *(["--relay-to", binds[1]] if k == 0 else [])])
                 for k, bind in enumerate(binds)}
        daemons = start_daemons(specs, workdir, env)
        try:
            with Pipeline.connect(binds) as pipeline:
                greedy_decode(pipeline, 1, prompt, 4)  # the graphs captured
                start = time.time_ns()
                tokens[name] = greedy_decode(pipeline, 2, prompt, 12).tokens
                end = time.time_ns()
                stats = pipeline.stats()
        finally:
            stop_all(daemons.values())
        if name == "timeline":
            assert stats[0]["rows"]["sent_on_device"] > 0
            reports = [s["timeline"] for s in stats]
            assert {"step start", "step end", "published"} <= {label for label, _ in reports[0]["gpu"]}
            assert {"wait queued", "wait done", "step start"} <= {label for label, _ in reports[1]["gpu"]}
            intervals = bench_gpu().relay_step_intervals(reports, start, end)
            assert intervals["steps"] >= 10  # 12 tokens: the steps after the prefill's, each closed by the next
            assert intervals["first_step"] > 0 and intervals["second_step"] > 0 and intervals["put"] >= 0
            assert intervals["noticed"] >= 0 and intervals["cycle"] >= intervals["first_step"] + intervals["second_step"]
        else:
            assert "timeline" not in stats[0]
    assert tokens["timeline"] == tokens["plain"]
