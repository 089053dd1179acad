"""How shardctl writes: results to stdout (a table, or one JSON document), progress to stderr."""

from __future__ import annotations

import json
from typing import Optional, Sequence

import click

MiB = 1 << 20


def progress(message: str) -> None:
    click.echo(f"[shardctl] {message}", err=True)


def emit_json(record: dict) -> None:
    click.echo(json.dumps(record))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def fmt(value: Optional[float], digits: int = 1, suffix: str = "") -> Optional[str]:
    return None if value is None else f"{value:.{digits}f}{suffix}"


def fmt_bytes(value: Optional[int]) -> Optional[str]:
    return None if value is None else f"{value / MiB:.1f} MiB"


def fmt_percent(value: Optional[float]) -> Optional[str]:
    """A rate in [0, 1] as '12.3%'."""
    return fmt(None if value is None else 100 * value, 1, "%")
