"""Model definitions, configs and shard-aware loading."""
