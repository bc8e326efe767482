"""ParallelDims: the one topology object every layer is built with.

Mesh axes, outermost first: ``pp, dp, cp, tp`` (Megatron-Core's default rank order,
"tp-cp-ep-dp-pp" innermost first: ``initialize_model_parallel(order=...)`` in
megatron/core/parallel_state.py). Ranks that differ only in their tp coordinate are adjacent (rank = ((pp*DP + dp)*CP + cp)*TP + tp), so a tp group lives
inside a node, where links are fastest; a stage's dp x cp x tp ranks are one contiguous block and
pp crosses nodes. Expert parallelism does not add an axis: expert layers re-fold the dp x tp
ranks of a stage as edp x ep x etp ("parallel folding", Megatron-Core, Liu et al. 2025,
https://arxiv.org/abs/2504.14960), so ``ep * etp`` must divide ``dp * tp``. A rank's stage index
s = dp_rank * tp + tp_rank is read as s = (edp_rank * ep + ep_rank) * etp + etp_rank: etp
innermost, so an expert's tensor-parallel slices sit on neighbouring (tp-adjacent) ranks, and
when ep * etp divides tp an expert group lies inside one tp group. Why pp is outermost: with dp
outside pp, an ep group that spans dp replicas would stride over every stage (pp inside the ep
group) and leave the node even when ep * etp ranks would fit in one; with pp outside, it is
ep * etp consecutive ranks when cp = 1.

A ParallelDims with every size 1 needs no process group at all; its groups are
``None`` (a one-rank group) and every collective on them is a no-op.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from shardlm.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_AXES = ("pp", "dp", "cp", "tp")  # outermost first: the rank formula above
EXPERT_AXES = ("edp", "ep", "etp")  # the folded dp x tp ranks of a stage, outermost first
EXPERT_GROUPS = ("ep", "etp", "edp", "ep_etp", "edp_cp")
"""ep_etp: the ep x etp ranks that hold one copy of all experts; edp_cp: the ranks of a stage that
hold the same expert slices (edp x cp: training sums their gradients)."""
_VARY = {"ep_etp": ("ep", "etp"), "edp_cp": ("edp", "cp")}  # the coordinates a group kind spans


class LayoutError(UsageError):
    """A parallel layout that cannot work, with a message that says what would."""


def factorisations(world_size: int, n: int) -> list[tuple[int, ...]]:
    """Every ordered n-tuple of positive ints whose product is ``world_size``."""
    if n == 1:
        return [(world_size,)]
    return [
        (d, *rest)
        for d in range(1, world_size + 1)
        if world_size % d == 0
        for rest in factorisations(world_size // d, n - 1)
    ]


@functools.cache
def axes() -> tuple[str, ...]:
    """The layout's axes, as ParallelDims declares them: dp, pp, cp, tp, ep, etp."""
    return tuple(f.name for f in fields(ParallelDims) if f.metadata.get("help"))


def axis_help(axis: str) -> str:
    """The one-line description of an axis (what its CLI flag says)."""
    return next(f.metadata["help"] for f in fields(ParallelDims) if f.name == axis)


def vllm_name(axis: str) -> str | None:
    """The keyword vLLM gives an axis (``tensor_parallel_size`` for tp), if it has one."""
    return next(f.metadata.get("vllm") for f in fields(ParallelDims) if f.name == axis)


def _axis(help: str, vllm: str | None = None):
    """An axis of the layout: a size (1 turns it off), the one line its flag's help shows, and
    vLLM's name for it (accepted too: ``--tensor-parallel-size``, ``LLM(tensor_parallel_size=2)``)."""
    return field(default=1, metadata={"help": help, "vllm": vllm})


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The one declaration of the parallel axes: the engine's and the trainer's configs hold one,
    the planner's Layout extends it, and the CLI's axis flags are made from its fields (a new axis
    is a field here; each command then says whether it offers it)."""

    dp: int = _axis("data-parallel replicas, each a full pp x cp x tp model", "data_parallel_size")
    pp: int = _axis("pipeline stages, each a contiguous run of layers", "pipeline_parallel_size")
    cp: int = _axis("context-parallel ranks, each a slice of every sequence")
    tp: int = _axis(
        "tensor-parallel ranks, each a slice of every weight matrix (1..attention heads)", "tensor_parallel_size"
    )
    ep: int = _axis("expert-parallel ranks for MoE layers, folded over dp x tp")
    etp: int = _axis("expert-tensor-parallel ranks: each expert's weights split this many ways")
    _mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    _expert_groups: dict | None = field(default=None, compare=False, repr=False)
    _dp_cp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    _built: dict = field(default_factory=dict, compare=False, repr=False)  # groups made on first use

    def __post_init__(self) -> None:
        for name in axes():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{name}={v!r} must be a positive integer (1 turns the axis off)")
        n = self.dp * self.tp
        if n % (self.ep * self.etp):
            valid_etp = [e for e in range(1, n + 1) if n % e == 0]
            hint = (
                f"valid ep for etp={self.etp}: {self.valid_ep()}"
                if n % self.etp == 0
                else f"etp={self.etp} itself does not divide {n}; valid etp: {valid_etp}"
            )
            raise LayoutError(
                f"ep={self.ep} x etp={self.etp} does not fold into dp x tp = {n} ranks: "
                f"expert layers re-use the attention ranks of a stage, so ep*etp must divide dp*tp; {hint}"
            )

    @classmethod
    def take(cls, options: dict) -> ParallelDims:
        """The layout among keyword ``options`` (``LLM(tp=2, ...)``, a config's flat form; vLLM's
        names, ``tensor_parallel_size=2``, too): its axis sizes are removed from the dict, the rest
        stay for the caller."""
        sizes = {}
        for a in axes():
            given = [(k, options.pop(k)) for k in (a, vllm_name(a)) if k is not None and k in options]
            if len({v for _, v in given}) > 1:
                raise LayoutError(f"{' and '.join(f'{k}={v}' for k, v in given)} disagree; give one of them")
            if given:
                sizes[a] = given[0][1]
        return cls(**sizes)

    def sizes(self) -> dict[str, int]:
        """{axis: size} of every axis."""
        return {a: getattr(self, a) for a in axes()}

    def unbuilt(self) -> ParallelDims:
        """The same layout without a mesh or groups: what a rank builds its own mesh on."""
        return ParallelDims.take(self.sizes())

    def refuse_beyond(self, offered: tuple[str, ...], what: str) -> None:
        """Raise for any axis outside ``offered`` whose size is not 1 (``what`` cannot run it)."""
        for a in axes():
            if a not in offered and getattr(self, a) != 1:
                raise LayoutError(
                    f"{a}={getattr(self, a)}: {what} does not split over {a}; use {a}=1 (it offers {', '.join(offered)})"
                )

    # ---- sizes (pure) --------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: how many copies of each expert exist."""
        return self.dp * self.tp // (self.ep * self.etp)

    def valid_ep(self) -> list[int]:
        n = self.dp * self.tp
        return [e for e in range(1, n + 1) if n % (e * self.etp) == 0]

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            got = " x ".join(f"{a}={getattr(self, a)}" for a in MESH_AXES if getattr(self, a) > 1) or "all 1"
            options = ", ".join(
                "(" + ", ".join(f"{a}={v}" for a, v in zip(("dp", "pp", "tp"), f)) + ")"
                for f in factorisations(world_size, 3)
            )
            raise LayoutError(
                f"layout {got} needs {self.world_size} ranks but the world has {world_size}; "
                f"dp*pp*cp*tp must equal the world size, e.g. {options}"
            )

    def rank_of(self, *, dp: int = 0, pp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these mesh coordinates (the rank formula above)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (the inverse of the rank formula above)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(
                f"rank {rank} is outside this layout's world of {self.world_size} ranks (0..{self.world_size - 1})"
            )
        out = {}
        for axis in reversed(MESH_AXES):
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return {a: out[a] for a in MESH_AXES}

    def expert_coords(self, rank: int) -> dict[str, int]:
        """(edp, ep, etp) coordinates of a global rank: its stage index re-folded (see above)."""
        c = self.coords(rank)
        s = c["dp"] * self.tp + c["tp"]
        return {"edp": s // (self.ep * self.etp), "ep": s // self.etp % self.ep, "etp": s % self.etp}

    def group_ranks(self, kind: str) -> list[list[int]]:
        """Every group of a mesh axis or expert group kind, as ascending global ranks (pure)."""
        if kind in MESH_AXES or kind == "dp_cp":
            vary = ("dp", "cp") if kind == "dp_cp" else (kind,)
            key = lambda r: tuple(v for a, v in self.coords(r).items() if a not in vary)
        elif kind in EXPERT_GROUPS:
            vary = _VARY.get(kind, (kind,))

            def key(r: int) -> tuple[int, ...]:
                c, e = self.coords(r), self.expert_coords(r)
                return (c["pp"], *(() if "cp" in vary else (c["cp"],)), *(v for a, v in e.items() if a not in vary))
        else:
            raise KeyError(
                f"unknown group {kind!r}; mesh axes are {MESH_AXES} (and dp_cp), expert groups {EXPERT_GROUPS}"
            )
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            groups.setdefault(key(r), []).append(r)
        return sorted(groups.values())

    # ---- the mesh --------------------------------------------------------------
    def build_mesh(self, device_type: str) -> ParallelDims:
        """Create the named DeviceMesh (collective over the world). Returns self."""
        if self._mesh is not None:
            return self
        if self.world_size == 1 and not dist.is_initialized():
            return self
        if not dist.is_initialized():
            raise LayoutError(
                f"a layout of {self.world_size} ranks needs torch.distributed; start with "
                f"shardlm's launcher (LLM(...) or `shardlm generate`) or under torchrun"
            )
        self.check_world_size(dist.get_world_size())
        from torch.distributed.device_mesh import DeviceMesh

        # every axis's groups made here, with the world's timeout: init_device_mesh's would take
        # torch's default (30 min for gloo), so a subgroup whose peer is gone (a lost host) would
        # wait that long instead of --timeout
        mine = [self._made(f"mesh:{axis}", self.group_ranks(axis)) for axis in MESH_AXES]
        assert all(g is not None for g in mine)  # every rank is in one group of each axis
        ranks = torch.arange(self.world_size).view(self.shape())  # row-major over MESH_AXES, as coords()
        mesh = DeviceMesh.from_group(cast(list, mine), device_type, mesh=ranks, mesh_dim_names=MESH_AXES)
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_expert_groups", self._build_expert_groups(mesh))
        object.__setattr__(self, "_dp_cp_group", self._build_dp_cp_group(mesh))
        return self

    def _build_dp_cp_group(self, mesh: DeviceMesh) -> dist.ProcessGroup | None:
        """The ranks that hold the same weights in training (every dp and cp coordinate of one pp,
        tp position): gradients are summed over them. Collective, like the expert groups."""
        if self.cp == 1 or self.dp == 1:
            return mesh.get_group("cp" if self.dp == 1 else "dp")
        mine = None
        for ranks in self.group_ranks("dp_cp"):
            g = dist.new_group(ranks, timeout=timedelta(seconds=group_timeout(None)))
            mine = g if dist.get_rank() in ranks else mine
        return mine

    def _build_expert_groups(self, mesh: DeviceMesh) -> dict[str, dist.ProcessGroup | None]:
        """One process group per expert group kind (collective: every rank creates every group,
        in the same order). A kind whose groups are one rank is None; one whose groups are
        exactly the tp or dp groups (or an earlier kind's) reuses them instead of new sockets."""
        me = dist.get_rank()
        known: dict[tuple, dist.ProcessGroup | None] = {
            tuple(map(tuple, self.group_ranks(a))): mesh.get_group(a) for a in ("tp", "dp")
        }
        out: dict[str, dist.ProcessGroup | None] = {}
        for kind in EXPERT_GROUPS:
            groups = self.group_ranks(kind)
            key = tuple(map(tuple, groups))
            if len(groups[0]) == 1:
                out[kind] = None
            elif key not in known:
                mine = None
                for ranks in groups:
                    g = dist.new_group(ranks, timeout=timedelta(seconds=group_timeout(None)))
                    mine = g if me in ranks else mine
                known[key] = mine
            out.setdefault(kind, known.get(key))
        return out

    def _made(self, name: str, groups: list[list[int]]) -> dist.ProcessGroup | None:
        """This rank's group among ``groups`` (made once, then cached under ``name``). Collective:
        every rank makes every group, in the same order, so every rank calls this alike."""
        if name not in self._built:
            me, mine = dist.get_rank(), None
            for ranks in groups:
                g = dist.new_group(ranks, timeout=timedelta(seconds=group_timeout(None)))
                mine = g if me in ranks else mine
            self._built[name] = mine
        return self._built[name]

    def replica_group(self) -> dist.ProcessGroup | None:
        """Every rank of this rank's replica (all its pp, cp and tp positions); None when a replica
        is one rank. Collective on first use (the serving loop's news goes over it)."""
        if not self._need_mesh() or self.world_size == self.dp:
            return None
        return self._made("replica", self.replica_ranks())

    def replica_ranks(self) -> list[list[int]]:
        """Every replica's global ranks, ascending, by dp rank (pure): not consecutive when pp > 1,
        pp being the outermost axis."""
        return [
            sorted(
                self.rank_of(dp=d, pp=p, cp=c, tp=t)
                for p in range(self.pp)
                for c in range(self.cp)
                for t in range(self.tp)
            )
            for d in range(self.dp)
        ]

    def embedding_group(self) -> dist.ProcessGroup | None:
        """The first and the last pipeline stage of this rank's (dp, cp, tp) position, the two
        holders of a tied embedding; None without pipeline stages. Collective on first use."""
        if not self._need_mesh() or self.pp == 1:
            return None
        return self._made("embedding", [[r[0], r[-1]] for r in self.group_ranks("pp")])

    @property
    def mesh(self) -> DeviceMesh | None:
        return self._mesh

    def _need_mesh(self) -> DeviceMesh | None:
        """This layout's mesh (None: a one-rank layout without one); a multi-rank layout without
        one is an error."""
        if self._mesh is None and self.world_size > 1:
            raise LayoutError("call build_mesh() before asking for groups or ranks of a multi-rank layout")
        return self._mesh

    def group(self, axis: str) -> dist.ProcessGroup | None:
        if axis not in MESH_AXES:
            raise KeyError(f"unknown mesh axis {axis!r}; axes are {MESH_AXES}")
        return mesh.get_group(axis) if (mesh := self._need_mesh()) is not None else None

    def rank(self, axis: str) -> int:
        if axis not in MESH_AXES:
            raise KeyError(f"unknown mesh axis {axis!r}; axes are {MESH_AXES}")
        return mesh.get_local_rank(axis) if (mesh := self._need_mesh()) is not None else 0

    @property
    def dp_cp_group(self) -> dist.ProcessGroup | None:
        """dp x cp ranks of this rank's pp and tp position (training's gradient group)."""
        return self._dp_cp_group if self._need_mesh() is not None else None

    def expert_group(self, kind: str) -> dist.ProcessGroup | None:
        """The ep, etp, edp, ep_etp or edp_cp group of this rank (None when it has one rank)."""
        if kind not in EXPERT_GROUPS:
            raise KeyError(f"unknown expert group {kind!r}; expert groups are {EXPERT_GROUPS}")
        self._need_mesh()
        return None if self._expert_groups is None else self._expert_groups[kind]

    def expert_rank(self, axis: str) -> int:
        """This rank's coordinate on an expert axis (edp, ep or etp)."""
        if axis not in EXPERT_AXES:
            raise KeyError(f"unknown expert axis {axis!r}; expert axes are {EXPERT_AXES}")
        self._need_mesh()
        return self.expert_coords(self.global_rank)[axis]

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if self._mesh is not None else 0

    # {axis}_group / _rank / _size, spelled out for readability at call sites.
    dp_group = property(lambda s: s.group("dp"))
    pp_group = property(lambda s: s.group("pp"))
    cp_group = property(lambda s: s.group("cp"))
    tp_group = property(lambda s: s.group("tp"))
    dp_rank = property(lambda s: s.rank("dp"))
    pp_rank = property(lambda s: s.rank("pp"))
    cp_rank = property(lambda s: s.rank("cp"))
    tp_rank = property(lambda s: s.rank("tp"))
    dp_size = property(lambda s: s.dp)
    pp_size = property(lambda s: s.pp)
    cp_size = property(lambda s: s.cp)
    tp_size = property(lambda s: s.tp)
    ep_group = property(lambda s: s.expert_group("ep"))
    etp_group = property(lambda s: s.expert_group("etp"))
    edp_group = property(lambda s: s.expert_group("edp"))
    ep_etp_group = property(lambda s: s.expert_group("ep_etp"))
    edp_cp_group = property(lambda s: s.expert_group("edp_cp"))
    ep_rank = property(lambda s: s.expert_rank("ep"))
    etp_rank = property(lambda s: s.expert_rank("etp"))
    edp_rank = property(lambda s: s.expert_rank("edp"))
    ep_size = property(lambda s: s.ep)
    etp_size = property(lambda s: s.etp)
    edp_size = property(lambda s: s.edp)


def group_timeout(group: dist.ProcessGroup | None) -> float:
    """Seconds a collective of ``group`` (None: the world) may wait before it fails (300 when unknown)."""
    try:
        group = group or dist.distributed_c10d._get_default_group()
        device = torch.device("cpu") if torch.device("cpu") in group._device_types else torch.device("cuda")
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:
        return 300.0
