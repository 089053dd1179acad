"""`shardctl generate`: one generation through the shards, streamed as tokens commit, or one JSON record.

`run_generation` and `generation_record` are also what `demo` runs and reports (and `bench`, through
`generate --json` in a child process)."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import click

from coordinator import benchstats
from coordinator.cli.options import (
    block_size_limit,
    block_size_option,
    busy_poll_option,
    check_mean_commit,
    daemon_args_from,
    launched_capacity_options,
    liveness_timeout_option,
    load_curve,
    pipeline_groups_option,
    parse_ids,
    quantize_option,
    recovery_timeout_option,
    seconds,
    shard_source_options,
    tokenizer_option,
)
from coordinator.cli.output import emit_json, fmt, fmt_percent, progress
from coordinator.cli.plan import (DEFAULT_DRAFT_PLACEMENT, DRAFT_PLACEMENTS, connect_pipeline, dflash_daemon, make_plan,
                                  mode_daemon_args)
from coordinator.drafting.drafters import DRAFTERS, make_drafter
from coordinator.relay.client import ShardClient
from coordinator.relay.shards import PipelineError, ShardInfo
from coordinator.relay.target import Target
from coordinator.sampling import Sampling
from coordinator.scheduler.block_size import AUTO, VerifyCost, verify_cost_of
from coordinator.scheduler.recovery import RECOVERY_TIMEOUT_S
from coordinator.scheduler.requests import DecodeResult
from coordinator.scheduler.requests import Request
from coordinator.scheduler.scheduler import decode_all
from coordinator.tokenizer import NoTokenizer, TokenizerUnavailable, load_tokenizer
from protocol.layout import CHECKPOINT, ROLLBACK_MODES

GREEDY = "none"  # --drafter none: plain greedy decoding
ORACLE_NOTE = (
    "oracle is a benchmark drafter: it was handed the target's own greedy continuation, "
    "computed first through the same shards, and errs on a seeded schedule"
)


class TextStream:
    """Prints committed tokens as text (or ids) as they arrive, never half a character."""

    def __init__(self, tokenizer, ids: bool, eos_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = ids
        self.eos = frozenset(eos_ids)  # an EOS that ends the output is not text
        self.tokens: list[int] = []
        self.printed = ""

    def __call__(self, committed: list[int]) -> None:
        self.tokens.extend(committed)
        if self.ids:
            click.echo(" ".join(map(str, committed)) + " ", nl=False)
            sys.stdout.flush()
            return
        text = self.tokenizer.decode(text_tokens(self.tokens, self.eos))
        stable = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence may still be completed
        if stable.startswith(self.printed) and len(stable) > len(self.printed):
            click.echo(stable[len(self.printed):], nl=False)
            sys.stdout.flush()
            self.printed = stable

    def finish(self) -> None:
        if not self.ids:
            text = self.tokenizer.decode(text_tokens(self.tokens, self.eos))
            if text.startswith(self.printed):
                click.echo(text[len(self.printed):], nl=False)
        click.echo("")


def text_tokens(tokens: Sequence[int], eos_ids) -> list[int]:
    """The generated tokens that are text: all but an EOS that ended the generation."""
    return list(tokens[:-1]) if tokens and tokens[-1] in eos_ids else list(tokens)


@dataclass
class Generation:
    result: DecodeResult
    reference: Optional[DecodeResult]  # the oracle's greedy pass
    drafter: str
    rollback: Optional[str]
    block_size: Optional[int]
    streams: Optional[list[DecodeResult]] = None  # every stream of a --concurrency batch (the first is `result`)
    batch_seconds: Optional[float] = None  # the whole batch's wall time


def run_generation(
    target: Target,
    prompt: list[int],
    *,
    drafter: str,
    rollback: str,
    block_size: int,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    mean_commit: float = 6.0,
    oracle_seed: int = 0,
    on_commit: Optional[Callable[[list[int]], None]] = None,
    reference: Optional[list[int]] = None,
    draft_client: Optional[ShardClient] = None,
    sampling: Optional[Sampling] = None,
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S,
    concurrency: int = 1,
    pipeline_groups: int = 1,
    verify_cost: Optional[VerifyCost] = None,
) -> Generation:
    """One generation through `target` (the scheduler, as `shardctl serve` runs it) with fresh random sequence
    ids. `oracle` first decodes greedily through the same target, unless `reference` (those ids) is given.
    `dflash` drafts on the daemon behind `draft_client`; `target` is then a Pipeline.

    `concurrency` > 1 runs that many copies of the request at once in one batch (a throughput benchmark); the
    result is the first stream's, with `Generation.streams` holding every stream's. With `verify_cost`
    (`--block-size auto`) each verify block takes the scheduler's choice, at most `block_size` rows (a DFlash
    drafter's own limit cuts it)."""
    batch = dict(concurrency=concurrency, recovery_timeout_s=recovery_timeout_s, pipeline_groups=pipeline_groups)
    if drafter == GREEDY:
        results, wall = decode_together(target, prompt, max_new_tokens, eos_ids, on_commit, sampling, **batch)
        return Generation(results[0], None, drafter, None, None, results, wall)
    reference_result = None
    if drafter == "oracle" and reference is None:
        reference_result = decode_together(target, prompt, max_new_tokens, eos_ids)[0][0]
        reference = reference_result.tokens
    if drafter == "dflash" and draft_client is None:
        raise click.UsageError("--drafter dflash needs a drafter daemon (--draft-shard, or --draft when launching)")
    try:
        chosen = make_drafter(drafter, prompt_len=len(prompt), reference=reference, block_size=block_size,
                              mean_commit=mean_commit, seed=oracle_seed, draft_client=draft_client, pipeline=target)
    except PipelineError as error:  # a drafter daemon that does not fit these shards
        raise click.UsageError(str(error)) from None
    except ValueError as error:  # the oracle's schedule
        raise click.BadParameter(str(error), param_hint="--mean-commit") from None
    if drafter == "dflash" and verify_cost is not None:
        block_size = min(block_size, chosen.max_block_size)
    if drafter == "dflash" and block_size > chosen.max_block_size:
        raise click.BadParameter(
            f"the dflash drafter fills blocks of at most {chosen.max_block_size} tokens, got {block_size}",
            param_hint="--block-size",
        )
    if drafter == "dflash":  # one state per stream on the same daemon and connections
        drafters = [chosen] + [chosen.fresh() for _ in range(concurrency - 1)]
    else:
        drafters = [chosen] + [make_drafter(drafter, prompt_len=len(prompt), reference=reference,
                                            block_size=block_size, mean_commit=mean_commit, seed=oracle_seed)
                               for _ in range(concurrency - 1)]
    results, wall = decode_together(target, prompt, max_new_tokens, eos_ids, on_commit, sampling, drafters,
                                    block_size=block_size, rollback=rollback, verify_cost=verify_cost, **batch)
    return Generation(results[0], reference_result, drafter, rollback, block_size, results, wall)


def decode_together(
    target: Target, prompt: list[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
    on_commit: Optional[Callable[[list[int]], None]] = None, sampling: Optional[Sampling] = None,
    drafters: Optional[Sequence] = None, *, concurrency: int = 1, block_size: int = 16, rollback: str = CHECKPOINT,
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S, pipeline_groups: int = 1, verify_cost: Optional[VerifyCost] = None,
) -> tuple[list[DecodeResult], float]:
    """`concurrency` copies of one request through one scheduler (the first streams to `on_commit`): each
    stream's result, and the wall seconds of the whole batch."""
    requests = [Request(prompt, max_new_tokens, eos_ids=eos_ids, sampling=sampling,
                        drafter=drafters[index] if drafters else None, block_size=block_size, verify_cost=verify_cost,
                        on_commit=on_commit if index == 0 else None) for index in range(concurrency)]
    started = time.perf_counter()
    results = decode_all(target, requests, rollback=rollback, recovery_timeout_s=recovery_timeout_s,
                         pipeline_groups=pipeline_groups)
    return results, time.perf_counter() - started


def generation_record(generation: Generation, tokenizer, shards: Sequence[ShardInfo] = (), eos_ids=()) -> dict:
    result = generation.result
    summary = result.summary()
    record = {
        "tokens": result.tokens,
        "text": tokenizer.decode(text_tokens(result.tokens, frozenset(eos_ids))),
        "finish_reason": result.finish_reason,
        # sha256 over the comma-joined decimal ids (benchstats.tokens_digest)
        "sha256": benchstats.tokens_digest(result.tokens),
        "drafter": generation.drafter,
        "rollback": generation.rollback,
        "block_size": generation.block_size,
        **summary,
        "rollbacks": {"fast": result.rollbacks_fast, "fallback": result.rollbacks_fallback, "replays": result.replays},
        "commits": result.commits,
        "shards": [{"endpoint": s.endpoint, "layers": [s.begin, s.end]} for s in shards],
    }
    streams = generation.streams or [result]
    if len(streams) > 1:
        record["concurrency"] = len(streams)
        record["aggregate_tok_s"] = (sum(len(r.tokens) for r in streams) / generation.batch_seconds
                                     if generation.batch_seconds else None)
        # Every copy of the request must produce the same tokens whatever shared its steps.
        record["streams_identical"] = all(r.tokens == result.tokens for r in streams)
    if generation.drafter == "oracle":
        record["drafter_note"] = ORACLE_NOTE
        if generation.reference is not None:
            reference = generation.reference.summary()
            record["reference"] = {key: reference[key] for key in ("new_tokens", "prefill_tok_s", "decode_tok_s", "wall_seconds")}
            # The greedy pass doubles as the exactness check: speculation must reproduce it token for token.
            record["reference"]["sha256"] = benchstats.tokens_digest(generation.reference.tokens)
            record["matches_greedy"] = generation.reference.tokens == result.tokens
    return record


def describe_generation(record: dict) -> str:
    parts = [
        f"{record['new_tokens']} tokens",
        f"{record['steps']} steps",
        f"acceptance {fmt_percent(record['acceptance_rate']) or '-'}",
        f"avg commit {fmt(record['avg_commit'], 2) or '-'}",
        f"prefill {fmt(record['prefill_tok_s']) or '-'} tok/s",
        f"decode {fmt(record['decode_tok_s']) or '-'} tok/s",
        f"rollbacks fast {record['rollbacks']['fast']} fallback {record['rollbacks']['fallback']} replays {record['rollbacks']['replays']}",
        f"sha256 {record['sha256'][:16]}",
    ]
    return ", ".join(parts)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@shard_source_options
@quantize_option
@launched_capacity_options
@click.option("--prompt", help="Prompt text (tokenized with the model's tokenizer.json, or --tokenizer).")
@click.option("--prompt-ids", help="Prompt as token ids: 1,2,3.")
@tokenizer_option
@click.option("--max-new-tokens", type=click.IntRange(0), default=64, show_default=True)
@click.option("--drafter", type=click.Choice((GREEDY, *DRAFTERS)), default="ngram", show_default=True,
              help="none: plain greedy; ngram: prompt lookup; oracle: benchmark drafter; dflash: the DFlash "
                   "block drafter on a drafter daemon, fed with features the shards capture.")
@click.option("--draft-shard", metavar="EP", help="dflash with --shards: endpoint of the daemon hosting the drafter.")
@click.option("--draft", metavar="DIR|synthetic[:LAYERS]",
              help="dflash when launching shards: the drafter daemon to launch beside them "
                   "(default: MODEL/draft for --model when it exists, synthetic for --synthetic).")
@click.option("--draft-placement", type=click.Choice(DRAFT_PLACEMENTS), default=DEFAULT_DRAFT_PLACEMENT, show_default=True,
              help="Where a launched drafter runs: its own daemon, or beside the first or the last shard (proposing in the verify reply).")
@block_size_option
@click.option("--rollback-mode", "--rollback", "rollback", type=click.Choice(ROLLBACK_MODES), default=CHECKPOINT,
              show_default=True, help="replay (by the coordinator, any shards), checkpoint or replay-ssm (by the shards).")
@click.option("--mean-commit", type=float, default=6.0, show_default=True,
              help="oracle: tokens committed per step on average.")
@click.option("--oracle-seed", type=int, default=0, show_default=True, help="oracle: seed of its error schedule.")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly --max-new-tokens tokens.")
@click.option("--temperature", type=click.FloatRange(0, 100), default=0.0, show_default=True,
              help="Sample at this temperature on the head shard (0: greedy, the argmax).")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0: all tokens.")
@click.option("--seed", type=click.IntRange(0, (1 << 63) - 1), default=None,
              help="Sampling seed: the same seed gives the same output (default: a random one).")
@recovery_timeout_option
@liveness_timeout_option
@busy_poll_option("auto")
@pipeline_groups_option
@click.option("--concurrency", type=click.IntRange(1), default=1, show_default=True,
              help="Run this many copies of the request at once, batched by the scheduler (a throughput "
                   "benchmark: the output is the first copy's; --json adds aggregate_tok_s and streams_identical).")
@click.option("--ids", "print_ids", is_flag=True, help="Stream token ids instead of text.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end instead of streaming.")
def generate(shards, model_dir, synthetic, split, layer_spec, devices, transport, dtype, timeout, curve_server_key,
             curve_client_key, quantize, max_sequences, max_context, allow_long_context, prompt, prompt_ids, tokenizer_dir, max_new_tokens, drafter,
             draft_shard, draft, draft_placement, block_size, rollback, mean_commit, oracle_seed, ignore_eos, temperature, top_p, top_k,
             seed, recovery_timeout, liveness_timeout, busy_poll_ms, pipeline_groups, concurrency, print_ids, as_json):
    """Generate greedily (or sampling, --temperature), speculating with a drafter; stream the text as tokens commit.

    \b
    Examples:
      shardctl generate --shards tcp://127.0.0.1:7700,ipc:///tmp/$USER-shard1.sock --prompt "hello"
      shardctl generate --synthetic small --split 2 --max-context 8192 --prompt "hello" --drafter oracle --json
    """
    sampling = Sampling.make(temperature, top_p, top_k, seed)
    if not sampling.greedy and drafter == "oracle":
        raise click.UsageError("--drafter oracle replays the greedy output; sample with ngram, dflash or none")
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    ids = parse_ids(prompt_ids, "--prompt-ids") if prompt_ids is not None else None
    adaptive, block_size = block_size == AUTO, block_size_limit(block_size)
    check_mean_commit(drafter, mean_commit, block_size)
    speculating = drafter != GREEDY
    plan = make_plan(shards, model_dir, synthetic, split, layer_spec, devices, transport,
                     # one generation is one sequence: shards launched for it hold one, so their fast step is
                     # one sequence's rows (shardd's batch default, 128 rows for 8 sequences, slows a lone stream)
                     daemon_args_from(dtype=dtype, max_sequences=max_sequences or 1, max_context=max_context,
                                      allow_long_context=allow_long_context,
                                      busy_poll_ms="auto" if busy_poll_ms is None else busy_poll_ms),
                     curve=curve_server_key or curve_client_key, quantize=quantize,
                     max_context=max_context, allow_long_context=allow_long_context)
    if shards and (max_sequences or max_context):
        raise click.UsageError("--max-sequences and --max-context size the shards generate launches; "
                               "running shards (--shards) keep the limits they were started with")
    if drafter == "dflash":
        plan.draft_endpoint, plan.draft = dflash_daemon(plan, draft_shard, draft)
        plan.draft_placement = draft_placement
    elif draft_shard or draft:
        raise click.UsageError("--draft-shard and --draft go with --drafter dflash")
    curve = load_curve(curve_server_key, curve_client_key)
    with plan.running_with_drafter(mode_daemon_args(rollback, block_size, speculating)) as (endpoints, draft_endpoint), \
            contextlib.ExitStack() as stack:
        draft_client = None
        if draft_endpoint is not None:
            draft_client = stack.enter_context(ShardClient(draft_endpoint, timeout_s=timeout, curve=curve,
                                                           liveness_timeout_s=liveness_timeout,
                                                           busy_poll_s=seconds(busy_poll_ms)))
        with connect_pipeline(endpoints, timeout, curve, liveness_timeout, busy_poll_ms) as pipeline:
            if speculating:
                try:
                    pipeline.check_speculation(rollback, block_size)
                except PipelineError as error:
                    raise click.UsageError(str(error)) from None
            try:
                tokenizer = load_tokenizer(tokenizer_dir or plan.model_dir, pipeline.vocab_size, pipeline.shards,
                                           given=tokenizer_dir is not None)
            except TokenizerUnavailable as error:
                raise click.UsageError(str(error)) from None
            if prompt is not None and not as_json:
                progress(f"tokenizer: {tokenizer.source}")
            if ids is None:
                try:
                    ids = tokenizer.encode(prompt)
                except TokenizerUnavailable as error:
                    raise click.BadParameter(str(error), param_hint="--prompt") from None
                if not ids:
                    raise click.BadParameter("the prompt is empty after tokenization", param_hint="--prompt")
            bad = [i for i in ids if i >= pipeline.vocab_size]
            if bad:
                raise click.BadParameter(f"token id {bad[0]} is outside the vocabulary 0..{pipeline.vocab_size - 1}",
                                         param_hint="--prompt-ids")
            if len(ids) >= pipeline.max_context:
                raise click.BadParameter(
                    f"the prompt holds {len(ids)} tokens; the shards hold {pipeline.max_context} per sequence, leaving "
                    f"no room for output (launch them with a larger --max-context)", param_hint="--prompt")
            if len(ids) + max_new_tokens > pipeline.max_context:  # as the HTTP API's max_tokens: refused, not capped
                raise click.BadParameter(
                    f"{max_new_tokens} new tokens after a prompt of {len(ids)} is more than the shards' context of "
                    f"{pipeline.max_context} tokens: at most {pipeline.max_context - len(ids)}", param_hint="--max-new-tokens")
            eos_ids = () if ignore_eos else tuple(tokenizer.eos_ids) or tuple(pipeline.shards[-1].model.get("eos_token_ids") or ())
            if drafter == "oracle":
                progress(f"{ORACLE_NOTE}; running that greedy pass now")
            # without a tokenizer the output has no text: its ids are what there is to show
            stream = None if as_json else TextStream(tokenizer, print_ids or isinstance(tokenizer, NoTokenizer), eos_ids)
            generation = run_generation(
                pipeline, ids, drafter=drafter, rollback=rollback, block_size=block_size,
                verify_cost=adaptive_cost(pipeline) if adaptive and speculating else None,
                max_new_tokens=max_new_tokens, eos_ids=eos_ids, mean_commit=mean_commit, oracle_seed=oracle_seed,
                on_commit=stream, draft_client=draft_client, sampling=sampling, recovery_timeout_s=recovery_timeout,
                concurrency=concurrency, pipeline_groups=pipeline_groups,
            )
            record = generation_record(generation, tokenizer, pipeline.shards, eos_ids)
            if record.get("recoveries"):  # on stderr also under --json: a shard went away and came back
                progress(f"recovered {record['recoveries']} time(s): a shard was lost and its sequence re-filled "
                         f"from the committed tokens (the output is unchanged)")
    if as_json:
        emit_json(record)
    else:
        stream.finish()
        progress(describe_generation(record))


def adaptive_cost(target) -> VerifyCost:
    """--block-size auto's cost model of `target`, or the usage error saying why there is none."""
    try:
        return verify_cost_of(target)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
