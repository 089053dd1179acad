"""`shardctl serve`: an OpenAI-compatible HTTP API in front of the shard pipeline.

`protocol` holds the request and response models, `responses` the Responses API (over the chat path), `engine`
turns requests into sequences stepped together by one scheduler thread, `chat` applies the model's chat template,
`tools` parses tool calls, `choices` turns a request into its choices' parameters, `errors` the OpenAI error objects
and refusals, `streaming` the server-sent events, `frontdoor` bounds what a client may cost, `metrics` the Prometheus
counters, `app` the thin FastAPI routes."""
