"""ParallelDims: field validation, world-size checks, rank <-> coordinate maths, expert folding.

Pure unit tests: no process group is created. Everything here is integer bookkeeping,
so every comparison is exact.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import pytest
import torch.distributed as dist

from shardlm.errors import UsageError
from shardlm.parallel.dims import MESH_AXES, LayoutError, ParallelDims, factorisations

FIELDS = ("dp", "pp", "cp", "tp", "ep", "etp")


def rank_of(dims: ParallelDims, c: dict[str, int]) -> int:
    """The documented rank formula: rank = ((pp*DP + dp)*CP + cp)*TP + tp."""
    return ((c["pp"] * dims.dp + c["dp"]) * dims.cp + c["cp"]) * dims.tp + c["tp"]


# ---- field validation ---------------------------------------------------------------


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("bad", [0, -1, -4, True, False, 2.0, 1.5, "2", None])
def test_each_field_rejects_bad_values_naming_field_and_value(name, bad):
    with pytest.raises(LayoutError) as err:
        ParallelDims(**{name: bad})
    msg = str(err.value)
    assert f"{name}={bad!r}" in msg, msg
    assert "positive integer" in msg
    # the error is a usage error (the CLI prints it and exits 2), not a crash
    assert isinstance(err.value, UsageError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize("name", FIELDS)
def test_each_field_accepts_a_valid_value(name):
    # can-fail guard for the test above: a good value of the same field is accepted.
    # (ep/etp must fold into dp*tp, so give them room.)
    kw = {name: 2}
    if name in ("ep", "etp"):
        kw["tp"] = 2
    dims = ParallelDims(**kw)
    assert getattr(dims, name) == 2


def test_positional_arguments_are_refused():
    # keyword-only config: ParallelDims(2, 2) would silently mean dp=2, pp=2 otherwise
    with pytest.raises(TypeError):
        ParallelDims(2, 2)  # type: ignore[misc]


# ---- factorisations and the world size ---------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 6, 8, 12])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_factorisations_are_exactly_the_ordered_tuples_with_that_product(world, n):
    got = factorisations(world, n)
    brute = [t for t in itertools.product(range(1, world + 1), repeat=n) if math.prod(t) == world]
    assert sorted(got) == sorted(brute)
    assert len(set(got)) == len(got)  # no duplicates
    assert len(got) >= 1


def test_factorisations_known_value():
    assert factorisations(4, 2) == [(1, 4), (2, 2), (4, 1)]


def test_check_world_size_accepts_matching_world():
    ParallelDims(dp=2, pp=3, cp=1, tp=2).check_world_size(12)  # must not raise
    ParallelDims().check_world_size(1)


@pytest.mark.parametrize("dims_kw,world", [({"tp": 2}, 4), ({"dp": 2, "pp": 2}, 6), ({}, 8)])
def test_check_world_size_message_lists_layout_counts_and_valid_factorisations(dims_kw, world):
    dims = ParallelDims(**dims_kw)
    with pytest.raises(LayoutError) as err:
        dims.check_world_size(world)
    msg = str(err.value)
    assert f"needs {dims.world_size} ranks" in msg, msg
    assert f"world has {world}" in msg, msg
    for axis, v in dims_kw.items():
        assert f"{axis}={v}" in msg
    # every (dp, pp, tp) factorisation of the real world size is offered, each a valid layout
    for dp, pp, tp in factorisations(world, 3):
        assert f"(dp={dp}, pp={pp}, tp={tp})" in msg, (dp, pp, tp, msg)
        ParallelDims(dp=dp, pp=pp, tp=tp).check_world_size(world)
    # and nothing else is offered (no invalid suggestion slips in)
    offered = re.findall(r"\(dp=(\d+), pp=(\d+), tp=(\d+)\)", msg)
    assert all(int(a) * int(b) * int(c) == world for a, b, c in offered)
    assert len(offered) == len(factorisations(world, 3))


# ---- rank <-> coordinates ----------------------------------------------------------

LAYOUTS = [
    dict(),
    dict(tp=4),
    dict(dp=2, pp=3, cp=1, tp=2),
    dict(dp=1, pp=2, cp=2, tp=2),
    dict(dp=3, pp=1, cp=2, tp=1),
    dict(dp=2, pp=2, cp=2, tp=3),
    dict(dp=5, pp=1, cp=1, tp=1),
]


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: "x".join(f"{k}{v}" for k, v in kw.items()) or "single")
def test_coords_is_the_inverse_of_the_rank_formula(kw):
    dims = ParallelDims(**kw)
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert tuple(c) == MESH_AXES  # ordered outermost first
        for axis in MESH_AXES:
            assert 0 <= c[axis] < getattr(dims, axis), (rank, c)
        assert rank_of(dims, c) == rank, (rank, c)
        seen.add(tuple(c.values()))
    # a bijection onto the full grid: every coordinate is hit exactly once
    assert len(seen) == dims.world_size == math.prod(dims.shape())


def test_coords_known_values_tp_innermost_pp_outermost():
    # can-fail guard: a transposed formula (tp outermost) would still be a bijection,
    # so pin down concrete values. dp=2, pp=3, cp=1, tp=2 -> 12 ranks.
    dims = ParallelDims(dp=2, pp=3, tp=2)
    assert dims.coords(0) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert dims.coords(1) == {"pp": 0, "dp": 0, "cp": 0, "tp": 1}  # neighbours differ in tp
    assert dims.coords(2) == {"pp": 0, "dp": 1, "cp": 0, "tp": 0}  # then dp: a stage is one block
    assert dims.coords(4) == {"pp": 1, "dp": 0, "cp": 0, "tp": 0}
    assert dims.coords(11) == {"pp": 2, "dp": 1, "cp": 0, "tp": 1}
    assert dims.replica_ranks() == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]


@pytest.mark.parametrize("rank", [-1, 12, 13])
def test_coords_rejects_ranks_outside_the_world(rank):
    dims = ParallelDims(dp=2, pp=3, tp=2)
    with pytest.raises((LayoutError, ValueError, IndexError)):
        dims.coords(rank)


# ---- expert folding: ep * etp must divide dp * tp ----------------------------------


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 2), (1, 6), (3, 4), (8, 1)])
def test_ep_etp_fold_rule_every_choice(dp, tp):
    n = dp * tp
    checked_bad = 0
    for ep in range(1, n + 3):
        for etp in range(1, n + 3):
            if n % (ep * etp) == 0:
                dims = ParallelDims(dp=dp, tp=tp, ep=ep, etp=etp)
                assert dims.edp * ep * etp == n
                assert ep in dims.valid_ep()
                continue
            with pytest.raises(LayoutError) as err:
                ParallelDims(dp=dp, tp=tp, ep=ep, etp=etp)
            msg = str(err.value)
            assert f"ep={ep}" in msg and f"etp={etp}" in msg, msg
            assert f"dp x tp = {n}" in msg, msg
            valid = [e for e in range(1, n + 1) if n % (e * etp) == 0]
            if valid:
                assert f"valid ep for etp={etp}: {valid}" in msg, msg
            checked_bad += 1
    assert checked_bad > 0  # the loop did exercise the error path


def test_ep_folds_over_dp_times_tp_not_pp_or_cp():
    # 8 ranks in all, but only dp*tp = 2 of them per stage/context slice fold into experts
    with pytest.raises(LayoutError, match=r"valid ep for etp=1: \[1, 2\]"):
        ParallelDims(dp=1, pp=2, cp=2, tp=2, ep=4)
    assert ParallelDims(dp=1, pp=2, cp=2, tp=2, ep=2).edp == 1
    assert ParallelDims(dp=2, tp=2, ep=2).edp == 2


def test_ep_error_always_suggests_something_valid():
    with pytest.raises(LayoutError) as err:
        ParallelDims(tp=3, etp=2)
    msg = str(err.value)
    assert "etp=2" in msg
    assert "[]" not in msg, msg


# ---- a 1-rank layout needs no torch.distributed --------------------------------------


def test_single_rank_layout_has_none_groups_without_distributed():
    assert not dist.is_initialized()  # precondition: nothing below may rely on a process group
    dims = ParallelDims().build_mesh("cpu")
    assert dims.mesh is None
    assert not dist.is_initialized()  # build_mesh did not start one
    for axis in MESH_AXES:
        assert dims.group(axis) is None
        assert getattr(dims, f"{axis}_group") is None
        assert getattr(dims, f"{axis}_rank") == 0
        assert getattr(dims, f"{axis}_size") == 1
    assert dims.global_rank == 0
    assert dims.world_size == 1 and dims.edp == 1


def test_multi_rank_layout_without_mesh_refuses_groups():
    # can-fail guard for the test above: a 2-rank layout must not pretend to be one rank
    assert not dist.is_initialized()
    dims = ParallelDims(tp=2)
    with pytest.raises(LayoutError, match="build_mesh"):
        _ = dims.tp_group
    with pytest.raises(LayoutError, match="build_mesh"):
        _ = dims.dp_rank
    with pytest.raises(LayoutError, match="torch.distributed"):
        dims.build_mesh("cpu")


def test_unknown_axis_is_named():
    with pytest.raises(KeyError, match="'ep'"):
        ParallelDims().group("ep")


def test_frozen_and_compares_by_sizes():
    a, b = ParallelDims(dp=2, tp=2), ParallelDims(tp=2, dp=2)
    assert a == b and a != ParallelDims(dp=2, tp=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tp = 4  # type: ignore[misc]


def test_dp_cp_groups_are_the_ranks_that_share_weights():
    """Training sums gradients over every dp and cp coordinate of one (pp, tp) position."""
    dims = ParallelDims(dp=2, cp=2, tp=2)
    assert dims.group_ranks("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for ranks in dims.group_ranks("dp_cp"):
        assert len({dims.coords(r)["tp"] for r in ranks}) == 1
        assert {(dims.coords(r)["dp"], dims.coords(r)["cp"]) for r in ranks} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert ParallelDims(dp=2, pp=2).group_ranks("dp_cp") == ParallelDims(dp=2, pp=2).group_ranks("dp")
    assert ParallelDims().dp_cp_group is None


# ---- one layout type: configs hold a ParallelDims, flags come from its fields ---------------


def test_axes_are_the_fields_and_each_has_a_flag_help():
    from dataclasses import fields

    from shardlm.parallel.dims import axes, axis_help

    declared = [f.name for f in fields(ParallelDims) if not f.name.startswith("_")]
    assert axes() == tuple(declared) == ("dp", "pp", "cp", "tp", "ep", "etp")
    assert all(axis_help(a) for a in axes())


def test_axis_flags_come_from_parallel_dims():
    import argparse

    from shardlm.args import add_axis_args, axis_options
    from shardlm.engine.config import AXES as ENGINE_AXES
    from shardlm.parallel.dims import axis_help
    from shardlm.train.trainer import AXES as TRAIN_AXES

    for offered in (ENGINE_AXES, TRAIN_AXES):
        p = argparse.ArgumentParser()
        add_axis_args(p, offered)
        flags = {a.option_strings[0]: a.help for a in p._actions if a.option_strings[0] != "-h"}
        assert flags == {f"--{a}": axis_help(a) for a in offered}
        assert axis_options(p.parse_args(["--tp", "2"])) == {a: 2 if a == "tp" else 1 for a in offered}
    assert set(ENGINE_AXES) == set(TRAIN_AXES) == set(MESH_AXES) | {"ep", "etp"}


def test_configs_hold_a_parallel_dims_and_refuse_axes_they_cannot_run():
    from shardlm.engine.config import EngineConfig
    from shardlm.train.trainer import TrainConfig

    cfg = EngineConfig.of(tp=2, pp=3, dtype="bfloat16")
    assert cfg.parallel == ParallelDims(tp=2, pp=3) and cfg.dtype == "bfloat16"
    assert cfg.dims() == cfg.parallel and cfg.dims() is not cfg.parallel  # a rank builds its mesh on a copy
    assert TrainConfig.of(dp=2, cp=2, zero=3).parallel == ParallelDims(dp=2, cp=2)
    assert EngineConfig.of(cp=2, tp=2).parallel == ParallelDims(cp=2, tp=2)
    assert TrainConfig.of(ep=2, dp=2).parallel == ParallelDims(dp=2, ep=2)
    with pytest.raises(UsageError, match="must be a ParallelDims"):
        EngineConfig(parallel={"tp": 2})


def test_planner_layout_is_a_parallel_dims_plus_its_knobs():
    from shardlm.plan.errors import PlanError
    from shardlm.plan.layout import Layout

    lay = Layout(dp=2, pp=2, tp=2, zero=1)
    assert isinstance(lay, ParallelDims) and lay.world_size == 8 and lay.sizes()["tp"] == 2
    for kw in (
        dict(dp=2, pp=3, tp=2),
        dict(dp=4, pp=2, tp=2, ep=4),
        dict(dp=2, pp=2, cp=2, tp=3),
        dict(dp=6, pp=2, tp=2, ep=6, etp=2),
    ):
        lay = Layout(**kw)  # the planner's array walk forms the engine's groups
        for kind in ("dp", "pp", "cp", "tp", "dp_cp", "edp", "ep", "etp"):
            assert sorted(sorted(g) for g in lay.groups(kind).tolist()) == lay.group_ranks(kind), (kw, kind)
    with pytest.raises(PlanError, match="ep=3"):
        Layout(dp=2, ep=3)


def test_vllm_names_for_the_axes():
    """vLLM users' spellings work: --tensor-parallel-size / -tp on the command line, tensor_parallel_size=
    in Python; a short and a long name that disagree are refused."""
    from shardlm.cli import build_parser
    from shardlm.engine.config import EngineConfig

    parser = build_parser()
    for argv in (["-tp", "2", "-pp", "3"], ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3"]):
        args = parser.parse_args(["generate", "hi", *argv, "--data-parallel-size", "2"])
        assert (args.tp, args.pp, args.dp) == (2, 3, 2)
    serve = parser.parse_args(["serve", "./my-model", "-tp", "2"])
    assert (serve.model_tag, serve.tp) == ("./my-model", 2)
    assert EngineConfig.of(tensor_parallel_size=2, pipeline_parallel_size=3).parallel == ParallelDims(tp=2, pp=3)
    assert ParallelDims.take({"tp": 2, "tensor_parallel_size": 2}) == ParallelDims(tp=2)
    with pytest.raises(LayoutError, match="tp=2 and tensor_parallel_size=4 disagree"):
        ParallelDims.take({"tp": 2, "tensor_parallel_size": 4})
