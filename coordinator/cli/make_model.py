"""`shardctl make-model`: write a synthetic checkpoint (and its drafter) in the real Qwen3.5 layout.

The writer lives on the shard side and needs torch, so it runs as `shardd make-model` in a child process: shardctl
itself never imports torch or shardd."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import click

from common.presets import PRESETS
from common.quantization import LAYOUTS
from common.dtypes import WEIGHT_DTYPES
from coordinator.cli.output import MiB, emit_json, progress


class MakeModelFailed(RuntimeError):
    """`shardd make-model` could not write the model; the message is its error."""


def write_model(preset: str, seed: int, dtype: str, out: Path, *, quantize: Optional[str] = None,
                with_drafter: bool = False, draft_layers: Optional[int] = None) -> tuple[Path, Optional[Path]]:
    """Write the model (and drafter) through `shardd make-model`, its progress bar on this stderr; (model, draft)."""
    command = [sys.executable, "-m", "shardd", "make-model", "--preset", preset, "--out", str(out), "--seed", str(seed),
               "--dtype", dtype, "--force", "--json"]
    command += ["--quantize", quantize] if quantize else []
    command += ["--with-drafter"] if with_drafter else []
    command += ["--draft-layers", str(draft_layers)] if draft_layers is not None else []
    child = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    try:
        written = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise MakeModelFailed(f"shardd make-model exited {child.returncode} without a result") from None
    if child.returncode != 0 or "error" in written:
        raise MakeModelFailed(written.get("error") or f"shardd make-model exited {child.returncode}")
    return Path(written["path"]), None if written["draft"] is None else Path(written["draft"])


@click.command("make-model", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--preset", type=click.Choice(tuple(PRESETS)), required=True, help="Model shape.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory to write.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(WEIGHT_DTYPES), default="float32", show_default=True)
@click.option("--quantize", type=click.Choice(LAYOUTS), default=None,
              help="Write the linears as FP8: fp8-block (quant_method 'fp8', 128x128 weight_scale_inv, partial blocks "
                   "at the edges) or fp8-channel (compressed-tensors, per-channel weight_scale); the head and "
                   "linear_attn.in_proj_a stay in --dtype, listed as not converted.")
@click.option("--force", is_flag=True, help="Overwrite a model already in --out.")
@click.option("--with-drafter", is_flag=True, help="Also write a matched synthetic DFlash drafter to OUT/draft/.")
@click.option("--draft-layers", type=click.IntRange(1), default=None, help="Layers of that drafter (default 2).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def make_model(preset, out_dir, seed, dtype, quantize, force, with_drafter, draft_layers, as_json):
    """Write a synthetic checkpoint (config.json, *.safetensors, index) in the Qwen3.5 layout;
    with --with-drafter also a DFlash draft checkpoint in OUT/draft/ (`--draft OUT/draft`).
    Files are written as their tensors are made, with a progress bar on a terminal.

    \b
    Example:
      shardctl make-model --preset tiny --out /tmp/$USER-tiny --with-drafter
      shardctl make-model --preset tiny --out /tmp/$USER-tiny-fp8 --quantize fp8-block --dtype bfloat16
    """
    if draft_layers is not None and not with_drafter:
        raise click.UsageError("--draft-layers goes with --with-drafter")
    out = Path(out_dir)
    if (out / "config.json").exists() and not force:
        raise click.UsageError(f"{out} already holds a model (config.json); pass --force to overwrite it")
    what = dtype + (f", {quantize}" if quantize else "")
    progress(f"writing synthetic {preset} (seed {seed}, {what}) to {out}")
    started = time.perf_counter()
    path, draft = write_model(preset, seed, dtype, out, quantize=quantize, with_drafter=with_drafter,
                              draft_layers=draft_layers)
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    size = sum((path / name).stat().st_size for name in files)
    record = {"path": str(path), "preset": preset, "seed": seed, "dtype": dtype, "quantize": quantize,
              "files": files, "bytes": size,
              "draft": None if draft is None else str(draft), "seconds": time.perf_counter() - started}
    if as_json:
        emit_json(record)
    else:
        click.echo(f"{path}: {len(files)} files, {size / MiB:.1f} MiB ({preset}, seed {seed}, {what})")
