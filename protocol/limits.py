"""Size limits a receiver enforces while decoding a request (TOO_LARGE when exceeded)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Limits:
    max_tokens_per_request: int = 4096   # tokens, hidden rows, feature rows, parents, block_size
    max_frame_bytes: int = 1 << 30       # any single tensor frame
    max_total_bytes: int = 1 << 31       # all frames of one message together, header included
    max_frames: int = 64                 # frames of one message, header included
    max_header_bytes: int = 1 << 20      # frame 0 (the msgpack header)
    max_capture_layers: int = 256        # entries of CAPTURE `layers`
    max_batch_items: int = 256           # sequences named by one batched FORWARD/CAPTURE/ROLLBACK (`items`)
