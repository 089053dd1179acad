"""Qwen3.5 hybrid model: one module per layer kind (norm, rope, attention, gdn, mlp), state passed in
explicitly (state.py), layer ranges run by shard.py. The GDN rollback lives in shardd/rollback.py."""
