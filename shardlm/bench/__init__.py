"""Benchmarks users run: `shardlm bench comm` (collectives per backend)."""
