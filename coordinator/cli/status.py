"""`shardctl status`: each shard's HELLO and STATS as a table (or JSON), and whether the set forms the model."""

from __future__ import annotations

import sys

import click

from coordinator.cli.options import EXIT_FAILURE, curve_options, load_curve, parse_list
from coordinator.cli.output import emit_json, fmt_bytes, format_table
from coordinator.client import ShardClient
from coordinator.pipeline import SHARD_FAILURES, PipelineError, ShardInfo, order_shards


@click.command()
@click.option("--shards", metavar="EP,EP,...", required=True, help="Endpoints of running shard daemons.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for each shard.")
@curve_options[0]
@curve_options[1]
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def status(shards, timeout, curve_server_key, curve_client_key, as_json):
    """Each shard's layers, device, rollback storage, memory and counters (HELLO + STATS).
    Exit 1 when a shard does not answer."""
    curve = load_curve(curve_server_key, curve_client_key)
    entries, infos = [], []
    endpoints = parse_list(shards)
    if not endpoints:
        raise click.BadParameter("name at least one endpoint", param_hint="--shards")
    for endpoint in endpoints:
        entry = {"endpoint": endpoint, "ok": False, "hello": None, "stats": None, "error": None}
        with ShardClient(endpoint, timeout_s=timeout, curve=curve) as client:
            try:
                entry["hello"] = client.hello()
                entry["stats"] = client.stats()
                entry["ok"] = True
                infos.append(ShardInfo(endpoint, entry["hello"]))
            except SHARD_FAILURES as error:
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
    if not all(entry["ok"] for entry in entries):
        sys.exit(EXIT_FAILURE)


def print_status(entries: list[dict], pipeline: dict) -> None:
    rows = []
    for entry in entries:
        hello, stats = entry["hello"] or {}, entry["stats"] or {}
        if not entry["ok"]:
            rows.append([entry["endpoint"], "DOWN"] + [None] * 10)
            continue
        storage = hello.get("rollback") or {}
        limits = hello.get("limits") or {}
        rows.append([
            entry["endpoint"],
            serving_label(hello),
            hello.get("device"),
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
        ["ENDPOINT", "LAYERS", "DEVICE", "DTYPE", "ROLLBACK", "OPEN", "WEIGHTS", "STATE", "CKPT", "CKPT/SEQ",
         "FORWARDS", "ERRORS"], rows))
    for entry in entries:
        stats = entry["stats"]
        if entry["error"]:
            click.echo(f"\n{entry['endpoint']}: DOWN: {entry['error']}")
        if not stats:
            continue
        counters = ", ".join(f"{key}={_compact(value)}" for key, value in stats.items() if value not in ({}, None))
        click.echo(f"\n{entry['endpoint']}: {counters}")
    click.echo(f"\npipeline: {'ok' if pipeline['ok'] else 'NOT USABLE'}: {pipeline['message']}")


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
