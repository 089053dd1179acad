"""The GPU fast path of a shard: the same step as shardd/engine/reference/, as one fixed-shape step of T rows.

- `weights.py`: the fused weight matrices built after loading (GDN qkv|z|b|a, attention q|k|v, MLP gate|up).
- `pools.py`: every sequence's state in pointer-stable slots (KV cache, GDN state, rollback storage).
- `step.py`: the step itself, GEMMs plus the Triton kernels of shardd/engine/kernels/.
- `graph.py`: the step captured as CUDA graphs, one per set of captured layers.
- `shard.py`: `FastShard`, the fast `ShardEngine` (shardd/engine/interface.py) a daemon serves on a GPU.

Every generated token goes through the T-row step (a decode or a replay of kept tokens fills the first
rows and pads the rest), so its result does not depend on how many tokens shared its step. Longer
inputs (prefill, re-fill of a prompt) run the reference model's chunked path over the same pooled state.
"""
