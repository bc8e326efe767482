"""Layout: one candidate way to spread a model over the cluster, and where its groups sit.

A Layout is a ``shardlm.parallel.dims.ParallelDims`` (the axes dp, pp, cp, tp, ep, etp and their
checks: world = dp*pp*cp*tp; ep*etp folds into dp*tp) plus what only the planner varies: the
training knobs below.
Ranks are numbered as ParallelDims numbers them (rank = ((pp_i*DP + dp_i)*CP + cp_i)*TP + tp_i,
pp outermost), so a tp group is contiguous (inside a node when it fits), a stage's ranks are one
block (an ep group folded over them too) and pp crosses nodes. A collective waits for its slowest
group, so the planner costs every kind of group by its worst placement (``slowest_group``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from shardlm.parallel.dims import EXPERT_AXES, MESH_AXES, LayoutError, ParallelDims, axes
from shardlm.parallel.expert import experts_span_replicas
from shardlm.parallel.schedules import PIPELINE_SCHEDULES
from shardlm.plan.activations import RECOMPUTE
from shardlm.plan.errors import PlanError

SCHEDULES = PIPELINE_SCHEDULES
"""Pipeline schedules: the trainer's (parallel/schedules.py defines them and names their sources)."""


CP_ATTENTION = ("ring", "ulysses")
"""The training cp attentions the planner costs (the trainer's all-gather is ring's traffic, unhidden)."""


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
    offload: bool = False
    """ZeRO-Offload (training): each rank's float32 masters and Adam moments in host memory, the
    step run there (``shardlm train --offload optimizer``)."""
    cp_attention: str = "ring"
    """How attention spans the cp ranks in training: "ring" (key/value blocks passed around,
    overlapped with attention) or "ulysses" (all-to-alls that split the heads; not overlapped)."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except LayoutError as e:
            raise PlanError(str(e)) from None
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule {self.schedule!r} is unknown; pick one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"recompute {self.recompute!r} is unknown; pick one of {', '.join(RECOMPUTE)}")
        if self.cp_attention not in CP_ATTENTION:
            raise PlanError(f"cp attention {self.cp_attention!r} is unknown; pick one of {', '.join(CP_ATTENTION)}")
        if self.sp and self.tp == 1:
            raise PlanError("sequence parallelism splits activations over the tp group; it needs tp > 1")

    def with_(self, **kw) -> Layout:
        return replace(self, **kw)

    def groups(self, kind: str) -> np.ndarray:
        """[groups, size]: every group of a mesh axis, of ``dp_cp`` or of an expert axis, as the
        engine forms them (``ParallelDims.group_ranks``, tested equal), in O(world) array steps."""
        return _groups(tuple(self.sizes().values()), kind)

    def slowest_group(self, kind: str, per_node: int) -> list[int]:
        """The ``kind`` group that spans the most nodes (then the fewest ranks in its emptiest
        node): the one a collective over every such group waits for."""
        return _slowest(tuple(self.sizes().values()), kind, per_node)

    def nodes_spanned(self, kind: str, per_node: int) -> int:
        """Nodes the slowest ``kind`` group spans (1: inside a node)."""
        return len({r // per_node for r in self.slowest_group(kind, per_node)})

    def moe_tokens(self, tokens: float) -> float:
        """The tokens whose (token, choice) pairs one ep group computes, for ``tokens`` per tp group,
        as ``parallel/expert.py`` dispatches them; a rank computes ``moe_tokens x k / ep`` pairs.
        Inside the tp group (ep x etp divides tp) the group's own tokens. Beyond it each of the ep x
        etp ranks sends 1/tp of its replica's tokens (ep x etp / tp replicas' worth in all), and each
        of an expert's etp ranks computes all of their pairs on its share of the rows."""
        if not experts_span_replicas(self.tp, self.ep, self.etp):
            return tokens
        return tokens * self.ep * self.etp / self.tp

    def attention_dp(self, moe: bool) -> bool:
        """Attention data-parallel beside expert-parallel MoE layers (SGLang's --enable-dp-attention):
        the experts span dp replicas (ep x etp does not divide tp), each replica attends over its own
        sequences and KV cache, and the replicas step in lockstep (``engine/engine.py``)."""
        return moe and self.dp > 1 and experts_span_replicas(self.tp, self.ep, self.etp)

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
            if self.cp > 1 and self.cp_attention != "ring":
                parts.append(self.cp_attention)
            if self.offload:
                parts.append("offload")
        return " ".join(parts)


@lru_cache(maxsize=65536)
def _groups(sizes: tuple[int, ...], kind: str) -> np.ndarray:
    dims = ParallelDims.take(dict(zip(axes(), sizes)))
    grid = np.arange(dims.world_size).reshape(dims.shape())  # axes in MESH_AXES order, as ranks are numbered
    if kind in MESH_AXES or kind == "dp_cp":
        vary = [MESH_AXES.index(a) for a in (("dp", "cp") if kind == "dp_cp" else (kind,))]
        moved = np.moveaxis(grid, vary, list(range(-len(vary), 0)))
        return moved.reshape(-1, math.prod(grid.shape[i] for i in vary))
    if kind in EXPERT_AXES:  # a stage's dp x tp ranks, s = dp_rank * tp + tp_rank, re-folded as (edp, ep, etp)
        stages = grid.transpose([MESH_AXES.index(a) for a in ("pp", "cp", "dp", "tp")])
        folded = stages.reshape(dims.pp * dims.cp, dims.edp, dims.ep, dims.etp)
        ax = 1 + EXPERT_AXES.index(kind)
        return np.moveaxis(folded, ax, -1).reshape(-1, folded.shape[ax])
    raise KeyError(f"unknown group {kind!r}; mesh axes are {MESH_AXES} (and dp_cp), expert axes {EXPERT_AXES}")


@lru_cache(maxsize=65536)
def _slowest(sizes: tuple[int, ...], kind: str, per_node: int) -> list[int]:
    nodes = _groups(sizes, kind) // per_node  # [groups, size], ascending along each row
    spans = 1 + (np.diff(nodes, axis=1) != 0).sum(axis=1)
    widest = np.flatnonzero(spans == spans.max())[:16]  # groups repeat with the node pattern: a few suffice
    # among those, the thinnest: fewest ranks on one node, so most of its traffic crosses (comm.placement's k)
    thinnest = min(widest, key=lambda g: np.unique(nodes[g], return_counts=True)[1].max())
    return _groups(sizes, kind)[thinnest].tolist()
