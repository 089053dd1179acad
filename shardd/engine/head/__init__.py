"""The head shard's answer for a forward's rows beyond the argmax (`answer.py`): penalties (`penalties.py`),
lossless speculative sampling (`sampling.py`) and logprobs (`logprobs.py`), batched over a step's rows."""
