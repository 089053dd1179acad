"""The README's "Measured" table, written from the benchmark JSON under bench/results/ (no figure typed by hand).

    python scripts/measured_table.py            # print the table
    python scripts/measured_table.py --write    # replace the table between the README's markers
    python scripts/measured_table.py --check    # exit 1 when the README's table is not what the JSON says

`SOURCES` names the JSON each row reads, under bench/results/CARD/ (a run's file as gpu_run.sh wrote it, copied in
with the commit it measured in its name; a row from a card other than the H200 names it); a new run replaces a
figure by replacing its file name here. tests/unit/test_readme.py checks the
README against this script.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- measured:begin (scripts/measured_table.py --write) -->", "<!-- measured:end -->"

SOURCES = {
    "relay": "h200/gpu_bench_relay_d3a9e78.json",  # `scripts/gpu_run.sh relay`: one process and two daemons
    "batch": "h200/gpu_bench_batch_http_0a47303.json",  # `scripts/gpu_run.sh batch`
    "dflash": "h100/gpu_bench_dflash_drafter_aae6311.json",  # `scripts/gpu_run.sh dflash -- --parts dflash-drafter`
    "dflash_batch": "h100/gpu_bench_dflash_batch_424abde.json",  # `scripts/gpu_run.sh dflash-batch`
    "fp8": "h100/gpu_bench_fp8_aae6311.json",  # `scripts/gpu_run.sh fp8`
    "seed": "h200/seed_bench_f1b92bb.json",  # `scripts/gpu_run.sh seed`
}


def load(name: str) -> dict | None:
    file = SOURCES[name]
    return json.loads((RESULTS / file).read_text()) if file else None


def card(name: str) -> str:
    """ ", on an H100" for a source measured on a card other than the H200 (the table's default)."""
    folder = SOURCES[name].split("/", 1)[0]
    return "" if folder == "h200" else f", on an {folder.upper()}"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def greedy(d: dict) -> str:
    if "floor_step_ms" in d:  # the floor of the bytes a decode step moves
        return (f"{d['greedy_ms_per_decode_step']:.2f} ms/token, {d['floor_step_ratio']['greedy']:.2f}x the "
                f"{d['floor_step_ms']['greedy']:.2f} ms floor")
    return f"{d['greedy_ms_per_token']:.2f} ms/token, {d['floor_ratio_greedy']:.2f}x the {d['floor_ms']:.2f} ms floor"


def verify(d: dict) -> str:
    modes = ("checkpoint", "replay-ssm")
    ratios = d["floor_step_ratio"] if "floor_step_ratio" in d else d["floor_ratio_step"]
    steps = " / ".join(f"{d['step_ms'][m]:.2f}" for m in modes)
    return f"{steps} ms ({' / '.join(f'{ratios[m]:.2f}x' for m in modes)})"


def rows() -> list[tuple[str, str, str]]:
    relay, batch, dflash, dflash_batch, fp8, seed = (load(name) for name in SOURCES)
    out = [
        ("greedy decode, one process", greedy(relay), "`scripts/gpu_run.sh relay`"),
        ("verify step, checkpoint / replay-ssm", verify(relay), "`scripts/gpu_run.sh relay`"),
        ("speculative tok/s, checkpoint / replay-ssm / replay",
         " / ".join(f"{relay['tok_s'][m]:.0f}" for m in ("checkpoint", "replay-ssm", "replay")),
         "`scripts/gpu_run.sh relay`"),
        ("two daemons over one process, checkpoint / replay-ssm",
         f"{pct(relay['e2e_vs_local']['checkpoint'])} / {pct(relay['e2e_vs_local']['replay-ssm'])}; greedy "
         f"{relay['e2e_greedy_vs_local']:.2f}x", "`scripts/gpu_run.sh relay`"),
        ("prefill, 1,024 tokens",
         f"{relay['prefill_tok_s']:,.0f} tok/s ({100 * relay['prefill_share_of_peak']:.0f}% of bf16 peak)",
         "`scripts/gpu_run.sh relay`"),
        ("batched decode, greedy 1 / 8 / 32 streams, one process",
         " / ".join(f"{batch['batch_tok_s_local']['greedy'][n]:,.0f}" for n in ("1", "8", "32")) + " tok/s",
         "`scripts/gpu_run.sh batch`"),
        ("`shardctl serve` over HTTP at 8 streams against no HTTP", f"{batch['batch_http']['http_vs_direct']:.3f}",
         "`scripts/gpu_run.sh batch`"),
        ("DFlash `PROPOSE`, 5-layer drafter" + card("dflash"),
         f"{dflash['draft_propose_ms_fast']:.2f} ms ({dflash['draft_floor_ratio']:.2f}x its floor)",
         "`scripts/gpu_run.sh dflash`"),
    ]
    if "draft_batch_ms" in dflash:
        b = dflash["draft_batch_ms"]
        out.append(("DFlash drafter step for 1 / 8 / 32 sequences (batched)" + card("dflash"),
                    f"{b['1']:.2f} / {b['8']:.2f} / {b['32']:.2f} ms (8 = {dflash['draft_batch_8_vs_1']:.2f}x one)",
                    "`scripts/gpu_run.sh dflash`"))
    if dflash_batch is not None:
        ratio = dflash_batch["dflash_batch_vs_oracle"]
        counts = sorted(ratio, key=int)
        out.append((f"DFlash step / tok/s against the oracle's, {' / '.join(counts)} streams" + card("dflash_batch"),
                    " / ".join(f"{ratio[n]['step']:.2f}x" for n in counts) + "; "
                    + " / ".join(pct(ratio[n]["tok_s"]) for n in counts), "`scripts/gpu_run.sh dflash-batch`"))
        http = dflash_batch.get("dflash_batch_http", {}).get("dflash_vs_none")
        if http:
            out.append(("`serve --drafter dflash` over `none`, 1 / 8 HTTP streams (drafter accepts nothing)"
                        + card("dflash_batch"),
                        " / ".join(pct(http[n]) for n in sorted(http, key=int)), "`scripts/gpu_run.sh dflash-batch`"))
    out += [
        ("FP8 greedy / verify step, one process" + card("fp8"),
         f"{fp8['greedy_ms_per_token']:.2f} / {fp8['step_ms']['checkpoint']:.2f} ms "
         f"({fp8['floor_ratio_greedy']:.2f}x / {fp8['floor_ratio_step']['checkpoint']:.2f}x the {fp8['floor_ms']:.2f} ms floor)",
         "`scripts/gpu_run.sh fp8`"),
        ("the seed's pair: two FP8 daemons capped at 24 GiB, A1 / B / A2", seed_figure(seed), "`scripts/gpu_run.sh seed`"),
        ("outputs: every mode, one process and two daemons, batched and alone",
         "identical" if all(d.get("outputs_identical", True) for d in (relay, batch, dflash, fp8) if d)
         and (dflash_batch is None or dflash_batch.get("dflash_batch_identical")) else "NOT identical",
         "every run above"),
    ]
    return out


def seed_figure(seed: dict) -> str:
    blocks, fp8 = seed["fp8"]["blocks"], seed["fp8"]
    a1, b, a2 = (blocks[name]["decode_tok_s"] for name in ("A1", "B", "A2"))
    return f"{a1:.1f} / {b:.1f} / {a2:.1f} tok/s (checkpoint {fp8['fast_vs_replay']:.2f}x replay)"


def table() -> str:
    lines = ["| figure | measured | measured by |", "|---|---|---|"]
    lines += [f"| {figure} | {value} | {by} |" for figure, value, by in rows()]
    return "\n".join(lines)


def readme_with_table(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the README's table")
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's table differs")
    args = parser.parse_args()
    text = README.read_text()
    if args.write:
        README.write_text(readme_with_table(text))
    elif args.check:
        if readme_with_table(text) != text:
            print("README.md's Measured table is not what the JSON says: run scripts/measured_table.py --write",
                  file=sys.stderr)
            return 1
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
