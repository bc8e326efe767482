"""ZeRO stages 0-3 over the data-parallel ranks (Rajbhandari et al. 2019, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", https://arxiv.org/abs/1910.02054 §5).

The parameters a rank holds (its tp shard of the model) are grouped into units, one per decoder
layer and one for the rest (embedding, final norm, LM head), as FSDP wraps them. A unit's
parameters form one flat vector, split over the dp ranks as evenly as possible; rank r owns
elements [lo, hi) of it, and the optimizer steps on what it owns:

    stage  a rank keeps                       gradients are reduced            after the step
    0      weights, gradients, Adam state     all-reduce, after backward       -
    1      weights, gradients, its state      reduce-scatter, after backward   all-gather weights
    2      weights, its gradients and state   reduce-scatter per unit, during  all-gather weights
                                              backward (full gradients freed)
    3      its weights, gradients and state   reduce-scatter per unit, during  -
                                              backward

Stage 3 gathers a unit's weights for its forward and drops them after; the weights its
backward needs are gathered again when autograd first asks for them (a saved-tensor hook
stands in for each saved weight, so no weight is held between forward and backward).

Gradients are summed over dp, not averaged: the trainer divides the loss by the global token
count, so a step equals one process's step on the whole batch whatever the split.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.weak import WeakTensorKeyDictionary

if TYPE_CHECKING:
    from shardlm.models.transformer import Transformer

from shardlm.parallel.comm import all_gather, all_reduce, group_rank, group_size, reduce_scatter, split_sizes

STAGES = (0, 1, 2, 3)


class Unit:
    """Parameters flattened as one vector, of which this rank owns elements [lo, hi)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], group, stage: int, replicated: set[int], tp: int):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.group, self.stage = group, stage
        self.numel = sum(p.numel() for p in self.params)
        self.sizes = split_sizes(self.numel, group_size(group))
        rank = group_rank(group)
        self.lo = 0 if stage == 0 else sum(self.sizes[:rank])
        self.hi = self.numel if stage == 0 else self.lo + self.sizes[rank]
        # elements whose gradient every tp rank holds whole (norms, a row-parallel bias): a
        # global gradient norm counts them once, not tp times
        self.tp_weighted: list[tuple[int, int, float]] = []
        offset = 0
        for p in self.params:
            if id(p) in replicated and tp > 1:
                self.tp_weighted.append((offset, offset + p.numel(), 1 / tp))
            offset += p.numel()
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.flat: Tensor | None = None
        self.flat_grad: Tensor | None = None  # stages 0-1: the gradients' flat buffer during backward
        self.regathered: Tensor | None = None  # stage 3: weights gathered again for backward
        if stage == 3:
            self.shard = nn.Parameter(flat[self.lo : self.hi].clone())
            for p in self.params:  # released: a stage-3 rank holds only its shard
                p.data = p.data.new_empty(0)
                p.requires_grad_(False)
        else:
            self.flat = flat
            for p, view in zip(self.params, self.views(flat)):
                p.data = view  # the model's parameters live in the flat vector
            self.shard = nn.Parameter(flat[self.lo : self.hi])  # a view: the optimizer updates the model
        # what the optimizer steps on: the shard itself in float32; for 16-bit weights a float32
        # master copy of it (mixed precision, ZeRO §3: K = 12 bytes of state per parameter)
        wide = self.shard.dtype == torch.float32
        self.master = self.shard if wide else nn.Parameter(self.shard.detach().float())
        self.ready = 0

    def views(self, flat: Tensor) -> list[Tensor]:
        out, offset = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(flat[offset : offset + n].view(shape))
            offset += n
        return out

    # ---- gradients -----------------------------------------------------------------------
    def bucket_grads(self) -> None:
        """Stages 0-1: before backward, point every parameter's gradient into one flat buffer
        (autograd then accumulates in place, as DDP's gradient_as_bucket_view does), so the
        reduction needs no copy."""
        if self.stage < 2 and self.flat_grad is None:
            assert self.flat is not None  # stages 0-2 keep the full flat weights
            self.flat_grad = torch.zeros_like(self.flat)
            for p, view in zip(self.params, self.views(self.flat_grad)):
                p.grad = view

    def reduce_grads(self) -> None:
        """Sum the unit's gradients over dp (in float32) into ``master.grad``; free the full ones."""
        if self.flat_grad is not None:
            g, self.flat_grad = self.flat_grad, None
        else:
            g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        for p in self.params:
            p.grad = None
        g = g.float()
        mine = all_reduce(g, self.group) if self.stage == 0 else reduce_scatter(g, self.group, sizes=self.sizes)
        self.accumulate(mine)
        self.ready = 0

    def accumulate(self, g: Tensor) -> None:
        g = g.float()
        if self.master.grad is None:
            self.master.grad = g
        else:
            self.master.grad += g

    def param_ready(self) -> None:
        """Stage 2: one more parameter's gradient is complete; reduce once all of them are."""
        self.ready += 1
        if self.ready == len(self.params):
            self.reduce_grads()

    def grad_sq(self) -> Tensor:
        """Sum of squares of the gradient elements this rank owns (tp-replicated ones weighted)."""
        g = self.master.grad
        assert g is not None  # after reduce_grads
        total = torch.linalg.vector_norm(g) ** 2
        for a, b, w in self.tp_weighted:
            a, b = max(a, self.lo), min(b, self.hi)
            if a < b:
                total -= (1 - w) * torch.linalg.vector_norm(g[a - self.lo : b - self.lo]) ** 2
        return total

    # ---- weights -------------------------------------------------------------------------
    def gather(self) -> Tensor:
        """The whole flat weight vector from every rank's shard (a new tensor)."""
        full = all_gather(self.shard.detach(), self.group, sizes=self.sizes)
        return full.clone() if group_size(self.group) == 1 else full  # one rank: all_gather returns its input

    def after_step(self) -> None:
        """The updated master into the shard; stages 1-2: every rank's shard back into everyone's
        full weights."""
        if self.master is not self.shard:
            self.shard.data.copy_(self.master.detach())
        self.master.grad = self.shard.grad = None
        if self.stage in (1, 2) and group_size(self.group) > 1:
            assert self.flat is not None
            self.flat.copy_(all_gather(self.shard.detach(), self.group, sizes=self.sizes))


class _Gather(torch.autograd.Function):
    """forward: all-gather a unit's shards; backward: reduce-scatter the gradient (sum over dp)."""

    @staticmethod
    def forward(ctx, shard: Tensor, unit: Unit) -> Tensor:
        ctx.unit = unit
        return unit.gather()

    @staticmethod
    def backward(ctx, grad: Tensor):
        unit = ctx.unit
        unit.regathered = None  # this unit's backward is over: drop its re-gathered weights
        summed = reduce_scatter(grad.float().contiguous(), unit.group, sizes=unit.sizes)  # float32 sum
        return summed.to(unit.shard.dtype), None


@dataclass(frozen=True)
class _SavedWeight:
    """Stands in for a saved view of a stage-3 unit's gathered weights."""

    unit: Unit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Sharded(nn.Module):
    """Stage 3: runs ``inner`` (a decoder layer) with its unit's weights gathered for the call."""

    def __init__(self, inner: nn.Module, unit: Unit, zero: Zero):
        super().__init__()
        self.inner = inner
        self._unit, self._zero = unit, zero

    def forward(self, *args):
        return functional_call(self.inner, self._zero.gathered(self._unit), args)


class Zero:
    """ZeRO-``stage`` for ``model`` (a Transformer) over ``group``: the ranks that hold the same
    weights and sum their gradients (dp, or dp x cp with context parallelism).

    Construction rewires the model: stages 0-2 move its parameters into flat vectors; stage 3
    replaces each decoder layer by a wrapper that gathers the layer's weights per call. A step:
    ``start_backward``, the forward through ``forward`` and backward, ``finish_backward``, the
    optimizer over ``shards()``, ``after_step``."""

    def __init__(
        self, model: Transformer, group, tp: int, stage: int, replicated: set[int], tied: nn.Parameter | None = None
    ):
        """``tied``: the embedding a first and a last pipeline stage both hold (tied LM head), kept
        in a unit of its own, laid out alike on both stages, so its gradients can be summed across."""
        if stage not in STAGES:
            raise ValueError(
                f"zero={stage!r} is not a ZeRO stage; use one of {STAGES} "
                f"(0: plain data parallel, 1: optimizer state, 2: + gradients, 3: + weights)"
            )
        self.stage, self.model = stage, model
        in_layers = {id(p) for layer in model.layers for p in layer.parameters()}
        outer = [(n, p) for n, p in model.named_parameters() if id(p) not in in_layers]
        self.units = [Unit(list(layer.named_parameters()), group, stage, replicated, tp) for layer in model.layers]
        # outside the layers: the embedding, final norm and LM head; the tied embedding apart
        root = [(n, p) for n, p in outer if p is not tied]
        tied_named = [(n, p) for n, p in outer if p is tied]
        self.outer = [Unit(named, group, stage, replicated, tp) for named in (root, tied_named) if named]
        self.tied = self.outer[-1] if tied_named else None
        self.units += self.outer
        self._owner = WeakTensorKeyDictionary()  # stage 3: gathered flat vector -> its unit
        if stage == 2:
            for unit in self.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda _, u=unit: u.param_ready())
        if stage == 3:
            for i, layer in enumerate(model.layers):
                model.layers[i] = _Sharded(layer, self.units[i], self)

    def start_backward(self) -> None:
        """Call before a step's first backward."""
        for unit in self.units:
            unit.bucket_grads()

    def shards(self) -> list[nn.Parameter]:
        """What the optimizer steps on: this rank's part of every unit, in float32."""
        return [u.master for u in self.units]

    # ---- forward -------------------------------------------------------------------------
    def gathered(self, unit: Unit) -> dict[str, Tensor]:
        full = _Gather.apply(unit.shard, unit)
        # by the tensor that owns the memory: views of views name it as their _base, and a gathered
        # vector may itself be a view (all_gather's movedim); keyed by ``full``, no saved weight of
        # a multi-rank gather was recognised and backward kept every gathered weight alive
        self._owner[full if full._base is None else full._base] = unit
        return dict(zip(unit.names, unit.views(full)))

    def forward(self, *args, **kwargs):
        if self.stage < 3:
            return self.model(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            weights = {name: w for unit in self.outer for name, w in self.gathered(unit).items()}
            return functional_call(self.model, weights, args, kwargs)

    def _pack(self, t: Tensor):
        unit = self._owner.get(t._base) if t._base is not None else None
        if unit is None:
            return t
        return _SavedWeight(unit, t.size(), t.stride(), int(t.storage_offset()))

    @staticmethod
    def _unpack(saved):
        if not isinstance(saved, _SavedWeight):
            return saved
        unit = saved.unit
        if unit.regathered is None:
            unit.regathered = unit.gather()
        return unit.regathered.as_strided(saved.size, saved.stride, saved.offset)

    # ---- backward and step ---------------------------------------------------------------
    def finish_backward(self) -> None:
        """Reduce what backward has not reduced yet (stages 0-1: everything, at once); stage 3's
        16-bit shard gradients go to the float32 masters."""
        for unit in self.units:
            if self.stage < 3 and (self.stage < 2 or unit.ready):
                unit.reduce_grads()
            elif self.stage == 3 and unit.master is not unit.shard and unit.shard.grad is not None:
                unit.accumulate(unit.shard.grad)
                unit.shard.grad = None

    def grad_norm(self, tp_group, pp_group=None, count_tied: bool = True) -> Tensor:
        """The global gradient norm: every element of the model counted once (a tied embedding
        that two pipeline stages hold: on the one with ``count_tied``)."""
        sq = torch.stack([u.grad_sq() for u in self.units if count_tied or u is not self.tied]).sum()
        if self.stage > 0:  # each rank of the group owns different elements
            all_reduce(sq, self.units[0].group)
        return all_reduce(all_reduce(sq, tp_group), pp_group).sqrt()

    def clip(self, max_norm: float, norm: Tensor) -> None:
        """Scale gradients so their global norm (``norm``) is at most ``max_norm``, as
        torch.nn.utils.clip_grad_norm_ does."""
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for unit in self.units:
            assert unit.master.grad is not None  # after reduce_grads
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
        """Bytes of weights, gradients and float32 masters (mixed precision) this rank holds now
        (call right after backward, before ``finish_backward``, to see the gradients at their peak)."""
        weights = sum(u.shard.nbytes if self.stage == 3 or u.flat is None else u.flat.nbytes for u in self.units)
        grads = sum(p.grad.nbytes for u in self.units for p in u.params if p.grad is not None)
        grads += sum(u.master.grad.nbytes for u in self.units if u.master.grad is not None)
        grads += sum(u.shard.grad.nbytes for u in self.units if u.master is not u.shard and u.shard.grad is not None)
        masters = sum(u.master.nbytes for u in self.units if u.master is not u.shard)
        return {"weights": weights, "gradients": grads, "masters": masters}
