#!/usr/bin/env python3
"""Launch the weight-only FP8 GEMM once per (shape, layout) at 16 rows, for a hardware-counter profile: run it
under Nsight Compute (`NCU=1 scripts/gpu_run.sh fp8-gemm` does) to see whether a matrix's time goes to
memory (dram throughput against its peak), to instruction issue (issue slots busy) or to stalls (warp states).

    ncu --clock-control none -k regex:_fp8_gemm_kernel --section SpeedOfLight --section SchedulerStats \
        --section WarpStateStats --section Occupancy python3 scripts/profile_fp8_gemm.py
Each launch is preceded by one untimed warm-up (compilation) of the same config; the NVTX-free order is the one
printed, so ncu's report lines up with it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shardd.engine.kernels import fp8_gemm as fp8  # noqa: E402

SHAPES = {"gdn_in_proj": (16480, 5120), "out_proj": (5120, 6144), "attn_qkv": (14336, 5120), "gate_up": (34816, 5120),
          "down": (5120, 17408)}
BLOCK = (128, 128)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="gate_up,down,out_proj")
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    order = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weight = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1]), device="cuda") * 1e-3
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        config = fp8.tile_config(n, k, True)
        packed = fp8.pack_weight(weight, config, BLOCK)
        for layout, w in (("row-major", weight), ("packed", packed)):
            fp8.fp8_gemm(x, w, scale, BLOCK, config, convert=fp8.HOPPER_CONVERT)  # warm-up: compiles
            torch.cuda.synchronize()
            fp8.fp8_gemm(x, w, scale, BLOCK, config, convert=fp8.HOPPER_CONVERT)
            torch.cuda.synchronize()
            order.append(f"{name} {layout} {config}")
    print("launches (each after its warm-up):\n  " + "\n  ".join(order))
    return 0


if __name__ == "__main__":
    sys.exit(main())
