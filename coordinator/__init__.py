"""Coordinator: shard clients, pipeline, decoding loop, drafters, benchmarks and the shardctl CLI."""
