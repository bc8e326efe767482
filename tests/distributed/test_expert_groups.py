"""The folded expert groups built on real ranks equal the pure ``ParallelDims.group_ranks`` ones
(tests/unit/test_moe_units.py checks the pure ones)."""

from __future__ import annotations

from harness.moe_reference import FOLDS
from harness.multirank import run_ranks
from shardlm.parallel.dims import EXPERT_GROUPS, ParallelDims


def built_groups(layouts):
    """On a rank: for each layout, {kind: member ranks of this rank's group, or None}."""
    import torch.distributed as dist

    from harness.multirank import dims

    out = []
    for kw in layouts:
        d = dims(**kw)
        out.append(
            {
                k: (None if d.expert_group(k) is None else dist.get_process_group_ranks(d.expert_group(k)))
                for k in EXPERT_GROUPS
            }
        )
    return out


def test_built_groups_match_the_pure_ones():
    layouts = [kw for kw in FOLDS if ParallelDims(**kw).world_size == 4]
    results = run_ranks(4, built_groups, layouts)
    for rank, per_layout in enumerate(results):
        for kw, got in zip(layouts, per_layout):
            dims = ParallelDims(**kw)
            for kind in EXPERT_GROUPS:
                mine = next(g for g in dims.group_ranks(kind) if rank in g)
                assert got[kind] == (None if len(mine) == 1 else mine), (kw, kind, rank)
