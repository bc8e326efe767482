"""Training: a vocab-parallel loss, ZeRO stages 0-3 over the data-parallel ranks, the trainer."""
