"""Layout: one candidate way to spread a model over the cluster, and where its groups sit.

A Layout is a ``shardlm.parallel.dims.ParallelDims`` (the axes dp, pp, cp, tp, ep, etp and their
checks: world = dp*pp*cp*tp; ep*etp folds into dp*tp) plus what only the planner varies: the
training knobs below.
Ranks are numbered as ParallelDims numbers them: rank = ((dp_i*PP + pp_i)*CP + cp_i)*TP + tp_i,
so a tp group is contiguous (inside a node when it fits) and dp is outermost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm.parallel.dims import MESH_AXES, LayoutError, ParallelDims
from shardlm.plan.activations import RECOMPUTE
from shardlm.plan.errors import PlanError

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
"""Pipeline schedules: 1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2), GPipe (Huang et al.
2019, https://arxiv.org/abs/1811.06965), interleaved 1F1B (Narayanan et al. 2021 §2.2,
https://arxiv.org/abs/2104.04473), ZB-H1 (Qi et al. 2023, https://arxiv.org/abs/2401.10241 §3)."""


@dataclass(frozen=True, kw_only=True)
class Layout(ParallelDims):
    sp: bool = False
    """Megatron sequence parallelism over the tp group (training; needs tp > 1)."""
    zero: int = 0
    """ZeRO stage over the data-parallel ranks (training)."""
    schedule: str = "1f1b"
    """Pipeline schedule (training), one of SCHEDULES."""
    virtual: int = 1
    """Model chunks per stage for the interleaved schedule."""
    micro_batch: int = 1
    """Sequences per micro-batch (training)."""
    num_micro: int = 1
    """Micro-batches per step per replica (pipeline depth / gradient accumulation)."""
    recompute: str = "none"
    """Activation recomputation: none, selective, full."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except LayoutError as e:
            raise PlanError(str(e)) from None
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule {self.schedule!r} is unknown; pick one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"recompute {self.recompute!r} is unknown; pick one of {', '.join(RECOMPUTE)}")
        if self.sp and self.tp == 1:
            raise PlanError("sequence parallelism splits activations over the tp group; it needs tp > 1")

    def with_(self, **kw) -> Layout:
        return replace(self, **kw)

    def rank0_group(self, axis: str) -> list[int]:
        """Global ranks of the ``axis`` group that rank 0 belongs to (in O(axis size): the search
        asks for millions of them, where ``group_ranks`` would walk the world each time)."""
        if axis in MESH_AXES:
            return [self.rank_of(**{axis: i}) for i in range(getattr(self, axis))]
        if axis == "ep":  # fold dp x tp as (edp, ep, etp), etp innermost
            folded = [self.rank_of(dp=d, tp=t) for d in range(self.dp) for t in range(self.tp)]
            return [folded[i * self.etp] for i in range(self.ep)]
        raise KeyError(f"unknown group {axis!r}; mesh axes are {MESH_AXES} and ep")

    def label(self, training: bool = False) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        if training:
            if self.sp:
                parts.append("sp")
            parts.append(f"zero{self.zero}")
            if self.pp > 1:
                parts.append(self.schedule + (f"x{self.virtual}" if self.schedule == "interleaved" else ""))
            parts.append(f"mb{self.micro_batch}x{self.num_micro}")
            if self.recompute != "none":
                parts.append(f"rc-{self.recompute}")
        return " ".join(parts)
