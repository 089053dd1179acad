"""`shardd` command line: `serve` a layer range and/or a DFlash drafter, `keygen` CurveZMQ keys."""

from __future__ import annotations

import logging
import signal
import sys
import time

import click

from protocol.layout import CHECKPOINT, SHARD_ROLLBACK_MODES, check_layer_range, parse_layer_range
from shardd import systemd
from shardd.engine import ENGINES

MiB = 1 << 20


@click.group()
def main():
    """Shard daemon for layer-split speculative decoding of Qwen3.5 hybrid models."""


@main.command()
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), help="Checkpoint directory (HF layout).")
@click.option("--synthetic", help="Synthetic preset instead of a checkpoint: PRESET[:SEED] (tiny, small, qwen3.5-27b).")
@click.option("--layers", default=None,
              help="Layer range BEGIN:END this shard owns (default: all); 'none' serves only the --draft drafter.")
@click.option("--draft", "draft", metavar="DIR|synthetic[:LAYERS]", default=None,
              help="Also host a DFlash drafter: a draft checkpoint directory, or a synthetic one (default 2 layers) "
                   "matched to the target. It reads the target's embedding and lm_head from --model/--synthetic.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda:N.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--bind", default="tcp://127.0.0.1:7700", show_default=True, help="ZeroMQ endpoint (tcp://127.0.0.1:PORT or ipc://PATH).")
@click.option("--max-verify-tokens", type=click.IntRange(0, 1024), default=16, show_default=True,
              help="Rollback storage: most tokens one checkpointed step may carry (0 = no rollback storage).")
@click.option("--rollback-mode", type=click.Choice(SHARD_ROLLBACK_MODES), default=CHECKPOINT, show_default=True)
@click.option("--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
              help="Step implementation: fast (fixed-shape step, Triton + CUDA graphs; CUDA only), reference, "
                   "or auto (fast on a CUDA device).")
@click.option("--max-sequences", type=click.IntRange(1, 65536), default=8, show_default=True)
@click.option("--max-context", type=click.IntRange(1, 1 << 22), default=4096, show_default=True, help="Tokens per sequence.")
@click.option("--max-tokens-per-request", type=click.IntRange(1, 1 << 20), default=4096, show_default=True)
@click.option("--curve-secret-key", type=click.Path(exists=True, dir_okay=False), help="Server key file from `shardd keygen` (needed for non-loopback binds).")
@click.option("--curve-allow", "curve_allow_dir", type=click.Path(exists=True, file_okay=False), help="Directory of allowed client public keys.")
@click.option("--sequence-idle-timeout", type=click.FloatRange(0), default=300.0, show_default=True,
              help="Seconds a sequence may go without a request before it is closed and its memory returned (0: never).")
@click.option("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice).")
@click.option("--log-level", default="INFO", show_default=True)
def serve(model_dir, synthetic, layers, draft, device, dtype, bind, max_verify_tokens, rollback_mode, engine, max_sequences,
          max_context, max_tokens_per_request, curve_secret_key, curve_allow_dir, sequence_idle_timeout, threads, log_level):
    """Load a layer range (and/or a drafter) and serve it until SIGTERM, SIGINT or SHUTDOWN."""
    # Our own logger only: torch's loggers stay at their defaults instead of chattering at INFO.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s shardd[%(process)d] %(levelname)s %(message)s"))
    log = logging.getLogger("shardd")
    log.addHandler(handler)
    log.setLevel(log_level.upper())
    log.propagate = False

    def stop_while_loading(signum, frame):
        # Until the daemon's loop takes over the signals (imports, weights): stop now, cleanly, and tell systemd so.
        log.info("signal %s while loading: stopping", signal.Signals(signum).name)
        systemd.notify("STOPPING=1")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop_while_loading)
    signal.signal(signal.SIGINT, stop_while_loading)
    import torch

    from shardd.daemon import ServeOptions, ShardDaemon, configure_security, is_loopback
    from shardd.loading import ModelSource, build_drafter, build_shard, parse_draft
    from shardd.engine import resolve_engine, serve_with
    from shardd.model.rollback import RollbackStorage

    if (model_dir is None) == (synthetic is None):
        raise click.UsageError("give exactly one of --model DIR or --synthetic PRESET[:SEED]")
    if curve_secret_key is None and not is_loopback(bind):
        raise click.UsageError(
            f"refusing to bind {bind} without encryption: a non-loopback bind needs --curve-secret-key "
            "(from `shardd keygen`) and --curve-allow DIR"
        )
    if threads:
        torch.set_num_threads(threads)
    draft_only = layers == "none"
    if draft_only and draft is None:
        raise click.UsageError("--layers none serves only a drafter: give --draft DIR|synthetic[:LAYERS]")
    try:
        source = ModelSource(model_dir=model_dir, synthetic=synthetic)
        config = source.config()
        begin, end = 0, config.num_layers
        if layers and not draft_only:
            begin, end = parse_layer_range(layers)
            check_layer_range(begin, end, config.num_layers)
        if draft is not None:
            parse_draft(draft)
        engine = resolve_engine(engine, device)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    storage = RollbackStorage(rollback_mode if max_verify_tokens else None, max_verify_tokens)
    options = ServeOptions(bind=bind, max_sequences=max_sequences, max_context=max_context,
                           max_tokens_per_request=max_tokens_per_request, curve_secret_key=curve_secret_key,
                           curve_allow_dir=curve_allow_dir, sequence_idle_timeout=sequence_idle_timeout)
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        options.tokenizer_dir = str(Path(model_dir).resolve())  # HELLO names it: the coordinator must not guess

    what = " + ".join(([] if draft_only else [f"layers {begin}:{end}"]) + ([f"drafter {draft}"] if draft else []))
    systemd.notify(f"STATUS=loading {what}")
    started = time.perf_counter()
    last_report = [0.0]

    def progress(done, total):
        now = time.perf_counter()
        if done == total or now - last_report[0] > 2.0:
            last_report[0] = now
            systemd.notify(f"STATUS=loading weights {done}/{total}")
            log.info("loading weights %d/%d", done, total)

    try:
        shard = None if draft_only else serve_with(engine, build_shard(
            source, begin, end, dtype=dtype, device=device, storage=storage, progress=progress
        ), max_sequences=max_sequences, max_context=max_context)
        drafter = build_drafter(source, draft, dtype=dtype, device=device, shard=shard) if draft else None
    except Exception as exc:  # noqa: BLE001 - a clear one-line reason beats a traceback for an operator
        log.error("failed to load %s: %s", what, exc)
        sys.exit(1)
    daemon = ShardDaemon(shard, options, drafter)
    if drafter is not None:
        c = drafter.config
        log.info(
            "loaded dflash drafter %s: %d layers, target layers %s, block %d, weights %.1f MiB; fingerprint %s",
            draft, c.num_hidden_layers, list(c.target_layer_ids), c.block_size, drafter.weight_bytes() / MiB,
            drafter.fingerprint,
        )
    if shard is None:
        daemon.serve()
        return
    log.info(
        "loaded layers %d:%d of %d (%d GDN, %d attention)%s%s dtype=%s device=%s weights=%.1f MiB in %.1fs; "
        "per sequence: state %.1f MiB (context %d), rollback storage %s %.1f MiB; fingerprint %s",
        begin, end, config.num_layers, len(shard.gdn_layers), len(shard.attention_layers),
        " +embedding" if shard.owns_embedding else "", " +head" if shard.owns_head else "",
        dtype, device, shard.weight_bytes() / MiB, time.perf_counter() - started,
        shard.state_bytes_per_sequence(max_context) / MiB, max_context,
        storage.mode if storage.enabled else "none", shard.checkpoint_bytes_per_sequence() / MiB, shard.fingerprint,
    )
    daemon.serve()


@main.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory for the key files.")
@click.option("--name", default="shardd", show_default=True, help="Base name of the key files.")
def keygen(out_dir, name):
    """Write a CurveZMQ key pair: NAME.key (public, share it) and NAME.key_secret (0600, in a 0700 directory)."""
    from shardd.security import write_private_keys

    public, secret = write_private_keys(out_dir, name)
    click.echo(f"public key: {public}\nsecret key: {secret}")


if __name__ == "__main__":
    main()
