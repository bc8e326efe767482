"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay (torchtitan's
``lr_scheduler`` choices; cosine from Loshchilov & Hutter 2017, "SGDR",
https://arxiv.org/abs/1608.03983, without restarts).

The rate is a pure function of the step index, so a resumed run (any layout) continues the
schedule from its saved step count with nothing else saved.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, schedule: str, warmup: int, total: int | None, floor: float) -> float:
    """The multiple of the peak rate for step ``step`` (0-based) of ``total``, as torchtitan's
    ``linear_warmup_stable_decay``: (step + 1) / (warmup + 1) during the warm-up (never 0), then 1
    (constant) or a decay from 1 towards ``floor`` over the remaining steps (progress (step -
    warmup) / (total - warmup): ``floor`` is where the step after the last would be)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    assert total is not None  # TrainConfig requires it for a decay
    progress = min(1.0, (step - warmup) / (total - warmup))
    decay = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * decay
