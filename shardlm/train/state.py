"""Training state that resumes on any layout: torch.distributed.checkpoint (DCP) with the
checkpoint's own tensor names.

What a run needs to go on is the float32 master weights, AdamW's two moments and a few counters.
Each rank holds a part of them: its tp rows or columns of some checkpoint tensors (the
``sources`` the layers load from), and under ZeRO >= 1 only its range of each unit's flat
vector. Whatever the layout, such a range of a 2-D block is at most three rectangles of the
checkpoint tensor (a partial row, whole rows, a partial row), so every rank saves exactly what
it holds as DCP chunks of the whole tensors, keyed by their checkpoint names: no gather, and
DCP's global plan checks that the chunks of all ranks tile each tensor exactly once. Loading
at another layout asks DCP for this rank's rectangles of the new layout; DCP reads the
overlapping parts of the saved chunks (its resharding), straight into the masters and moments.

Keys: ``<name>`` (master weights), ``optimizer.exp_avg.<name>``, ``optimizer.exp_avg_sq.<name>``,
and ``trainer`` (steps taken, AdamW's step count, the float16 loss scaler). A DCP folder thus
reads as an HF-named state dict (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardlm.errors import UsageError
from shardlm.models.moe import moe_blocks
from shardlm.parallel.comm import group_rank
from shardlm.parallel.expert import ExpertParallelSwiGLU
from shardlm.parallel.tensor import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    whole_tensors,
)

if TYPE_CHECKING:
    from shardlm.parallel.dims import ParallelDims
    from shardlm.train.zero import Unit, Zero


class Trainer(Protocol):
    """What this module reads and sets of a ``trainer.Trainer`` (which imports this module)."""

    steps: int

    @property
    def zero(self) -> Zero: ...
    @property
    def model(self) -> Any: ...
    @property
    def dims(self) -> ParallelDims: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scaler(self) -> Any: ...


MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Segment:
    """Elements [start, start + rows * width) of a unit's flat vector are the block of checkpoint
    tensor ``name`` at ``at`` (row-major; ``width`` 0: a 1-D block of ``rows`` elements)."""

    name: str
    start: int
    rows: int
    width: int
    at: tuple[int, ...]
    owner: bool
    """Whether this rank saves it: a block every tp rank holds whole (a norm) is saved by tp
    rank 0, a tied embedding by the first pipeline stage."""

    @property
    def numel(self) -> int:
        return self.rows * max(self.width, 1)

    def rectangles(self, lo: int, hi: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """The part of flat range [lo, hi) in this block as (flat start, offsets, sizes) chunks of
        the checkpoint tensor, each a contiguous run of the flat vector: at most three."""
        s, e = max(lo, self.start) - self.start, min(hi, self.start + self.numel) - self.start
        if s >= e:
            return []
        if not self.width:
            return [(self.start + s, (self.at[0] + s,), (e - s,))]
        out: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        while s < e:
            row, col = divmod(s, self.width)
            if col or e - s < self.width:  # a partial row
                n = min(self.width - col, e - s)
                out.append((self.start + s, (self.at[0] + row, self.at[1] + col), (1, n)))
            else:  # whole rows
                n = (e - s) // self.width * self.width
                out.append((self.start + s, (self.at[0] + row, self.at[1]), (n // self.width, self.width)))
            s += n
        return out


def segments(trainer: Trainer) -> list[list[Segment]]:
    """Per ZeRO unit, the checkpoint blocks its flat vector holds (each parameter as its layer
    loaded it: ColumnParallelLinear's fused sources by rows, RowParallelLinear's by columns)."""
    zero, model, dims = trainer.zero, trainer.model, trainer.dims
    where = {}
    for i, unit in enumerate(zero.units):
        offset = 0
        for p, shape in zip(unit.params, unit.shapes):
            where[id(p)] = (i, offset, shape)
            offset += shape.numel()
    out: list[list[Segment]] = [[] for _ in zero.units]
    seen: set[tuple[int, int]] = set()

    def add(p, name: str, row: int, rows: int | None, at: tuple[int, ...] | None, whole_on_every_tp_rank=False):
        i, offset, shape = where[id(p)]  # the shape the unit recorded (ZeRO-3 releases the parameter's data)
        at = (0,) * len(shape) if at is None else at
        width = shape[-1] if len(shape) >= 2 else 0
        start = offset + row * max(width, 1)
        if (i, start) in seen:  # a tied weight met through the LM head too
            return
        seen.add((i, start))
        tied_copy = zero.units[i] is zero.tied and not model.first
        owner = not (whole_on_every_tp_rank and dims.tp_rank) and not tied_copy
        out[i].append(Segment(name, start, shape[0] - row if rows is None else rows, width, at, owner))

    for m in model.modules():
        if isinstance(m, ColumnParallelLinear):
            row = 0
            for (source, rows), n in zip(m.sources, m.out_sizes):
                first = rows.start if rows is not None else 0
                add(m.weight, f"{source}.weight", row, n, (first, 0))
                if m.bias is not None:
                    add(m.bias, f"{source}.bias", row, n, (first,))
                row += n
        elif isinstance(m, RowParallelLinear):
            add(m.weight, f"{m.source}.weight", 0, None, (0, m.cols.start if m.cols is not None else 0))
            if m.bias is not None:
                add(m.bias, f"{m.source}.bias", 0, None, (0,), whole_on_every_tp_rank=True)
        elif isinstance(m, (VocabParallelEmbedding, ParallelLMHead)) and m.source is not None:
            add(m.weight, f"{m.source}.weight", 0, None, (m.rows.start, 0))
        for name, p in whole_tensors(m):
            add(p, name, 0, None, None, whole_on_every_tp_rank=True)
        if isinstance(m, ExpertParallelSwiGLU):  # its unit's group holds each slice once (or whole: stage 0)
            for name, w, first, count, at in m.expert_blocks():
                add(w, name, first, count, at)
    for unit, segs in zip(zero.units, out):
        if sum(s.numel for s in segs) != unit.numel:
            raise NotImplementedError(
                f"the training state cannot name every parameter of the unit holding {unit.names}: "
                f"a layer kind that segments() does not know"
            )
    return out


@dataclass(frozen=True)
class Chunk:
    """One rectangle of checkpoint tensor ``key``, and where it lives on this rank."""

    key: str
    name: str  # the checkpoint tensor (key is it, or one of its optimizer moments)
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: Tensor  # a view of this rank's master or moment buffer


def chunks(trainer: Trainer, *, saving: bool) -> tuple[list[Chunk], dict[str, tuple[int, ...]]]:
    """This rank's rectangles of every saved tensor (saving: only those it owns), and the global
    size of each checkpoint tensor (the extents all ranks' blocks reach)."""
    out: list[Chunk] = []
    extent: dict[str, tuple[int, ...]] = {}
    moments = _moments(trainer)
    dims = trainer.dims
    first = dims.dp_rank == 0 and dims.cp_rank == 0 and dims.tp_rank == 0  # one rank of each stage
    for block in moe_blocks(trainer.model):  # DeepSeek-V3's correction biases (bias_update_rate moves them)
        if block.router.bias is not None:
            name, bias = f"{block.router.source}.e_score_correction_bias", block.router.bias
            extent[name] = tuple(bias.shape)
            if first or not saving:
                out.append(Chunk(name, name, (0,), tuple(bias.shape), bias))
    for unit, segs in zip(trainer.zero.units, segments(trainer)):
        zero_only = trainer.zero.stage == 0 and group_rank(unit.group) != 0  # whole copies: one saves
        buffers = {"": unit.master.detach()} | {f"optimizer.{k}.": moments[k][unit] for k in MOMENTS}
        for seg in segs:
            end = (seg.at[0] + seg.rows,) if not seg.width else (seg.at[0] + seg.rows, seg.at[1] + seg.width)
            extent[seg.name] = tuple(map(max, extent.get(seg.name, end), end))
            if saving and (not seg.owner or zero_only):
                continue
            for flat, offsets, sizes in seg.rectangles(unit.lo, unit.hi):
                a = flat - unit.lo
                for prefix, buf in buffers.items():
                    view = buf[a : a + torch.Size(sizes).numel()].view(sizes)
                    out.append(Chunk(prefix + seg.name, seg.name, offsets, sizes, view))
    return out, extent


def _moments(trainer: Trainer) -> dict[str, dict[Unit, Tensor]]:
    """AdamW's moments of each unit's master (zeros before the first step; created if absent)."""
    state = trainer.optimizer.state
    out: dict[str, dict[Unit, Tensor]] = {k: {} for k in MOMENTS}
    for unit in trainer.zero.units:
        s = state[unit.master]
        for k in MOMENTS:
            if k not in s:
                s[k] = torch.zeros_like(unit.master, memory_format=torch.preserve_format).detach()
            out[k][unit] = s[k]
    return out


def _global_extents(extent: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return extent
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, extent)
    merged: dict[str, tuple[int, ...]] = {}
    for part in everyone:
        for name, end in part.items():
            merged[name] = tuple(map(max, merged.get(name, end), end))
    return merged


class _SavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner for the ``trainer`` record, plus one SHARD write per chunk."""

    def __init__(self, mine: list[Chunk], sizes: dict[str, tuple[int, ...]]):
        super().__init__()
        self.mine, self.sizes = {(c.key, c.offsets): c for c in mine}, sizes

    def create_local_plan(self):
        plan = super().create_local_plan()
        writes = [
            WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties.create_from_tensor(c.tensor),
                    size=torch.Size(self.sizes[c.name]),
                ),
            )
            for c in self.mine.values()
        ]
        self.plan = dataclasses.replace(plan, items=plan.items + writes)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        chunk = self.mine.get((index.fqn, tuple(index.offset or ())))
        return chunk.tensor.contiguous() if chunk is not None else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner for the ``trainer`` record, plus reads of each chunk's region of the
    saved chunks (DCP's resharding)."""

    def __init__(self, mine: list[Chunk]):
        super().__init__()
        self.mine = {(c.key, c.offsets): c for c in mine}

    def create_local_plan(self):
        plan = super().create_local_plan()
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        reads = []
        for i, c in enumerate(self.mine.values()):
            chunk = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
            for item in create_read_items_for_chunk_list(c.key, saved[c.key], [chunk]):
                reads.append(dataclasses.replace(item, dest_index=MetadataIndex(c.key, torch.Size(c.offsets), i)))
        return dataclasses.replace(plan, items=plan.items + reads)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        chunk = self.mine.get((index.fqn, tuple(index.offset or ())))
        return chunk.tensor if chunk is not None else super().lookup_tensor(index)


def _record(trainer: Trainer) -> str:
    """The counters, as one JSON string (one DCP bytes item, whatever the run's dtype)."""
    steps = [s["step"] for s in trainer.optimizer.state.values() if "step" in s]
    return json.dumps(
        {
            "steps": trainer.steps,
            "adam_step": float(steps[0]) if steps else 0.0,
            "loss_scaler": None if trainer.scaler is None else vars(trainer.scaler),
        }
    )


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is what a one-rank run is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(trainer: Trainer, folder: str) -> None:
    """Write this rank's part of the state into DCP folder ``folder`` (collective)."""
    mine, extent = chunks(trainer, saving=True)
    planner = _SavePlanner(mine, _global_extents(extent))
    with _one_process_is_meant():
        dcp.save(
            {"trainer": _record(trainer)}, checkpoint_id=folder, planner=planner, no_dist=not dist.is_initialized()
        )


def load(trainer: Trainer, folder: str, source: str) -> int:
    """Read this rank's part of the state at this run's layout from ``folder`` (collective);
    returns the steps it had taken. Hyperparameters (lr, betas, ...) stay this run's."""
    mine, _ = chunks(trainer, saving=False)
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    for c in mine:  # here, not in the planner: DCP would wrap the error in its own
        md = saved.get(c.key)
        if not isinstance(md, TensorStorageMetadata):
            raise UsageError(
                f"the training state in {source!r} has no tensor {c.key!r}: it was saved for another "
                f"model; resume with that model, or start afresh"
            )
        end = tuple(o + n for o, n in zip(c.offsets, c.sizes))
        if len(end) != len(md.size) or any(e > n for e, n in zip(end, md.size)):
            raise UsageError(
                f"the training state in {source!r} holds {c.key!r} of size {tuple(md.size)}, this model "
                f"needs it to reach {end}: it was saved for another model"
            )
    state = {"trainer": ""}
    with torch.no_grad(), _one_process_is_meant():
        dcp.load(state, checkpoint_id=folder, planner=_LoadPlanner(mine), no_dist=not dist.is_initialized())
    record = json.loads(state["trainer"])
    for unit in trainer.zero.units:
        s = trainer.optimizer.state[unit.master]
        if record["adam_step"]:
            s["step"] = torch.tensor(record["adam_step"], dtype=torch.float32)
        else:  # saved before the first step: no moments yet
            trainer.optimizer.state.pop(unit.master, None)
    trainer.zero.after_step()  # the weights (16-bit copies, stages 1-2's full vectors) from the masters
    if trainer.scaler is not None and record["loss_scaler"] is not None:
        vars(trainer.scaler).update(record["loss_scaler"])
    trainer.steps = record["steps"]
    return trainer.steps
