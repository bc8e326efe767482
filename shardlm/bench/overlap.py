"""Can tensor-parallel decode hide its all-reduces behind compute? Measured, per path.

A stand-in for SmolLM2's decoder at tp=2 on each rank (30 layers; per layer the rank's
shards of QKV, O, gate/up and down as float32 products on [batch, 576], and an all-reduce
of [batch, 576] after O and after down, as RowParallelLinear does) runs as:

* ``compute``: no communication at all (the floor);
* ``sync``: all-reduce where the layer needs it, waited on at once (what shardlm does);
* ``tbo``: two-batch overlap (SGLang): the batch split in halves A and B; A's all-reduce
  is started, B computes, then A's result is waited on, and so on, so each wait has the
  other half's compute in front of it (shared memory: ``ShmGroup.all_reduce_start``;
  gloo: ``async_op=True``, whose work runs on gloo's own thread).

``exposed = sync - compute`` is the most any overlap could win.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

HIDDEN, QKV, O_IN, GATE_UP, DOWN_IN, LAYERS = 576, 448, 320, 1536, 768, 30


def _weights(seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    w = lambda o, i: torch.randn(o, i, generator=g) * i**-0.5
    return [(w(QKV, HIDDEN), w(HIDDEN, O_IN), w(GATE_UP, HIDDEN), w(HIDDEN, DOWN_IN)) for _ in range(LAYERS)]


def _attn(h, wq, wo):
    return (h @ wq.t())[:, :O_IN] @ wo.t()  # [b, 576]


def _mlp(h, wg, wd):
    gu = h @ wg.t()  # [b, 1536]
    return (torch.nn.functional.silu(gu[:, :DOWN_IN]) * gu[:, DOWN_IN:]) @ wd.t()  # [b, 576]


def _step_sync(x, layers, reduce):
    for wq, wo, wg, wd in layers:
        x = x + reduce(_attn(x, wq, wo))
        x = x + reduce(_mlp(x, wg, wd))
    return x


def _step_tbo(x, layers, start):
    """Halves a and b alternate: a's all-reduce runs while b computes and the other way round."""
    subs = [(f, w1, w2) for wq, wo, wg, wd in layers for f, w1, w2 in ((_attn, wq, wo), (_mlp, wg, wd))]
    a, b = (t.contiguous() for t in x.chunk(2))
    f, w1, w2 = subs[0]
    wait_a = start(f(a, w1, w2))
    pb = f(b, w1, w2)
    for i in range(len(subs)):
        a = a + wait_a()
        wait_b = start(pb)  # b's all-reduce i runs while a computes sub-layer i + 1
        last = i + 1 == len(subs)
        if not last:
            f, w1, w2 = subs[i + 1]
            pa = f(a, w1, w2)
        b = b + wait_b()
        if not last:
            wait_a = start(pa)  # a's all-reduce i + 1 runs while b computes it
            pb = f(b, w1, w2)
    return torch.cat([a, b])


def _starter(path: str, group, fast):
    if path == "shm":
        return fast.all_reduce_start

    def start(t):
        work = dist.all_reduce(t, group=group, async_op=True)
        return lambda: (work.wait(), t)[1]

    return start


def measure_overlap(batches=(1, 8, 64), repeats: int = 5, steps: int = 3) -> list[dict]:
    """ms per decode step for each (path, batch, variant); run on every rank of a 2-rank world."""
    from shardlm.parallel import comm, shm

    world = dist.group.WORLD
    layers = _weights(dist.get_rank())
    rows = []
    for path in ("shm", "gloo"):
        group = dist.new_group(list(range(dist.get_world_size())))
        fast = shm.set_backend(group, path)
        start = _starter(path, group, fast)
        reduce = lambda t: comm.all_reduce(t, group)
        for b in batches:
            x = torch.randn(b, HIDDEN) * 0.01
            variants = {
                "compute": lambda: _step_sync(x, layers, lambda t: t),
                "sync": lambda: _step_sync(x, layers, reduce),
            }
            if b > 1:
                variants["tbo"] = lambda: _step_tbo(x, layers, start)
            best = dict.fromkeys(variants, float("inf"))
            for fn in variants.values():
                fn()
            for _ in range(repeats):  # variants in turns: a burst of outside load hits them alike
                for name, fn in variants.items():
                    dist.barrier(group=world)
                    t = time.perf_counter()
                    for _ in range(steps):
                        fn()
                    took = torch.tensor([(time.perf_counter() - t) / steps])
                    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=world)
                    best[name] = min(best[name], took.item())
            rows += [dict(path=path, batch=b, variant=name, ms=t * 1e3) for name, t in best.items()]
    return rows


def overlap_table(rows: list[dict]) -> str:
    by = {(r["path"], r["batch"], r["variant"]): r["ms"] for r in rows}
    lines = [f"{'path':<5} {'batch':>5} {'compute ms':>10} {'sync ms':>8} {'exposed':>8} {'tbo ms':>7} {'tbo/sync':>8}"]
    for path, b in dict.fromkeys((r["path"], r["batch"]) for r in rows):
        c, s, t = by[(path, b, "compute")], by[(path, b, "sync")], by.get((path, b, "tbo"))
        tbo = f"{t:>7.2f} {s / t:>7.2f}x" if t else f"{'-':>7} {'-':>8}"
        lines.append(f"{path:<5} {b:>5} {c:>10.2f} {s:>8.2f} {(s - c) / s:>7.0%} {tbo}")
    return "\n".join(lines)
