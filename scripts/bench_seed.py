#!/usr/bin/env python3
"""The benchmark this project started from, on our stack: Qwen3.5-27B (synthetic, its real shape) split over two
daemons, each held to 24 GB as an RTX 3090 would hold it, FP8 weights, checkpoint storage on, the 27B-shaped
DFlash drafter (`--draft synthetic:5`), a 1,024-token prompt and 256 new tokens; fast rollback (checkpoint)
against replay in blocks A1 (checkpoint), B (replay), A2 (checkpoint), one discarded warm-up and five measured
runs per block, every run's output hashed (all must be the same tokens). Then the same run in bf16 without the
cap, and FP8 against its own dequantized bf16 model (max |Δlogit|, top-1 agreement over a 256-token greedy run).

    python3 scripts/bench_seed.py --json bench/results/h200/seed_bench.json            # all three parts
    python3 scripts/bench_seed.py --parts fp8 --runs 2 --tokens 64                     # quick

Parts, each in its own processes: `fp8` and `bf16` (two daemons on --devices), `compare` (one process, one GPU).
Prints the seed's table last (median decode tok/s, wall time, acceptance, average commit, A1-A2 drift).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAST, REPLAY = "checkpoint", "replay"


def token_hash(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


# ---- two daemons ----------------------------------------------------------------------------------------

def start_daemons(args, quantize: str | None, cap: str | None, run_dir: Path) -> tuple[list, list[str]]:
    from coordinator.client import ShardClient, ShardTimeout
    from shardd.presets import preset_config

    layers = preset_config(args.preset).num_layers
    ranges = [(0, layers // 2), (layers // 2, layers)]
    devices = args.devices.split(",")
    processes, endpoints = [], []
    for index, (begin, end) in enumerate(ranges):
        endpoint = f"ipc://{run_dir}/shard{index}.sock"
        command = [sys.executable, "-m", "shardd", "serve", "--synthetic", f"{args.preset}:{args.seed}",
                   "--layers", f"{begin}:{end}", "--device", devices[index], "--dtype", "bfloat16",
                   "--engine", "fast" if devices[index].startswith("cuda") else "reference",  # cpu: a dry run
                   "--bind", endpoint, "--rollback-mode", "checkpoint", "--max-verify-tokens", str(args.block),
                   "--max-sequences", "1", "--max-context", str(args.context),
                   "--max-tokens-per-request", str(args.prompt_len)]
        if index == 0:  # the drafter beside the embedding it borrows (the head is read for it)
            command += ["--draft", f"synthetic:{args.draft_layers}"]
        if quantize:
            command += ["--quantize", quantize]
        if cap:
            command += ["--max-gpu-memory", cap]
        log = open(run_dir / f"shard{index}.log", "w")
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        endpoints.append(endpoint)
    deadline = time.monotonic() + args.load_timeout
    for index, (process, endpoint) in enumerate(zip(processes, endpoints)):
        client = ShardClient(endpoint, timeout_s=1.0)
        try:
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"shard {index} did not come up: "
                                       + (run_dir / f"shard{index}.log").read_text()[-3000:])
                try:
                    client.hello(timeout_s=0.5)
                    break
                except ShardTimeout:
                    continue
        finally:
            client.close()
    return processes, endpoints


def run_pair(args, quantize: str | None, cap: str | None) -> dict:
    """The seed's A/B/A over two daemons."""
    from coordinator import benchstats
    from coordinator.client import ShardClient
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafters import make_drafter
    from coordinator.pipeline import Pipeline
    from shardd.presets import preset_config

    config = preset_config(args.preset)
    prompt = prompt_ids(config.vocab_size, args.prompt_len, args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-seed-"))
    out: dict = {"weights": quantize or "bfloat16", "cap": cap, "prompt_tokens": len(prompt), "new_tokens": args.tokens,
                 "block": args.block, "draft": f"synthetic:{args.draft_layers}", "runs_per_block": args.runs}
    processes, endpoints = start_daemons(args, quantize, cap, run_dir)
    try:
        with Pipeline.connect(endpoints, timeout_s=600) as pipeline:
            out["memory_plan"] = [shard.hello.get("memory") for shard in pipeline.shards]
            greedy = greedy_decode(pipeline, 1, prompt, args.tokens)
            out["greedy_tok_s"] = round(greedy.decode_tok_s, 2)
            hashes = {"greedy": token_hash(greedy.tokens)}
            draft_client = ShardClient(endpoints[0], timeout_s=600)

            def one_run(mode: str, seq: int) -> dict:
                drafter = make_drafter("dflash", draft_client=draft_client, pipeline=pipeline)
                result = speculative_decode(drafter.target, seq, prompt, drafter, block_size=args.block, rollback=mode,
                                            max_new_tokens=args.tokens)
                return {**result.summary(), "hash": token_hash(result.tokens)}

            one_run(FAST, 2)  # warm-up, discarded
            blocks: dict[str, list[dict]] = {"A1": [], "B": [], "A2": []}
            for name, mode in (("A1", FAST), ("B", REPLAY), ("A2", FAST)):
                for i in range(args.runs):
                    run = one_run(mode, 10 + len(blocks[name]) + 100 * len(blocks))
                    blocks[name].append(run)
                    hashes[f"{name}/{i}"] = run["hash"]
                    print(f"{out['weights']} {name} ({mode}) run {i}: {run['decode_tok_s']:.1f} tok/s, "
                          f"commit {run['avg_commit'] or 0:.2f}", flush=True)
            out["blocks"] = {name: benchstats.summarize_runs(runs) for name, runs in blocks.items()}
            out["runs"] = blocks
            a1, a2 = out["blocks"]["A1"]["decode_tok_s"], out["blocks"]["A2"]["decode_tok_s"]
            out["drift_a1_a2"] = round(benchstats.drift(a1, a2), 4)
            out["fast_vs_replay"] = round(statistics.mean([a1, a2]) / out["blocks"]["B"]["decode_tok_s"], 3)
            out["hashes"] = hashes
            out["outputs_identical"] = len(set(hashes.values())) == 1
            out["device_memory"] = [client.hello().get("device_memory") for client in pipeline.clients]
            draft_client.close()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    return out


# ---- FP8 against its own dequantized bf16 model ------------------------------------------------------------

def run_compare(args) -> dict:
    import torch

    from coordinator.decoding import greedy_decode
    from shardd.fast.shard import FastShard
    from shardd.loading import ModelSource, build_shard
    from shardd.model import rollback as rb
    from shardd.model.shard import ShardModel
    from shardd.quant import Fp8Linear
    from tests.local import LocalTarget

    device = args.devices.split(",")[0]
    source = ModelSource(synthetic=f"{args.preset}:{args.seed}", quantize=args.quantize)
    config = source.config()
    storage = rb.RollbackStorage(FAST, args.block)
    fp8 = build_shard(source, 0, config.num_layers, dtype="bfloat16", device=device, storage=storage, keep_fp8=True)
    prompt = prompt_ids(config.vocab_size, args.prompt_len, args.seed)
    fast = FastShard(fp8, max_sequences=1, max_context=args.context) if device.startswith("cuda") else fp8
    greedy = greedy_decode(LocalTarget.from_shards([fast], args.context), 1, prompt, args.compare_tokens).tokens
    del fast
    sequence = prompt + greedy[:-1]

    @torch.inference_mode()
    def logits_of(model) -> torch.Tensor:
        """[new tokens, vocab] float32 of one forward of prompt + greedy, at the positions that chose them."""
        state = model.new_state(len(sequence) + 1)
        return model.forward(state, 0, tokens=sequence).logits[len(prompt) - 1:].float()

    fp8_logits = logits_of(fp8)
    weights = {}
    for layer in fp8.layers:  # the dequantized model: every FP8 matrix multiplied out to bf16, the rest shared
        for module in (layer.mlp, layer.linear_attn if layer.is_gdn else layer.self_attn):
            for name, value in vars(module).items():
                if isinstance(value, Fp8Linear):
                    weights[id(value)] = value.dequantized(torch.bfloat16)
    for layer in fp8.layers:
        for module in (layer.mlp, layer.linear_attn if layer.is_gdn else layer.self_attn):
            for name, value in list(vars(module).items()):
                if isinstance(value, Fp8Linear):
                    setattr(module, name, weights[id(value)])
    bf16_logits = logits_of(fp8)  # the same model object, now holding the dequantized bf16 matrices
    assert isinstance(fp8, ShardModel)
    delta = (fp8_logits - bf16_logits).abs()
    top1 = (bf16_logits.argmax(-1) == torch.tensor(greedy, device=bf16_logits.device)).float().mean().item()
    return {"compare_weights": args.quantize, "compare_tokens": len(greedy), "max_abs_delta_logit": round(delta.max().item(), 4),
            "mean_abs_delta_logit": round(delta.mean().item(), 5), "top1_agreement": round(top1, 4),
            "fp8_greedy_hash": token_hash(greedy)}


# ---- the whole run ------------------------------------------------------------------------------------------

def table(result: dict) -> str:
    lines = ["| weights | cap | mode | decode tok/s (median) | wall s | acceptance | avg commit |",
             "|---|---|---|---|---|---|---|"]
    for part in ("fp8", "bf16"):
        run = result.get(part)
        if not run or "blocks" not in run:
            continue
        for name, mode in (("A1", FAST), ("B", REPLAY), ("A2", FAST)):
            b = run["blocks"][name]
            lines.append(f"| {run['weights']} | {run['cap'] or 'none'} | {name} {mode} | {b['decode_tok_s']:.1f} | "
                         f"{b['wall_seconds']:.2f} | {(b['acceptance_rate'] or 0):.3f} | {(b['avg_commit'] or 0):.2f} |")
        lines.append(f"| {run['weights']} | | drift A1-A2 {run['drift_a1_a2']:.1%}, checkpoint/replay "
                     f"{run['fast_vs_replay']:.2f}x, outputs identical: {run['outputs_identical']} | | | | |")
    if "max_abs_delta_logit" in result.get("compare", {}):
        c = result["compare"]
        lines.append(f"\nFP8 vs its dequantized bf16 model over {c['compare_tokens']} greedy tokens: max |Δlogit| "
                     f"{c['max_abs_delta_logit']}, top-1 agreement {c['top1_agreement']:.2%}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("fp8", "bf16", "compare"), help="Run one part in this process.")
    parser.add_argument("--parts", default="fp8,bf16,compare")
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize", default="fp8-block", choices=("fp8-block", "fp8-channel"))
    parser.add_argument("--cap", default="24GiB", help="--max-gpu-memory of each FP8 daemon (the seed's 3090s).")
    parser.add_argument("--devices", default="cuda:0,cuda:1")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--compare-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096, help="Each daemon's --max-context (checkpoint storage "
                        "for one sequence at this many tokens).")
    parser.add_argument("--runs", type=int, default=5, help="Measured runs per block.")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--load-timeout", type=float, default=600)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    if args.part:
        if args.part == "compare":
            result = run_compare(args)
        else:
            result = run_pair(args, args.quantize if args.part == "fp8" else None,
                              args.cap if args.part == "fp8" else None)
        text = json.dumps(result, indent=2) + "\n"
        Path(args.json).write_text(text) if args.json else print(text)
        return 0

    merged: dict = {}
    drop = {"--json", "--parts"}
    cleaned, skip = [], False
    for arg in sys.argv[1:]:  # the child gets every option but --json / --parts
        if skip:
            skip = False
            continue
        if arg in drop:
            skip = True
            continue
        if arg.split("=", 1)[0] in drop:
            continue
        cleaned.append(arg)
    for part in args.parts.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            path = handle.name
        print(f"== {part}", flush=True)
        done = subprocess.run([sys.executable, __file__, "--part", part, "--json", path, *cleaned], cwd=ROOT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        merged[part] = json.loads(Path(path).read_text()) if done.returncode == 0 else {"failed": done.returncode}
        if args.json:  # after every part, so a later part's failure loses nothing
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(merged, indent=2) + "\n")
    hashes = set((merged.get("fp8", {}).get("hashes") or {}).values())
    if merged.get("compare", {}).get("compare_tokens") == args.tokens:
        hashes.add(merged["compare"]["fp8_greedy_hash"])  # one process and two daemons: the same FP8 tokens
    merged["fp8_outputs_identical"] = len(hashes) == 1 if hashes else None
    if args.json:
        Path(args.json).write_text(json.dumps(merged, indent=2) + "\n")
    print(table(merged))
    failed = [part for part, value in merged.items() if isinstance(value, dict) and "failed" in value]
    return 1 if failed or merged["fp8_outputs_identical"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
