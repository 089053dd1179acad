"""`shardctl status`: each shard's HELLO and STATS as a table (or JSON), and whether the set forms the model.

Exit 0 when every shard answers and together they serve the whole model; 1 otherwise (a shard down, a gap, mixed
weights), so `shardctl status --shards ... && start-traffic` is a health check."""

from __future__ import annotations

import sys

import click

from coordinator.cli.options import EXIT_FAILURE, curve_options, load_curve, timeout_option
from coordinator.cli.output import emit_json, fmt_bytes, format_table
from coordinator.cli.plan import ShardUnreachable, hello_or_wait, shard_endpoints
from coordinator.relay.client import ShardClient
from coordinator.relay.pipeline import SHARD_FAILURES
from coordinator.relay.shards import PipelineError, ShardInfo, order_shards


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shards", metavar="EP,EP,...", required=True, help="Endpoints of running shard daemons.")
@timeout_option
@curve_options[0]
@curve_options[1]
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def status(shards, timeout, curve_server_key, curve_client_key, as_json):
    """Each shard's pid, version, uptime, layers, device and its memory, open sequences and counters
    (HELLO + STATS), and whether together they serve the model. Exit 1 when a shard is down or the
    set is not a usable pipeline.

    \b
    Example:
      shardctl status --shards tcp://127.0.0.1:7700,ipc:///tmp/$USER-shard1.sock
    """
    curve = load_curve(curve_server_key, curve_client_key)
    entries, infos = [], []
    endpoints = shard_endpoints(shards)
    for endpoint in endpoints:
        entry = {"endpoint": endpoint, "ok": False, "hello": None, "stats": None, "error": None}
        with ShardClient(endpoint, timeout_s=timeout, curve=curve) as client:
            try:
                entry["hello"] = hello_or_wait(client, timeout, wait_to_start=False, curve=curve)  # a snapshot: down is down
                entry["stats"] = client.stats()
                entry["ok"] = True
                infos.append(ShardInfo(endpoint, entry["hello"]))
            except (*SHARD_FAILURES, ShardUnreachable) as error:
                entry["error"] = str(error)
        entries.append(entry)
    pipeline = {"ok": False, "message": "not every shard answered"}
    if infos and len(infos) == len(entries):
        try:
            ordered = order_shards(infos)
            drafters = sum(1 for info in infos if not info.owns_layers)
            pipeline = {"ok": True, "message": f"{len(ordered)} shard(s) cover all {ordered[0].model['num_layers']} layers "
                                               f"of {ordered[0].model['fingerprint']}"
                                               + (f"; {drafters} drafter-only daemon(s)" if drafters else "")}
        except PipelineError as error:
            pipeline = {"ok": False, "message": str(error)}
    if as_json:
        emit_json({"shards": entries, "pipeline": pipeline})
    else:
        print_status(entries, pipeline)
    if not pipeline["ok"]:
        sys.exit(EXIT_FAILURE)


def print_status(entries: list[dict], pipeline: dict) -> None:
    rows = []
    for entry in entries:
        hello, stats = entry["hello"] or {}, entry["stats"] or {}
        if not entry["ok"]:
            rows.append([entry["endpoint"], "DOWN"] + [None] * 14)
            continue
        storage = hello.get("rollback") or {}
        limits = hello.get("limits") or {}
        memory = hello.get("device_memory") or {}
        rows.append([
            entry["endpoint"],
            serving_label(hello),
            hello.get("pid"),
            hello.get("version"),
            fmt_duration(hello.get("uptime_seconds")),
            hello.get("device"),
            fmt_memory(memory),
            hello.get("dtype"),
            f"{storage.get('mode') or 'none'}/{storage.get('max_verify_tokens')}",
            f"{stats.get('open_sequences', '-')}/{limits.get('max_sequences', '-')}",
            fmt_bytes(stats.get("weight_bytes")),
            fmt_bytes(stats.get("state_bytes")),
            fmt_bytes(stats.get("checkpoint_bytes")),
            fmt_bytes(storage.get("checkpoint_bytes_per_sequence")),
            stats.get("forwards"),
            sum((stats.get("errors") or {}).values()) if isinstance(stats.get("errors"), dict) else stats.get("errors"),
        ])
    click.echo(format_table(
        ["ENDPOINT", "LAYERS", "PID", "VERSION", "UPTIME", "DEVICE", "DEVICE MEM", "DTYPE", "ROLLBACK", "OPEN", "WEIGHTS", "STATE", "CKPT", "CKPT/SEQ",
         "FORWARDS", "ERRORS"], rows))
    for entry in entries:
        stats = entry["stats"]
        if entry["error"]:
            click.echo(f"\n{entry['endpoint']}: DOWN: {entry['error']}")
        if not stats:
            continue
        counters = ", ".join(f"{key}={_compact(value)}" for key, value in stats.items() if value not in ({}, None))
        click.echo(f"\n{entry['endpoint']}: {counters}")
        plan = (entry["hello"] or {}).get("memory")
        if plan:
            click.echo(f"{entry['endpoint']}: memory plan: {fmt_plan(plan)}")
    click.echo(f"\npipeline: {'ok' if pipeline['ok'] else 'NOT USABLE'}: {pipeline['message']}")


def fmt_duration(seconds) -> str | None:
    if seconds is None:
        return None
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    return (f"{days}d" if days else "") + f"{rest // 3600:d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"


def fmt_memory(memory: dict) -> str | None:
    """'12.3/80.0 GiB' of the daemon's device (host memory for a CPU shard)."""
    if "used_bytes" not in memory or "total_bytes" not in memory:
        return None
    return f"{memory['used_bytes'] / (1 << 30):.1f}/{memory['total_bytes'] / (1 << 30):.1f} GiB"


def fmt_plan(plan: dict) -> str:
    """'weights 12.10 GiB, kv_cache 0.13 GiB, ... = 14.02 GiB of 24.00 GiB' (common.memory's breakdown)."""
    gib = lambda n: f"{n / (1 << 30):.2f} GiB"  # noqa: E731
    items = ", ".join(f"{name} {gib(n)}" for name, n in (plan.get("items") or {}).items() if n)
    cap = plan.get("cap_bytes")
    return f"{items} = {gib(plan.get('total_bytes') or 0)}" + (f" of a {gib(cap)} cap" if cap else " (no cap)")


def serving_label(hello: dict) -> str:
    """'0:3', '3:6+head', '3:6+head+dflash', 'dflash' (a drafter-only daemon)."""
    parts = [] if hello.get("layers") is None else [f"{hello['layers'][0]}:{hello['layers'][1]}"]
    parts += ["head"] if hello.get("owns_head") else []
    parts += [hello["drafter"].get("name", "drafter")] if hello.get("drafter") else []
    return "+".join(parts)


def _compact(value) -> str:
    if isinstance(value, dict):
        return "{" + " ".join(f"{k}:{_compact(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
