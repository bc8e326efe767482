"""Expert parallelism: routed SwiGLU experts spread over the ep x etp ranks, with dispatch and
combine (GShard, Lepikhin et al. 2020, https://arxiv.org/abs/2006.16668, sec. 2.2; expert
tensor parallelism and "parallel folding" as in Megatron-Core, https://arxiv.org/abs/2504.14960).

Expert layers re-fold the dp x tp ranks of a stage as edp x ep x etp (see ``dims.py``): ep
rank r holds the experts of ``placement.slots[r]`` whole, etp rank t holds rows
``shard_range(I, etp, t)`` of each of them (gate/up rows, down columns), and the edp ranks
are copies. Tokens arrive as attention leaves them: replicated over tp, different per dp
rank. The router has already run there (it is cheap and replicated), so every rank of a
tp group holds the same top-k choices. Two ways to reach the experts:

* ``replicated``, when the ep x etp ranks that hold one copy of every expert lie inside a
  tp group (ep * etp divides tp): they all hold every token already, so each computes its
  own experts' share for all tokens, and one all-reduce over those ranks sums the shares,
  exactly as a tensor-parallel MLP does. No token moves; an all-to-all would only send
  tokens to ranks that have them.
* ``all_to_all`` otherwise (the expert group spans dp replicas, which hold different
  tokens): each tp rank takes its 1/tp of the tokens (so no token is sent twice), the etp
  ranks of an expert share theirs (all-gather), every (token, choice) pair goes to the ep
  rank of its expert's slot (all-to-all with per-rank counts, nothing dropped), is
  computed, comes back (the reverse all-to-all) and is weighted and summed; the etp
  partial sums are reduce-scattered and the tp group all-gathers its tokens again.

A rank with no tokens (an idle dp replica) passes a [0, hidden] batch and still joins
every collective with zero counts, so the ranks' collectives always match.

Each layer counts, per slot, the (token, expert) pairs it computes (``slot_tokens``) and
the seconds spent in collectives (``comm_s``); ``expert_stats.py`` reads them.

Training: the token rows and the routing weights enter through regions whose backward completes
their gradients (``replicated``: summed over the ep x etp block, which splits the pairs; ``all_to_all``:
each tp rank's share gathered back), so the router's and the residual stream's gradients are
whole on every tp rank; the all-to-alls' backward is the reverse all-to-all. An expert slice's
gradient is this rank's pairs' share; the trainer sums it over the ranks that hold the same slice
(``edp_cp_group``). In the replicated path every ep x etp block of a tp group computes the same
pairs, so each block's weight gradient is scaled by ``1 / blocks`` first (``duplicates``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.parallel import comm
from shardlm.parallel.dims import LayoutError, ParallelDims
from shardlm.parallel.eplb import ExpertPlacement
from shardlm.parallel.tensor import TensorSource, linear, shard_range

# (source, logical expert, intermediate rows) -> (gate [rows, H], up [rows, H], down [H, rows])
ExpertReader = Callable[[TensorSource, int, slice], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# (source, logical expert) -> the checkpoint names of its (gate [I, H], up [I, H], down [H, I]) tensors
ExpertNames = Callable[[TensorSource, int], tuple[str, str, str]]
DISPATCH = ("auto", "replicated", "all_to_all")


def experts_span_replicas(tp: int, ep: int, etp: int) -> bool:
    """Whether the ep x etp ranks holding one copy of every expert reach beyond one tp group
    (ep * etp does not divide tp), so tokens go to them by all-to-all across dp replicas."""
    return tp % (ep * etp) != 0


class ExpertParallelSwiGLU(nn.Module):
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's top-k experts e."""

    # buffers registered by _alloc (the placement's tables, ExpertPlacement.tables, and the counter)
    replica_slots: torch.Tensor  # [experts, max replicas] long
    num_replicas: torch.Tensor  # [experts] long
    slot_rank: torch.Tensor  # [slots] long
    slot_local: torch.Tensor  # [slots] long
    slot_tokens: torch.Tensor  # [local slots] long: (token, choice) pairs computed per slot

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        read: ExpertReader,
        names: ExpertNames,
        dims: ParallelDims,
        dtype: torch.dtype,
        placement: ExpertPlacement | None = None,
        dispatch: str = "auto",
    ):
        super().__init__()
        if dims.etp > intermediate_size:
            raise LayoutError(
                f"etp={dims.etp} is larger than the expert width {intermediate_size}; use etp <= {intermediate_size}"
            )
        self.read, self.names, self.hidden, self.dtype = read, names, hidden_size, dtype
        self.tensor_names: dict[int, tuple[str, str, str]] = {}  # logical expert -> its checkpoint names (load)
        self.ep, self.etp, self.tp = dims.ep, dims.etp, dims.tp
        self.ep_rank, self.etp_rank, self.tp_rank = dims.ep_rank, dims.etp_rank, dims.tp_rank
        self.tp_group, self.ep_group = dims.tp_group, dims.ep_group
        self.etp_group, self.block_group = dims.etp_group, dims.ep_etp_group
        self.stage_index = dims.dp_rank * dims.tp + dims.tp_rank  # unique per rank of the stage
        self.rows = shard_range(intermediate_size, dims.etp, self.etp_rank)
        # The ep x etp ranks holding one copy of every expert lie inside one tp group exactly
        # when ep * etp divides tp (etp innermost, then ep; see dims.py). Then they already hold
        # the same tokens, and summing their shares (one all-reduce) is cheaper than sending
        # tokens to ranks that have them. Otherwise they span dp replicas: all-to-all.
        inside_tp = not experts_span_replicas(dims.tp, dims.ep, dims.etp)
        if dispatch not in DISPATCH or (dispatch == "replicated" and not inside_tp):
            raise LayoutError(
                f"dispatch={dispatch!r} cannot work here: 'replicated' needs ep*etp="
                f"{dims.ep * dims.etp} to divide tp={dims.tp}; use 'auto' or 'all_to_all'"
            )
        self.dispatch = ("replicated" if inside_tp else "all_to_all") if dispatch == "auto" else dispatch
        # blocks of a tp group that compute the same pairs (replicated path; see the module docstring)
        self.duplicates = dims.tp // (dims.ep * dims.etp) if self.dispatch == "replicated" else 1
        # Each (token, expert) pair is computed by etp ranks, and in the replicated path by every
        # ep x etp block of the tp group: one of those copies counts it, so sums over ranks are exact.
        first_block = self.dispatch == "all_to_all" or dims.tp_rank < dims.ep * dims.etp
        self.counts_once = first_block and self.etp_rank == 0
        self.comm_s = 0.0
        self._alloc(placement or ExpertPlacement.contiguous(num_experts, dims.ep))

    # ---- placement and weights -------------------------------------------------------
    def _alloc(self, placement: ExpertPlacement) -> None:
        if placement.ep != self.ep:
            raise LayoutError(f"a placement over {placement.ep} ep ranks does not fit ep={self.ep}")
        self.placement = placement
        self.local_experts = placement.slots[self.ep_rank]  # logical expert of each local slot
        n, r, h = len(self.local_experts), self.rows.stop - self.rows.start, self.hidden
        dev = self.slot_tokens.device if hasattr(self, "slot_tokens") else None
        # gate rows then up rows per slot, so one matmul gives both
        self.w13 = nn.Parameter(torch.empty(n, 2 * r, h, dtype=self.dtype, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, h, r, dtype=self.dtype, device=dev), requires_grad=False)
        for name, t in placement.tables(self.w13.device).items():
            self.register_buffer(name, t, persistent=False)
        self.max_replicas = int(self.num_replicas.max())
        self.register_buffer("slot_tokens", torch.zeros(n, dtype=torch.long, device=self.w13.device), persistent=False)

    def load(self, src: TensorSource) -> None:
        with torch.no_grad():
            for s, e in enumerate(self.local_experts):
                gate, up, down = self.read(src, e, self.rows)
                self.w13[s].copy_(torch.cat([gate, up]))
                self.w2[s].copy_(down)
                self.tensor_names[e] = self.names(src, e)

    def expert_blocks(self) -> list[tuple[str, nn.Parameter, int, int, tuple[int, int]]]:
        """Where each local expert's slice of a checkpoint tensor lives: (name, w13 or w2, first
        row of the parameter viewed as [rows, last dim], rows, offset (row, col) in the checkpoint
        tensor). gate and up are rows ``self.rows`` of [I, H]; down is those columns of [H, I]."""
        r, h, out = self.rows.stop - self.rows.start, self.hidden, []
        for s, e in enumerate(self.local_experts):
            gate, up, down = self.tensor_names[e]
            out.append((gate, self.w13, s * 2 * r, r, (self.rows.start, 0)))
            out.append((up, self.w13, s * 2 * r + r, r, (self.rows.start, 0)))
            out.append((down, self.w2, s * h, h, (0, self.rows.start)))
        return out

    def place(self, placement: ExpertPlacement, src: TensorSource) -> None:
        """Move to a new placement (every rank of the stage with the same one), reading this
        rank's new slots from the checkpoint. Counters restart."""
        self._alloc(placement)
        self.load(src)

    # ---- forward -----------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, H]; ids, weights [tokens, k] (the router's choices). Returns [tokens, H]."""
        if self.dispatch == "replicated":
            return self._replicated(x, ids, weights)
        return self._all_to_all(x, ids, weights)

    def _training(self) -> bool:
        return torch.is_grad_enabled() and self.w13.requires_grad

    def _replicated(self, x, ids, weights):
        if self._training():  # the block's ranks compute different pairs: their gradients are summed
            x, weights = comm.copy_to_region(x, self.block_group), comm.copy_to_region(weights, self.block_group)
        slots = self._choose_slots(ids, offset=0)  # [tokens, k]; the same on every rank of the block
        tok, k = (self.slot_rank[slots] == self.ep_rank).nonzero(as_tuple=True)  # pairs this rank computes
        by_slot = torch.argsort(slots[tok, k], stable=True)  # HF adds a token's experts in expert order
        tok, k = tok[by_slot], k[by_slot]
        local = self.slot_local[slots[tok, k]]
        y = self._experts(x[tok], local)  # [pairs, H] (this rank's etp share)
        out = x.new_zeros(x.shape).index_add_(0, tok, (y * weights[tok, k, None]).to(x.dtype))
        return self._timed(comm.reduce_from_region, out, self.block_group)

    def _all_to_all(self, x, ids, weights):
        n, k = ids.shape
        tp_sizes = comm.split_sizes(n, self.tp)
        mine = slice(sum(tp_sizes[: self.tp_rank]), sum(tp_sizes[: self.tp_rank + 1]))
        x = comm.split_to_region(x, self.tp_group, 0, tp_sizes)  # [own tokens, H]
        weights = comm.split_to_region(weights, self.tp_group, 0, tp_sizes)  # backward: gathered back
        ids = ids[mine]
        if self.etp > 1:  # an expert's etp ranks must all see its tokens
            etp_sizes = self._timed(_exchange_counts, x.shape[0], x.device, self.etp_group)
            x = self._timed(comm.all_gather_region, x, self.etp_group, 0, etp_sizes)
            ids = self._timed(comm.all_gather, ids, self.etp_group, 0, etp_sizes)
            weights = self._timed(comm.all_gather_region, weights, self.etp_group, 0, etp_sizes)
        slots = self._choose_slots(ids, offset=self.stage_index).flatten()  # [pairs]
        order = torch.argsort(slots, stable=True)  # by slot: grouped by ep rank, then local slot
        token = order // k  # the token of each pair, in send order
        # per (destination rank, its local slot) counts: the receiver learns both from one exchange
        send = x.new_zeros((self.ep, self.max_slots), dtype=torch.long)
        send[self.slot_rank, self.slot_local] = torch.bincount(slots, minlength=len(self.slot_rank))
        ones = [1] * self.ep
        recv = self._timed(comm.all_to_all, send, self.ep_group, ones, ones)  # [ep, max slots], by source rank
        send_sizes, recv_sizes = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = self._timed(comm.all_to_all_region, x[token], self.ep_group, send_sizes, recv_sizes)
        # rows arrive by source rank, each source's sorted by local slot: label each with its slot
        local = torch.arange(self.max_slots, device=x.device).repeat(self.ep).repeat_interleave(recv.flatten())
        y = self._experts(rows, local, counted=recv.sum(0))  # [received pairs, H]
        back = self._timed(comm.all_to_all_region, y, self.ep_group, recv_sizes, send_sizes)  # [pairs, H]
        w = weights.flatten()[order, None]
        out = x.new_zeros(x.shape).index_add_(0, token, (back * w).to(x.dtype))  # [tokens, H]
        if self.etp > 1:  # sum the etp partials; each rank keeps its own tokens
            out = self._timed(comm.reduce_scatter_region, out, self.etp_group, 0, etp_sizes)
        if n == 0:  # the whole tp group is idle (it shares n): nothing to gather
            return out
        return self._timed(comm.gather_from_region, out, self.tp_group, 0, tp_sizes)

    @property
    def max_slots(self) -> int:
        return max(len(r) for r in self.placement.slots)

    def _choose_slots(self, ids: torch.Tensor, offset: int) -> torch.Tensor:
        """The global slot of each (token, choice): a replicated expert's pairs go round-robin
        over its replicas, starting at ``offset`` so one-token batches of different ranks spread."""
        if self.max_replicas == 1:
            return self.replica_slots[ids, 0]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        sorted_ids = flat[order]
        counts = torch.bincount(flat, minlength=self.replica_slots.shape[0])
        first = torch.cumsum(counts, 0) - counts
        pos = torch.arange(flat.numel(), device=flat.device) - first[sorted_ids] + offset
        out = torch.empty_like(flat)
        out[order] = self.replica_slots[sorted_ids, pos % self.num_replicas[sorted_ids]]
        return out.view_as(ids)

    def _experts(self, rows: torch.Tensor, local: torch.Tensor, counted: torch.Tensor | None = None):
        """rows [pairs, H] through the SwiGLU of their local slot; returns [pairs, H]. The pairs are
        put in slot order once and each slot takes its run as a view (``split``), so a pair's row is
        copied there and back once however many experts the rank holds; the weights likewise
        (``unbind``). Indexing each slot's rows out of the whole tensor, or its weights out of the
        stacked ones, made backward write a whole zero gradient of that tensor per slot: traffic
        that grew with the square of the experts a rank holds (docs/performance.md)."""
        counts = torch.bincount(local, minlength=len(self.local_experts)) if counted is None else counted
        if self.counts_once:
            self.slot_tokens += counts[: len(self.local_experts)]
        order = torch.argsort(local, stable=True)
        w13, w2 = self.w13, self.w2
        if self.duplicates > 1 and self._training():
            w13, w2 = _ScaleGrad.apply(w13, 1 / self.duplicates), _ScaleGrad.apply(w2, 1 / self.duplicates)
        w13s, w2s = w13.unbind(0), w2.unbind(0)  # one view each (w13[s]'s gradient is a whole w13 per expert)
        outs = []
        for s, run in enumerate(rows[order].split(counts.tolist())):
            if run.shape[0]:
                gate, up = linear(run, w13s[s]).chunk(2, dim=-1)  # [c, rows] each
                outs.append(linear(F.silu(gate) * up, w2s[s]))  # [c, H]
        out = torch.empty_like(rows)
        if outs:
            out[order] = torch.cat(outs)
        return out

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.comm_s += time.perf_counter() - t0  # wall time: exact on CPU, launch time on CUDA
        return out


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def _exchange_counts(n: int, device, group) -> list[int]:
    """Every rank's token count in ``group`` (one small all-gather)."""
    mine = torch.tensor([n], dtype=torch.long, device=device)
    return comm.all_gather(mine, group).tolist()
