"""The inference engine: scheduler, KV blocks, model runner, sampling."""
