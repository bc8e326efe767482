"""A ZeRO unit (zero.py): the parameters of one decoder layer (or of the rest of the model) as
one flat vector, split over the ranks that hold the same weights; this rank owns [lo, hi) of it
(Rajbhandari et al. 2019, https://arxiv.org/abs/1910.02054 §5)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardlm.parallel.comm import Pending, all_gather, all_gather_start, group_rank, group_size, split_sizes


class Unit:
    """Parameters flattened as one vector, of which this rank owns elements [lo, hi)."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        group,
        stage: int,
        replicated: set[int],
        tp: int,
        offload: bool = False,
        expert: bool = False,
    ):
        self.expert = expert  # routed experts: ``group`` holds the ranks with the same expert slices
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
        self.flat_grad: Tensor | None = None  # stages 0-1: the gradients' flat buffer during a step
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
        # ZeRO-Offload (Ren et al. 2021, https://arxiv.org/abs/2101.06840): a GPU rank's master and
        # (through the optimizer) its moments live in pinned CPU memory, where the step runs
        self.offloaded = offload and self.shard.device.type != "cpu"
        if self.offloaded:
            self.master = nn.Parameter(self.shard.detach().float().cpu().pin_memory())

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

    def full_grad(self, free: bool) -> Tensor:
        """Stages 0-2: the unit's whole gradient as one flat float32 vector (the flat buffer itself
        in float32); ``free``: the parameters' gradients are dropped (ZeRO-2 once it is sent)."""
        if self.flat_grad is not None:
            g = self.flat_grad
        else:
            g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        if free:
            self.drop_grads()
        return g.float()

    def drop_grads(self) -> None:
        """Forget the full gradients (summed over dp into ``master.grad`` already)."""
        self.flat_grad = None
        for p in self.params:
            p.grad = None

    def accumulate(self, g: Tensor) -> None:
        # offloaded: copied down asynchronously; Zero.finish_backward waits before the step reads it
        g = g.float().to(self.master.device, non_blocking=True)
        if self.master.grad is None:
            self.master.grad = g
        else:
            self.master.grad += g

    def grad_sq(self) -> Tensor:
        """Sum of squares of the gradient elements this rank owns (tp-replicated ones weighted)."""
        g = self.master.grad
        assert g is not None  # after finish_backward
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

    def gather_start(self) -> Pending:
        """``gather`` started asynchronously (prefetch; more than one rank)."""
        return all_gather_start(self.shard.detach(), self.group, sizes=self.sizes)

    def after_step(self) -> None:
        """The updated master into the shard; stages 1-2: every rank's shard back into everyone's
        full weights."""
        if self.master is not self.shard:  # offloaded: up from pinned memory, ahead of the next forward
            self.shard.data.copy_(self.master.detach(), non_blocking=self.offloaded)
        self.master.grad = self.shard.grad = None
        if self.stage in (1, 2) and group_size(self.group) > 1:
            assert self.flat is not None
            self.flat.copy_(all_gather(self.shard.detach(), self.group, sizes=self.sizes))
