"""What the tests share: real daemons and a wire client, `shardctl serve` processes and the model they serve,
transformers as the numerical reference, an in-memory target, chi-square checks. Nothing outside tests/ imports it."""
