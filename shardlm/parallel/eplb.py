"""Where experts live: a placement of logical experts into the slots of the ep ranks, and
expert-parallel load balancing (EPLB) that picks one from observed load.

A placement gives each ep rank a list of slots, each holding one logical expert's
weights. Every expert has at least one slot; a hot expert may have several
(replicas, identical weights), and the dispatcher spreads that expert's tokens over
them round-robin. Replicas change where a token is computed, never what it computes,
so outputs are unchanged by any placement.

The balancing follows DeepSeek's EPLB (https://github.com/deepseek-ai/EPLB, the
"replicate, then pack" steps of its balanced placement): give the spare slots one by
one to the expert with the highest load per replica, then pack replicas, heaviest
first, onto the least-loaded rank that still has a free slot and does not already
hold that expert (the longest-processing-time greedy rule).

Everything here is pure: no process group, no tensors beyond small index tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardlm.parallel.collectives import split_sizes
from shardlm.parallel.dims import LayoutError


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    """Logical experts of the layer (the router's choices)."""
    slots: tuple[tuple[int, ...], ...]
    """slots[r]: the logical expert held in each slot of ep rank r, in slot order."""

    def __post_init__(self) -> None:
        held = {e for rank in self.slots for e in rank}
        if not self.slots or any(len(r) == 0 for r in self.slots):
            raise LayoutError(
                f"every ep rank needs at least one expert slot; got slots per rank {[len(r) for r in self.slots]}"
            )
        bad = sorted(e for e in held if not 0 <= e < self.num_experts)
        missing = sorted(set(range(self.num_experts)) - held)
        if bad or missing:
            raise LayoutError(
                f"a placement must hold every expert 0..{self.num_experts - 1} at least once "
                f"and nothing else; missing {missing}, out of range {bad}"
            )

    @classmethod
    def contiguous(cls, num_experts: int, ep: int) -> ExpertPlacement:
        """The default: rank r holds a contiguous run of experts (the first E % ep ranks one more)."""
        if ep > num_experts:
            valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise LayoutError(
                f"ep={ep} is larger than the model's {num_experts} experts: every expert-parallel rank "
                f"needs at least one expert; use ep <= {num_experts} (even splits: {valid})"
            )
        sizes, start, slots = split_sizes(num_experts, ep), 0, []
        for n in sizes:
            slots.append(tuple(range(start, start + n)))
            start += n
        return cls(num_experts, tuple(slots))

    # ---- derived ---------------------------------------------------------------------
    @property
    def ep(self) -> int:
        return len(self.slots)

    @property
    def slot_expert(self) -> list[int]:
        """The logical expert of every global slot (rank r's slots numbered after rank r-1's)."""
        return [e for rank in self.slots for e in rank]

    @property
    def slot_rank(self) -> list[int]:
        return [r for r, rank in enumerate(self.slots) for _ in rank]

    @property
    def slot_offsets(self) -> list[int]:
        """Global index of each rank's first slot."""
        out, n = [], 0
        for rank in self.slots:
            out.append(n)
            n += len(rank)
        return out

    def replicas(self, expert: int) -> list[int]:
        """The global slots holding ``expert``."""
        return [s for s, e in enumerate(self.slot_expert) if e == expert]

    def tables(self, device=None) -> dict[str, torch.Tensor]:
        """Index tables for the dispatcher: replica_slots [E, max replicas] (padded with the
        first replica), num_replicas [E], slot_rank [S], slot_local [S] (index on its rank)."""
        reps = [self.replicas(e) for e in range(self.num_experts)]
        width = max(len(r) for r in reps)
        local = [i for rank in self.slots for i in range(len(rank))]
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)
        return {
            "replica_slots": as_long([r + [r[0]] * (width - len(r)) for r in reps]),
            "num_replicas": as_long([len(r) for r in reps]),
            "slot_rank": as_long(self.slot_rank),
            "slot_local": as_long(local),
        }

    def rank_load(self, slot_load: Sequence[float]) -> list[float]:
        """Load of each ep rank given the load of each global slot."""
        out = [0.0] * self.ep
        for r, x in zip(self.slot_rank, slot_load):
            out[r] += float(x)
        return out


def imbalance(rank_load: Sequence[float]) -> float:
    """max / mean of per-rank load: 1.0 is perfect balance, ep means one rank does everything."""
    total = float(sum(rank_load))
    return max(rank_load) * len(rank_load) / total if total > 0 else 1.0


def rebalance(load: Sequence[float], ep: int, slots_per_rank: int) -> ExpertPlacement:
    """A placement of ``len(load)`` experts into ``ep * slots_per_rank`` slots that evens out
    the expected per-rank load, given each expert's observed load (e.g. tokens routed)."""
    num_experts = len(load)
    total_slots = ep * slots_per_rank
    if total_slots < num_experts:
        need = -(-num_experts // ep)
        raise LayoutError(
            f"slots_per_rank={slots_per_rank} x ep={ep} = {total_slots} slots cannot hold "
            f"{num_experts} experts; use slots_per_rank >= {need}"
        )
    load = [float(x) for x in load]
    # 1. replicate: each spare slot goes to the expert with the most load per replica
    replicas = [1] * num_experts
    for _ in range(total_slots - num_experts):
        e = max(range(num_experts), key=lambda i: (load[i] / replicas[i], -i))
        replicas[e] += 1
    # 2. pack: heaviest replica first onto the least-loaded rank with room that lacks that expert
    items = sorted(
        ((load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
        key=lambda t: (-t[0], t[1]),
    )
    rank_load = [0.0] * ep
    slots: list[list[int]] = [[] for _ in range(ep)]
    for w, e in items:
        free = [r for r in range(ep) if len(slots[r]) < slots_per_rank]
        fresh = [r for r in free if e not in slots[r]] or free  # a replica on the same rank is useless
        r = min(fresh, key=lambda i: (rank_load[i], len(slots[i]), i))
        slots[r].append(e)
        rank_load[r] += w
    return ExpertPlacement(num_experts, tuple(tuple(sorted(s)) for s in slots))
