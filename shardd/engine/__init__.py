"""The shard engines: what runs a daemon's layer range over its sequences' states.

- `interface.py`: `ShardEngine`, the protocol a daemon serves; `batch.py`: a batched forward's items.
- `reference/`: the readable model code (any device; the CPU path), `ShardModel`.
- `fast/`: the fixed-shape GPU step (fused weights, CUDA graphs, state pools), `FastShard`, and the fast drafter.
- `kernels/`: the Triton kernels of the fast step, one op per module.
- `head/`: what the head shard answers beyond the argmax: penalties, sampling, logprobs.
- `select.py`: which engine a daemon serves its shard with, from its flags.
"""
