"""The DFlash parts of scripts/bench_gpu.py: `--parts dflash` (`dflash-drafter`: PROPOSE in process;
`dflash-placements`: the drafter in each placement beside two daemons) and `--parts dflash-batch` (DFlash streams in
the scheduler's batches, and through shardctl serve)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_daemons import PYSPY_STEADY, pyspy_top, serve_processes, stop_processes
from bench_measure import BLOCK, MEAN_COMMIT, copy_bandwidth, cuda_seconds, median_ms, profile_top, token_hash
from bench_relay import phase_readings, shard_phases


# ---- dflash: the real drafter's PROPOSE every step, on one GPU ------------------------------------------------


def run_dflash_drafter(args) -> dict:
    """--parts dflash's first part, in a process of its own, so that none of its GPU memory (the drafter's graphs
    keep private pools) is held while the placements' daemons load on the same GPU."""
    if not args.dflash_device.startswith("cuda"):
        return {}
    out = drafter_in_process(args)
    print(f"drafter PROPOSE in process: fast {out['draft_propose_ms_fast']} ms, reference "
          f"{out['draft_propose_ms_reference']} ms, floor {out['draft_floor_ms']} ms", flush=True)
    return out


def drafter_in_process(args) -> dict:
    """PROPOSE's compute alone, in this process: the drafter (`--draft`) of the preset's target, its fast path
    (CUDA graphs) and its reference (eager), one context step of MEAN_COMMIT rows plus a 16-row block, against
    the weight-read floor of the drafter and the target head it borrows."""
    import torch

    from shardd.draft.model import DFlashDrafter
    from common.draft_config import parse_draft, synthetic_draft_config
    from shardd.draft.synthetic import synthetic_draft_weights
    from shardd.engine.fast.draft import FastDrafter
    from common.presets import preset_config
    from shardd.synthetic.model import synthetic_tensor

    device = torch.device(args.dflash_device)
    torch.cuda.set_device(device)
    target = preset_config(args.preset)
    _, layers = parse_draft(args.draft)
    config = synthetic_draft_config(target, num_layers=layers)
    vocab_shape = (target.vocab_size, target.hidden_size)
    embed = synthetic_tensor(target, "embed_tokens.weight", vocab_shape, args.seed, device).to(torch.bfloat16)
    head = synthetic_tensor(target, "lm_head.weight", vocab_shape, args.seed, device).to(torch.bfloat16)
    reference = DFlashDrafter(config, synthetic_draft_weights(config, args.seed, dtype=torch.bfloat16),
                              target_embed=embed, target_lm_head=head, device=device, dtype=torch.bfloat16)
    bandwidth = copy_bandwidth(torch, device)
    read_bytes = reference.weight_bytes() + head.nbytes  # the layers, fc, and the head for the mask rows
    context = args.prompt_len + args.tokens + 4 * BLOCK
    fast = FastDrafter(reference, max_sequences=1, max_context=context)
    generator = torch.Generator().manual_seed(args.seed)
    prompt_rows = torch.randn(args.prompt_len, config.feature_size, generator=generator).to(torch.bfloat16)
    step_rows = torch.randn(int(MEAN_COMMIT), config.feature_size, generator=generator).to(torch.bfloat16)
    out = {"draft_read_bytes": read_bytes, "draft_floor_ms": round(read_bytes / bandwidth * 1e3, 3),
           "draft_layers": layers, "draft_rows_per_step": fast.batch_rows}
    for name, model in (("fast", fast), ("reference", reference)):
        state = model.new_state(context)
        model.add_context(state, prompt_rows)
        start_length = state.length

        def propose():
            model.crop(state, start_length)
            model.add_context(state, step_rows)
            model.propose(state, 1, BLOCK)

        for _ in range(3):
            propose()
        out[f"draft_propose_ms_{name}"] = median_ms(cuda_seconds(torch, device, propose, args.repeats))
        if name == "fast":
            out["profile_propose_top"] = profile_top(torch, propose, 5)
        model.release_state(state)
    out["draft_floor_ratio"] = round(out["draft_propose_ms_fast"] / out["draft_floor_ms"], 3)
    # the daemon's drafter beside a batched verify: one step of R = 8 blocks for every count up to 8 sequences
    batched = FastDrafter(reference, max_sequences=32, max_context=context, step_rows=8 * BLOCK)
    out["draft_batch_rows_per_step"] = batched.batch_rows
    out["draft_batch_ms"] = {}
    for count in (1, 8, 32):
        states = [batched.new_state(context) for _ in range(count)]
        batched.add_context_batch([(state, prompt_rows) for state in states])

        def propose_all():
            for state in states:
                batched.crop(state, args.prompt_len)
            batched.add_context_batch([(state, step_rows) for state in states])
            batched.propose_batch([(state, 1, BLOCK) for state in states])

        for _ in range(3):
            propose_all()
        samples = []
        for _ in range(args.repeats):
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            propose_all()
            torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - began)
        out["draft_batch_ms"][str(count)] = median_ms(samples)
        if count in (1, 8):
            out.setdefault("profile_batch_top", {})[str(count)] = profile_top(torch, propose_all, 5)
        for state in states:
            batched.release_state(state)
    out["draft_batch_8_vs_1"] = round(out["draft_batch_ms"]["8"] / out["draft_batch_ms"]["1"], 3)
    return out


class TimedTarget:
    """A decode target whose verify forwards (at most BLOCK rows: not the prefill) and rollbacks are timed;
    `on_decode()` runs once, before the first verify (after the prefill)."""

    def __init__(self, target, on_decode=None):
        self.target = target
        self.seconds = {"verify": 0.0, "rollback": 0.0}
        self.on_decode = on_decode
        self.at_decode = None

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, seq, pos, tokens, **kwargs):
        if self.at_decode is None and len(tokens) <= BLOCK and self.on_decode is not None:
            self.at_decode = self.on_decode()
        began = time.perf_counter()
        ids = self.target.forward(seq, pos, tokens, **kwargs)
        if len(tokens) <= BLOCK:
            self.seconds["verify"] += time.perf_counter() - began
        return ids

    def rollback(self, seq, keep):
        began = time.perf_counter()
        self.target.rollback(seq, keep)
        self.seconds["rollback"] += time.perf_counter() - began


class ProposingOracle:
    """The real DFlash drafter's PROPOSE every step (its whole cost: features sent, context appended, a block
    drafted), then the oracle's tokens: the steps commit as at the oracle's mean acceptance, so the time is
    the real drafter's even though synthetic weights accept nothing."""

    name = "dflash (real PROPOSE, oracle commits)"

    def __init__(self, dflash, oracle):
        self.dflash, self.oracle = dflash, oracle
        self.seconds = 0.0
        self.on_first, self.at_decode = None, None

    def propose(self, history, n):
        if self.at_decode is None and self.on_first is not None:
            self.at_decode = self.on_first()
        began = time.perf_counter()
        self.dflash.propose(history, n)
        self.seconds += time.perf_counter() - began
        return self.oracle.propose(history, n)

    # A scheduler stream: its sequence opened, closed and re-filled through the DFlash client's target, and its
    # forwards prepared and collected by it, so the real drafter's context follows as with DFlash alone.
    @property
    def target(self):
        return self.dflash.target

    def prepare(self, forward):
        return self.dflash.prepare(forward)

    def collect(self, forward, answer):
        return self.dflash.collect(forward, answer)


def run_dflash(args) -> dict:
    """Two target daemons (layers 0:L/2, L/2:L) and the drafter in each placement, all on one GPU: the drafter
    in its own daemon ("own"), beside the first shard's layers ("first"), beside the last ("last": it proposes
    the next block in the verify's reply, no PROPOSE round trip; "last-propose": the same daemon asked with
    PROPOSE every step). Per
    placement and mean commit: tok/s with the real PROPOSE every step, the oracle's on the same daemons, and
    the per-step breakdown (client wall time of propose / verify / rollback; daemon compute from STATS; relay =
    the step's wall time beyond the daemons' compute)."""
    import torch

    from coordinator.relay.client import ShardClient
    from coordinator.decoding import greedy_decode, speculative_decode
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.drafting.drafters import OracleDrafter
    from coordinator.relay.pipeline import Pipeline
    from common.presets import preset_config

    out: dict = {"dflash_draft": args.draft, "dflash_device": args.dflash_device, "dflash_block": BLOCK}
    config = preset_config(args.preset)
    half = config.num_layers // 2
    placements = [placement for placement in args.placements.split(",") if placement]
    if not placements:
        return out
    specs = {"first": ["--layers", f"0:{half}"], "last": ["--layers", f"{half}:{config.num_layers}"]}
    hosts = {"last-propose": "last"}  # a placement measured on another placement's daemon
    for placement in placements:
        host = hosts.get(placement, placement)
        if host in ("first", "last"):
            if "--draft" not in specs[host]:
                specs[host] += ["--draft", args.draft]
        else:
            specs[host] = ["--layers", "none", "--draft", args.draft]
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    commits = [float(c) for c in args.commits.split(",")]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-dflash-"))
    processes, endpoints = serve_processes(args, specs, run_dir)
    hashes: dict = {}
    try:
        stats_clients = {name: ShardClient(endpoint, timeout_s=60) for name, endpoint in endpoints.items()}
        draft_clients = {name: ShardClient(endpoints[hosts.get(name, name)], timeout_s=600) for name in placements}

        def drafter_client(placement):
            dflash = DFlashDrafterClient(draft_clients[placement], pipeline)
            if placement == "last-propose":
                dflash.proposes_in_reply = False
            return dflash

        def compute_seconds():
            return {name: dict(client.stats()["compute_seconds"]) for name, client in stats_clients.items()}

        def daemon_ms(before, after, steps):
            """Daemon compute per decode step by request type (a step's types), summed over the daemons."""
            totals: dict = {}
            for name in after:
                for kind, seconds in after[name].items():
                    if kind not in ("FORWARD", "CAPTURE", "PROPOSE", "ROLLBACK"):
                        continue
                    totals[kind] = totals.get(kind, 0.0) + seconds - before[name].get(kind, 0.0)
            return {kind: round(seconds / steps * 1e3, 3) for kind, seconds in sorted(totals.items()) if seconds > 0}

        with Pipeline.connect([endpoints["first"], endpoints["last"]], timeout_s=600) as pipeline:
            greedy_decode(pipeline, 90, prompt[:32], 4)  # warm-up
            greedy = greedy_decode(pipeline, 1, prompt, args.tokens)
            hashes["dflash/greedy"] = token_hash(greedy.tokens)
            out["dflash_greedy_ms_per_token"] = round(greedy.decode_seconds / len(greedy.tokens) * 1e3, 3)
            runs: dict = {}

            def oracle_run(commit):
                target = TimedTarget(pipeline, compute_seconds)
                drafter = OracleDrafter.with_mean_commit(greedy.tokens, len(prompt), block_size=BLOCK, mean_commit=commit)
                result = speculative_decode(target, 2, prompt, drafter, block_size=BLOCK, max_new_tokens=args.tokens)
                return result, target, None, daemon_ms(target.at_decode, compute_seconds(), result.steps)

            def dflash_run(placement, commit):
                dflash = drafter_client(placement)
                target = TimedTarget(dflash.target)
                oracle = OracleDrafter.with_mean_commit(greedy.tokens, len(prompt), block_size=BLOCK, mean_commit=commit)
                drafter = ProposingOracle(dflash, oracle)
                # the daemons' compute from the first PROPOSE on (it carries the prompt's features: a decode cost)
                drafter.on_first = compute_seconds
                result = speculative_decode(target, 3, prompt, drafter, block_size=BLOCK, max_new_tokens=args.tokens)
                return result, target, drafter, daemon_ms(drafter.at_decode, compute_seconds(), result.steps)

            def record(key, commit, run):
                result, target, drafter, daemon = run
                steps = result.steps
                entry = {
                    "tok_s": round(len(result.tokens) / result.decode_seconds, 2),
                    "mean_commit": round(result.avg_commit, 2),
                    "step_ms": round(result.decode_seconds / steps * 1e3, 3),
                    "propose_ms": round(drafter.seconds / steps * 1e3, 3) if drafter else 0.0,
                    "proposals_in_reply": drafter.dflash.proposals_in_reply if drafter else 0,
                    "verify_ms": round(target.seconds["verify"] / steps * 1e3, 3),
                    "rollback_ms": round(target.seconds["rollback"] / steps * 1e3, 3),
                    "daemon_ms": daemon,
                }
                entry["relay_ms"] = round(entry["step_ms"] - sum(daemon.values()), 3)
                runs.setdefault(key, {}).setdefault(f"{commit:g}", []).append(entry)
                hashes[f"dflash/{key}/{commit:g}"] = token_hash(result.tokens)
                print(f"{key} commit {commit:g}: {entry['tok_s']} tok/s, step {entry['step_ms']} ms "
                      f"(propose {entry['propose_ms']}, verify {entry['verify_ms']}, rollback {entry['rollback_ms']}, "
                      f"relay {entry['relay_ms']})", flush=True)

            for placement in placements:  # warm-up: each drafter's graphs, each daemon's first PROPOSE
                dflash = drafter_client(placement)
                speculative_decode(dflash.target, 91, prompt[:64], dflash, block_size=BLOCK, max_new_tokens=4)
            for commit in commits:
                record("oracle", commit, oracle_run(commit))
                for placement in placements:
                    record(placement, commit, dflash_run(placement, commit))
                record("oracle", commit, oracle_run(commit))  # A/B/A: the oracle before and after
            # the real drafter's own tokens (synthetic weights: about one token per step), still the greedy output
            dflash = drafter_client(placements[0])
            real = speculative_decode(dflash.target, 4, prompt, dflash, block_size=BLOCK, max_new_tokens=args.tokens)
            hashes["dflash/real"] = token_hash(real.tokens)
            out["dflash_real_tok_s"] = round(len(real.tokens) / real.decode_seconds, 2)
            out["dflash_real_mean_commit"] = round(real.avg_commit, 2)
            out["dflash_real_identical_to_greedy"] = real.tokens == greedy.tokens
    finally:
        stop_processes(processes)

    def median_entry(entries):
        return {key: (round(statistics.median(e[key] for e in entries), 3) if not isinstance(entries[0][key], dict)
                      else entries[len(entries) // 2][key]) for key in entries[0]}

    out["dflash_runs"] = {key: {c: median_entry(v) for c, v in by_commit.items()} for key, by_commit in runs.items()}
    oracle = out["dflash_runs"]["oracle"]
    out["dflash_vs_oracle"] = {
        placement: {c: {"tok_s": round(entry["tok_s"] / oracle[c]["tok_s"], 3),
                        "step": round(entry["step_ms"] / oracle[c]["step_ms"], 3)}
                    for c, entry in out["dflash_runs"][placement].items()}
        for placement in placements
    }
    best = max(placements, key=lambda p: out["dflash_vs_oracle"][p][f"{max(commits):g}"]["tok_s"])
    out["dflash_best_placement"] = best
    out["hashes"] = hashes
    return out


def dflash_table(merged: dict) -> str:
    """The short table the GPU script prints last."""
    lines = [f"drafter PROPOSE (in process): fast {merged.get('draft_propose_ms_fast')} ms, reference "
             f"{merged.get('draft_propose_ms_reference')} ms, floor {merged.get('draft_floor_ms')} ms "
             f"(x{merged.get('draft_floor_ratio')})"]
    runs = merged.get("dflash_runs", {})
    lines.append(f"{'run':<12} {'commit':>6} {'tok/s':>8} {'step ms':>8} {'propose':>8} {'verify':>8} {'rollback':>8} "
                 f"{'relay':>7} {'vs oracle':>9}")
    for key, by_commit in runs.items():
        for commit, e in by_commit.items():
            ratio = merged.get("dflash_vs_oracle", {}).get(key, {}).get(commit, {}).get("tok_s", 1.0 if key == "oracle" else "")
            lines.append(f"{key:<12} {commit:>6} {e['tok_s']:>8} {e['step_ms']:>8} {e['propose_ms']:>8} {e['verify_ms']:>8} "
                         f"{e['rollback_ms']:>8} {e['relay_ms']:>7} {ratio:>9}")
    lines.append(f"best placement: {merged.get('dflash_best_placement')}; real drafter {merged.get('dflash_real_tok_s')} tok/s "
                 f"(commit {merged.get('dflash_real_mean_commit')}), identical to greedy: "
                 f"{merged.get('dflash_real_identical_to_greedy')}; all outputs identical: {merged.get('outputs_identical')}")
    return "\n".join(lines)


# ---- dflash-batch: DFlash streams in the scheduler's batches, and through shardctl serve -------------------

HTTP_STREAMS = (1, 8)
AVERAGED = ("tok_s", "decode_tok_s", "step_ms", "mean_commit")  # the oracle's figures: its two runs' mean


def run_dflash_batch(args) -> dict:
    """Two target daemons (layers 0:L/2, L/2:L) with the drafter beside the last shard (the shipped placement:
    it proposes the next block in the verify's reply), chained as `shardctl launch` chains them (the rows, and the
    first shard's captured layers with them, go from shard to shard), replay-ssm storage for every stream, all on
    `--dflash-device`. Per --streams count, that many streams together through the scheduler: the oracle, then
    DFlash (the real drafter proposing every step, the oracle's commit schedule deciding what is accepted:
    `ProposingOracle`), then the oracle again (A/B/A). Then `shardctl serve --drafter dflash` (the real drafter's
    own tokens) beside `--drafter none` on the same daemons, HTTP_STREAMS concurrent greedy completions."""
    from bench_batch import digest, run_streams, stream_prompts
    from coordinator.drafting.dflash import DFlashDrafterClient
    from coordinator.relay.client import ShardClient
    from coordinator.relay.pipeline import Pipeline
    from common.presets import preset_config

    streams = [int(count) for count in args.streams.split(",")]
    layers = preset_config(args.preset).num_layers
    specs = {"first": ["--layers", f"0:{layers // 2}"],
             "last": ["--layers", f"{layers // 2}:{layers}", "--draft", args.draft]}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-dflash-batch-"))
    widest = max(*streams, *HTTP_STREAMS)
    spied = Path(args.pyspy).resolve() if args.pyspy else None
    if spied is not None:
        spied.mkdir(parents=True, exist_ok=True)
    processes, endpoints = serve_processes(args, specs, run_dir, max_sequences=widest + 1, rollback="replay-ssm",
                                           pyspy=spied, chained=True)
    shards = [endpoints["first"], endpoints["last"]]
    prompts = stream_prompts(args, widest)
    out: dict = {"dflash_batch_streams": streams, "dflash_batch_draft": args.draft,
                 "dflash_batch_device": args.dflash_device, "dflash_batch_engine": args.dflash_engine}
    runs: dict = {"oracle": {}, "dflash": {}}
    checks: dict = {}
    try:
        with Pipeline.connect(shards, timeout_s=600) as pipeline, ShardClient(endpoints["last"], timeout_s=600) as client:
            dflash = DFlashDrafterClient(client, pipeline)
            drafters: list = []

            def proposing(index, oracle):
                drafters.append(ProposingOracle(dflash.fresh(), oracle))
                return drafters[-1]

            def run(kind, count, greedy, args=args):
                drafters.clear()
                stats: dict = {}
                before = phase_readings(pipeline)
                tokens, tok_s, commit = run_streams(pipeline, prompts[:count], args, references=greedy, stats=stats,
                                                    wrap=proposing if kind == "dflash" else None)
                after = phase_readings(pipeline)
                entry = {"tok_s": tok_s, "decode_tok_s": stats["decode_tok_s"], "step_ms": stats["step_ms"],
                         "mean_commit": commit, "steps": stats["steps"], "digest": digest(tokens),
                         # where a scheduler step's time goes: per shard, the daemon's phases and the coordinator's
                         # phases of its requests, ms per step (steps: the first shard's requests)
                         "phases_per_step": shard_phases(before, after)}
                if kind == "dflash":  # blocks the head shard proposed in a verify's reply (no PROPOSE sent)
                    entry["proposals_in_reply"] = sum(d.dflash.proposals_in_reply for d in drafters)
                print(f"dflash-batch {kind} x{count}: {tok_s} tok/s (decode {entry['decode_tok_s']}), step "
                      f"{entry['step_ms']} ms, mean commit {commit}", flush=True)
                return tokens, entry

            # warm-up: every path the runs take (prompt chunks, verify steps, the drafter's first PROPOSE and replies)
            warm = argparse.Namespace(**{**vars(args), "tokens": min(args.tokens, 2 * BLOCK)})
            reference, _, _ = run_streams(pipeline, prompts[:2], warm)
            run("oracle", 2, reference, warm)
            run("dflash", 2, reference, warm)
            greedy, _, _ = run_streams(pipeline, prompts[:max(streams)], args)
            alone = None  # stream 0's DFlash tokens decoded by itself
            for count in streams:
                entries = []
                for kind in ("oracle", "dflash", "oracle"):  # A/B/A: the oracle before and after
                    tokens, entry = run(kind, count, greedy)
                    entries.append(entry)
                    checks[f"{kind}_x{count}_equals_greedy"] = checks.get(f"{kind}_x{count}_equals_greedy", True) \
                        and tokens == greedy[:count]
                    if kind == "dflash":
                        if count == 1:
                            alone = tokens[0]
                        elif alone is None:
                            alone = run("dflash", 1, greedy)[0][0]
                        checks[f"dflash_x{count}_stream0_equals_alone"] = tokens[0] == alone
                runs["dflash"][str(count)] = entries[1]
                runs["oracle"][str(count)] = {key: (round((a + b) / 2, 3) if key in AVERAGED and None not in (a, b) else a)
                                              for (key, a), b in zip(entries[0].items(), entries[2].values())}
            # per shard, whether its prefill's graphs replay each set of captured layers (a set that stays eager
            # costs a prompt its launches)
            shard_stats = pipeline.stats()
            out["dflash_batch_prefill_graphs"] = [shard.get("engine", {}).get("prefill_graphs") for shard in shard_stats]
            # per shard, how rows (and the carried feature rows) travelled: STATS `rows` (on_device, carried_on_device)
            out["dflash_batch_rows"] = [shard.get("rows") for shard in shard_stats]
        out["dflash_batch_http"] = dflash_http(args, shards, endpoints["last"], prompts, run_dir, checks)
    finally:
        stop_processes(processes, profiled=spied is not None)
    if spied is not None:  # each daemon's busiest frames over the whole part (py-spy wrote them as it exited)
        out["dflash_batch_pyspy"] = {path.stem: pyspy_top(path, **PYSPY_STEADY) for path in sorted(spied.glob("*.txt"))}
    out["dflash_batch_runs"] = runs
    out["dflash_batch_vs_oracle"] = {
        count: {figure: round(runs["dflash"][count][key] / runs["oracle"][count][key], 3)
                for figure, key in (("step", "step_ms"), ("tok_s", "tok_s"), ("decode_tok_s", "decode_tok_s"))
                if runs["dflash"][count][key] and runs["oracle"][count][key]}
        for count in runs["dflash"]}
    out["dflash_batch_checks"] = checks
    out["dflash_batch_identical"] = all(checks.values())
    return out


def dflash_http(args, shards: list[str], draft_shard: str, prompts, run_dir: Path, checks: dict) -> dict:
    """`shardctl serve --drafter dflash` (the drafter beside the last shard, its own proposals), the same with
    `--block-size auto` (`dflash-auto`), and `--drafter none` over the same daemons, HTTP_STREAMS concurrent greedy
    completions each: tok/s by drafter and streams, `dflash_vs_none` and `dflash_auto_vs_none`; into `checks`,
    DFlash's texts equal to greedy's and stream 0's to itself alone."""
    from bench_batch import http_streams

    dflash = ["--drafter", "dflash", "--draft-shard", draft_shard, "--rollback", "replay-ssm"]
    serve_args = {"none": ["--drafter", "none"], "dflash": dflash, "dflash-auto": [*dflash, "--block-size", "auto"]}
    out: dict = {name: {} for name in serve_args}
    try:
        for count in HTTP_STREAMS:
            for drafter, extra in serve_args.items():
                out[drafter][str(count)] = http_streams(args, shards, prompts[:count], run_dir, serve_args=extra)
                print(f"dflash-batch HTTP {drafter} x{count}: {out[drafter][str(count)]['tok_s']} tok/s", flush=True)
    except Exception as error:  # noqa: BLE001 - e.g. the serve extra (fastapi, uvicorn, httpx) not installed
        out["error"] = f"{type(error).__name__}: {error}"
        print(f"dflash-batch HTTP failed: {out['error']}", flush=True)
        return out
    for count in HTTP_STREAMS:
        none = out["none"][str(count)]
        for name in ("dflash", "dflash-auto"):
            runs = out[name]
            checks[f"http_{name}_x{count}_equals_greedy"] = runs[str(count)]["stream_digests"] == none["stream_digests"]
            checks[f"http_{name}_x{count}_stream0_equals_alone"] = (runs[str(count)]["stream_digests"][0]
                                                                    == runs[str(HTTP_STREAMS[0])]["stream_digests"][0])
    for name in ("dflash", "dflash-auto"):
        out[f"{name.replace('-', '_')}_vs_none"] = {
            str(count): round(out[name][str(count)]["tok_s"] / out["none"][str(count)]["tok_s"], 3)
            for count in HTTP_STREAMS}
    return out


def dflash_batch_table(merged: dict) -> str:
    """The short table the GPU script prints last."""
    lines = [f"{'streams':>7} {'run':<7} {'tok/s':>8} {'decode':>8} {'step ms':>8} {'commit':>6} "
             f"{'step vs oracle':>14} {'tok/s vs oracle':>15}"]
    for count, dflash in merged.get("dflash_batch_runs", {}).get("dflash", {}).items():
        oracle = merged["dflash_batch_runs"]["oracle"][count]
        ratio = merged.get("dflash_batch_vs_oracle", {}).get(count, {})
        for kind, e in (("oracle", oracle), ("dflash", dflash)):
            lines.append(f"{count:>7} {kind:<7} {e['tok_s']:>8} {str(e['decode_tok_s']):>8} {str(e['step_ms']):>8} "
                         f"{str(e['mean_commit']):>6} {ratio.get('step', '') if kind == 'dflash' else '':>14} "
                         f"{ratio.get('tok_s', '') if kind == 'dflash' else '':>15}")
    http = merged.get("dflash_batch_http", {})
    for count, ratio in http.get("dflash_vs_none", {}).items():
        auto = http.get("dflash_auto_vs_none", {}).get(count)
        lines.append(f"HTTP x{count}: dflash {http['dflash'][count]['tok_s']} tok/s, none {http['none'][count]['tok_s']} "
                     f"tok/s ({ratio})" + (f"; --block-size auto {http['dflash-auto'][count]['tok_s']} tok/s ({auto})"
                                           if auto is not None else ""))
    if "error" in http:
        lines.append(f"HTTP failed: {http['error']}")
    lines.append(f"dflash_batch_identical: {merged.get('dflash_batch_identical')}"
                 + "".join(f"\n  differs: {name}" for name, ok in merged.get("dflash_batch_checks", {}).items() if not ok))
    return "\n".join(lines)
