"""The scheduler and its pieces: `scheduler` (continuous batching: which sequences run in a step, and how many rows
each), `batches` (the batch calls for a target without them), `fallback` (a stream whose drafter fails decodes
plainly), `sizing` (a step's rows, a prompt chunk), `prefix` (the prefix index), `block_size` (`--block-size auto`),
`requests` (a request and its result), `commit` (the commit rule of a verify step) and `recovery` (re-filling a
lost sequence), the last three shared with the reference loop in `coordinator.decoding`."""
