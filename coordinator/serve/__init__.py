"""`shardctl serve`: an OpenAI-compatible HTTP API in front of the shard pipeline.

`protocol` holds the request and response models, `engine` turns a request into a sequence on the shards
(one decode thread per request, its own pipeline connection), `chat` applies the model's chat template,
`metrics` the Prometheus counters, `app` the thin FastAPI routes."""
