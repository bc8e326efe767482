"""ZeRO stages 0-3 over the data-parallel ranks (Rajbhandari et al. 2019, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", https://arxiv.org/abs/1910.02054 §5).

The parameters a rank holds (its tp shard of the model) are grouped into units, one per decoder
layer and one for the rest (embedding, final norm, LM head), as FSDP wraps them. A unit's
parameters form one flat vector, split over the dp ranks as evenly as possible; rank r owns
elements [lo, hi) of it, and the optimizer steps on what it owns:

    stage  a rank keeps                       gradients are reduced               after the step
    0      weights, gradients, Adam state     all-reduce per bucket, during       -
                                              backward
    1      weights, gradients, its state      reduce-scatter per bucket, during   all-gather weights
                                              backward
    2      weights, its gradients and state   reduce-scatter per bucket, during   all-gather weights
                                              backward (full gradients freed)
    3      its weights, gradients and state   reduce-scatter per unit, during     -
                                              backward

Stages 0-2 reduce in buckets of whole units (``bucket_mb``), each started asynchronously as
soon as backward has completed its gradients, only in the step's last backward under gradient
accumulation (overlap.py; ``bucket_mb=0``: blocking, stages 0-1 after backward, stage 2 a unit
at a time). Stage 3 gathers a unit's weights for its forward and drops them after; the weights
its backward needs are gathered again when autograd first asks for them (a saved-tensor hook
stands in for each saved weight, so no weight is held between forward and backward). The next
``prefetch`` decoder layers' gathers are in flight while one computes, in forward and in
backward (overlap.py).

Gradients are summed over dp, not averaged: the trainer divides the loss by the global token
count, so a step equals one process's step on the whole batch whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.weak import WeakTensorKeyDictionary

if TYPE_CHECKING:
    from shardlm.models.transformer import Transformer

from shardlm.parallel.comm import all_reduce, group_size, reduce_scatter
from shardlm.parallel.expert import ExpertParallelSwiGLU
from shardlm.train.overlap import Buckets, Prefetch
from shardlm.train.unit import Unit

STAGES = (0, 1, 2, 3)


class _Gather(torch.autograd.Function):
    """forward: all-gather a unit's shards (``fetch``: prefetched or now); backward: reduce-scatter
    the gradient (sum over dp)."""

    @staticmethod
    def forward(ctx, shard: Tensor, unit: Unit, fetch: Callable[[Unit], Tensor]) -> Tensor:
        ctx.unit = unit
        return fetch(unit)

    @staticmethod
    def backward(ctx, grad: Tensor):
        unit = ctx.unit
        unit.regathered = None  # this unit's backward is over: drop its re-gathered weights
        summed = reduce_scatter(grad.float().contiguous(), unit.group, sizes=unit.sizes)  # float32 sum
        return summed.to(unit.shard.dtype), None, None


@dataclass(frozen=True)
class _SavedWeight:
    """Stands in for a saved view of a stage-3 unit's gathered weights."""

    unit: Unit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Sharded(nn.Module):
    """Stage 3: runs ``inner`` (a decoder layer) with its units' weights gathered for the call."""

    def __init__(self, inner: nn.Module, units: list[Unit], zero: Zero):
        super().__init__()
        self.inner = inner
        self._units, self._zero = units, zero

    def forward(self, *args):
        weights = {name: w for unit in self._units for name, w in self._zero.gathered(unit).items()}
        return functional_call(self.inner, weights, args)


class Zero:
    """ZeRO-``stage`` for ``model`` (a Transformer) over ``group``: the ranks that hold the same
    weights and sum their gradients (dp, or dp x cp with context parallelism).

    Construction rewires the model: stages 0-2 move its parameters into flat vectors; stage 3
    replaces each decoder layer by a wrapper that gathers the layer's weights per call. A step:
    ``start_backward``, the forwards through ``forward`` and each backward inside ``backward``,
    ``finish_backward``, the optimizer over ``shards()``, ``after_step``."""

    def __init__(
        self,
        model: Transformer,
        group,
        tp: int,
        stage: int,
        replicated: set[int],
        tied: nn.Parameter | None = None,
        *,
        expert_group=None,
        prefetch: int = 1,
        bucket_mb: float = 25.0,
        offload: bool = False,
    ):
        """``tied``: the embedding a first and a last pipeline stage both hold (tied LM head), kept
        in a unit of its own, laid out alike on both stages, so its gradients can be summed across.
        ``expert_group``: the ranks that hold the same routed-expert slices (dims.edp_cp_group); an
        MoE layer's experts form a unit of their own over it, beside the layer's other weights.
        ``prefetch``: stage 3's layers gathered ahead (0: none); ``bucket_mb``: stages 0-2's gradient
        buckets (0: no overlap); see overlap.py."""
        if stage not in STAGES:
            raise ValueError(
                f"zero={stage!r} is not a ZeRO stage; use one of {STAGES} "
                f"(0: plain data parallel, 1: optimizer state, 2: + gradients, 3: + weights)"
            )
        self.stage, self.model, self.group, self.expert_group = stage, model, group, expert_group
        in_layers = {id(p) for layer in model.layers for p in layer.parameters()}
        outer = [(n, p) for n, p in model.named_parameters() if id(p) not in in_layers]
        unit = lambda named: Unit(named, group, stage, replicated, tp, offload)
        routed = {id(p) for m in model.modules() if isinstance(m, ExpertParallelSwiGLU) for p in (m.w13, m.w2)}

        def layer_units(layer: nn.Module) -> list[Unit]:
            named = list(layer.named_parameters())
            units = [unit([(n, p) for n, p in named if id(p) not in routed])]
            experts = [(n, p) for n, p in named if id(p) in routed]
            if experts:  # summed over the ranks holding the same slices; never whole on every tp rank
                units.append(Unit(experts, expert_group, stage, set(), tp, offload, expert=True))
            return units

        self.layer_units = [layer_units(layer) for layer in model.layers]
        # outside the layers: the embedding, final norm and LM head; the tied embedding apart
        root = [(n, p) for n, p in outer if p is not tied]
        tied_named = [(n, p) for n, p in outer if p is tied]
        self.outer = [unit(named) for named in (root, tied_named) if named]
        self.tied = self.outer[-1] if tied_named else None
        self.units = [u for units in self.layer_units for u in units] + self.outer
        self._owner = WeakTensorKeyDictionary()  # stage 3: gathered flat vector -> its unit
        # in the order backward completes them: the last layer first, the embedding's unit last
        backward_order = [u for units in self.layer_units[::-1] for u in units] + self.outer
        self.buckets = Buckets(backward_order, stage, bucket_mb) if stage < 3 else None
        layers = [units[0] for units in self.layer_units]  # prefetched; experts are gathered when met
        self.prefetch = Prefetch(layers, prefetch if group_size(group) > 1 else 0) if stage == 3 else None
        if stage == 3:
            for i, layer in enumerate(model.layers):
                model.layers[i] = _Sharded(layer, self.layer_units[i], self)

    def start_backward(self) -> None:
        """Call before a step's first backward."""
        for unit in self.units:
            unit.bucket_grads()

    def _span(self, chunk: int) -> range:
        """The indices in model.layers of the layers of ``chunk``."""
        runs = self.model.chunks
        start = sum(len(r) for r in runs[:chunk])
        return range(start, start + len(runs[chunk]))

    @contextmanager
    def backward(self, last: bool, chunk: int = 0) -> Iterator[None]:
        """Around each backward of a step (of ``chunk``'s layers): only the ``last`` one reduces
        gradients (stages 0-2; DDP's no_sync for the others, so a step reduces once whatever its
        micro-batches); stage 3 starts re-gathering the chunk's last layers' weights ahead."""
        if self.prefetch is not None:
            self.prefetch.begin(-1, self._span(chunk))
        if self.buckets is not None:
            self.buckets.reducing = last
        try:
            yield
        finally:
            if self.buckets is not None:
                self.buckets.reducing = False

    def leaves(self) -> list[nn.Parameter]:
        """The tensors autograd accumulates gradients into: the model's parameters (stages 0-2),
        each unit's shard (stage 3, through its gather)."""
        return [u.shard for u in self.units] if self.stage == 3 else [p for u in self.units for p in u.params]

    def shards(self) -> list[nn.Parameter]:
        """What the optimizer steps on: this rank's part of every unit, in float32."""
        return [u.master for u in self.units]

    # ---- forward -------------------------------------------------------------------------
    def gathered(self, unit: Unit) -> dict[str, Tensor]:
        assert self.prefetch is not None  # stage 3
        full = _Gather.apply(unit.shard, unit, self.prefetch.fetch)
        # by the tensor that owns the memory: views of views name it as their _base, and a gathered
        # vector may itself be a view (all_gather's movedim); keyed by ``full``, no saved weight of
        # a multi-rank gather was recognised and backward kept every gathered weight alive
        self._owner[full if full._base is None else full._base] = unit
        return dict(zip(unit.names, unit.views(full)))

    def forward(self, *args, **kwargs):
        if self.stage < 3:
            return self.model(*args, **kwargs)
        assert self.prefetch is not None  # stage 3
        self.prefetch.begin(1, self._span(kwargs.get("chunk", 0)))
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            weights = {name: w for unit in self.outer for name, w in self.gathered(unit).items()}
            return functional_call(self.model, weights, args, kwargs)

    def _pack(self, t: Tensor):
        unit = self._owner.get(t._base) if t._base is not None else None
        if unit is None:
            return t
        return _SavedWeight(unit, t.size(), t.stride(), int(t.storage_offset()))

    def _unpack(self, saved):
        if not isinstance(saved, _SavedWeight):
            return saved
        unit = saved.unit
        if unit.regathered is None:
            assert self.prefetch is not None  # stage 3
            unit.regathered = self.prefetch.fetch(unit)
        return unit.regathered.as_strided(saved.size, saved.stride, saved.offset)

    # ---- backward and step ---------------------------------------------------------------
    def finish_backward(self) -> None:
        """Stages 0-2: wait for the reductions in flight and run those not started; stage 3's
        16-bit shard gradients go to the float32 masters."""
        if self.buckets is not None:
            self.buckets.finish()
        else:
            assert self.prefetch is not None and not self.prefetch.pending  # else next step would use stale weights
            for unit in self.units:
                if unit.master is not unit.shard and unit.shard.grad is not None:
                    unit.accumulate(unit.shard.grad)
                    unit.shard.grad = None
        if any(u.offloaded for u in self.units):
            torch.cuda.synchronize()  # the gradients copied down (non-blocking) are in CPU memory now

    def grad_norm(self, tp_group, pp_group=None, count_tied: bool = True) -> Tensor:
        """The global gradient norm: every element of the model counted once (a tied embedding
        that two pipeline stages hold: on the one with ``count_tied``)."""
        counted = [u for u in self.units if count_tied or u is not self.tied]
        sq = torch.stack([u.grad_sq() for u in counted if not u.expert]).sum()
        if self.stage > 0:  # each rank of the group owns different elements
            all_reduce(sq, self.group)
        experts = [u.grad_sq() for u in counted if u.expert]
        if experts:  # the stage's dp x cp x tp ranks hold each expert slice's gradient once over the
            # expert group (stages 1-3: its parts), every rank of that group (stage 0: whole)
            e = all_reduce(torch.stack(experts).sum(), self.group)
            sq = sq + (e / group_size(self.expert_group) if self.stage == 0 else e)
        return all_reduce(all_reduce(sq, tp_group), pp_group).sqrt()

    def clip(self, max_norm: float, norm: Tensor) -> None:
        """Scale gradients so their global norm (``norm``) is at most ``max_norm``, as
        torch.nn.utils.clip_grad_norm_ does."""
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for unit in self.units:
            assert unit.master.grad is not None  # after finish_backward
            unit.master.grad.mul_(coef)

    def after_step(self) -> None:
        for unit in self.units:
            unit.after_step()

    def scale_grads(self, factor: float) -> None:
        """Multiply every owned gradient (float32) by ``factor`` (float16: undo the loss scale)."""
        for unit in self.units:
            if unit.master.grad is not None:
                unit.master.grad.mul_(factor)

    def drop_grads(self) -> None:
        """Forget this step's gradients without stepping (a float16 step that overflowed)."""
        for unit in self.units:
            unit.master.grad = unit.shard.grad = None

    def load_masters(self, masters: list[Tensor]) -> None:
        """Set this rank's owned part of every unit (as ``shards()`` lists them, float32) and
        rebuild the weights from it, as after an optimizer step (stages 1-2 all-gather)."""
        if [tuple(m.shape) for m in masters] != [tuple(u.master.shape) for u in self.units]:
            raise ValueError("the saved shards do not fit this rank's ZeRO units (a different model or layout)")
        with torch.no_grad():
            for unit, m in zip(self.units, masters):
                unit.master.copy_(m)
        self.after_step()

    @contextmanager
    def full_weights(self):
        """Inside: every parameter of the model holds its whole (tp-shard) value, also at stage 3
        (for saving and checking; gathers everything at once)."""
        if self.stage < 3:
            yield
            return
        for unit in self.units:
            for p, view in zip(unit.params, unit.views(unit.gather())):
                p.data = view
        try:
            yield
        finally:
            for unit in self.units:
                for p in unit.params:
                    p.data = p.data.new_empty(0)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of weights, gradients, float32 masters (mixed precision) and gradient-reduction
        buffers this rank holds now (call right after backward, before ``finish_backward``, to see
        the gradients at their peak). Gradients are those the table says a stage keeps: the full
        ones at stages 0-1, its float32 sums at 2-3 (also those of reductions in flight); the
        buffers are the rest: what reductions in flight send where it is a copy, and at stages
        0-1 the sums beside the full gradients until ``finish_backward`` drops those."""
        weights = sum(u.shard.nbytes if self.stage == 3 or u.flat is None else u.flat.nbytes for u in self.units)
        full = sum(p.grad.nbytes for u in self.units for p in u.params if p.grad is not None)
        summed = sum(u.master.grad.nbytes for u in self.units if u.master.grad is not None)
        summed += sum(u.shard.grad.nbytes for u in self.units if u.master is not u.shard and u.shard.grad is not None)
        in_flight, sent = self.buckets.in_flight_bytes() if self.buckets is not None else (0, 0)
        summed += in_flight
        grads, buffers = (full, summed + sent) if self.stage < 2 else (full + summed, sent)
        masters = sum(u.master.nbytes for u in self.units if u.master is not u.shard)
        return {"weights": weights, "gradients": grads, "masters": masters, "buffers": buffers}
