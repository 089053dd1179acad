#!/usr/bin/env python3
"""Old tree (NAME_before.json) against this tree (NAME.json), side by side, for every pair that
scripts/gpu_run.sh's BEFORE_TREE left in OUT: one line per figure, before / after / after over before.

    python3 scripts/ab_compare.py "$OUT"
    python3 scripts/ab_compare.py RUN1 RUN2 RUN3 [--json FILE]

With several OUT folders (the same A/B run again), each figure's line gives every run's after/before and their
median: a figure stands or falls by the median of the runs, not by one of them.
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

# the figures that matter, as dotted paths (regular expressions over the flattened JSON)
FIGURES = [
    # one process (part local)
    r"greedy_ms_per_token", r"greedy_tok_s", r"tok_s\.[a-z-]+", r"step_ms\.[a-z-]+", r"rollback_ms\.[a-z-]+",
    r"floor_ms", r"floor_ratio_greedy", r"prefill_tok_s", r"step_ms_at_32k_context",
    # two daemons (part relay; relay_ms_per_step needs the local part in the same JSON)
    r"e2e_greedy_ms_per_token", r"e2e_tok_s\.[a-z-]+", r"e2e_step_ms\.[a-z-]+", r"relay_ms_per_step\.[a-z-]+",
    r"e2e_vs_local\.[a-z-]+", r"e2e_greedy_vs_local", r"relay_round_trip_ms\.\d",
    # DFlash (part dflash)
    r"draft_propose_ms_(fast|reference)", r"draft_floor_ratio", r"dflash_greedy_ms_per_token",
    r"dflash_runs\.[a-z-]+\.\d+\.(tok_s|step_ms|propose_ms|relay_ms)", r"dflash_vs_oracle\.[a-z-]+\.\d+\.tok_s",
    r"dflash_real_tok_s", r"e2e_dflash_step_ms\.[a-z-]+",
    # DFlash streams in the scheduler and through shardctl serve (part dflash-batch)
    r"dflash_batch_runs\.(oracle|dflash)\.\d+\.(tok_s|decode_tok_s|step_ms|mean_commit)",
    r"dflash_batch_vs_oracle\.\d+\.(step|tok_s|decode_tok_s)", r"dflash_batch_http\.(none|dflash|dflash-auto)\.\d+\.tok_s",
    r"dflash_batch_http\.dflash(_auto)?_vs_none\.\d+",
    # many streams (parts batch-local, batch-daemons)
    r"batch_tok_s_(local|daemons)\.(greedy|oracle)\.\d+", r"batch_decode_tok_s_(local|daemons)\.(greedy|oracle)\.\d+",
    r"batch_tok_s_local_prefill_chunk16\.\d+", r"batch_checkpoint_oracle_x8_tok_s",
    r"batch_prefill_ms_(local|daemons)\.\d+", r"batch_http\.(tok_s|direct_tok_s|http_vs_direct)",
    # whether the figures stand
    r"outputs_identical", r"batch_identical", r"dflash_batch_identical", r"dflash_real_identical_to_greedy", r"failed_parts",
]
PATTERN = re.compile("^(" + "|".join(FIGURES) + ")$")


def flatten(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}{key}.")
    elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        for index, item in enumerate(value):
            yield f"{prefix}{index}", item
    else:
        yield prefix[:-1], value


def load(path: Path) -> dict:
    try:
        return dict(flatten(json.loads(path.read_text())))
    except (OSError, ValueError) as error:
        print(f"  {path.name}: no JSON ({error})")
        return {}


def ratio(before, after) -> float | None:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (before, after))
    return after / before if numbers and before else None


def compare(folders: list[Path]) -> dict:
    """{pair file: {figure: {"before": [...], "after": [...], "ratios": [...], "median_ratio": x}}} over the runs."""
    table: dict = {}
    for out in folders:
        pairs = sorted(out.glob("*_before.json"))
        if not pairs:
            print(f"ab_compare: no *_before.json in {out}")
        for before_path in pairs:
            after_path = before_path.with_name(before_path.name.replace("_before.json", ".json"))
            before, after = load(before_path), load(after_path)
            figures = table.setdefault(after_path.name, {})
            for key in [k for k in {**before, **after} if PATTERN.match(k)]:
                row = figures.setdefault(key, {"before": [], "after": [], "ratios": []})
                b, a = before.get(key, "-"), after.get(key, "-")
                row["before"].append(b)
                row["after"].append(a)
                r = ratio(b, a)
                if r is not None:
                    row["ratios"].append(round(r, 4))
    for figures in table.values():
        for row in figures.values():
            if row["ratios"]:
                row["median_ratio"] = round(statistics.median(row["ratios"]), 4)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="*", default=["bench/results/gpu"], help="OUT folders of the same A/B run")
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args()
    table = compare([Path(folder) for folder in args.out])
    several = len(args.out) > 1
    for name, figures in table.items():
        print(f"==== A/B {name}: before (old tree) | after (this tree) | after/before"
              + (" per run | median" if several else ""))
        for key, row in figures.items():
            if several:
                ratios = " ".join(f"{r:.3f}" for r in row["ratios"])
                median = f"{row['median_ratio']:.3f}" if "median_ratio" in row else ""
                print(f"{key:<48} {ratios:>24} {median:>7}")
            else:
                b, a = row["before"][0], row["after"][0]
                shown = f"{row['ratios'][0]:.3f}" if row["ratios"] else ""
                print(f"{key:<48} {str(b):>12} {str(a):>12} {shown:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
