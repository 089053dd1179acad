"""How many rows a step holds, how long a prompt chunk is, and how many sequences the shards hold at once."""

from __future__ import annotations

from typing import Optional

# Rows per step at least, as vLLM's `max_num_batched_tokens` (8,192 for its OpenAI server): prompts that arrive
# together are prefilled in one step, and a prompt takes at most half a step (`default_prefill_chunk`), which bounds
# how long the running streams wait for a token behind it.
DEFAULT_BATCH_ROWS = 8192
# The prompt chunk where the shards keep prefix entries (coordinator.scheduler.prefix): a prompt resumes from the
# last whole chunk it shares with an earlier one, so a smaller chunk hits more prompts, at more steps per prompt.
PREFIX_CHUNK = 256


def default_prefill_chunk(batch_rows: int, prefill_rows: Optional[int]) -> int:
    """Half a step (a chunk fits beside half a step of streams); with shards that run their prefill in graphed
    pieces of `prefill_rows` (HELLO), the largest multiple of a piece within that, at least one piece: a chunk
    that is not whole pieces runs its remainder eagerly."""
    chunk = max(1, batch_rows // 2)
    if prefill_rows and prefill_rows <= batch_rows:
        chunk = max(prefill_rows, chunk // prefill_rows * prefill_rows)
    return chunk


def shard_capacity(target) -> Optional[int]:
    """The most sequences every shard of a `Pipeline` holds at once (HELLO limits), or None when unknown."""
    shards = getattr(target, "shards", None) or []
    limits = [shard.hello["limits"]["max_sequences"] for shard in shards if hasattr(shard, "hello")]
    return min(limits) if limits else None
