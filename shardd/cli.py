"""`shardd` command line: `serve` a layer range and/or a DFlash drafter, `keygen` CurveZMQ keys, `make-model` a
synthetic checkpoint (what `shardctl make-model` runs)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import click

from common import __version__
from common.busy_poll import AUTO_BUSY_POLL_CPUS, AUTO_BUSY_POLL_MS
from common.dtypes import DTYPE_CHOICES
from common.presets import PRESETS
from common.quantization import LAYOUTS
from protocol.layout import CHECKPOINT, SHARD_ROLLBACK_MODES
from shardd.config import FlagError, ShardConfig
from shardd.engine.select import DEFAULT_STEP_ROWS, ENGINES, PREFILL_ROWS
from shardd.obs import logs, timeline
from shardd.obs.logs import FORMATS, LEVELS
from shardd.obs.progress import LoadProgress
from shardd.server import systemd
from shardd.server.ring import DEFAULT_ROWS as RING_ROWS
from shardd.server.rows import WAIT_S

MiB = 1 << 20


CONTEXT = {"help_option_names": ["-h", "--help"]}
EXIT_FAILURE = 1  # a runtime failure (cannot bind, cannot load); click's usage errors exit 2


def removed_option(name: str, now: str):
    """A flag that was removed: hidden, and refused with one line saying what happens now (exit 2, a usage
    error), so a script that still passes it learns why instead of having it ignored."""

    def refuse(ctx, param, value):
        if value is not None:
            click.echo(f"Error: {name} was removed: {now}; drop the flag", err=True)
            ctx.exit(2)

    return click.option(name, hidden=True, expose_value=False, is_eager=True, callback=refuse, metavar="VALUE")


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="shardd")
def main():
    """Shard daemon for layer-split speculative decoding of Qwen3.5 hybrid models.

    \b
    Example:
      shardd serve --synthetic tiny --layers 0:3 --bind tcp://127.0.0.1:7700
    """


@main.command(context_settings=CONTEXT)
@click.option("--model", "model_dir", metavar="DIR|ORG/NAME",
              help="Checkpoint directory (HF layout), or a Hugging Face model id (downloaded to its cache).")
@click.option("--synthetic", help="Synthetic preset instead of a checkpoint: PRESET[:SEED] (tiny, small, qwen3.5-27b).")
@click.option("--layers", default=None,
              help="Layer range BEGIN:END this shard owns (default: all); 'none' serves only the --draft drafter.")
@click.option("--draft", "draft", metavar="DIR|synthetic[:LAYERS]", default=None,
              help="Also host a DFlash drafter: a draft checkpoint directory, or a synthetic one (default 2 layers) "
                   "matched to the target. It reads the target's embedding and lm_head from --model/--synthetic.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda:N.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES, case_sensitive=False), default="auto", show_default=True,
              help="Weight dtype (bf16, fp16 as vLLM spells them). auto: on a GPU the checkpoint's dtype, bfloat16 for a "
                   "float32 or synthetic model; on the CPU float32.")
@click.option("--bind", default="tcp://127.0.0.1:7700", show_default=True,
              help="ZeroMQ endpoint: tcp://127.0.0.1:PORT (PORT * picks a free one and logs it) or ipc://PATH.")
@click.option("--endpoint-file", type=click.Path(dir_okay=False), default=None,
              help="Write the bound endpoint (the port * picked) to this file as soon as it is bound.")
@click.option("--max-verify-tokens", type=click.IntRange(0, 1024), default=16, show_default=True,
              help="Rollback storage: most tokens one checkpointed step may carry (0 = no rollback storage).")
@click.option("--rollback-mode", "--rollback", "rollback_mode", type=click.Choice(SHARD_ROLLBACK_MODES), default=CHECKPOINT,
              show_default=True, help="How rejected draft tokens leave the GDN state (replay needs no daemon support).")
@click.option("--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
              help="Step implementation: fast (fixed-shape step, Triton + CUDA graphs; CUDA only), reference, "
                   "or auto (fast on a CUDA device).")
@click.option("--step-rows", type=click.IntRange(1, 4096), default=None,
              help="Fast engine: rows of its one fixed-shape step, shared by the sequences of a batch (each brings "
                   f"at most --max-verify-tokens). Default {DEFAULT_STEP_ROWS}, at most --max-sequences x "
                   "--max-verify-tokens, at least --max-verify-tokens; with FP8 weights --max-verify-tokens (the "
                   "FP8 GEMM's time grows with the rows).")
@click.option("--prefill-rows", type=click.IntRange(0, 1 << 16), default=PREFILL_ROWS, show_default=True,
              help="Fast engine on a GPU: a prompt goes through the prefill in pieces of this many rows, each whole "
                   "piece replayed from CUDA graphs (a prompt chunk costs its kernels' time, not its launches'); "
                   "0: one eager call per request.")
@click.option("--max-sequences", "--max-num-seqs", "max_sequences", type=click.IntRange(1, 65536), default=8,
              show_default=True)
@click.option("--max-context", "--max-model-len", "max_context", type=click.IntRange(1, 1 << 22), default=4096,
              show_default=True, help="Tokens per sequence, at most the model's max_position_embeddings.")
@click.option("--allow-long-context", is_flag=True,
              help="Allow --max-context past the model's max_position_embeddings (positions it was not trained on).")
@click.option("--max-tokens-per-request", type=click.IntRange(1, 1 << 20), default=4096, show_default=True)
@click.option("--max-gpu-memory", default=None, metavar="SIZE|FRACTION",
              help="Cap what this daemon may allocate: 24GiB, 24GB, 20000MiB, or a fraction of the device (0.9). "
                   "Before loading it adds up weights, KV cache, GDN states, checkpoint buffers and step buffers / "
                   "CUDA graphs, and refuses to start, naming each, if they do not fit; on CUDA the allocator "
                   "enforces the cap too.")
@click.option("--prefix-cache-gib", default="auto", show_default=True, metavar="GIB|auto",
              help="Memory for the prefix cache (README, \"Prefix caching\"): prompt states kept so that a request "
                   "sharing a prompt prefix resumes after it; 0 turns it off. auto: 4 GiB on a GPU, 1 GiB on the "
                   "CPU, under --max-gpu-memory at most what the rest of the plan leaves, else at most half of what "
                   "the GPU holds beyond the plan.")
@click.option("--quantize", type=click.Choice(("fp8-block", "fp8-channel")), default=None,
              help="With --synthetic: the linears as FP8 in this layout, as `shardctl make-model --quantize` writes "
                   "them (a checkpoint's config.json says its own).")
@click.option("--curve-secret-key", type=click.Path(exists=True, dir_okay=False), help="Server key file from `shardd keygen` (needed for non-loopback binds).")
@click.option("--curve-allow", "curve_allow_dir", type=click.Path(exists=True, file_okay=False), help="Directory of allowed client public keys.")
@click.option("--sequence-idle-timeout", type=click.FloatRange(0), default=300.0, show_default=True,
              help="Seconds a sequence may go without a request before it is closed and its memory returned (0: never).")
@click.option("--busy-poll-ms", default="auto", show_default=True,
              help="After each request, poll for the next one without sleeping for this long (a core kept busy, "
                   "no wake-up on the next request's way in; 0: sleep at once). auto: "
                   f"{AUTO_BUSY_POLL_MS:g} on a GPU with at least {AUTO_BUSY_POLL_CPUS} usable CPUs (a dedicated GPU "
                   "host), else 0; HELLO reports it. It pays with the coordinator polling too: shardctl's --busy-poll-ms "
                   "auto follows the daemons (Pipeline.connect busy_poll_s=None).")
@click.option("--relay-to", default=None, metavar="ENDPOINT",
              help="The next shard's endpoint (ipc:// or loopback tcp://: a daemon of this host): a FORWARD that asks "
                   "(send_rows) sends its output rows straight there instead of back through the coordinator "
                   "(PROTOCOL.md, \"Rows from shard to shard\"). HELLO reports it; not with --curve-secret-key.")
@click.option("--relay-to-file", default=None, metavar="PATH",
              help="As --relay-to, the endpoint read from the file the next shard writes (its --endpoint-file) once "
                   "it is there: for launchers whose daemons bind a free port (tcp://HOST:*).")
@click.option("--relay-key", "relay_key_file", default=None, metavar="FILE",
              help="The shard set's secret (32 to 128 characters in a file only its owner may read): this daemon "
                   "presents it to its --relay-to shard, and takes ROWS only from the connection that presented it "
                   "(refused FORBIDDEN otherwise). Without it any connection's ROWS are taken. shardctl's launched "
                   "sets get one each; not with --curve-secret-key.")
@click.option("--rows-wait", type=click.FloatRange(0.1, 3600), default=WAIT_S, show_default=True,
              help="Seconds a FORWARD waits at most for its rows from the previous shard (rows_ticket) before it is "
                   "refused ROWS_MISSING, changing nothing.")
@removed_option("--device-rows", "between GPU daemons of one host the rows always go through the next shard's "
                f"device ring (slots of {RING_ROWS} rows; larger steps, and shards that cannot share GPU memory, "
                "go through the host)")
@removed_option("--ring-wait", "the daemons always wait for ring rows on the device (the GPU's front end; on the "
                "host where the driver has no stream memory operations)")
@click.option("--threads", type=int, default=None,
              help="CPU threads for torch (default: 1 on a GPU, whose host work is small copies; torch's choice on the CPU).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on http://--metrics-host:PORT/metrics (0: any free port, logged).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address the metrics endpoint listens on.")
@click.option("--log-level", type=click.Choice(LEVELS, case_sensitive=False), default="INFO", show_default=True)
@click.option("--log-format", type=click.Choice(FORMATS), default="text", show_default=True,
              help="text lines, or one JSON object per line.")
def serve(model_dir, synthetic, layers, draft, device, dtype, bind, endpoint_file, max_verify_tokens, rollback_mode, engine,
          step_rows, prefill_rows, max_sequences, max_context, allow_long_context, max_tokens_per_request, max_gpu_memory,
          prefix_cache_gib, quantize, curve_secret_key, curve_allow_dir,
          sequence_idle_timeout, busy_poll_ms, relay_to, relay_to_file, relay_key_file, rows_wait,
          threads, metrics_port,
          metrics_host, log_level, log_format):
    """Load a layer range (and/or a drafter) and serve it until SIGTERM, SIGINT or SHUTDOWN.

    The socket is bound before the weights load: a port in use fails at once, and requests that arrive while
    loading are answered once it is done.

    \b
    Examples:
      shardd serve --synthetic tiny --layers 0:3 --bind tcp://127.0.0.1:7700
      shardd serve --model /srv/Qwen3.5-27B --layers 32:64 --device cuda:1 --dtype bfloat16 \\
          --bind ipc:///run/shardd/1.sock --metrics-port 9101
    """
    log = logs.setup(log_level, log_format)

    def stop_while_loading(signum, frame):
        # Until the daemon's loop takes over the signals (imports, weights): stop now, cleanly, and tell systemd so.
        log.info("signal %s while loading: stopping", signal.Signals(signum).name)
        systemd.notify("STOPPING=1")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop_while_loading)
    signal.signal(signal.SIGINT, stop_while_loading)
    if max_gpu_memory is not None:
        expandable_segments()
    try:
        config = ShardConfig.from_flags(
            model_dir=model_dir, synthetic=synthetic, quantize=quantize, layers=layers, draft=draft, device=device,
            dtype=dtype, engine=engine, max_verify_tokens=max_verify_tokens, rollback_mode=rollback_mode,
            step_rows=step_rows, prefill_rows=prefill_rows, max_sequences=max_sequences, max_context=max_context,
            allow_long_context=allow_long_context, max_tokens_per_request=max_tokens_per_request, max_gpu_memory=max_gpu_memory,
            prefix_cache_gib=prefix_cache_gib,
            sequence_idle_timeout=sequence_idle_timeout, bind=bind, endpoint_file=endpoint_file,
            curve_secret_key=curve_secret_key, curve_allow_dir=curve_allow_dir, busy_poll_ms=busy_poll_ms,
            relay_to=relay_to, relay_to_file=relay_to_file, relay_key_file=relay_key_file, rows_wait_s=rows_wait,
            threads=threads,
            metrics_port=metrics_port, metrics_host=metrics_host)
        timeline.capacity(config.device)  # SHARDD_TIMELINE, a diagnostic: refused where it cannot stamp
    except FlagError as error:
        if error.flag is not None:
            raise click.BadParameter(str(error), param_hint=error.flag) from None
        raise click.UsageError(str(error)) from None
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    run(config, log)


def run(config: ShardConfig, log) -> None:
    """Plan the memory, bind, load the weights and serve `config` until stopped (exit 1, one line, when it cannot)."""
    import torch

    from shardd.engine.select import draft_with, serve_with
    from shardd.server.daemon import ShardDaemon
    from shardd.server.listen import BindError, largest_frame_bytes, listen, write_endpoint_file
    from shardd.weights.loading import build_drafter, build_shard, daemon_memory_plan, draft_feature_size
    from common.memory import MemoryBudgetError, fmt_gib

    if config.threads:
        torch.set_num_threads(config.threads)
    elif config.on_gpu:
        # A pool of OpenMP workers, spinning after each parallel copy, competes for the host's cores with the
        # serving thread, libzmq's I/O thread and the other daemons.
        torch.set_num_threads(1)
    source = config.source()
    model = source.config()
    try:
        plan = daemon_memory_plan(source, model, config)
    except (ValueError, OSError) as exc:
        log.error("cannot plan memory: %s", exc)
        sys.exit(EXIT_FAILURE)
    try:
        plan.check()
    except MemoryBudgetError as exc:
        log.error("refusing to start: %s", exc)
        sys.exit(EXIT_FAILURE)
    scheme = source.scheme()
    cap = config.max_gpu_memory
    if cap is not None and config.on_gpu:
        limit_device_memory(torch, torch.device(config.device), cap)
    try:  # the drafter's feature width sizes the frame limit; a bad drafter config fails at its load below
        feature_size = draft_feature_size(model, config.draft) if config.draft is not None else 0
    except (ValueError, OSError):
        feature_size = 0
    try:
        # before the weights: a taken port fails now, not after minutes of loading
        listener = listen(config, largest_frame_bytes(model.hidden_size, feature_size, config.max_tokens_per_request))
    except BindError as exc:
        log.error("%s", exc)
        sys.exit(EXIT_FAILURE)
    log.info("bound %s", listener.endpoint)
    if config.busy_poll_s:
        log.info("polling for the next request %g ms after each reply without sleeping (--busy-poll-ms)",
                 config.busy_poll_s * 1000)
    # after the bind: a port that is taken fails in one line, before anything else is said
    log.info("memory plan: %s = %s%s", plan.line(), fmt_gib(plan.total),
             f" of --max-gpu-memory {fmt_gib(cap)}" if cap else "")
    if config.endpoint_file:
        write_endpoint_file(config.endpoint_file, listener.endpoint)

    layers = config.layers
    what = " + ".join(([] if layers is None else [f"layers {layers[0]}:{layers[1]}"])
                      + ([f"drafter {config.draft}"] if config.draft else []))
    systemd.notify(f"STATUS=loading {what}")
    started = time.perf_counter()
    try:
        loaded = None if layers is None else build_shard(
            source, *layers, dtype=config.dtype, device=config.device, storage=config.storage(),
            progress=LoadProgress(what, log), keep_fp8=config.keeps_fp8,
        )
        # the drafter's weights before the engines' pools and graphs: loading's transients (a synthetic vocab
        # matrix in float32) come while the least is held, which is what lets a capped daemon load
        draft_model = build_drafter(source, config.draft, dtype=config.dtype, device=config.device,
                                    shard=loaded) if config.draft else None
        if config.on_gpu:
            # and handed back before the pools: a capped allocator counts what it caches, so the checkpoint
            # buffers (one 2.4 GiB block for the 27B shape) failed under 24 GiB with 2.7 GiB cached and free
            torch.cuda.empty_cache()
        shard = None if loaded is None else serve_with(config.engine, loaded, max_sequences=config.max_sequences,
                                                       max_context=config.max_context, step_rows=config.step_rows,
                                                       prefill_rows=config.prefill_rows)
        drafter = draft_with(config.engine, draft_model, max_sequences=config.max_sequences,
                             max_context=config.max_context, step_rows=config.step_rows)
        del loaded, draft_model
        if config.on_gpu:
            torch.cuda.empty_cache()  # loading's freed transients back to the device: what it holds is what it uses
    except BaseException as exc:  # a signal while loading (SystemExit) too: no socket file left behind
        listener.close()
        if not isinstance(exc, Exception):
            raise
        # a clear one-line reason beats a traceback for an operator
        log.error("failed to load %s: %s", what, exc)
        sys.exit(EXIT_FAILURE)
    daemon = ShardDaemon(shard, config, drafter, memory=plan.describe(),
                         quantization=scheme.describe() if scheme is not None else None)
    if config.metrics_port is not None:
        from shardd.obs.metrics import serve_metrics

        log.info("metrics on %s", serve_metrics(daemon, config.metrics_host, config.metrics_port))
    if drafter is not None:
        c = drafter.config
        log.info(
            "loaded dflash drafter %s: %d layers, target layers %s, block %d, weights %.1f MiB; fingerprint %s",
            config.draft, c.num_hidden_layers, list(c.target_layer_ids), c.block_size, drafter.weight_bytes() / MiB,
            drafter.fingerprint,
        )
    if shard is not None:
        storage = shard.storage
        log.info(
            "loaded layers %d:%d of %d (%d GDN, %d attention)%s%s dtype=%s device=%s weights=%.1f MiB in %.1fs; "
            "per sequence: state %.1f MiB (context %d), rollback storage %s %.1f MiB; fingerprint %s",
            shard.begin, shard.end, model.num_layers, len(shard.gdn_layers), len(shard.attention_layers),
            " +embedding" if shard.owns_embedding else "", " +head" if shard.owns_head else "",
            config.dtype, config.device, shard.weight_bytes() / MiB, time.perf_counter() - started,
            shard.state_bytes_per_sequence(config.max_context) / MiB, config.max_context,
            storage.mode if storage.enabled else "none", shard.checkpoint_bytes_per_sequence() / MiB,
            shard.fingerprint,
        )
    daemon.serve(listener)


def expandable_segments() -> None:
    """A capped daemon's allocator maps memory as it grows instead of caching fixed segments: with segments, the
    27B FP8 shard's checkpoint buffers (one 2.4 GiB block) failed under 24 GiB with 3.4 GiB cached and free in
    pieces. Before CUDA starts (the allocator reads this once); an operator's own setting of it is kept."""
    import os

    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in setting:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [setting, "expandable_segments:True"]))


def limit_device_memory(torch, device, cap: int) -> None:
    """Have the CUDA caching allocator refuse to grow past `cap` bytes on `device`."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)


@main.command(context_settings=CONTEXT)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory for the key files.")
@click.option("--name", default="shardd", show_default=True, help="Base name of the key files.")
@click.option("--json", "as_json", is_flag=True, help="Print the two paths as JSON.")
def keygen(out_dir, name, as_json):
    """Write a CurveZMQ key pair: NAME.key (public, share it) and NAME.key_secret (0600, in a 0700 directory).

    \b
    Example:
      shardd keygen --out /etc/shardd/keys --name server
    """
    from shardd.server.security import write_private_keys

    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise click.BadParameter(f"{name!r} is not a file name (the key files go into --out)", param_hint="--name")
    try:
        public, secret = write_private_keys(out_dir, name)
    except OSError as error:
        click.echo(f"shardd keygen: error: cannot write the keys into {out_dir}: {error.strerror or error}", err=True)
        sys.exit(EXIT_FAILURE)
    if as_json:
        click.echo(json.dumps({"public_key": str(public), "secret_key": str(secret)}))
    else:
        click.echo(f"public key: {public}\nsecret key: {secret}")


@main.command("make-model", context_settings=CONTEXT)
@click.option("--preset", type=click.Choice(tuple(PRESETS)), required=True, help="Model shape.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory to write.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--quantize", type=click.Choice(LAYOUTS), default=None, help="Write the linears as FP8 in this layout.")
@click.option("--force", is_flag=True, help="Overwrite a model already in --out.")
@click.option("--with-drafter", is_flag=True, help="Also write a matched synthetic DFlash drafter to OUT/draft/.")
@click.option("--draft-layers", type=click.IntRange(1), default=None, help="Layers of that drafter (default 2).")
@click.option("--json", "as_json", is_flag=True, help="Print the paths written, or why writing failed, as JSON (a usage error stays text, exit 2).")
def make_model(preset, out_dir, seed, dtype, quantize, force, with_drafter, draft_layers, as_json):
    """Write a synthetic checkpoint in the Qwen3.5 layout (what `shardctl make-model` runs).

    \b
    Example:
      shardd make-model --preset tiny --out /tmp/$USER-tiny --with-drafter
    """
    out = Path(out_dir)
    if (out / "config.json").exists() and not force:
        raise click.UsageError(f"{out} already holds a model (config.json); pass --force to overwrite it")
    from shardd.synthetic.checkpoint import write_synthetic_drafter, write_synthetic_model  # torch: only this command needs it

    # Written beside --out first and moved in whole, so a failure (a full disk, a missing library) leaves nothing.
    staging, existed = None, out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        write_synthetic_model(preset, seed, dtype, staging, quantize=quantize)
        if with_drafter:
            write_synthetic_drafter(staging, preset, seed, dtype, draft_layers)
        publish(staging, out)
    except Exception as error:  # noqa: BLE001 - whatever it was, one line and nothing left behind
        reason = str(error) if isinstance(error, (OSError, ValueError)) else f"{type(error).__name__}: {error}"
        click.echo(json.dumps({"error": reason}) if as_json else f"shardd: error: {reason}", err=not as_json)
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        sys.exit(EXIT_FAILURE)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    draft = out / "draft" if with_drafter else None
    if as_json:
        click.echo(json.dumps({"path": str(out), "draft": None if draft is None else str(draft)}))
    else:
        click.echo(str(out) + (f"\n{draft}" if draft is not None else ""))


def publish(staging: Path, out: Path) -> None:
    """Move what `staging` holds into `out`, each entry replacing the one of its name."""
    for entry in staging.iterdir():
        target = out / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(entry, target)


if __name__ == "__main__":
    main()


for _command in main.commands.values():  # `shardd serve --version` as `shardd --version`
    click.version_option(__version__, "-V", "--version", prog_name="shardd")(_command)
