"""`shardctl launch --dry-run`: each daemon's memory plan for a launch, from the model's config alone (no weights
read, no daemon started, no GPU needed), with the accounting the daemons check `--max-gpu-memory` by
(common.memory, common.shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import click

from common.draft_config import draft_config_of
from common.dtypes import resolve_dtype
from common.memory import MemoryPlan, fmt_gib, hosted_drafter, parse_memory, plan_memory, rollback_bytes_per_sequence
from common.model_config import ModelConfig
from common.quantization import Fp8Scheme
from common.shapes import WEIGHT_PARTS, fp8_tensors, shard_shapes, weight_bytes_by_part
from common.sizes import PREFILL_ROWS, step_rows_for
from coordinator.cli.output import format_table
from protocol.layout import CHECKPOINT

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# shardd serve's defaults, which a launched daemon takes where the launch does not say
DAEMON_DEFAULTS = {"max_sequences": 8, "max_context": 4096, "max_tokens_per_request": 4096, "max_verify_tokens": 16,
                   "rollback_mode": CHECKPOINT}
# what a daemon holds per sequence, beside its weights
STATE_ITEMS = ("kv_cache", "gdn_states", "checkpoint_buffers", "drafter_context")


@dataclass
class DaemonPlan:
    layers: tuple[int, int] | None  # None: a drafter-only daemon
    device: str
    dtype: str
    engine: str
    plan: MemoryPlan
    drafter: bool = False  # it hosts the drafter (--draft)

    @property
    def name(self) -> str:
        if self.layers is None:
            return "drafter"
        return f"{self.layers[0]}:{self.layers[1]}" + (" + drafter" if self.drafter else "")

    def describe(self) -> dict:
        return {"layers": None if self.layers is None else list(self.layers), "drafter": self.drafter,
                "device": self.device, "dtype": self.dtype, "engine": self.engine,
                "weights": {name: n for name, n in self.plan.weight_parts.items() if n},
                "items": dict(self.plan.items), "total_bytes": self.plan.total, "cap_bytes": self.plan.cap,
                "fits": self.plan.fits()}


def daemon_plans(config: ModelConfig, splits, *, scheme: Optional[Fp8Scheme], model_dir: Optional[str],
                 devices: tuple[str, ...], dtype: Optional[str], max_gpu_memory: Optional[str],
                 draft: Optional[str] = None, draft_placement: str = "last", **limits) -> list[DaemonPlan]:
    """The memory plan of each daemon `splits` launches, as `shardd serve` computes it at its start with the same
    flags (`limits`: max_sequences, max_context, max_tokens_per_request, max_verify_tokens, rollback_mode; None
    takes the daemon's default), with the drafter (`draft`) beside the first or the last shard or on a daemon of its
    own (`draft_placement`, on the last shard's device) as `launch` places it. The engine is `--engine auto`'s: the
    fast step on a GPU, the reference engine on the CPU."""
    limits = {name: DAEMON_DEFAULTS[name] if limits.get(name) is None else limits[name] for name in DAEMON_DEFAULTS}
    try:
        cap = None if max_gpu_memory is None else parse_memory(max_gpu_memory, None)
    except ValueError as error:
        raise click.BadParameter(f"{error} (a dry run knows no device: give a size)", param_hint="--max-gpu-memory")
    plans = []
    draft_config = _draft_config(draft, config) if draft is not None else None
    hosts = {"first": 0, "last": len(splits) - 1}.get(draft_placement) if draft is not None else None

    def on_device(device: str) -> tuple[bool, str, str]:
        """(on a GPU, the weights' dtype, `--engine auto`'s engine) of a daemon on `device`."""
        on_gpu = device.startswith("cuda")
        return on_gpu, resolve_dtype(dtype or "auto", device, model_dir), "fast" if on_gpu else "reference"

    def drafter(layers: tuple[int, int] | None, weight_dtype: str, engine: str) -> tuple[int, dict[str, int]]:
        return hosted_drafter(draft_config, config, DTYPE_BYTES[weight_dtype], layers=layers, engine=engine,
                              max_sequences=limits["max_sequences"], max_context=limits["max_context"], step_rows=None)

    for index, (begin, end) in enumerate(splits):
        device = devices[index] if len(devices) > 1 else (devices[0] if devices else "cpu")
        on_gpu, weight_dtype, engine = on_device(device)
        drafter_bytes, drafter_state = drafter((begin, end), weight_dtype, engine) if index == hosts else (0, None)
        keeps_fp8 = on_gpu  # shardd.config.ShardConfig.keeps_fp8: the CPU dequantizes at load
        shapes = shard_shapes(config, begin, end)
        fp8 = fp8_tensors(shapes, scheme) if keeps_fp8 else set()
        weights = weight_bytes_by_part(config, shapes, begin=begin, dtype_bytes=DTYPE_BYTES[weight_dtype],
                                       scheme=scheme, fp8=fp8)
        verify, mode = limits["max_verify_tokens"], limits["rollback_mode"]
        step_rows = step_rows_for(engine, None, verify, max_sequences=limits["max_sequences"], fp8=bool(fp8))
        gdn = sum(1 for layer in range(begin, end) if config.is_gdn(layer))
        plan = plan_memory(
            config, begin, end, weight_bytes=weights, dtype_bytes=DTYPE_BYTES[weight_dtype], engine=engine,
            max_sequences=limits["max_sequences"], max_context=limits["max_context"],
            max_tokens_per_request=limits["max_tokens_per_request"],
            checkpoint_bytes_per_sequence=rollback_bytes_per_sequence(config, gdn, mode if verify else None, verify),
            step_rows=step_rows or (verify or 16), cap=cap, prefill_rows=PREFILL_ROWS if on_gpu else 0,
            drafter_bytes=drafter_bytes, drafter_state=drafter_state,
            prefix_cache=None, on_gpu=on_gpu)  # the daemons' --prefix-cache-gib auto
        plans.append(DaemonPlan((begin, end), device, weight_dtype, engine, plan, drafter=index == hosts))
    if draft is not None and hosts is None:  # a daemon of its own: `shardd serve --layers none --draft`
        device = devices[-1] if devices else "cpu"
        on_gpu, weight_dtype, engine = on_device(device)
        drafter_bytes, drafter_state = drafter(None, weight_dtype, engine)
        plan = plan_memory(
            config, 0, 0, weight_bytes={}, dtype_bytes=DTYPE_BYTES[weight_dtype], engine="reference",
            max_sequences=0, max_context=limits["max_context"], max_tokens_per_request=limits["max_tokens_per_request"],
            checkpoint_bytes_per_sequence=0, step_rows=limits["max_verify_tokens"] or 16, cap=cap,
            drafter_bytes=drafter_bytes, drafter_state=drafter_state, prefix_cache=None, on_gpu=on_gpu)
        plans.append(DaemonPlan(None, device, weight_dtype, engine, plan, drafter=True))
    return plans


def _draft_config(draft: str, config: ModelConfig):
    try:
        return draft_config_of(draft, config)
    except (ValueError, OSError) as error:
        raise click.BadParameter(str(error), param_hint="--draft") from None


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f}"


def plans_table(plans: list[DaemonPlan]) -> str:
    """One row a daemon, GiB: its weights by part (WEIGHTS adds a hosted drafter's, with the target embedding and
    head it borrows), what its sequences hold, the rest, the total against its cap."""
    rows = []
    for daemon in plans:
        parts, items = {name: 0 for name in WEIGHT_PARTS} | daemon.plan.weight_parts, daemon.plan.items
        state = sum(items.get(name, 0) for name in STATE_ITEMS)
        weights = items["weights"] + items.get("drafter", 0)
        other = daemon.plan.total - weights - state
        rows.append([
            daemon.name, daemon.device, daemon.dtype, parts["experts"], parts["shared_expert"] + parts["mlp"],
            parts["attention"] + parts["gdn"], parts["embedding"] + parts["head"], weights, state, other,
            daemon.plan.total,
            "-" if daemon.plan.cap is None else f"{_gib(daemon.plan.cap)} {'ok' if daemon.plan.fits() else 'OVER'}"])
    return format_table(
        ["LAYERS", "DEVICE", "DTYPE", "EXPERTS", "MLP/SHARED", "ATTN+GDN", "EMBED+HEAD", "WEIGHTS", "STATE", "OTHER",
         "TOTAL", "CAP"],
        [[_gib(cell) if isinstance(cell, int) else cell for cell in row] for row in rows])


def plans_summary(plans: list[DaemonPlan]) -> str:
    """The line under the table: the largest daemon, and the daemons over their cap."""
    largest = max(plans, key=lambda daemon: daemon.plan.total)
    over = [daemon.name for daemon in plans if not daemon.plan.fits()]
    weights = sum(daemon.plan.items["weights"] + daemon.plan.items.get("drafter", 0) for daemon in plans)
    line = f"weights {fmt_gib(weights)} in all; the largest daemon ({largest.name}) needs {fmt_gib(largest.plan.total)}"
    return line + (f"; over --max-gpu-memory: {', '.join(over)}" if over else "")
