"""Expert load statistics of a model's expert layers, and EPLB applied to them.

Each ``ExpertParallelSwiGLU`` counts, per local slot, the (token, expert) pairs it has
computed since the last read, and the seconds its collectives took. ``local_load`` reads
one rank's counters without talking (cheap enough for every step); ``collect_load`` sums
them over the stage (a collective: every rank of the stage calls it at the same point)
into per-expert and per-ep-rank token counts, each pair counted once. ``rebalance_experts``
turns collected load into a new placement per layer (``eplb.rebalance``) and moves every
rank to it, reading its new slots from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardlm.parallel import comm
from shardlm.parallel.dims import ParallelDims
from shardlm.parallel.eplb import imbalance, rebalance
from shardlm.parallel.expert import ExpertParallelSwiGLU
from shardlm.parallel.tensor import TensorSource


def expert_layers(model: nn.Module) -> list[ExpertParallelSwiGLU]:
    """The model's expert layers on this rank, in layer order."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelSwiGLU)]


@dataclass
class ExpertLoad:
    """Tokens routed, per layer: summed over the stage, each (token, expert) pair once."""

    expert_tokens: list[list[int]]
    """[layer][logical expert]: pairs routed to each expert."""
    rank_tokens: list[list[int]]
    """[layer][ep rank]: pairs computed by each ep rank (summed over its edp copies)."""
    comm_s: float = 0.0
    """Seconds this rank spent in expert collectives (dispatch, combine, reductions)."""

    @property
    def imbalance(self) -> list[float]:
        """max / mean per-ep-rank load of each layer (1.0 = even)."""
        return [imbalance(r) for r in self.rank_tokens]

    @property
    def mean_imbalance(self) -> float:
        return sum(self.imbalance) / len(self.imbalance) if self.rank_tokens else 1.0

    def to_dict(self) -> dict:
        """For a JSON timing line or a metrics endpoint."""
        return {
            "expert_tokens": self.expert_tokens,
            "rank_tokens": self.rank_tokens,
            "imbalance": [round(x, 4) for x in self.imbalance],
            "comm_s": round(self.comm_s, 6),
        }


def local_load(model: nn.Module, reset: bool = True) -> tuple[list[list[int]], float]:
    """This rank's counters, no collective: ([layer][local slot] pairs computed, comm seconds)."""
    layers = expert_layers(model)
    counts = [layer.slot_tokens.tolist() for layer in layers]
    seconds = sum(layer.comm_s for layer in layers)
    if reset:
        for layer in layers:
            layer.slot_tokens.zero_()
            layer.comm_s = 0.0
    return counts, seconds


def collect_load(model: nn.Module, dims: ParallelDims, reset: bool = True, across_dp: bool = True) -> ExpertLoad:
    """The stage's load (collective over its tp and dp groups; every rank of the stage calls it).

    ``across_dp=False`` sums over this replica's tp group only (no collective spans
    replicas); its counts are then this replica's share, to be added up across replicas.
    """
    layers = expert_layers(model)
    width = max((len(layer.slot_rank) for layer in layers), default=0)
    device = layers[0].slot_tokens.device if layers else None
    glob = torch.zeros((len(layers), width), dtype=torch.long, device=device)  # [layer, global slot]
    for i, layer in enumerate(layers):
        if layer.counts_once:  # the copies that saw the same pairs add nothing
            start = layer.placement.slot_offsets[layer.ep_rank]
            glob[i, start : start + len(layer.local_experts)] = layer.slot_tokens
    comm.all_reduce(glob, dims.tp_group)
    if across_dp:
        comm.all_reduce(glob, dims.dp_group)  # over the stage's dp x tp ranks
    _, seconds = local_load(model, reset)
    expert_tokens, rank_tokens = [], []
    for i, layer in enumerate(layers):
        p = layer.placement
        slot_load = glob[i, : len(p.slot_expert)].tolist()
        per_expert = [0] * p.num_experts
        for e, n in zip(p.slot_expert, slot_load):
            per_expert[e] += n
        expert_tokens.append(per_expert)
        rank_tokens.append([int(x) for x in p.rank_load(slot_load)])
    return ExpertLoad(expert_tokens, rank_tokens, seconds)


def rebalance_experts(model: nn.Module, load: ExpertLoad, src: TensorSource, redundant: int = 0) -> None:
    """EPLB: re-place every expert layer for ``load`` with ``redundant`` extra slots per
    layer (spread over the ep ranks, rounded up to whole slots per rank). Outputs are
    unchanged; every rank of the stage must call it with the same ``load`` (collect_load's
    result is identical on all of them)."""
    if redundant < 0:
        raise ValueError(f"redundant={redundant} must be >= 0 (extra expert slots per layer)")
    for layer, tokens in zip(expert_layers(model), load.expert_tokens):
        ep = layer.ep
        slots = -(-(len(tokens) + redundant) // ep)
        layer.place(rebalance(tokens, ep, slots), src)
