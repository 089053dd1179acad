"""The way to the shards: one client per shard daemon, the shard set their HELLOs describe, the pipeline over them
and the relay of each step's rows from shard to shard, the `Target` interface the decoding loops drive, and the
liveness watch on each connection."""
