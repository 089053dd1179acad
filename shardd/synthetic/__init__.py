"""Synthetic Qwen3.5 models: deterministic weights of any shape (`model.py`) and checkpoints on disk in the real
layout (`checkpoint.py`, what `shardd make-model` writes)."""
