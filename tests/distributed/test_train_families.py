"""Training beyond Llama: each family's steps equal HF transformers' own training (losses and
gradient norms at every step, weights after three; the tolerances of test_train.py).

Qwen3: the per-head q/k norm weights are one vector each, applied to every head; their gradients
are summed over the heads of a rank (autograd) and over the tp ranks (the copy region's backward).
"""

from __future__ import annotations

import pytest
import torch
from test_train import OPTIM, _as_saved, check_against_hf, hf_training

from harness.moe_reference import cached_tiny_moe
from harness.multirank import run_ranks
from harness.rankfns import resume_and_step, train_and_save, train_and_save_state, train_steps
from harness.reference import TINY_MOE_MODELS


@pytest.fixture(scope="module")
def qwen3_run(tiny):
    return hf_training(str(tiny("qwen3").path))


@pytest.mark.parametrize(
    "dp,tp,zero", [(1, 1, 0), (1, 2, 1), pytest.param(2, 2, 3, marks=pytest.mark.slow)], ids=lambda v: str(v)
)  # dp2 x tp2 ZeRO-3 (~7 s) in the slow tier: make test's budget
def test_qwen3_trains_as_hf(qwen3_run, dp, tp, zero):
    path, batches = qwen3_run[:2]
    check_against_hf(run_ranks(dp * tp, train_steps, path, batches, dp, tp, zero, **OPTIM), qwen3_run)


# ---- MoE: experts over ep (folded over dp x tp), the router and the load-balancing loss ----------

AUX = 0.02  # HF's router_aux_loss_coef of Qwen-MoE configs (Mixtral's is 0.001)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """(name, aux) -> HF's own training of the tiny MoE model, with its load-balancing loss or not."""
    runs = {}

    def get(name: str, aux: bool):
        if (name, aux) not in runs:
            ref = cached_tiny_moe(name, tmp_path_factory)
            runs[name, aux] = hf_training(str(ref.path), AUX if aux else None)
        return runs[name, aux]

    return get


# (dp, tp, ep, zero, extra): experts whole on each tp rank, over the dp ranks (all-to-all), inside
# the tp group (the replicated path, once and with two copies of each slice), over both, with cp
MOE_LAYOUTS = [
    (1, 1, 1, 0, {}),
    (1, 2, 1, 1, {}),  # every tp rank computes every pair: each one's weight gradient is halved
    (2, 1, 2, 1, {}),
    (2, 1, 2, 3, {}),
    (1, 2, 2, 1, {}),
    (2, 2, 2, 1, {}),
    (2, 2, 4, 2, {}),
    (2, 1, 1, 2, {"cp": 2}),
]
# the load-balancing loss needs the whole batch in one forward; pipelines train without it
PIPELINED = [(2, 1, 2, 1, {"pp": 2, "grad_accum": 2}), (1, 2, 2, 3, {"pp": 2, "grad_accum": 2})]


def _moe_id(layout) -> str:
    dp, tp, ep, zero, x = layout
    return f"dp{dp}-tp{tp}-ep{ep}-zero{zero}" + "".join(f"-{k.replace('_', '')}{v}" for k, v in x.items())


def _moe_cases():
    """Every (model, layout), ordered by world size: the rank pools (two alive at once) start once."""
    return sorted(_all_moe_cases(), key=lambda case: _world(*case.values[2:]))


def _world(dp, tp, ep, zero, extra) -> int:
    return dp * tp * extra.get("cp", 1) * extra.get("pp", 1)


def _all_moe_cases():
    for name in TINY_MOE_MODELS:
        deepseek = name.startswith("deepseek")  # no aux loss in HF; MLA has no cp yet; tp=4 splits no KV head
        layouts = [lay for lay in MOE_LAYOUTS if not (deepseek and "cp" in lay[4])]
        layouts += [(1, 4, 4, 1, {})] if deepseek else []
        for lay in layouts:
            # make test's budget: Qwen2-MoE (the shared expert) at one rank and at ep4, the rest slow;
            # tp4 ep4 (~10 s) for DeepSeek-V3 only
            slow = name == "qwen2_moe" and lay not in (MOE_LAYOUTS[0], MOE_LAYOUTS[6])
            slow |= name == "deepseek_v2" and lay == (1, 4, 4, 1, {})
            marks = pytest.mark.slow if slow else ()
            yield pytest.param(name, not deepseek, *lay, id=f"{name}-{_moe_id(lay)}", marks=marks)
        for lay in PIPELINED:  # 5-13 s each: one model's in make test, the others' in the slow tier
            marks = () if name == "deepseek_v3" else pytest.mark.slow
            yield pytest.param(name, False, *lay, id=f"{name}-{_moe_id(lay)}", marks=marks)
    # ZB-H1's split backward through the experts' all-to-all and DeepSeek's router (one model: ~10 s)
    lay = (2, 1, 2, 1, {"pp": 2, "grad_accum": 2, "pp_schedule": "zb-h1"})
    yield pytest.param("deepseek_v3", False, *lay, id=f"deepseek_v3-{_moe_id(lay)}")


@pytest.mark.parametrize("name,aux,dp,tp,ep,zero,extra", _moe_cases())
def test_moe_trains_as_hf(moe_runs, name, aux, dp, tp, ep, zero, extra):
    run = moe_runs(name, aux)
    options = {**OPTIM, **extra, **({"aux_loss_coef": AUX} if aux else {})}
    results = run_ranks(_world(dp, tp, ep, zero, extra), train_steps, run[0], run[1], dp, tp, zero, ep=ep, **options)
    check_against_hf(results, run)
    if aux:
        assert all(s["aux_loss"] > 0 for stats, *_ in results for s in stats)


def test_moe_state_resumes_on_another_expert_layout(moe_runs, tmp_path):
    """Two steps with the experts split over the dp ranks at ZeRO-3, the state saved; a run with
    them split inside the tp group at ZeRO-1 loads it (each expert slice from the ranks that wrote
    it, by checkpoint name): the weights bitwise, and the third step the uninterrupted run's there
    (within float32 reduction order, as test_train's resume test)."""
    from shardlm.train.checkpoint import assemble

    path, batches = moe_runs("qwen3_moe", False)[:2]
    saved, resumed = dict(dp=2, ep=2, zero=3), dict(tp=2, ep=2, zero=1)
    kept = run_ranks(2, train_and_save_state, path, batches[:2], str(tmp_path), **OPTIM, **saved)
    back = run_ranks(2, resume_and_step, path, batches[2], str(tmp_path), **OPTIM, **resumed)
    straight = run_ranks(2, train_steps, path, batches, 1, 2, 1, ep=2, **OPTIM)
    everything = lambda per_rank: assemble([p for part in per_rank for p in part])
    before, loaded = everything(kept), everything([p for _, p, _, _ in back])
    assert any(".experts." in k for k in before) and loaded.keys() == before.keys()
    assert all(torch.equal(loaded[k], before[k]) for k in before)
    for (_, _, stats, _), (want, *_) in zip(back, straight):
        got, expect = (stats["loss"], stats["grad_norm"]), (want[-1]["loss"], want[-1]["grad_norm"])
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=0)
    after, want = everything([p for *_, p in back]), everything([p for _, p, _, _ in straight])
    for k in want:
        torch.testing.assert_close(after[k], want[k], rtol=0, atol=1e-4, msg=k)


def test_moe_model_saved_from_expert_ranks_loads_in_hf(moe_runs, tmp_path):
    """Trained with the experts split over the dp ranks and saved: HF loads the directory (its
    own config.json, every expert once) with the weights HF trained itself."""
    import transformers

    path, batches, _, _, after = moe_runs("mixtral", True)
    run_ranks(2, train_and_save, path, batches, 2, 1, 1, str(tmp_path), ep=2, aux_loss_coef=AUX, **OPTIM)
    saved = _as_saved(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32))
    assert saved.keys() == after.keys()
    for k in after:
        torch.testing.assert_close(saved[k], after[k], rtol=0, atol=1e-4, msg=k)


def test_deepseek_v3_bias_moves_towards_balance_and_resumes(moe_runs, tmp_path):
    """One step with bias_update_rate: each layer's correction bias moved by the rate, up for the
    experts HF's routers chose less often than the mean on that batch and down for the others, on
    every rank alike (dp=2 x ep=2 counts both halves of the batch); a resumed run has it back."""
    import transformers

    from harness.moe_reference import routers
    from harness.rankfns import expert_biases_after

    path, batches = moe_runs("deepseek_v3", False)[:2]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    picks = []
    hooks = [r.register_forward_hook(lambda m, a, out: picks.append(out[2])) for r in routers(hf)]
    with torch.no_grad():
        hf(batches[0][:, :-1])
    for h in hooks:
        h.remove()
    rate = 0.01
    want = []
    for router, ids in zip(routers(hf), picks):
        load = torch.bincount(ids.flatten(), minlength=router.e_score_correction_bias.numel()).float()
        assert len(set(load.tolist())) > 1  # the load is uneven: the update has a direction
        want.append(router.e_score_correction_bias + rate * torch.sign(load.mean() - load))
    got = run_ranks(
        2, expert_biases_after, path, batches[:1], str(tmp_path), dp=2, ep=2, bias_update_rate=rate, **OPTIM
    )
    for biases in got:
        for b, w in zip(biases, want):
            torch.testing.assert_close(b, w, rtol=0, atol=1e-7)
    back = run_ranks(2, expert_biases_after, path, [], str(tmp_path), resume=True, tp=2, ep=2, **OPTIM)
    assert all(torch.equal(b, g) for biases in back for b, g in zip(biases, got[0]))
