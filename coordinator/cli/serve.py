"""`shardctl serve`: the OpenAI-compatible HTTP API (coordinator.serve) over running or launched shards."""

from __future__ import annotations

import asyncio
import logging
import socket

import click

from common.hub import model_name
from common.synthetic_tokenizer import chat_template, tokenizer_config
from coordinator.cli.options import (
    block_size_limit,
    block_size_option,
    MissingExtra,
    busy_poll_option,
    daemon_args_from,
    launched_capacity_options,
    max_gpu_memory_option,
    prefix_cache_option,
    liveness_timeout_option,
    load_curve,
    pipeline_groups_option,
    quantize_option,
    recovery_timeout_option,
    seconds,
    shard_source_options,
    tokenizer_option,
)
from coordinator.cli.output import emit_json, progress
from coordinator.cli.plan import (DEFAULT_DRAFT_PLACEMENT, DRAFT_PLACEMENTS, connect_pipeline, dflash_daemon, make_plan,
                                  mode_daemon_args)
from coordinator.launch import LaunchError
from coordinator.scheduler.block_size import AUTO
from coordinator.supervise import ShardLost
from coordinator.relay.shards import PipelineError
from coordinator.serve.auth import is_loopback_host
from coordinator.serve.limits import ACCEPT_BACKLOG, MAX_CONNECTIONS, REQUEST_TIMEOUT_S
from coordinator.tokenizer import NoTokenizer, TokenizerUnavailable, load_tokenizer, synthetic_preset
from protocol.layout import CHECKPOINT, ROLLBACK_MODES


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP server's socket, bound (uvicorn listens on it once the shards are ready); LaunchError when the
    address cannot be had."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise click.BadParameter(f"cannot resolve {host!r}: {error.strerror}", param_hint="--host") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise LaunchError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


class _DropCancellations(logging.Filter):
    """A second Ctrl-C stops uvicorn at once, cancelling the requests still running and its lifespan task: a
    requested stop, not an application error, so no traceback (uvicorn logs the first, starlette the second as
    a message holding the traceback's text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, asyncio.CancelledError):
            return False
        message = record.getMessage() if isinstance(record.msg, str) else ""
        return not (message.startswith("Traceback") and message.rstrip().endswith("CancelledError"))


def quiet_cancellations() -> None:
    logging.getLogger("uvicorn.error").addFilter(_DropCancellations())


@click.command()
@shard_source_options
@quantize_option
@launched_capacity_options
@max_gpu_memory_option
@prefix_cache_option
@click.option("--max-tokens-per-request", type=click.IntRange(1), default=None,
              help="Tokens one request to a launched shard may carry (shardd's default).")
@recovery_timeout_option
@liveness_timeout_option
@busy_poll_option("0")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP server listens on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@tokenizer_option
@click.option("--served-model-name", help="The model id clients ask for (default: the model directory's name).")
@click.option("--drafter", type=click.Choice(("none", "ngram", "dflash")), default="ngram", show_default=True,
              help="none: one token per step; ngram: prompt lookup; dflash: the drafter daemon (--draft-shard/--draft).")
@click.option("--draft-shard", metavar="EP", help="dflash with --shards: endpoint of the daemon hosting the drafter.")
@click.option("--draft", metavar="DIR|synthetic[:LAYERS]", help="dflash when launching shards: the drafter to launch.")
@click.option("--draft-placement", type=click.Choice(DRAFT_PLACEMENTS), default=DEFAULT_DRAFT_PLACEMENT, show_default=True,
              help="Where a launched drafter runs: its own daemon, or beside the first or the last shard (proposing in the verify reply).")
@block_size_option
@click.option("--rollback-mode", "--rollback", "rollback", type=click.Choice(ROLLBACK_MODES), default=CHECKPOINT,
              show_default=True, help="replay (by the coordinator, any shards), checkpoint or replay-ssm (by the shards).")
@click.option("--batch-rows", type=click.IntRange(1), default=None, metavar="ROWS",
              help="Rows (tokens) the scheduler puts in one step, shared by decode, verify and prompt-chunk rows "
                   "(default: the shards' fixed step, at least 8192, as vLLM's max_num_batched_tokens); prompts go in "
                   "chunks of half that.")
@pipeline_groups_option
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "prefix_caching", default=True, show_default=True,
              help="Prompts resume from the longest prefix the shards hold from earlier prompts (README, \"Prefix "
                   "caching\"; each daemon's --prefix-cache-gib): same output, no re-prefill of a shared prefix.")
@click.option("--log-level", type=click.Choice(("critical", "error", "warning", "info", "debug")), default="info",
              show_default=True)
@click.option("--max-body-bytes", type=click.IntRange(1024), metavar="BYTES",
              help="Largest request body; larger ones are answered 413 unread (default: room for a prompt of the "
                   "whole context, at least 1 MiB).")
@click.option("--request-timeout", type=click.FloatRange(0.1), default=REQUEST_TIMEOUT_S, show_default=True,
              metavar="SECONDS", help="A request's headers and body must arrive within this; slower ones are closed.")
@click.option("--max-connections", type=click.IntRange(16), default=MAX_CONNECTIONS, show_default=True,
              help="Open HTTP connections at most (the open-file limit is raised to fit); more are answered 503.")
@click.option("--exit-on-shard-loss", is_flag=True,
              help="Exit (code 1) when a launched shard dies or hangs and cannot be restarted; by default the server "
                   "stays up and answers 503 on /health and /v1/*, saying why.")
@click.option("--json", "as_json", is_flag=True, help="Once the shards are ready, print what is served as one JSON line.")
@click.option("--api-key", envvar=["SHARDCTL_API_KEY", "VLLM_API_KEY"], show_envvar=True,
              help="Clients must send 'Authorization: Bearer KEY' on /v1 and the tokenizer routes (/health and "
                   "/metrics stay open); required when --host is not loopback.")
def serve(shards, model_dir, synthetic, split, layer_spec, devices, transport, dtype, timeout, curve_server_key,
          curve_client_key, quantize, max_sequences, max_context, allow_long_context, max_tokens_per_request, recovery_timeout, liveness_timeout,
          busy_poll_ms, host, port, tokenizer_dir, served_model_name, drafter, draft_shard, draft, draft_placement, block_size, rollback, batch_rows, pipeline_groups, prefix_caching, log_level,
          max_body_bytes, request_timeout, max_connections, exit_on_shard_loss, as_json, api_key, max_gpu_memory,
          prefix_cache_gib):
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
    /version, /health, /metrics).

    \b
    Examples:
      shardctl serve --shards tcp://127.0.0.1:7700,ipc:///tmp/$USER-shard1.sock --port 8000
      shardctl serve --model /srv/Qwen3.5-27B --split 2 --devices cuda:0,cuda:1 --drafter ngram --json
    """
    adaptive, block_size = block_size == AUTO, block_size_limit(block_size)
    try:
        import uvicorn

        from coordinator.serve.app import build_app
        from coordinator.serve.chat import ChatTemplate, load_chat_template
        from coordinator.serve.engine import Engine, EngineConfig, RequestError, generation_defaults
        from coordinator.serve.frontdoor import GuardedH11Protocol, install_log_filter
        from coordinator.serve.limits import FrontDoorLimits, connection_budget, default_max_body_bytes
    except ImportError as error:  # installed without the serve extra
        raise MissingExtra(error.name or str(error), "serve") from None

    if not api_key and not is_loopback_host(host):
        raise click.UsageError(f"--host {host} is not loopback: give --api-key (or SHARDCTL_API_KEY) so that not "
                               f"everyone who reaches it can use the model")
    speculating = drafter != "none"
    listener = listen_socket(host, port)  # a taken port fails now, before any shard loads its weights
    port = listener.getsockname()[1]
    plan = make_plan(shards, model_dir, synthetic, split, layer_spec, devices, transport,
                     daemon_args_from(dtype=dtype, max_sequences=max_sequences, max_context=max_context,
                                      allow_long_context=allow_long_context,
                                      max_tokens_per_request=max_tokens_per_request, max_gpu_memory=max_gpu_memory,
                                      prefix_cache_gib=prefix_cache_gib,
                                      busy_poll_ms="auto" if busy_poll_ms is None else busy_poll_ms),
                     curve=curve_server_key or curve_client_key, quantize=quantize,
                     max_context=max_context, allow_long_context=allow_long_context)
    if shards and (max_sequences or max_context or max_tokens_per_request or max_gpu_memory or prefix_cache_gib):
        raise click.UsageError("--max-sequences, --max-context, --max-tokens-per-request, --max-gpu-memory and "
                               "--prefix-cache-gib size the shards serve launches; running shards (--shards) keep "
                               "the limits they were started with")
    if drafter == "dflash":
        plan.draft_endpoint, plan.draft = dflash_daemon(plan, draft_shard, draft)
        plan.draft_placement = draft_placement
    elif draft_shard or draft:
        raise click.UsageError("--draft-shard and --draft go with --drafter dflash")
    curve = load_curve(curve_server_key, curve_client_key)
    serving: dict = {}  # the engine and the HTTP server, once they exist (a shard may be lost before)

    def shard_lost(reason: str) -> None:  # the supervisor's thread: a launched shard could not be brought back
        serving["lost"] = reason
        if "engine" in serving:
            serving["engine"].lost = reason
        progress("exiting: a shard is lost (--exit-on-shard-loss)" if exit_on_shard_loss else
                 "a shard is lost: answering 503 on /health and /v1/* from now on")
        if exit_on_shard_loss and "server" in serving:
            serving["server"].should_exit = True

    with plan.running_with_drafter(mode_daemon_args(rollback, block_size, speculating),
                                   on_lost=shard_lost) as (endpoints, draft_endpoint):
        with connect_pipeline(endpoints, timeout, curve, liveness_timeout, busy_poll_ms) as pipeline:
            try:
                tokenizer = load_tokenizer(tokenizer_dir or plan.model_dir, pipeline.vocab_size, pipeline.shards,
                                           given=tokenizer_dir is not None)
            except TokenizerUnavailable as error:
                raise click.UsageError(str(error)) from None
            if isinstance(tokenizer, NoTokenizer):
                tokenizer.refusal = RequestError  # a text request is the client's to fix: a 400 naming the cause
            eos_ids = tuple(tokenizer.eos_ids) or tuple(pipeline.shards[-1].model.get("eos_token_ids") or ())
            preset = synthetic_preset(pipeline.shards[0])
        source_dir = tokenizer.model_dir or plan.model_dir
        template = load_chat_template(source_dir)
        if template is None and getattr(tokenizer, "synthetic", False):  # an in-memory synthetic model's own template
            config = tokenizer_config()
            special = {key: config[key] or "" for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
            template = ChatTemplate(chat_template(), special, "common/chat_template.jinja (the synthetic model's)")
        # The model's name: the directory's (a hub snapshot's: its id, as vLLM serves it), a synthetic preset's.
        name = served_model_name or (model_name(source_dir) if source_dir else
                                     f"synthetic-{preset}" if preset else "shardd")
        try:
            config = EngineConfig(model_name=name, drafter=drafter, rollback=rollback, block_size=block_size,
                                  adaptive_block=adaptive,
                                  batch_rows=batch_rows, pipeline_groups=pipeline_groups,
                                  prefix_caching=prefix_caching, draft_endpoint=draft_endpoint, eos_ids=eos_ids,
                                  defaults=generation_defaults(source_dir), timeout_s=timeout,
                                  recovery_timeout_s=recovery_timeout, liveness_timeout_s=liveness_timeout,
                                  busy_poll_s=seconds(busy_poll_ms))
            engine = Engine(endpoints, tokenizer, config, curve=curve, chat_template=template)
        except (PipelineError, ValueError) as error:
            raise click.UsageError(str(error)) from None
        progress(f"tokenizer: {tokenizer.source}; chat template: {template.origin if template else 'none'}; "
                 f"model {name!r}, {len(endpoints)} shards, context {engine.max_context}, "
                 f"{engine.max_sequences} concurrent sequences, drafter {drafter}")
        if as_json:
            emit_json({"url": f"http://{host}:{port}/v1", "model": name, "shards": list(endpoints),
                       "max_context": engine.max_context, "max_sequences": engine.max_sequences, "drafter": drafter})
        limits = FrontDoorLimits(max_body_bytes=max_body_bytes or default_max_body_bytes(engine.max_context),
                                 request_timeout_s=request_timeout, max_connections=connection_budget(max_connections))
        if limits.max_connections < max_connections:
            progress(f"the open-file limit allows {limits.max_connections} connections, not {max_connections}")
        serving["engine"], engine.lost = engine, serving.get("lost")
        try:
            server = uvicorn.Config(build_app(engine, api_key, limits), host=host, port=port, log_level=log_level,
                                    http=GuardedH11Protocol.configured(limits), backlog=ACCEPT_BACKLOG)
            install_log_filter()  # after uvicorn set its loggers up
            progress(f"listening on http://{host}:{port}")
            quiet_cancellations()
            serving["server"] = uvicorn.Server(server)
            if exit_on_shard_loss and engine.lost is not None:
                serving["server"].should_exit = True
            serving["server"].run(sockets=[listener])
        finally:
            engine.close()
            listener.close()
        if exit_on_shard_loss and engine.lost is not None:
            raise ShardLost(engine.lost)
