"""shardd: the shard daemon and the Qwen3.5 hybrid model code it runs."""

__version__ = "0.1.0"  # the one place: pyproject.toml reads it
