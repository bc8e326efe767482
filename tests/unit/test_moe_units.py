"""Pieces of expert parallelism without a model: the folded expert groups, placements and
EPLB, MoE config parsing, the router against HF's, and fused expert checkpoints.

Everything but the router and checkpoint tests is integer bookkeeping, compared exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.moe_reference import FOLDS, cached_tiny_moe, choice_margin, hf_model, routers
from harness.reference import TINY_MOE_MODELS
from shardlm.parallel.dims import EXPERT_GROUPS, LayoutError, ParallelDims
from shardlm.parallel.eplb import ExpertPlacement, imbalance, rebalance


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    return lambda name: cached_tiny_moe(name, tmp_path_factory)


# ---- folded expert groups -----------------------------------------------------------


@pytest.mark.parametrize("kw", FOLDS, ids=str)
def test_expert_groups_partition_each_stage_by_the_folded_coordinates(kw):
    dims = ParallelDims(**kw)
    for kind in EXPERT_GROUPS:
        groups = dims.group_ranks(kind)
        assert sorted(itertools.chain(*groups)) == list(range(dims.world_size))  # a partition
        vary = {"ep_etp": ("ep", "etp"), "edp_cp": ("edp", "cp")}.get(kind, (kind,))
        sizes = {"ep": dims.ep, "etp": dims.etp, "edp": dims.edp, "ep_etp": dims.ep * dims.etp}
        size = dims.edp * dims.cp if kind == "edp_cp" else sizes[kind]
        for g in groups:
            assert len(g) == size
            c = [dims.coords(r) for r in g]
            # never across stages; across context slices only the gradient group
            assert len({(x["pp"], x["cp"] if kind != "edp_cp" else 0) for x in c}) == 1
            e = [dims.expert_coords(r) for r in g]
            fixed = {tuple(v for a, v in x.items() if a not in vary) for x in e}
            assert len(fixed) == 1  # members differ only in the varying expert axes
            # group-local rank order = the axis coordinate (so group rank == ep_rank etc.)
            if kind in sizes and kind != "ep_etp":
                assert [x[kind] for x in e] == list(range(size))


def test_expert_coords_fold_the_stage_index_etp_innermost():
    dims = ParallelDims(dp=2, tp=4, ep=2, etp=2)
    got = [tuple(dims.expert_coords(r).values()) for r in range(8)]
    assert got == [(e, p, t) for e in range(2) for p in range(2) for t in range(2)]
    # the ep x etp block of a rank lies inside its tp group exactly when ep*etp divides tp
    assert {tuple(g) for g in dims.group_ranks("ep_etp")} <= {tuple(g) for g in dims.group_ranks("tp")}
    wide = ParallelDims(dp=2, tp=2, ep=4)
    assert wide.group_ranks("ep") == [[0, 1, 2, 3]] and wide.group_ranks("tp") == [[0, 1], [2, 3]]


def test_unknown_expert_group_is_named():
    with pytest.raises(KeyError, match="'xp'"):
        ParallelDims().group_ranks("xp")
    assert ParallelDims().expert_group("ep") is None and ParallelDims().ep_rank == 0


# ---- placements and EPLB ------------------------------------------------------------


def test_contiguous_placement_and_its_tables():
    p = ExpertPlacement.contiguous(6, 4)
    assert p.slots == ((0, 1), (2, 3), (4,), (5,))
    t = p.tables()
    assert t["slot_rank"].tolist() == [0, 0, 1, 1, 2, 3] and t["slot_local"].tolist() == [0, 1, 0, 1, 0, 0]
    assert t["replica_slots"][:, 0].tolist() == list(range(6)) and t["num_replicas"].tolist() == [1] * 6
    with pytest.raises(LayoutError, match=r"ep=8 is larger than the model's 6 experts.*use ep <= 6"):
        ExpertPlacement.contiguous(6, 8)
    with pytest.raises(LayoutError, match=r"missing \[2\]"):
        ExpertPlacement(3, ((0,), (1,)))


def test_rebalance_replicates_hot_experts_and_evens_rank_load():
    load = [900, 700, 30, 20, 10, 10, 5, 5]  # two hot experts on rank 0 of a contiguous ep=4 placement
    before = ExpertPlacement.contiguous(8, 4)
    slot_load = lambda p: [load[e] / len(p.replicas(e)) for e in p.slot_expert]
    after = rebalance(load, ep=4, slots_per_rank=3)
    assert [len(s) for s in after.slots] == [3, 3, 3, 3]
    assert sorted(set(after.slot_expert)) == list(range(8))
    assert len(after.replicas(0)) >= 2 and len(after.replicas(1)) >= 2
    for s in after.slots:
        assert len(set(s)) == len(s)  # no expert twice on one rank
    ib_before = imbalance(before.rank_load(slot_load(before)))
    ib_after = imbalance(after.rank_load(slot_load(after)))
    # 3 replicas of 900 and of 700 over 4 ranks: some rank holds 300 + 233 + small, ~1.28 at best
    assert ib_before > 3.0 and ib_after < 1.3, (ib_before, ib_after)
    assert rebalance(load, 4, 3) == after  # deterministic: every rank computes the same one
    with pytest.raises(LayoutError, match="slots_per_rank >= 2"):
        rebalance(load, ep=4, slots_per_rank=1)


def test_imbalance_is_max_over_mean():
    assert imbalance([1, 1, 1, 1]) == 1.0 and imbalance([4, 0, 0, 0]) == 4.0 and imbalance([0, 0]) == 1.0


# ---- config ----------------------------------------------------------------------


def test_moe_layers_and_support(tiny_moe):
    from shardlm.models.config import ConfigError, ModelConfig

    q2 = ModelConfig.from_json_file(tiny_moe("qwen2_moe").path / "config.json")
    assert q2.is_moe and q2.mlp_only_layers == (0,) and q2.shared_expert_intermediate_size == 128
    assert [q2.is_moe_layer(i) for i in range(2)] == [False, True]
    q2.check_supported()
    mx = ModelConfig.from_json_file(tiny_moe("mixtral").path / "config.json")
    assert (mx.num_experts, mx.num_experts_per_tok, mx.moe_intermediate_size) == (8, 2, 64)
    import dataclasses

    assert [dataclasses.replace(q2, decoder_sparse_step=2).is_moe_layer(i) for i in range(4)] == [False, True] * 2
    with pytest.raises(ConfigError, match="'gpt_oss' is not runnable"):
        dataclasses.replace(mx, family="gpt_oss").check_supported()
    with pytest.raises(ConfigError, match="num_experts_per_tok=9"):
        dataclasses.replace(mx, num_experts_per_tok=9).check_supported()
    v3 = ModelConfig.from_json_file(tiny_moe("deepseek_v3").path / "config.json")
    v3.check_supported()
    assert (v3.scoring_func, v3.topk_method, v3.n_group, v3.topk_group, v3.first_k_dense) == (
        "sigmoid",
        "group_limited",
        4,
        2,
        1,
    )
    assert v3.is_mla and v3.rope_interleave and v3.rotary_dim == 16 and v3.shared_expert_intermediate_size == 48
    v2 = ModelConfig.from_json_file(tiny_moe("deepseek_v2").path / "config.json")
    assert (v2.scoring_func, v2.topk_method, v2.q_lora_rank, v2.shared_expert_intermediate_size) == (
        "softmax",
        "group_limited",
        0,
        64,
    )
    with pytest.raises(ConfigError, match="n_group=3 does not divide the 8 experts"):
        dataclasses.replace(v3, n_group=3).check_supported()
    with pytest.raises(ConfigError, match="topk_group=1 of n_group=4 groups leaves fewer experts than"):
        dataclasses.replace(v2, topk_group=1).check_supported()
    with pytest.raises(ConfigError, match="topk_method='mystery' is not supported"):
        ModelConfig.from_hf({**v2.extra, "topk_method": "mystery"})


# ---- router and fused checkpoints -------------------------------------------------


@pytest.mark.parametrize("name", list(TINY_MOE_MODELS))
def test_router_matches_hf(name, tiny_moe):
    from shardlm.models.config import ModelConfig
    from shardlm.models.loader import open_checkpoint
    from shardlm.models.moe import Router

    ref = tiny_moe(name)
    ckpt = open_checkpoint(ref.path)
    layer = 0 if name in ("mixtral", "qwen3_moe") else 1  # the others' layer 0 is dense
    router = Router(ckpt.config, f"model.layers.{layer}", torch.float32)
    router.load(ckpt.source())
    hf = routers(hf_model(name))[0]  # its weight is overwritten with ours below
    x = torch.randn(16, ckpt.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert isinstance(ckpt.config, ModelConfig)
    hf.weight.data.copy_(router.weight)
    if router.bias is not None:  # DeepSeek-V3's correction bias, loaded from the file
        assert torch.equal(router.bias, hf.e_score_correction_bias) and router.bias.abs().max() > 0
    logits_hf, w_hf, ids_hf = hf(x)
    assert choice_margin(hf, logits_hf) > 1e-4
    w, ids = router(x)
    order, order_hf = ids.sort(-1), ids_hf.sort(-1)  # DeepSeek's HF router returns them unsorted
    assert torch.equal(order.values, order_hf.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_hf.gather(1, order_hf.indices), rtol=0, atol=1e-7)
    scale = ckpt.config.routed_scaling_factor
    gap = (w.sum(-1) - scale).abs().max()  # renormalised top-k sum to one (times the scaling); the others do not
    assert gap < 1e-6 if router.normalise else gap > 1e-3


def test_fused_expert_checkpoint_loads_the_same_weights(tiny_moe, tmp_path):
    """transformers 5 holds experts as 3-D gate_up_proj/down_proj; a file in that layout loads too."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardlm.models.loader import load_model, open_checkpoint
    from shardlm.models.moe import moe_blocks

    ref = tiny_moe("mixtral")
    tensors = {}
    with safe_open(str(ref.path / "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            tensors[k.replace(".block_sparse_moe.", ".mlp.")] = f.get_tensor(k)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        e = range(8)
        w1, w3, w2 = ([tensors.pop(f"{p}.{i}.{n}.weight") for i in e] for n in ("w1", "w3", "w2"))
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3)])  # [E, 2I, H]
        tensors[f"{p}.down_proj"] = torch.stack(w2)  # [E, H, I]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ref.path / "config.json").read_text())
    dims = ParallelDims()
    fused = moe_blocks(load_model(open_checkpoint(tmp_path), dims))
    split = moe_blocks(load_model(open_checkpoint(ref.path), dims))
    for a, b in zip(fused, split):
        assert torch.equal(a.experts.w13, b.experts.w13) and torch.equal(a.experts.w2, b.experts.w2)
        assert torch.equal(a.router.weight, b.router.weight)
    assert not torch.equal(split[0].experts.w13, split[1].experts.w13)  # layers differ: a mix-up would show


def test_check_expert_layout_names_the_bad_value_and_a_good_one(tiny_moe):
    from shardlm.models.config import ModelConfig
    from shardlm.models.moe import check_expert_layout

    q3 = ModelConfig.from_json_file(tiny_moe("qwen3_moe").path / "config.json")  # 6 experts of width 64
    check_expert_layout(q3, 4, 2)  # uneven ep is fine
    with pytest.raises(LayoutError, match=r"ep=8 is larger than the model's 6 experts.*\[1, 2, 3, 6\]"):
        check_expert_layout(q3, 8, 1)
    with pytest.raises(LayoutError, match="etp=128 is larger than the expert width 64; use etp <= 64"):
        check_expert_layout(q3, 1, 128)
    import dataclasses

    dense = dataclasses.replace(q3, num_experts=0)
    check_expert_layout(dense, 1, 1)
    with pytest.raises(LayoutError, match="dense model without experts; use ep=1 etp=1"):
        check_expert_layout(dense, 2, 1)
