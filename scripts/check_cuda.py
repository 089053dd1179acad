#!/usr/bin/env python3
"""GPU path check: the same checkpoint on cuda and cpu gives the same logits, and every rollback
mode on cuda equals a fresh recompute. Prints one JSON object; exit 1 on a mismatch."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.presets import preset_config  # noqa: E402
from protocol.layout import SHARD_ROLLBACK_MODES  # noqa: E402
from shardd.weights.loading import ModelSource, build_shard  # noqa: E402
from shardd.engine.reference.rollback import RollbackStorage  # noqa: E402
from shardd.synthetic.model import write_checkpoint  # noqa: E402


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
    results, ok = {"device": device}, True
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("tiny", "small"):
            model_dir = write_checkpoint(Path(tmp) / preset, preset_config(preset), seed=0)
            source = ModelSource(model_dir=str(model_dir))
            config = source.config()
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, config.vocab_size, (90,), generator=g).tolist()
            cpu = build_shard(source, 0, config.num_layers)
            gpu = build_shard(source, 0, config.num_layers, device=device)
            ref = cpu.forward(cpu.new_state(256), 0, tokens=tokens).logits
            out = gpu.forward(gpu.new_state(256), 0, tokens=tokens).logits.cpu()
            diff = (out - ref).abs().max().item()
            results[f"{preset}_logits_max_abs_diff_cuda_vs_cpu"] = diff
            ok &= diff <= 1e-3  # TF32 may be on for matmuls on the GPU; fp32 CPU is the reference
            for mode in SHARD_ROLLBACK_MODES:
                shard = build_shard(source, 0, config.num_layers, device=device, storage=RollbackStorage(mode, 16))
                worst = 0.0
                for keep in (0, 1, 7, 16):
                    state = shard.new_state(256)
                    shard.forward(state, 0, tokens=tokens[:60])
                    shard.forward(state, 60, tokens=tokens[60:76], checkpoint=True)
                    shard.rollback(state, keep)
                    fresh = gpu.new_state(256)
                    gpu.forward(fresh, 0, tokens=tokens[: 60 + keep])
                    nxt = shard.forward(state, 60 + keep, tokens=tokens[80:83]).logits
                    ref_next = gpu.forward(fresh, 60 + keep, tokens=tokens[80:83]).logits
                    worst = max(worst, (nxt - ref_next).abs().max().item())
                    for layer in state.gdn:
                        worst = max(worst, (state.gdn[layer].recurrent - fresh.gdn[layer].recurrent).abs().max().item())
                results[f"{preset}_{mode}_rollback_max_abs_diff"] = worst
                ok &= worst <= 1e-3
    results["ok"] = bool(ok)
    print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
