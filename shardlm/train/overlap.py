"""ZeRO's communication overlapped with compute (used by zero.py).

* Gradient buckets, stages 0-2, as PyTorch DDP's (Li et al. 2020, "PyTorch Distributed:
  Experiences on Accelerating Data Parallel Training", https://arxiv.org/abs/2006.15704 §3.2):
  units, in the order backward completes them (the last decoder layer first, the embedding's unit
  last), are grouped into buckets of about ``bucket_mb``. A post-accumulate-grad hook counts each
  parameter's gradient; once a bucket's are all complete, its reduction (all-reduce at stage 0,
  one reduce-scatter at stages 1-2) starts asynchronously while backward goes on, and ``finish``
  waits for every one. Under gradient accumulation only the step's last backward reduces (DDP's
  ``no_sync`` for the others): a step sums its gradients over dp once, not once per micro-batch.
* Prefetch, stage 3, as FSDP's forward and backward prefetching (Zhao et al. 2023, "PyTorch
  FSDP", https://arxiv.org/abs/2304.11277 §3.4): while a decoder layer computes, the all-gathers
  of the next ``depth`` layers' weights (forward: the following ones; backward: the preceding
  ones, whose re-gathered weights backward needs next) are in flight, and a layer waits on its own
  when it starts.

The asynchronous collectives go through torch.distributed (``comm.*_start``: gloo's own threads,
NCCL's stream); what waits at once keeps the blocking ones (on one host, the shared-memory path).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from shardlm.parallel.comm import (
    Pending,
    all_reduce,
    all_reduce_start,
    group_size,
    reduce_scatter,
    reduce_scatter_start,
)

if TYPE_CHECKING:
    from shardlm.train.unit import Unit

IN_FLIGHT = 2
"""Bucket reductions in flight at once; starting another first waits for the oldest. What a
reduction sends is a copy of its gradients (the full ones at ZeRO-2, freed once sent), so this
bounds the memory overlap adds (DeepSpeed's overlap_comm double-buffers likewise)."""


class Bucket:
    """Whole units whose gradients are reduced together, in one collective."""

    def __init__(self, units: list[Unit]):
        self.units = units
        self.params = sum(len(u.params) for u in units)
        self.ready = 0  # parameters whose gradient is complete in this step's last backward
        self.done = False  # reduced this step
        self.result: Pending | Tensor | None = None  # the reduction, once started
        self.sent: Tensor | None = None  # what it sends, while in flight

    def start(self, stage: int, overlap: bool) -> None:
        """Start the reduction of the bucket's (complete) gradients: asynchronous with ``overlap``."""
        group = self.units[0].group
        grads = [u.full_grad(free=stage == 2) for u in self.units]  # float32 [numel] each
        if stage == 0:
            send = grads[0] if len(grads) == 1 else torch.cat(grads)
            self.result = all_reduce_start(send, group) if overlap else all_reduce(send, group)
        else:
            n = group_size(group)
            send = grads[0] if len(grads) == 1 else torch.cat([c for r in range(n) for c in self._chunks(grads, r)])
            sizes = [sum(u.sizes[r] for u in self.units) for r in range(n)]
            if overlap:
                self.result = reduce_scatter_start(send, group, sizes=sizes)
            else:
                self.result = reduce_scatter(send, group, sizes=sizes)
        self.sent = send

    def _chunks(self, grads: list[Tensor], r: int) -> list[Tensor]:
        """Rank r's chunk of each unit's gradient. Laid out rank by rank (rank-major), one
        reduce-scatter hands each rank its own chunk of every unit of the bucket."""
        out = []
        for unit, g in zip(self.units, grads):
            start = sum(unit.sizes[:r])
            out.append(g[start : start + unit.sizes[r]])
        return out

    def retire(self, stage: int) -> None:
        """Wait for the reduction; each unit's summed part goes to its master's gradient."""
        assert self.result is not None  # started
        out = self.result if isinstance(self.result, Tensor) else self.result.wait()
        sizes = [u.numel if stage == 0 else u.hi - u.lo for u in self.units]
        for unit, g in zip(self.units, out.split(sizes)):
            unit.accumulate(g)
        self.result = self.sent = None
        self.done = True


class Buckets:
    """Stages 0-2: every gradient summed over dp once a step, in buckets of ``bucket_mb``
    started as soon as backward completes them (``bucket_mb=0``: no overlap, each unit alone and
    blocking: stages 0-1 after backward, stage 2 as the unit's gradients complete)."""

    def __init__(self, units: list[Unit], stage: int, bucket_mb: float):
        self.stage, self.overlap = stage, bucket_mb > 0
        cap = bucket_mb * 2**20
        self.buckets: list[Bucket] = []
        current: list[Unit] = []
        for unit in units:  # a bucket is reduced in one collective: its units share a group
            if current and (4 * sum(u.numel for u in current + [unit]) > cap or unit.group is not current[0].group):
                self.buckets.append(Bucket(current))
                current = []
            current.append(unit)
        self.buckets.append(Bucket(current))
        for bucket in self.buckets:
            for unit in bucket.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda _, b=bucket: self._ready(b))
        self.reducing = False  # whether this backward is the step's last one
        self.in_flight: deque[Bucket] = deque()

    def _ready(self, bucket: Bucket) -> None:
        """One more of the bucket's parameters has its gradient for the step (last backward only)."""
        if not self.reducing:
            return
        bucket.ready += 1
        if bucket.ready == bucket.params and (self.overlap or self.stage == 2):
            if len(self.in_flight) == IN_FLIGHT:
                self.in_flight.popleft().retire(self.stage)
            bucket.start(self.stage, self.overlap)
            if self.overlap:
                self.in_flight.append(bucket)
            else:
                bucket.retire(self.stage)

    def finish(self) -> None:
        """After the step's backwards: reduce what has not started (a gradient that never came, or
        no overlap), wait for what is in flight, drop the full gradients."""
        while self.in_flight:
            self.in_flight.popleft().retire(self.stage)
        for bucket in self.buckets:
            if not bucket.done:
                bucket.start(self.stage, overlap=False)
                bucket.retire(self.stage)
            bucket.ready, bucket.done = 0, False
            for unit in bucket.units:
                unit.drop_grads()

    def in_flight_bytes(self) -> tuple[int, int]:
        """(this rank's float32 sums of the reductions in flight, what they send where that is a
        copy and not the gradients themselves)."""
        summed = sum(4 * (u.hi - u.lo) for b in self.in_flight for u in b.units) if self.stage > 0 else 0
        sent = sum(b.sent.nbytes for b in self.in_flight if b.sent is not None and b.sent is not b.units[0].flat_grad)
        return summed, sent


class Prefetch:
    """Stage 3: keeps the all-gathers of the next ``depth`` decoder layers (``layers``, in forward
    order) in flight in the direction of the pass; ``fetch`` gives a unit's gathered weights."""

    def __init__(self, layers: list[Unit], depth: int):
        self.layers, self.depth = layers, depth
        self.index = {u: i for i, u in enumerate(layers)}
        self.pending: dict[Unit, Pending] = {}  # gathers in flight
        self.step = 1  # +1 in forward, -1 in backward
        self.span = range(len(layers))  # the layers of the pass

    def begin(self, step: int, span: range | None = None) -> None:
        """A pass over the layers ``span`` (indices into ``layers``; all of them by default, a
        chunk's under the interleaved schedule) starts: forward (+1) from its first layer,
        backward (-1) from its last."""
        self.step, self.span = step, span if span is not None else range(len(self.layers))
        self._ahead(self.span.start - 1 if step > 0 else self.span.stop)

    def fetch(self, unit: Unit) -> Tensor:
        """The unit's whole flat weights: its gather in flight, else gathered now; then the
        gathers of the next ``depth`` layers are started (the one just taken no longer counts)."""
        pending = self.pending.pop(unit, None)
        full = pending.wait() if pending is not None else unit.gather()
        if unit in self.index:
            self._ahead(self.index[unit])
        return full

    def _ahead(self, i: int) -> None:
        for j in range(i + self.step, i + self.step * (self.depth + 1), self.step):
            if j in self.span and self.layers[j] not in self.pending:
                self.pending[self.layers[j]] = self.layers[j].gather_start()
