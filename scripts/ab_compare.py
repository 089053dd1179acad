#!/usr/bin/env python3
"""Old tree (NAME_before.json) against this tree (NAME.json), side by side, for every pair that
scripts/gpu_run.sh's BEFORE_TREE left in OUT: one line per figure, before / after / after over before.

    python3 scripts/ab_compare.py "$OUT"
"""

import json
import re
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
    r"dflash_batch_vs_oracle\.\d+\.(step|tok_s|decode_tok_s)", r"dflash_batch_http\.(none|dflash)\.\d+\.tok_s",
    r"dflash_batch_http\.dflash_vs_none\.\d+",
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


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/gpu")
    pairs = sorted(out.glob("*_before.json"))
    if not pairs:
        print(f"ab_compare: no *_before.json in {out}")
    for before_path in pairs:
        after_path = before_path.with_name(before_path.name.replace("_before.json", ".json"))
        print(f"==== A/B {after_path.name}: before (old tree) | after (this tree) | after/before")
        before, after = load(before_path), load(after_path)
        for key in [k for k in {**before, **after} if PATTERN.match(k)]:
            b, a = before.get(key, "-"), after.get(key, "-")
            ratio = ""
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and b:
                ratio = f"{a / b:.3f}"
            print(f"{key:<48} {str(b):>12} {str(a):>12} {ratio:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
