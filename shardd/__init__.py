"""shardd: the shard daemon and the Qwen3.5 hybrid model code it runs."""
