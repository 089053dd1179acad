"""--split balances weight bytes, not layer counts, and `shardctl launch --dry-run` prints every daemon's memory
plan from the config alone (no daemon, no GPU), failing when one does not fit its cap."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from common.presets import preset_config
from common.quantization import synthetic_scheme
from common.shapes import layer_split_costs
from coordinator.cli import cli
from protocol.layout import balanced_split, even_split

EIGHT_GPUS = ",".join(f"cuda:{i}" for i in range(8))


def heaviest(costs, ranges):
    return max(sum(costs[b:e]) for b, e in ranges)


def test_balanced_split_is_exact_on_small_cases():
    from itertools import combinations

    costs = [5, 1, 1, 1, 1, 9, 2, 2, 3]
    for parts in range(1, len(costs) + 1):
        best = min(heaviest(costs, list(zip((0, *cuts), (*cuts, len(costs)))))
                   for cuts in combinations(range(1, len(costs)), parts - 1))
        ranges = balanced_split(costs, parts)
        assert heaviest(costs, ranges) == best and len(ranges) == parts
        assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))


def test_uniform_layers_split_as_evenly_as_before():
    assert even_split(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert balanced_split([4] * 10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_the_27b_split_over_eight_is_lighter_than_equal_layer_counts():
    costs = layer_split_costs(preset_config("qwen3.5-27b"), dtype_bytes=2)
    assert heaviest(costs, balanced_split(costs, 8)) < 0.85 * heaviest(costs, even_split(64, 8))


def test_dry_run_plans_the_397b_over_eight_daemons_in_fp8_and_bf16():
    base = ["launch", "--synthetic", "qwen3.5-397b-a17b", "--split", "8", "--devices", EIGHT_GPUS, "--dry-run", "--json"]
    fp8 = CliRunner().invoke(cli, [*base, "--quantize", "fp8-block", "--max-gpu-memory", "80GiB"])
    assert fp8.exit_code == 0, fp8.output
    plan = json.loads(fp8.stdout)
    daemons = plan["daemons"]
    assert [d["layers"][1] for d in daemons][-1] == 60 and len(daemons) == 8
    costs = layer_split_costs(preset_config("qwen3.5-397b-a17b"), dtype_bytes=2, scheme=synthetic_scheme("fp8-block"))
    assert [sum(d["weights"].values()) for d in daemons] == [sum(costs[b:e]) for b, e in (d["layers"] for d in daemons)]
    assert all(d["weights"]["experts"] > 0.9 * d["items"]["weights"] - 2 * 248320 * 4096 * 2 for d in daemons)
    assert "embedding" in daemons[0]["weights"] and "head" in daemons[-1]["weights"]
    assert all(d["fits"] and d["engine"] == "fast" for d in daemons)  # FP8 experts: the fast step's too
    bf16 = CliRunner().invoke(cli, [*base, "--dtype", "bf16", "--max-gpu-memory", "80GiB"])
    assert bf16.exit_code == 1  # about 740 GiB of bf16 weights do not fit eight 80 GiB daemons
    assert not any(d["fits"] for d in json.loads(bf16.stdout)["daemons"])
    assert all(d["engine"] == "fast" for d in json.loads(bf16.stdout)["daemons"])
    table = CliRunner().invoke(cli, base[:-1] + ["--quantize", "fp8-block"])
    assert table.exit_code == 0 and "EXPERTS" in table.stdout and "53:60" in table.stdout


def test_dry_run_35b_a3b_fp8_fits_two_24_gib_daemons():
    """Two 24 GiB daemons hold the 35B-A3B in block FP8 on the fast engine, and each daemon's plan is the one
    `shardd serve --engine auto` computes at its start (FP8 experts at their bytes and scales, the fast step's
    buffers, the prefill graphs)."""
    from shardd.config import ShardConfig
    from shardd.engine.select import resolve_engine, step_rows_for
    from shardd.weights.loading import ModelSource, daemon_memory_plan

    result = CliRunner().invoke(cli, ["launch", "--synthetic", "qwen3.5-35b-a3b", "--quantize", "fp8-block", "--split",
                                      "2", "--devices", "cuda:0,cuda:1", "--max-gpu-memory", "24GiB", "--max-sequences",
                                      "1", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    daemons = json.loads(result.stdout)["daemons"]
    assert [d["layers"] for d in daemons] == [[0, 20], [20, 40]]
    assert all(d["total_bytes"] <= 24 << 30 for d in daemons)
    pytest.importorskip("triton", reason="--engine auto picks the fast engine where triton is installed")
    source = ModelSource(synthetic="qwen3.5-35b-a3b", quantize="fp8-block")
    for daemon in daemons:
        engine = resolve_engine("auto", daemon["device"])
        assert engine == daemon["engine"] == "fast"
        shard = ShardConfig(synthetic="qwen3.5-35b-a3b", quantize="fp8-block", layers=tuple(daemon["layers"]),
                            device=daemon["device"], dtype="bfloat16", engine=engine, max_sequences=1,
                            step_rows=step_rows_for(engine, None, 16, max_sequences=1, fp8=True),
                            max_gpu_memory=24 << 30)
        plan = daemon_memory_plan(source, source.config(), shard)
        assert (plan.items, plan.total) == (daemon["items"], daemon["total_bytes"])


@pytest.mark.parametrize("placement", ["first", "last", "own"])
def test_dry_run_plans_the_drafter_where_launch_places_it(placement):
    """`--draft` in a dry run: the daemon hosting the drafter (or a drafter-only daemon of its own) plans the drafter's
    weights, with the target embedding and head it borrows, and its contexts, as `shardd serve --draft` does."""
    from shardd.config import ShardConfig
    from shardd.engine.select import step_rows_for
    from shardd.weights.loading import ModelSource, daemon_memory_plan

    args = ["launch", "--synthetic", "qwen3.5-27b", "--split", "2", "--devices", "cuda:0,cuda:1", "--max-sequences",
            "2", "--max-context", "4096", "--max-gpu-memory", "40GiB", "--draft", "synthetic:5", "--draft-placement",
            placement, "--dry-run", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    daemons = json.loads(result.stdout)["daemons"]
    hosting = [d for d in daemons if d["drafter"]]
    assert len(hosting) == 1 and len(daemons) == (3 if placement == "own" else 2)
    host = hosting[0]
    assert host["layers"] == {"first": [0, 32], "last": [32, 64], "own": None}[placement]
    assert host["items"]["drafter"] > 0 and host["items"]["drafter_context"] > 0
    assert not any("drafter" in d["items"] for d in daemons if not d["drafter"])
    table = CliRunner().invoke(cli, args[:-1])
    assert table.exit_code == 0 and ("drafter" in table.stdout)
    pytest.importorskip("triton", reason="--engine auto picks the fast engine where triton is installed")
    source = ModelSource(synthetic="qwen3.5-27b")
    layers = None if host["layers"] is None else tuple(host["layers"])
    shard = ShardConfig(synthetic="qwen3.5-27b", layers=layers, device=host["device"], dtype="bfloat16",
                        engine=host["engine"], max_sequences=2, max_context=4096, draft="synthetic:5",
                        max_gpu_memory=40 << 30,
                        step_rows=step_rows_for("fast", None, 16, max_sequences=2, fp8=False) if layers else None)
    plan = daemon_memory_plan(source, source.config(), shard)
    assert (plan.items, plan.total) == (host["items"], host["total_bytes"])
