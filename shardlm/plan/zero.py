"""Model-state memory under ZeRO stages 0-3 (Rajbhandari et al. 2019, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", https://arxiv.org/abs/1910.02054 §5.1).

Mixed-precision Adam keeps, per parameter, 2 bytes of 16-bit weights, 2 bytes of 16-bit
gradients and K = 12 bytes of optimizer state (fp32 master weights, momentum, variance).
Stage 1 shards the optimizer state over the N_d data-parallel ranks, stage 2 also the
gradients, stage 3 also the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

PARAM_BYTES = 2
"""16-bit weights (ZeRO §3: Psi parameters take 2 Psi bytes)."""
GRAD_BYTES = 2
"""16-bit gradients (what backward writes into the parameters' ``.grad``)."""
REDUCED_GRAD_BYTES = 4
"""Gradients as shardlm's trainer reduces them over the dp ranks and steps on them: float32 at every
stage (``train/unit.py`` ``Unit.full_grad`` sends the all-reduce or reduce-scatter of stages 0-2 in
float32, ``train/zero.py`` ``_Gather.backward`` stage 3's reduce-scatter; the sums the optimizer
reads are float32). ``shardlm train`` has no option to reduce in 16 bits, so the planner has none."""
ADAM_STATE_BYTES = 12
"""K in the ZeRO paper: fp32 copy of the weights, momentum and variance, 4 bytes each."""

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank of the three model states."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def model_states(
    params: float,
    *,
    dp: int,
    stage: int,
    param_bytes: float = PARAM_BYTES,
    grad_bytes: float = GRAD_BYTES,
    state_bytes: float = ADAM_STATE_BYTES,
) -> ModelStates:
    """Per-rank model states for ``params`` parameters (already split by TP/PP/EP) under ZeRO-``stage``
    (bytes per parameter: mixed-precision Adam by default; float32 Adam is 4, 4, 8)."""
    if stage not in ZERO_STAGES:
        from shardlm.plan.errors import PlanError

        raise PlanError(f"--zero {stage}: ZeRO stages are 0 (plain data parallel), 1, 2 and 3")
    w, g, o = param_bytes * params, grad_bytes * params, state_bytes * params
    return ModelStates(
        weights=w / dp if stage >= 3 else w,
        gradients=g / dp if stage >= 2 else g,
        optimizer=o / dp if stage >= 1 else o,
    )


# ---- DeepSpeed's own estimator, reproduced to check against its printed numbers ------------
# https://deepspeed.readthedocs.io/en/latest/memory.html
# (estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs, no offload)


def deepspeed_zero2_bytes(total_params: float, num_gpus: int) -> float:
    """ZeRO-2 per-GPU bytes as DeepSpeed estimates them: 4 Psi + 16 Psi / N."""
    return 4 * total_params + 16 * total_params / num_gpus


def deepspeed_zero3_bytes(total_params: float, largest_layer_params: float, num_gpus: int) -> float:
    """ZeRO-3 per-GPU bytes as DeepSpeed estimates them: 4 x largest layer + 18 Psi / N."""
    return 4 * largest_layer_params + 18 * total_params / num_gpus
