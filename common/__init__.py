"""The torch-free pieces both sides share: the model's config and synthetic shapes, checkpoint quantization
schemes, the synthetic tokenizer, hub ids, endpoint checks, busy polling, and the project's version."""

__version__ = "0.1.0"  # the one place: pyproject.toml reads it
