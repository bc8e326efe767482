"""shardlm: run and train large language models across many devices with every parallel strategy."""

__version__ = "0.1.0"
