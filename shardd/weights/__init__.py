"""Weights: the one safetensors reader (`reader.py`), building a shard or a drafter from a checkpoint or a synthetic
preset (`loading.py`), FP8 linears (`quant.py`), and the memory plan checked before anything loads (`memory.py`)."""
