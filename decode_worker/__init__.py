"""Decode worker: receives prompt KV from prefill workers and runs continuous batching (or colocated)."""
