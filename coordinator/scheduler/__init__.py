"""The scheduler and its pieces: `scheduler` (continuous batching: which sequences run in a step, and how many rows
each), `requests` (a request and its result), `commit` (the commit rule of a verify step) and `recovery` (re-filling a
lost sequence), the last three shared with the reference loop in `coordinator.decoding`."""
