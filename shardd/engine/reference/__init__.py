"""Qwen3.5 hybrid model: one module per layer kind (norm, rope, attention, gdn, mlp), state passed in
explicitly (state.py), layer ranges run by shard.py, the GDN rollback by rollback.py."""
