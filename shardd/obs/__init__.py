"""Observability of a daemon: logs, loading progress, Prometheus metrics, device memory, GPU timelines."""
